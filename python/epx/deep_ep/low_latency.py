"""The low-latency methods of deep_ep.Buffer, over an epx buffer made from the first call.

The epx buffer is made (collectively) by the first low_latency_dispatch, for its
(num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk), and made again when a
dispatch brings another shape; handles of the old one are then refused. Everything else
is epx.Buffer's low-latency mode (python/epx/low_latency.py, docs/LOW_LATENCY.md).
"""

import warnings

from ..buffer import Buffer as _EpxBuffer
from .. import errors
from ..errors import EpxError, Status, invalid_argument
from ..low_latency import LowLatencyHandle


# Experts per token of a low-latency buffer made early (enable_shrink): DeepEP's limit.
SHRINK_TOPK = 11

_LOGFMT_WARNED = []


def _tolerant_hook(hook):
    def receive():
        try:
            hook()
        except EpxError as error:
            if not errors.peer_lost(error.status):
                raise
    return receive


def _empty_like(tensor, columns):
    """A new [0, columns] tensor of `tensor`'s dtype, framework and device."""
    if hasattr(tensor, "new_empty"):
        return tensor.new_empty((0, columns))
    import numpy as np
    return np.empty((0, columns), dtype=tensor.dtype)


def _pad_columns(tensor, columns, value):
    """`tensor` [T, k] with columns k..columns-1 of `value` (a new tensor; torch or NumPy)."""
    rows, have = int(tensor.shape[0]), int(tensor.shape[1])
    if have == columns:
        return tensor
    if hasattr(tensor, "new_full"):
        import torch
        return torch.cat([tensor, tensor.new_full((rows, columns - have), value)], dim=1)
    import numpy as np
    return np.concatenate([tensor, np.full((rows, columns - have), value, tensor.dtype)],
                          axis=1)


def _warn_logfmt_once():
    if not _LOGFMT_WARNED:
        _LOGFMT_WARNED.append(True)
        warnings.warn("deep_ep.Buffer.low_latency_combine: use_logfmt is accepted and the rows "
                      "are sent as bf16 (epx has no LogFMT): exact sums, no fewer bytes",
                      stacklevel=3)


