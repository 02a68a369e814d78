"""deep_ep.ElasticBuffer and EPHandle on epx: DeepEP V2's expert-parallel API.

DeepEP V2 (deep_ep 2.x) puts dispatch and combine behind one class, ElasticBuffer, whose
dispatch returns the received tokens once per receiving rank (as V1) or, with
do_expand=True, once per (token, local expert) grouped by expert, and whose handle
(EPHandle) carries the routing as tensors. Here the rows move through an epx normal-mode
buffer (made at the first dispatch for (hidden, num_experts, num_topk,
num_max_tokens_per_rank), made again for another shape); the V2 views of them are built
by _elastic_ops. The rows' source ids travel in a second, 16-byte-per-row dispatch
through a small side buffer with the same routing. Engram, pipeline send/recv and the
all-gather / reduce-scatter sessions are not epx's and raise NotImplementedError.
docs/PYTHON.md ("DeepEP V2: ElasticBuffer") lists the differences.
"""

import numpy as np

from ..buffer import Buffer as _EpxBuffer
from ..buffer import _Call
from ..errors import EpxError, Status, invalid_argument
from ..events import EventOverlap
from . import _elastic_ops as ops
from .buffer import Buffer as _V1Buffer
from .buffer import _group_of
from .config import normal_bytes

# DeepEP V2's buffer sizes are multiples of this (get_elastic_buffer_alignment()).
BUFFER_ALIGNMENT = 2 << 20


class EPHandle:
    """The routing of one ElasticBuffer.dispatch, as DeepEP V2's EPHandle: pass it to
    combine, or to dispatch(handle=...) to send other rows the same way.

    Attributes (DeepEP's): do_expand, num_experts, expert_alignment,
    num_max_tokens_per_rank, num_sms, topk_idx, num_recv_tokens, num_expanded_tokens,
    num_recv_tokens_per_expert_list, psum_num_recv_tokens_per_scaleup_rank,
    psum_num_recv_tokens_per_expert, num_unaligned_recv_tokens_per_expert,
    recv_src_metadata ([n, 2 + k] int32: the source's global token id
    src_rank * num_max_tokens_per_rank + index, the source rank, then each top-k entry's
    expanded row or -1), dst_buffer_slot_idx ([num_tokens, num_ranks] int32: the row each
    of this rank's tokens has among each rank's received rows, -1 where it is not sent),
    token_metadata_at_forward and channel_linked_list (None: epx has no channels).
    """

    def __init__(self, **fields):
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self.num_unaligned_recv_tokens_per_expert = None
        self.__dict__.update(fields)

    def __repr__(self):
        return ("deep_ep.EPHandle(epx, do_expand=%s, num_recv_tokens=%d, num_experts=%d)"
                % (self.do_expand, self.num_recv_tokens, self.num_experts))


