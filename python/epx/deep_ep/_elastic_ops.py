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


class TorchExpansion:
    """Expansion computed with torch on the received ids' device (the host waits only for
    sizes: the expanded row count and counts, the entries' number). Same attributes;
    slots, psum are device tensors, counts a NumPy copy (small), and entry_rows /
    entry_cols / entry_slots device index tensors."""

    def __init__(self, recv_topk_idx, num_local_experts, alignment):
        torch = importlib.import_module("torch")
        idx = recv_topk_idx.to(torch.int64)
        n, k = int(idx.shape[0]), int(idx.shape[1])
        L = num_local_experts
        valid = (idx >= 0) & (idx < L)
        flat = torch.where(valid, idx, torch.full_like(idx, L)).reshape(-1)
        # An entry's rank among its expert's entries in row-major order: its place in a
        # stable sort by expert, less the expert's first place (searched in the sorted
        # ids: no atomics, no host wait).
        ordered, order = torch.sort(flat, stable=True)
        first_of = torch.searchsorted(ordered, torch.arange(L + 2, device=idx.device))
        ranks = torch.empty_like(flat)
        ranks[order] = torch.arange(flat.numel(), device=idx.device) - first_of[ordered]
        counts = first_of[1:L + 1] - first_of[:L]
        aligned = (counts + alignment - 1) // alignment * alignment
        starts = aligned.cumsum(0) - aligned
        self.psum = (starts + counts).to(torch.int32)
        starts_ext = torch.cat([starts, starts.new_zeros(1)])
        slots = torch.where(valid.reshape(-1), starts_ext[flat] + ranks,
                            torch.full_like(ranks, -1))
        self.slots_device = slots.reshape(n, k).to(torch.int32)
        host = torch.cat([aligned.sum().reshape(1), counts])
        host = host.cpu().numpy()  # a wait for sizes: the row count and the counts
        self.rows = int(host[0])
        self.counts = host[1:].astype(np.int64)
        self.entry_rows, self.entry_cols = valid.nonzero(as_tuple=True)
        self.entry_slots = slots.reshape(n, k)[self.entry_rows, self.entry_cols]
        self._slots_host = None

    @property
    def slots(self):
        """The slots as a NumPy array (for the host-side users; copied once)."""
        if self._slots_host is None:
            self._slots_host = self.slots_device.cpu().numpy()
        return self._slots_host


def expansion_of(recv_topk_idx, num_local_experts, alignment, n):
    """Expansion (NumPy) or TorchExpansion of the first n received rows' ids."""
    if hasattr(recv_topk_idx, "new_zeros"):
        return TorchExpansion(recv_topk_idx[:n], num_local_experts, alignment)
    return Expansion(np.asarray(recv_topk_idx)[:n], num_local_experts, alignment)


def _index(array, reference):
    """An index tensor for `reference`'s framework: device tensors pass as they are."""
    if hasattr(array, "new_zeros"):
        return array
    return like(np.asarray(array).astype(np.int64), reference)


def row_sources(expansion, rows):
    """(source, padding) for an expanded layout of `rows` rows, in the expansion's
    framework: each expanded row's received row (0 for padding rows), and the padding
    rows' positions. Kept on the expansion per row count."""
    cache = expansion.__dict__.setdefault("_row_sources", {})
    if rows not in cache:
        entries, slots = expansion.entry_rows, expansion.entry_slots
        if hasattr(slots, "new_zeros"):
            torch = importlib.import_module("torch")
            source = torch.full((rows,), -1, dtype=torch.int64, device=slots.device)
            source[slots.to(torch.int64)] = entries.to(torch.int64)
            padding = (source < 0).nonzero().squeeze(1)
            cache[rows] = (source.clamp(min=0), padding)
        else:
            source = np.full(rows, -1, dtype=np.int64)
            source[np.asarray(slots, dtype=np.int64)] = entries
            cache[rows] = (np.maximum(source, 0), np.nonzero(source < 0)[0])
    return cache[rows]


def expand_rows(tensor, expansion, rows, reference):
    """Rows of `tensor` [n, ...] placed at their entries' expanded rows (zeros elsewhere):
    one gather, then the padding rows zeroed."""
    if tensor is None:
        return None
    if not len(expansion.entry_slots):
        return zeros(tensor, (rows,) + tuple(tensor.shape[1:]))
    source, padding = row_sources(expansion, rows)
    out = tensor[_index(source, reference)]
    if len(padding):  # zeros of the rows' dtype: fp8 tensors may not take a scalar fill
        out[_index(padding, reference)] = zeros(out, (len(padding),) + tuple(out.shape[1:]))
    return out


def expand_weights(recv_topk_weights, expansion, rows, reference):
    """recv_topk_weights [n, k] as one weight per expanded row [rows] (0 in padding)."""
    if recv_topk_weights is None:
        return None
    out = zeros(recv_topk_weights, (rows,))
    if len(expansion.entry_slots):
        out[_index(expansion.entry_slots, reference)] = recv_topk_weights[
            _index(expansion.entry_rows, reference), _index(expansion.entry_cols, reference)]
    return out


