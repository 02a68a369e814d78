"""The array work of epx.deep_ep.ElasticBuffer (DeepEP V2's API), for NumPy and torch.

epx moves one row per (token, receiving rank), in source order; DeepEP V2 adds views of
the same rows: the expanded layout (one row per (token, local expert), grouped by expert,
each expert's rows padded to the alignment), the rows' source ids, and per-expert and
per-peer prefix sums. Index work is small (rows x top-k integers) and is done on the host
with NumPy; rows move with the caller's framework on the caller's device.
"""

import importlib

import numpy as np

from ._ops import framework_name

# DeepEP V2's column-major scales: each column's stride rounded up to this many rows.
SF_COLUMN_ALIGNMENT = 4


def align(value, alignment):
    return (value + alignment - 1) // alignment * alignment


def to_host(tensor):
    """A NumPy copy of a framework tensor (small index data only)."""
    if tensor is None:
        return None
    if hasattr(tensor, "detach"):
        return tensor.detach().cpu().numpy()
    return np.asarray(tensor)


def like(array, reference):
    """NumPy `array` as a tensor of `reference`'s framework and device."""
    if framework_name(reference, "ElasticBuffer's index tensors") == "torch":
        torch = importlib.import_module("torch")
        return torch.from_numpy(np.ascontiguousarray(array)).to(reference.device)
    return np.ascontiguousarray(array)


def zeros(reference, shape):
    """Zeros of `reference`'s dtype, framework and device."""
    if framework_name(reference, "ElasticBuffer's outputs") == "torch":
        torch = importlib.import_module("torch")
        return torch.zeros(shape, dtype=reference.dtype, device=reference.device)
    return np.zeros(shape, dtype=reference.dtype)


def pad_rows(tensor, rows, value):
    """A new tensor of `rows` rows: `tensor`'s rows, then rows of `value`."""
    if tensor is None:
        return None
    out = zeros(tensor, (rows,) + tuple(tensor.shape[1:]))
    have = min(rows, int(tensor.shape[0]))
    out[:have] = tensor[:have]
    if value != 0 and have < rows:
        out[have:] = value
    return out


def column_major(scales):
    """The same [rows, packs] values with rows contiguous per pack and each pack's stride
    rounded up to SF_COLUMN_ALIGNMENT rows (DeepEP's use_tma_aligned_col_major_sf)."""
    rows, packs = int(scales.shape[0]), int(scales.shape[1])
    stride = align(max(rows, 1), SF_COLUMN_ALIGNMENT)
    if framework_name(scales, "ElasticBuffer's column-major scales") == "torch":
        torch = importlib.import_module("torch")
        store = torch.zeros((packs, stride), dtype=scales.dtype, device=scales.device)
        out = store.t()[:rows]
    else:
        out = np.zeros((packs, stride), dtype=scales.dtype).T[:rows]
    out[:] = scales
    return out


def as_float(x):
    if framework_name(x, "ElasticBuffer.combine of the expanded layout") == "torch":
        torch = importlib.import_module("torch")
        return x.to(torch.float32)
    return x.astype(np.float32)


# ---------------------------------------------------------------- the expanded layout


class Expansion:
    """Where each received row's local-expert entries go in the expanded layout.

    slots [n, k] int32: the expanded row of entry (i, j), -1 where recv_topk_idx[i, j] is
    not a local expert (rows of an expert in the order of the received rows, which is
    source order). counts [L]: entries per local expert; psum [L]: DeepEP's expand-mode
    prefix sum (the aligned start of expert e plus its count); rows: the aligned total.
    """

    def __init__(self, recv_topk_idx, num_local_experts, alignment):
        idx = np.asarray(recv_topk_idx).astype(np.int64)
        n, k = idx.shape
        valid = (idx >= 0) & (idx < num_local_experts)
        self.counts = np.bincount(idx[valid], minlength=num_local_experts).astype(np.int64)
        aligned = align(self.counts, alignment)
        starts = np.concatenate(([0], np.cumsum(aligned)[:-1])).astype(np.int64)
        self.psum = (starts + self.counts).astype(np.int32)
        self.rows = int(aligned.sum())
        # Entries in row-major order: row i before row i + 1, j before j + 1 in a row.
        flat = np.where(valid, idx, num_local_experts).reshape(-1)
        order = np.argsort(flat, kind="stable")
        ranks = np.empty(flat.size, dtype=np.int64)
        ranks[order] = np.arange(flat.size) - np.concatenate(
            ([0], np.cumsum(np.bincount(flat, minlength=num_local_experts + 1))[:-1]))[
                flat[order]]
        slots = np.where(valid.reshape(-1), np.append(starts, 0)[flat] + ranks, -1)
        self.slots = slots.reshape(n, k).astype(np.int32)
        self.entry_rows, self.entry_cols = np.nonzero(valid)
        self.entry_slots = self.slots[self.entry_rows, self.entry_cols].astype(np.int64)