class ElasticBuffer:
    """DeepEP V2's ElasticBuffer over epx (the constructor is collective, as DeepEP's).

    group: a torch.distributed ProcessGroup, an epx.Group, or None (the group `epx
        launch` set up). num_bytes / num_max_tokens_per_rank, hidden, num_topk,
        use_fp8_dispatch: DeepEP's sizing; epx sizes its memory from the dispatch's
        shape, and num_max_tokens_per_rank is the default of dispatch's.
    deterministic: accepted; epx's rows always come in source order (rank, then token),
        which is DeepEP's deterministic order.
    allow_hybrid_mode: across nodes epx always forwards through one rank per node (the
        hybrid path); False is accepted. allow_multiple_reduction=False refuses combine
        in the expanded layout (epx reduces each rank's rows first).
    prefer_overlap_with_compute, sl_idx, num_allocated_qps, num_gpu_timeout_secs: accepted
        (epx's waits time out after EPX_TIMEOUT_MS). num_cpu_bytes > 0 (Engram storage)
        raises NotImplementedError.
    """

    def __init__(self, group=None, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0,
                 hidden=0, num_topk=0, use_fp8_dispatch=False, deterministic=False,
                 allow_hybrid_mode=True, allow_multiple_reduction=True,
                 prefer_overlap_with_compute=True, sl_idx=3, num_allocated_qps=0,
                 num_cpu_timeout_secs=300, num_gpu_timeout_secs=100, explicitly_destroy=False):
        if num_cpu_bytes:
            raise NotImplementedError("deep_ep.ElasticBuffer: num_cpu_bytes (Engram storage in "
                                      "host memory) is not supported by epx")
        self._epx_group, self._owns_group = _group_of(group, None)
        self.group = group if group is not None else self._epx_group
        self.rank_idx = self._epx_group.rank
        self.num_ranks = self._epx_group.world_size
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.deterministic = bool(deterministic)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_max_tokens_per_rank = int(num_max_tokens_per_rank)
        if num_bytes is None:
            num_bytes = self._size_hint(self.num_ranks, num_max_tokens_per_rank, hidden,
                                        num_topk)
        self.num_bytes = int(num_bytes)
        self.num_allocated_qps = int(num_allocated_qps) or (65 if allow_hybrid_mode else 17)
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()
        self.runtime = None  # DeepEP's C++ runtime: epx has none to expose
        self._main = None    # epx.Buffer moving the rows
        self._side = None    # epx.Buffer moving each row's source id
        self._shape = None   # (hidden, num_experts, num_topk, num_max_tokens_per_rank)

    # ------------------------------------------------------------ lifetime

    def destroy(self):
        """Free the epx buffers (collective). As DeepEP's, only with explicitly_destroy."""
        if not self.explicitly_destroy:
            raise EpxError(Status.ERR_INVALID_STATE,
                           "deep_ep.ElasticBuffer.destroy: the buffer was made with "
                           "explicitly_destroy=False (it is freed when collected)")
        self._release()

    def _release(self):
        for buffer in (self._main, self._side):
            if buffer is not None:
                buffer.destroy()
        self._main = self._side = self._shape = None
        if self._owns_group and self._epx_group is not None:
            self._epx_group.destroy()
        self._epx_group = None

    def __del__(self):
        try:
            if not self.explicitly_destroy:
                self._release()
        except Exception:
            pass

    def _group(self):
        if self._epx_group is None:
            raise EpxError(Status.ERR_INVALID_STATE,
                           "deep_ep.ElasticBuffer: used after destroy()")
        return self._epx_group

    # ------------------------------------------------------------ sizes and domains

    @staticmethod
    def _size_hint(num_ranks, num_max_tokens_per_rank, hidden, num_topk):
        tokens, hidden = int(num_max_tokens_per_rank), int(hidden)
        if tokens <= 0 or hidden <= 0:
            return 0
        size = normal_bytes(tokens, 2 * hidden, int(num_ranks), max(int(num_topk), 1))
        return ops.align(size, BUFFER_ALIGNMENT)

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk=0,
                             use_fp8_dispatch=False, allow_hybrid_mode=True,
                             allow_multiple_reduction=True):
        """epx's normal-mode bytes per rank for this shape (bf16 rows, so fp8 fits too),
        rounded up to 2 MiB. Local: group gives the rank count only."""
        num_ranks = group.world_size if hasattr(group, "world_size") else group.size()
        return ElasticBuffer._size_hint(num_ranks, num_max_tokens_per_rank, hidden, num_topk)

    def get_logical_domain_size(self):
        """(nodes, ranks per node) of the group: (1, num_ranks) on one node."""
        group = self._group()
        per_node = group.ranks_per_node
        if 0 < per_node < group.world_size:
            return group.world_size // per_node, per_node
        return 1, group.world_size

    def get_physical_domain_size(self):
        """(RDMA ranks, NVLink ranks): the nodes and the ranks of each, as epx sees them."""
        return self.get_logical_domain_size()

    def get_theoretical_num_sms(self, num_experts, num_topk, num_scaleout_topk=0,
                                rdma_gbs=0, nvlink_gbs=0, sm_read_gbs=200, sm_write_gbs=50):
        """The SMs per rank of the epx buffers this class makes (deep_ep.Buffer.num_sms, 20
        unless set_num_sms changed it), not DeepEP's bandwidth model; dispatch's and
        combine's num_sms are accepted and not used (an epx buffer's SMs are fixed when
        it is made)."""
        return _V1Buffer.num_sms

    def get_theoretical_num_qps(self, num_sms):
        """min(num_sms + 1, num_allocated_qps): accepted and unused (NVSHMEM's own queue
        pairs carry epx's traffic between nodes)."""
        return min(int(num_sms) + 1, self.num_allocated_qps)

    @staticmethod
    def capture():
        """An EventOverlap recorded on torch's current CUDA stream (no event without CUDA)."""
        return _EpxBuffer.capture()

    def get_comm_stream(self):
        raise NotImplementedError("deep_ep.ElasticBuffer.get_comm_stream: epx has no "
                                  "communication stream; operations run on the caller's "
                                  "current stream")

    def barrier(self, use_comm_stream=True, with_cpu_sync=False, sequential=True):
        """A barrier of the group's ranks (host side, with epx's timeout)."""
        self._group().barrier()

    # ------------------------------------------------------------ the epx buffers

    def _buffers(self, hidden, num_experts, num_topk, max_tokens):
        shape = (hidden, num_experts, num_topk, max_tokens)
        if self._shape == shape:
            return self._main, self._side
        group = self._group()
        if num_experts % self.num_ranks != 0:
            raise invalid_argument("deep_ep.ElasticBuffer.dispatch: num_experts %d is not a "
                                   "multiple of the %d ranks" % (num_experts, self.num_ranks))
        for buffer in (self._main, self._side):
            if buffer is not None:
                buffer.destroy()
        self._main = self._side = self._shape = None
        num_sms = _V1Buffer.num_sms
        self._main = _EpxBuffer(group, max_tokens_per_rank=max_tokens, hidden=hidden,
                                num_experts=num_experts, num_topk=num_topk, num_sms=num_sms)
        self._side = _EpxBuffer(group, max_tokens_per_rank=max_tokens,
                                hidden=ops.META_HIDDEN, num_experts=num_experts,
                                num_topk=num_topk, num_sms=num_sms)
        self._shape = shape
        return self._main, self._side

    # ------------------------------------------------------------ dispatch

    def dispatch(self, x, topk_idx=None, topk_weights=None,
                 cumulative_local_expert_recv_stats=None, num_experts=None,
                 num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0,
                 previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream=False, allocate_on_comm_stream=False, handle=None,
                 do_handle_copy=True, do_cpu_sync=None, do_expand=False,
                 do_zero_padding=False, use_tma_aligned_col_major_sf=False):
        """DeepEP V2's dispatch (collective): (recv_x or (recv_x, recv_sf), recv_topk_idx,
        recv_topk_weights, handle, event).

        Rows come once per receiving rank in source order (rank, then token), or with
        do_expand once per (token, local expert), grouped by expert, each expert's rows
        padded to expert_alignment (padding zeroed). recv_topk_idx holds local expert ids
        (-1 for other ranks' experts; None when expanded); recv_topk_weights is [n, k]
        (0 where the id is -1), [rows] when expanded, None without topk_weights.
        do_cpu_sync=False gives DeepEP's worst-case shapes (num_ranks *
        num_max_tokens_per_rank rows, padded with -1 ids and zeros); epx still waits for
        the counts on the host. With handle: the same routing (topk_idx must be None).
        """
        x_main, x_sf = x if isinstance(x, tuple) else (x, None)
        ops.framework_name(x_main, "dispatch")
        if previous_event is not None:
            previous_event.current_stream_wait()
        if handle is not None:
            if topk_idx is not None:
                raise invalid_argument("ElasticBuffer.dispatch: cached mode (handle given) "
                                       "takes no topk_idx, as DeepEP")
            if not isinstance(handle, EPHandle) or handle._owner is not self or \
                    handle._main is not self._main:
                raise invalid_argument("ElasticBuffer.dispatch: handle is not from this "
                                       "buffer's current shape (a dispatch of another shape "
                                       "made new epx buffers)")
            if do_cpu_sync:
                raise invalid_argument("ElasticBuffer.dispatch: cannot do CPU sync with a "
                                       "cached handle, as DeepEP")
            num_experts = handle.num_experts if num_experts is None else int(num_experts)
            alignment = handle.expert_alignment if expert_alignment is None \
                else int(expert_alignment)
            tokens = handle.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
                else int(num_max_tokens_per_rank)
            if (num_experts, alignment, tokens) != (handle.num_experts, handle.expert_alignment,
                                                    handle.num_max_tokens_per_rank):
                raise invalid_argument("ElasticBuffer.dispatch: num_experts, expert_alignment "
                                       "and num_max_tokens_per_rank must be the handle's")
            return self._dispatch_cached(x_main, x_sf, topk_weights, handle, do_expand,
                                         do_zero_padding, use_tma_aligned_col_major_sf,
                                         cumulative_local_expert_recv_stats,
                                         async_with_compute_stream)
        if topk_idx is None:
            raise invalid_argument("ElasticBuffer.dispatch: topk_idx is required without a "
                                   "handle")
        if num_experts is None:
            raise invalid_argument("ElasticBuffer.dispatch: num_experts is required without a "
                                   "handle")
        tokens = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
            else int(num_max_tokens_per_rank)
        if tokens <= 0:
            raise invalid_argument("ElasticBuffer.dispatch: num_max_tokens_per_rank is needed "
                                   "(here or at construction)")
        if int(x_main.shape[0]) > tokens:
            raise invalid_argument("ElasticBuffer.dispatch: x has %d tokens, more than "
                                   "num_max_tokens_per_rank %d" % (int(x_main.shape[0]), tokens))
        alignment = 1 if expert_alignment is None else int(expert_alignment)
        if alignment < 1:
            raise invalid_argument("ElasticBuffer.dispatch: expert_alignment must be >= 1")
        num_experts, num_topk = int(num_experts), int(topk_idx.shape[1])
        main, side = self._buffers(int(x_main.shape[1]), num_experts, num_topk, tokens)

        recv_x, recv_idx, recv_w, counts, epx_handle, _ = main.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=alignment,
            copy=True)
        n = epx_handle.num_recv_tokens
        ids = self.rank_idx * tokens + np.arange(int(x_main.shape[0]), dtype=np.int64)
        recv_meta, _, _, _, side_handle, _ = side.dispatch(
            ops.source_rows(ids, x_main), topk_idx=topk_idx, copy=True)
        side_handle.destroy()
        src_ids = ops.source_ids(recv_meta)[:n]
        recv_x_main, recv_sf = recv_x if isinstance(recv_x, tuple) else (recv_x, None)

        local = num_experts // self.num_ranks
        idx_host = ops.to_host(recv_idx)[:n]
        expansion = ops.Expansion(idx_host, local, alignment)
        meta = np.empty((n, 2 + num_topk), dtype=np.int32)
        meta[:, 0] = src_ids
        meta[:, 1] = src_ids // tokens
        meta[:, 2:] = expansion.slots
        src_rank = src_ids // tokens
        per_peer = np.bincount(src_rank % self.num_scaleup_ranks,
                               minlength=self.num_scaleup_ranks)
        handle = EPHandle(
            dst_buffer_slot_idx=ops.like(
                self._destination_rows(main, epx_handle, x_main, topk_idx, local), x_main),
            do_expand=bool(do_expand), num_experts=num_experts, expert_alignment=alignment,
            num_max_tokens_per_rank=tokens, num_sms=int(num_sms) or _V1Buffer.num_sms,
            topk_idx=_copy(topk_idx) if do_handle_copy else topk_idx,
            num_recv_tokens=n, num_expanded_tokens=expansion.rows if do_expand else n,
            num_recv_tokens_per_expert_list=list(counts),
            psum_num_recv_tokens_per_scaleup_rank=ops.like(
                np.cumsum(per_peer).astype(np.int32), x_main),
            psum_num_recv_tokens_per_expert=ops.like(
                expansion.psum if do_expand else np.cumsum(counts).astype(np.int32), x_main),
            num_unaligned_recv_tokens_per_expert=ops.like(
                expansion.counts.astype(np.int32), x_main),
            recv_src_metadata=ops.like(meta, x_main))
        handle._owner, handle._main, handle._epx = self, main, epx_handle
        handle._expansion, handle._recv_topk_idx = expansion, recv_idx
        if not do_cpu_sync and do_cpu_sync is not None:
            handle.num_recv_tokens_per_expert_list = []
        self._add_stats(cumulative_local_expert_recv_stats, expansion.counts)
        outputs = self._shape_outputs(recv_x_main, recv_sf, recv_idx, recv_w, handle,
                                      do_expand, use_tma_aligned_col_major_sf,
                                      do_cpu_sync is not None and not do_cpu_sync)
        return outputs + (handle, self._event(x_main, async_with_compute_stream))

    def _destination_rows(self, main, epx_handle, x, topk_idx, local):
        """[num_tokens, num_ranks] int32: each token's row among each rank's received rows
        (rows come in source order: the lower ranks' tokens, then this rank's in order),
        -1 where the token is not sent."""
        matrix = ops.to_host(_V1Buffer._rank_prefix_matrix(main, epx_handle,
                                                           _Call(main, "dispatch", x)))
        idx = ops.to_host(topk_idx).astype(np.int64)
        tokens = idx.shape[0]
        in_rank = np.zeros((tokens, self.num_ranks), dtype=bool)
        rows, cols = np.nonzero(idx >= 0)
        in_rank[rows, idx[rows, cols] // local] = True
        base = matrix[self.rank_idx - 1] if self.rank_idx > 0 else np.zeros(self.num_ranks)
        place = np.cumsum(in_rank, axis=0) - 1 + base.astype(np.int64)
        return np.where(in_rank, place, -1).astype(np.int32)

    def _dispatch_cached(self, x, x_sf, topk_weights, handle, do_expand, do_zero_padding,
                         col_major_sf, stats, async_finish):
        main = handle._main
        if topk_weights is not None:
            # epx's cached dispatch moves rows only; with weights, a fresh epx dispatch of
            # the handle's top-k (the same routing, so the same rows in the same order).
            recv_x, _, recv_w, _, fresh, _ = main.dispatch(
                (x, x_sf) if x_sf is not None else x, topk_idx=handle.topk_idx,
                topk_weights=topk_weights, expert_alignment=handle.expert_alignment,
                copy=True)
            fresh.destroy()
        else:
            recv_x, _, _, _, _, _ = main.dispatch(
                (x, x_sf) if x_sf is not None else x, handle=handle._epx, copy=True)
            recv_w = None
        recv_x_main, recv_sf = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        self._add_stats(stats, handle._expansion.counts)
        outputs = self._shape_outputs(recv_x_main, recv_sf, handle._recv_topk_idx, recv_w,
                                      handle, do_expand, col_major_sf, False)
        return outputs + (handle, self._event(x, async_finish))

    def _shape_outputs(self, recv_x, recv_sf, recv_idx, recv_w, handle, do_expand,
                       col_major_sf, worst_case):
        """(recv_x or (recv_x, recv_sf), recv_topk_idx, recv_topk_weights) in the layout
        asked for: expanded, or padded to DeepEP's worst case."""
        if do_expand:
            expansion = handle._expansion
            rows = expansion.rows
            if worst_case:
                local = handle.num_experts // self.num_ranks
                topk = int(handle.topk_idx.shape[1])
                rows = self.num_ranks * handle.num_max_tokens_per_rank * min(topk, local)
                rows = ops.align(rows + (handle.expert_alignment - 1) * local,
                                 handle.expert_alignment)
            out_x = ops.expand_rows(recv_x, expansion, rows, recv_x)
            out_sf = ops.expand_rows(recv_sf, expansion, rows, recv_x)
            out_w = ops.expand_weights(recv_w, expansion, rows, recv_x)
            out_idx = None
        elif worst_case:
            rows = self.num_ranks * handle.num_max_tokens_per_rank
            out_x, out_sf = ops.pad_rows(recv_x, rows, 0), ops.pad_rows(recv_sf, rows, 0)
            out_idx = ops.pad_rows(recv_idx, rows, -1)
            out_w = ops.pad_rows(recv_w, rows, 0)
        else:
            out_x, out_sf, out_idx, out_w = recv_x, recv_sf, _copy(recv_idx), recv_w
        if out_sf is not None and col_major_sf:
            out_sf = ops.column_major(out_sf)
        return ((out_x, out_sf) if out_sf is not None else out_x), out_idx, out_w

    @staticmethod
    def _add_stats(stats, counts):
        if stats is not None:
            stats += ops.like(counts.astype(np.int32), stats).to(stats.dtype) \
                if hasattr(stats, "detach") else counts.astype(stats.dtype)

    @staticmethod
    def _event(tensor, async_finish):
        return _V1Buffer._event(tensor, async_finish)

    # ------------------------------------------------------------ combine

    @staticmethod
    def _unpack_bias(bias):
        if bias is None:
            return None
        if isinstance(bias, tuple):
            if len(bias) != 2:
                raise invalid_argument("ElasticBuffer.combine: bias must be a tensor or a "
                                       "pair of tensors")
            return bias
        return bias

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0,
                previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream=False, allocate_on_comm_stream=False):
        """DeepEP V2's combine (collective): (combined_x, combined_topk_weights, event).

        x has the handle's received rows ([n, hidden]; the worst-case rows of a dispatch
        without CPU sync are cut to n), or with an expanded handle its expanded rows, which
        are first summed per received row in top-k order (fp32, one rounding: DeepEP's
        reduction within a rank). topk_weights ([n, k], or [rows] expanded) come back
        summed per token ([num_tokens, k], each entry from the rank of its expert). The
        sum over ranks is epx's combine (fp32 in rank order, bias_0 + bias_1 first;
        across nodes per node first)."""
        if not isinstance(handle, EPHandle) or handle._owner is not self or \
                handle._main is not self._main:
            raise invalid_argument("ElasticBuffer.combine: handle is not from this buffer's "
                                   "current shape")
        ops.framework_name(x, "combine")
        if previous_event is not None:
            previous_event.current_stream_wait()
        n = handle.num_recv_tokens
        if handle.do_expand:
            if not self.allow_multiple_reduction:
                raise NotImplementedError(
                    "ElasticBuffer.combine: the expanded layout with "
                    "allow_multiple_reduction=False (one reduction over every top-k entry) is "
                    "not supported: epx sums each rank's rows before the ranks' sums")
            slots = handle._expansion.slots
            rows = ops.reduce_expanded(x, slots, int(x.shape[1]))
            weights = ops.weights_of_slots(topk_weights, slots) \
                if topk_weights is not None else None
        else:
            rows = x[:n] if int(x.shape[0]) > n else x
            weights = topk_weights[:n] if topk_weights is not None and \
                int(topk_weights.shape[0]) > n else topk_weights
        combined_x, combined_w, _ = handle._main.combine(rows, handle._epx, weights,
                                                         self._unpack_bias(bias))
        return combined_x, combined_w, self._event(x, async_with_compute_stream)

    # ------------------------------------------------------------ not epx's

    def _not_epx(self, what):
        raise NotImplementedError("deep_ep.ElasticBuffer.%s is not supported by epx (it moves "
                                  "MoE dispatch and combine only)" % what)

    def engram_write(self, *args, **kwargs):
        self._not_epx("engram_write")

    def engram_fetch(self, *args, **kwargs):
        self._not_epx("engram_fetch")

    def pp_set_config(self, *args, **kwargs):
        self._not_epx("pp_set_config")

    def pp_send(self, *args, **kwargs):
        self._not_epx("pp_send")

    def pp_recv(self, *args, **kwargs):
        self._not_epx("pp_recv")

    def create_agrs_session(self, *args, **kwargs):
        self._not_epx("create_agrs_session")

    def destroy_agrs_session(self, *args, **kwargs):
        self._not_epx("destroy_agrs_session")

    def agrs_new_session(self, *args, **kwargs):
        self._not_epx("agrs_new_session")

    def agrs_set_config(self, *args, **kwargs):
        self._not_epx("agrs_set_config")

    def agrs_get_inplace_tensor(self, *args, **kwargs):
        self._not_epx("agrs_get_inplace_tensor")

    def all_gather(self, *args, **kwargs):
        self._not_epx("all_gather")

    def __repr__(self):
        return ("deep_ep.ElasticBuffer(epx, rank=%d of %d, shape %s)"
                % (self.rank_idx, self.num_ranks, self._shape))


def _copy(tensor):
    if tensor is None:
        return None
    return tensor.clone() if hasattr(tensor, "clone") else np.array(tensor, copy=True)