def _reduce_plan(slots):
    """The index sets of reduce_expanded, in slots' framework (int64): rows with at least one
    entry and their first entry's slot; rows with several, their first slot, and for each
    later top-k column the positions among them that have an entry there and its slot."""
    if hasattr(slots, "new_zeros"):
        torch = importlib.import_module("torch")
        slots = slots.to(torch.int64)

        def positions(mask):
            return mask.nonzero().squeeze(1)
        first = torch.argmax((slots >= 0).to(torch.int8), dim=1)
        first_slot = slots.gather(1, first.unsqueeze(1)).squeeze(1)
    else:
        slots = np.asarray(slots).astype(np.int64)

        def positions(mask):
            return np.nonzero(mask)[0]
        first = np.argmax(slots >= 0, axis=1) if slots.size else \
            np.zeros(slots.shape[0], np.int64)
        first_slot = slots[np.arange(slots.shape[0]), first] if slots.size else first
    entries = (slots >= 0).sum(1)
    some, multi = positions(entries >= 1), positions(entries >= 2)
    later = []
    for j in range(1, int(slots.shape[1])):
        rows = positions((slots[multi, j] >= 0) & (first[multi] < j))
        later.append((rows, slots[multi[rows], j]))
    return some, first_slot[some], multi, first_slot[multi], later


def reduce_expanded(x, slots, hidden):
    """[n, hidden] of each received row's expanded rows summed in top-k order in fp32, one
    rounding to x's dtype (DeepEP's reduction within a rank). slots: NumPy, or a device
    tensor (then the index work stays on the device; the host waits for sizes only).

    A row with one entry is that entry's row (its fp32 sum rounds back to it), so only the
    rows with several entries are summed in fp32: on the usual routings most rows have one,
    and the rows read are about the entries' once. Every received row has an entry (it
    was sent for one of this rank's experts), so the first entries are one gather."""
    some, some_slot, multi, multi_slot, later = _reduce_plan(slots)
    n = int(slots.shape[0])
    if framework_name(x, "ElasticBuffer.combine of the expanded layout") == "torch":
        torch = importlib.import_module("torch")
        index = lambda a: _index(a, x)  # noqa: E731 - int64 from _reduce_plan
        if len(some) == n:
            out = x.index_select(0, index(some_slot))
        else:
            out = zeros(x, (n, hidden))
            if len(some):
                out.index_copy_(0, index(some), x.index_select(0, index(some_slot)))
        if len(multi):
            acc = x.index_select(0, index(multi_slot)).to(torch.float32)
            for rows, slot in later:
                if len(rows):  # each row once per column: one add per element, in order
                    acc.index_add_(0, index(rows), x.index_select(0, index(slot)).to(
                        torch.float32))
            out.index_copy_(0, index(multi), acc.to(x.dtype))
        return out
    out = zeros(x, (n, hidden))
    if len(some):
        out[some] = x[some_slot]
    if len(multi):
        acc = x[multi_slot].astype(np.float32)
        for rows, slot in later:
            if len(rows):
                acc[rows] += x[slot].astype(np.float32)
        out[multi] = acc.astype(x.dtype)
    return out


def weights_of_slots(weights, slots):
    """An expanded weight per slot [rows] as [n, k] (0 where the slot is -1)."""
    if hasattr(slots, "new_zeros"):
        torch = importlib.import_module("torch")
        picked = weights[slots.clamp(min=0).to(torch.int64)]
        return torch.where(slots >= 0, picked, torch.zeros_like(picked))
    n, k = slots.shape
    out = zeros(weights, (n, k))
    rows, cols = np.nonzero(slots >= 0)
    if rows.size:
        out[like(rows.astype(np.int64), weights), like(cols.astype(np.int64), weights)] = \
            weights[like(slots[rows, cols].astype(np.int64), weights)]
    return out


# ---------------------------------------------------------------- the routing exchange


def routing_record(in_rank, rows):
    """This rank's part of the routing exchange, from its is_token_in_rank [tokens, ranks]
    (_ops.layout) (the same length on every rank: `rows` is
    the most tokens any rank has): its tokens per receiving rank (int64 each), then each
    of `rows` tokens' receiving ranks as bits (np.packbits order; tokens past this rank's
    last go nowhere)."""
    tokens, ranks = in_rank.shape
    bits = np.zeros((rows, (ranks + 7) // 8), dtype=np.uint8)
    bits[:tokens] = np.packbits(in_rank, axis=1)
    return in_rank.sum(axis=0).astype("<i8").tobytes() + bits.tobytes()


class Routing:
    """Every rank's routing_record: where each rank's tokens went, so that each rank knows
    its received rows' sources (rows come in source order: rank, then token) and where its
    own tokens landed, without moving anything on the device."""

    def __init__(self, records, max_tokens):
        ranks = len(records)
        self.max_tokens = max_tokens  # the global ids' stride (num_max_tokens_per_rank)
        self.sent = np.stack([np.frombuffer(r[:8 * ranks], dtype="<i8") for r in records])
        self.bits = np.stack([np.frombuffer(r[8 * ranks:], dtype=np.uint8).reshape(
            -1, (ranks + 7) // 8) for r in records])  # [ranks, rows, bytes]

    def source_ids(self, rank):
        """int64 global ids (source rank * max_tokens + token) of the rows `rank` received,
        in its row order."""
        byte, bit = divmod(rank, 8)
        hits = np.nonzero(self.bits[:, :, byte] & (0x80 >> bit))
        return hits[0] * self.max_tokens + hits[1]  # row-major: by rank, then token

    def destination_rows(self, rank, in_rank):
        """[tokens, ranks] int32: each of `rank`'s tokens' row among each receiving rank's
        rows (the lower ranks' tokens come first there), -1 where the token is not sent."""
        base = self.sent[:rank].sum(axis=0)
        place = np.cumsum(in_rank, axis=0) - 1 + base
        return np.where(in_rank, place, -1).astype(np.int32)