class LowLatencyMethods:
    """Mixed into deep_ep.Buffer (buffer.py), which calls _init_low_latency()."""

    def _init_low_latency(self):
        self._ll = None          # epx.Buffer with low-latency memory
        self._ll_shape = None    # (M, hidden, num_experts, num_topk)
        self._ll_masked = set()  # ranks masked before the epx buffer existed
        self._ll_padded = False  # made early: calls' top-k padded to _ll_pad_to entries
        self._ll_pad_to = SHRINK_TOPK
        self._ll_empty = None    # (key, x, topk_idx) of no tokens, like the last dispatch's

    def _make_low_latency_early(self, hint):
        """enable_shrink: make the low-latency buffer now, while every rank is here, for
        the hinted (M, hidden, num_ranks, num_experts) and SHRINK_TOPK experts per token
        (at most num_experts; calls with fewer are padded with -1). Without a hint of this group's size it is
        made by the first call, as otherwise (a warning says a rank absent from that call
        would leave the others waiting in the making)."""
        shapes = {s for s in (hint or ()) if s[2] == self.group_size}
        if len(shapes) != 1:
            warnings.warn("deep_ep.Buffer(enable_shrink=True): num_rdma_bytes is %s, so the "
                          "low-latency buffer is made by the first low_latency_dispatch (every "
                          "rank must take part in that call)"
                          % ("the hint of several shapes %s" % sorted(shapes) if shapes else
                             "not a get_low_latency_rdma_size_hint of this group's size "
                             "(every rank calls it, as DeepEP's examples do)"),
                          stacklevel=3)
            return
        m, hidden, _, num_experts = shapes.pop()
        self._ll_pad_to = min(SHRINK_TOPK, num_experts)  # epx: at most num_experts
        self._low_latency_buffer(m, hidden, num_experts, self._ll_pad_to)
        self._ll_padded = True

    def _pad_topk(self, shape, topk_idx, topk_weights=None):
        """Top-k padded to the early buffer's _ll_pad_to entries (-1, weight 0) when the
        call's shape is that buffer's; else unchanged (the buffer is made for the call)."""
        width = self._ll_pad_to
        if not self._ll_padded or self._ll_shape != tuple(shape) + (width,) or \
                int(topk_idx.shape[1]) > width:
            return topk_idx, topk_weights, int(topk_idx.shape[1])
        return (_pad_columns(topk_idx, width, -1),
                None if topk_weights is None else _pad_columns(topk_weights, width, 0),
                width)

    def _low_latency_buffer(self, m, hidden, num_experts, num_topk):
        if not self.low_latency_mode:
            raise EpxError(Status.ERR_INVALID_STATE,
                           "low_latency_dispatch: the buffer was made with "
                           "low_latency_mode=False")
        shape = (m, hidden, num_experts, num_topk)
        if self._ll_shape == shape:
            return self._ll
        if self._ll is not None:
            self._ll_masked.update(self._ll.get_masked_ranks())
            self._ll.destroy()
            self._ll = self._ll_shape = self._ll_empty = None
        self._ll = _EpxBuffer(self._group(), low_latency_mode=True,
                              num_max_dispatch_tokens_per_rank=m, hidden=hidden,
                              num_experts=num_experts, num_topk=num_topk)
        self._ll_shape = shape
        for rank in sorted(self._ll_masked):
            self._ll.mask_rank(rank)
        return self._ll

    def _ll_buffer_of(self, handle, op):
        if not isinstance(handle, LowLatencyHandle):
            raise invalid_argument("%s: handle must be the handle of this buffer's "
                                   "low_latency_dispatch, not %s" % (op, type(handle).__name__))
        if self._ll is None or handle._buffer is not self._ll:
            raise invalid_argument("%s: the handle's buffer was replaced (a dispatch of another "
                                   "shape made a new one) or belongs to another deep_ep.Buffer"
                                   % op)
        return self._ll

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False,
                             use_ue8m0=False, async_finish=False, return_recv_hook=False):
        """DeepEP's low_latency_dispatch: (recv_x or (recv_x, scales), recv_count, handle,
        event, hook). cumulative_local_expert_recv_stats ([L] int32) gets recv_count added
        (after hook() with return_recv_hook); dispatch_wait_recv_cost_stats ([num_ranks]
        int64) gets, for each source rank, the nanoseconds the receive waited for it
        (DeepEP: SM clock cycles; epx.Buffer.low_latency_dispatch)."""
        shape = (int(num_max_dispatch_tokens_per_rank), int(x.shape[1]), int(num_experts))
        topk_idx, _, num_topk = self._pad_topk(shape, topk_idx)
        buffer = self._low_latency_buffer(shape[0], shape[1], shape[2], num_topk)
        if self.enable_shrink:
            key = (type(x), str(getattr(x, "device", "cpu")), str(x.dtype), int(x.shape[1]),
                   int(topk_idx.shape[1]))
            if self._ll_empty is None or self._ll_empty[0] != key:
                self._ll_empty = (key, _empty_like(x, key[3]), _empty_like(topk_idx, key[4]))
        return self._shrink_tolerant(4, lambda: buffer.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
            round_scale, use_ue8m0, async_finish, return_recv_hook))

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False, out=None,
                            combine_wait_recv_cost_stats=None):
        """DeepEP's low_latency_combine: (combined_x, event, hook). combine_wait_recv_cost_stats
        ([num_ranks] int64) gets, for each expert rank, the nanoseconds the receive waited
        for it (DeepEP: SM clock cycles).

        use_logfmt (DeepEP's lossy 10-bit combine format, to send fewer bytes): epx sends
        the bf16 rows and sums them exactly as without it (with zero_copy too, which
        DeepEP refuses); a warning says so once per process."""
        buffer = self._ll_buffer_of(handle, "low_latency_combine")
        if use_logfmt:
            _warn_logfmt_once()
        if self._ll_padded and topk_idx is not None:
            topk_idx, topk_weights, _ = self._pad_topk(self._ll_shape[:3], topk_idx,
                                                       topk_weights)
        return self._shrink_tolerant(2, lambda: buffer.low_latency_combine(
            x, topk_idx, topk_weights, handle, False, zero_copy, async_finish,
            return_recv_hook, out, combine_wait_recv_cost_stats))

    def _shrink_tolerant(self, hook_at, call):
        """call()'s results. With enable_shrink, a step that lost a peer (it timed out or
        failed; epx masked it and completed the step with the others) returns its results
        as DeepEP's shrink mode does, the rank then being in low_latency_query_mask_buffer,
        and so does its receive hook; without, the EpxError is raised (it carries the
        results as .result)."""
        try:
            out = call()
        except EpxError as error:
            if not (self.enable_shrink and errors.peer_lost(error.status) and
                    getattr(error, "result", None) is not None):
                raise
            out = error.result
        hook = out[hook_at]
        if self.enable_shrink and hook is not None:
            out = out[:hook_at] + (_tolerant_hook(hook),) + out[hook_at + 1:]
        return out

    def get_next_low_latency_combine_buffer(self, handle):
        """bf16 [L, M * R, hidden] memory to write the expert outputs into, then
        low_latency_combine(..., zero_copy=True)."""
        buffer = self._ll_buffer_of(handle, "get_next_low_latency_combine_buffer")
        return buffer.get_next_low_latency_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Forget the low-latency steps (their handles become invalid). Nothing needs zeroing
        in epx (arrival flags carry sequence numbers), so it is local; with enable_shrink
        it is collective, as DeepEP's: a dispatch of no tokens first, so that a rank that
        does not take part is masked here, as DeepEP's clean masks it."""
        if self._ll is None:
            return
        if self.enable_shrink and self._ll_empty is not None:
            _, x, idx = self._ll_empty
            m = self._ll_shape[0]
            self._shrink_tolerant(4, lambda: self._ll.low_latency_dispatch(
                x, idx, m, self._ll_shape[2], use_fp8=False))
        self._ll.clean_low_latency_buffer()

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """mask=True: leave rank_to_mask out of later low-latency calls. Unmasking is not
        supported (NotImplementedError): only a rejoin unmasks (epx.Buffer.rejoin)."""
        if not mask:
            raise NotImplementedError("low_latency_update_mask_buffer: mask=False is not "
                                      "supported: epx unmasks a rank only when a new process "
                                      "takes its place through a rejoin (epx.Buffer.rejoin / "
                                      "epx.Buffer.create_rejoin, docs/STABILITY.md)")
        rank = int(rank_to_mask)
        if not 0 <= rank < self.group_size or rank == self.rank:
            raise invalid_argument("low_latency_update_mask_buffer: rank %d is not a peer of "
                                   "rank %d in 0..%d" % (rank, self.rank, self.group_size - 1))
        self._ll_masked.add(rank)
        if self._ll is not None:
            self._ll.mask_rank(rank)

    def low_latency_query_mask_buffer(self, mask_status):
        """Write 1 for each masked rank, 0 for the others, into mask_status ([R] int32)."""
        masked = set(self._ll_masked)
        if self._ll is not None:
            masked.update(self._ll.get_masked_ranks())
        for rank in range(self.group_size):
            mask_status[rank] = 1 if rank in masked else 0

    def low_latency_clean_mask_buffer(self):
        raise NotImplementedError("low_latency_clean_mask_buffer: epx masks are not undone")