def expand_rows(tensor, expansion, rows, reference):
    """Rows of `tensor` [n, ...] placed at their entries' expanded rows (zeros elsewhere)."""
    if tensor is None:
        return None
    out = zeros(tensor, (rows,) + tuple(tensor.shape[1:]))
    if expansion.entry_slots.size:
        out[like(expansion.entry_slots, reference)] = \
            tensor[like(expansion.entry_rows.astype(np.int64), reference)]
    return out


def expand_weights(recv_topk_weights, expansion, rows, reference):
    """recv_topk_weights [n, k] as one weight per expanded row [rows] (0 in padding)."""
    if recv_topk_weights is None:
        return None
    out = zeros(recv_topk_weights, (rows,))
    if expansion.entry_slots.size:
        out[like(expansion.entry_slots, reference)] = recv_topk_weights[
            like(expansion.entry_rows.astype(np.int64), reference),
            like(expansion.entry_cols.astype(np.int64), reference)]
    return out


def reduce_expanded(x, slots, hidden):
    """[n, hidden] of each received row's expanded rows summed in top-k order in fp32, one
    rounding to x's dtype (DeepEP's reduction within a rank)."""
    n, k = slots.shape
    acc = as_float(zeros(x, (n, hidden)))
    for j in range(k):
        rows = np.nonzero(slots[:, j] >= 0)[0]
        if rows.size:
            acc[like(rows.astype(np.int64), x)] += as_float(
                x[like(slots[rows, j].astype(np.int64), x)])
    if framework_name(x, "ElasticBuffer.combine of the expanded layout") == "torch":
        return acc.to(x.dtype)
    return acc.astype(x.dtype)


def weights_of_slots(weights, slots):
    """An expanded weight per slot [rows] as [n, k] (0 where the slot is -1)."""
    n, k = slots.shape
    out = zeros(weights, (n, k))
    rows, cols = np.nonzero(slots >= 0)
    if rows.size:
        out[like(rows.astype(np.int64), weights), like(cols.astype(np.int64), weights)] = \
            weights[like(slots[rows, cols].astype(np.int64), weights)]
    return out


# ---------------------------------------------------------------- source ids

# Width of the side dispatch that carries each token's source id (bf16 lanes).
META_HIDDEN = 8


def source_rows(global_ids, reference):
    """[T, META_HIDDEN] bf16 bit patterns carrying each token's int32 global id (low and
    high 16 bits in lanes 0 and 1), as a tensor epx can dispatch (raw bits for NumPy)."""
    ids = np.asarray(global_ids, dtype=np.int64).astype(np.uint32)
    lanes = np.zeros((ids.size, META_HIDDEN), dtype=np.uint16)
    lanes[:, 0] = ids & 0xFFFF
    lanes[:, 1] = ids >> 16
    if framework_name(reference, "ElasticBuffer's source ids") == "torch":
        torch = importlib.import_module("torch")
        bits = torch.from_numpy(lanes.view(np.int16)).to(reference.device)
        return bits.view(torch.bfloat16)
    from .._tensor import raw_bits
    return raw_bits(lanes, "bf16")


def source_ids(recv_rows):
    """The int32 global ids carried by received rows of source_rows (NumPy)."""
    if hasattr(recv_rows, "detach"):
        torch = importlib.import_module("torch")
        lanes = recv_rows.view(torch.int16).detach().cpu().numpy().view(np.uint16)
    else:
        lanes = np.asarray(getattr(recv_rows, "array", recv_rows)).view(np.uint16)
    return (lanes[:, 0].astype(np.uint32) | (lanes[:, 1].astype(np.uint32) << 16)).astype(
        np.int32)
