"""deep_ep.ElasticBuffer and EPHandle on epx: DeepEP V2's expert-parallel API.

DeepEP V2 (deep_ep 2.x) puts dispatch and combine behind one class, ElasticBuffer, whose
dispatch returns the received tokens once per receiving rank (as V1) or, with
do_expand=True, once per (token, local expert) grouped by expert, and whose handle
(EPHandle) carries the routing as tensors. Here the rows move through an epx normal-mode
buffer (made at the first dispatch for (hidden, num_experts, num_topk,
num_max_tokens_per_rank), made again for another shape); the V2 views of them are built
by _elastic_ops. Each fresh dispatch starts with two small host exchanges over the group:
the ranks' verdicts on their arguments, then where each rank's tokens go (a bit per
(token, rank)), from which each rank knows its rows' sources. Engram, pipeline send/recv and the
all-gather / reduce-scatter sessions are not epx's and raise NotImplementedError.
docs/PYTHON.md ("DeepEP V2: ElasticBuffer") lists the differences.
"""

import struct

import numpy as np

from ..buffer import Buffer as _EpxBuffer
from .._tensor import RawBits
from ..errors import EpxError, Status, invalid_argument
from . import _elastic_ops as ops
from . import _ops
from .buffer import Buffer as _V1Buffer
from .buffer import _group_of
from ._lifetime import Lifetime
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


class ElasticBuffer(Lifetime):
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

    _NAME = "deep_ep.ElasticBuffer"

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
        self._shape = None   # (hidden, num_experts, num_topk, num_max_tokens_per_rank)
        self._failed = False  # an operation on the buffers failed (they are made again)

    # ------------------------------------------------------------ lifetime

    # destroy(), _release() and _group(): _lifetime.Lifetime; _release_buffers() and
    # _epx_buffers() below.

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

    def _agree(self, shape, op, problem, tokens):
        """Start of every fresh dispatch: the ranks exchange their verdicts on the host
        (this rank's argument error or None, its buffers' failure, the shape (hidden,
        num_experts, num_topk, max_tokens), its number of tokens), so a mistake on one
        rank fails the call on every rank before any epx operation, and all ranks agree on
        whether to make the buffers again (another shape, or a failure anywhere). Returns
        (the epx buffer, the most tokens any rank has)."""
        group = self._group()
        mine = struct.pack("<BB5q", problem is None, self._main_failed(),
                           *(shape or (0,) * 4), tokens)
        votes = [struct.unpack("<BB5q", v) for v in group.allgather(mine)]
        most_tokens = max(v[6] for v in votes)
        bad = [r for r, v in enumerate(votes) if not v[0]]
        if bad:
            if problem is not None:
                raise invalid_argument("%s: %s" % (op, problem))
            raise EpxError(Status.ERR_REMOTE, "%s: rank %d refused its arguments (see its "
                           "error there)" % (op, bad[0]))
        shapes = {v[2:6] for v in votes}
        if len(shapes) > 1:
            raise invalid_argument("%s: the ranks differ in (hidden, num_experts, num_topk, "
                                   "num_max_tokens_per_rank): %s"
                                   % (op, ", ".join("rank %d %s" % (r, v[2:6])
                                                    for r, v in enumerate(votes))))
        any_failed = any(v[1] for v in votes)
        if shape == self._shape and self._main is not None and not any_failed:
            return self._main, most_tokens
        if any_failed and self._main is not None:
            # Healthy here, failed elsewhere: fail them here too, so that every rank frees
            # its buffers locally (destroying a healthy buffer is collective).
            self._fail_buffers(EpxError(Status.ERR_REMOTE, "%s: a peer's buffers failed"
                                        % op))
        self._release_buffers()
        hidden, num_experts, num_topk, max_tokens = shape
        num_sms = _V1Buffer.num_sms
        # combine's x is the caller's tensor: read in place (deep_ep.Buffer.auto_register).
        self._main = _EpxBuffer(group, max_tokens_per_rank=max_tokens, hidden=hidden,
                                num_experts=num_experts, num_topk=num_topk, num_sms=num_sms,
                                auto_register=_V1Buffer.auto_register)
        self._shape, self._failed = shape, False
        return self._main, most_tokens

    def _main_failed(self):
        if self._main is None:
            return False
        return self._failed or self._main.get_async_error()[0] != Status.SUCCESS

    def _collective(self, call, *args, **kwargs):
        """Run one epx operation; a failure (here or on a peer) leaves the buffers failed
        on every rank, and the next dispatch makes new ones."""
        try:
            return call(*args, **kwargs)
        except EpxError as error:
            self._fail_buffers(error)
            raise

    def _fail_buffers(self, error):
        """The epx buffer failed on this rank (destroyed locally later, as on the peers)."""
        if self._main is not None:
            try:
                self._main.abort(error)
            except EpxError:
                pass
        self._failed = True

    def _refuse(self, message):
        """Raise an argument error found on this rank. With buffers made, they are
        aborted first, so the peers' current or next operation fails (ERR_REMOTE naming
        this rank) instead of pairing with another call; the ElasticBuffer then makes new
        ones at its next dispatch (every rank's buffers failed alike)."""
        error = invalid_argument(message)
        if self._main is not None:
            self._fail_buffers(error)  # made again by the next dispatch
        raise error

    def _wait_for(self, event, op):
        """The caller's previous_event on the current stream; an error there fails the call
        on every rank (_refuse), as an argument error would."""
        if event is None:
            return
        try:
            event.current_stream_wait()
        except Exception as error:  # noqa: BLE001 - reported on every rank
            self._refuse("%s: previous_event: %s: %s" % (op, type(error).__name__, error))

    def _fresh_problem(self, x, topk_idx, num_experts, tokens, alignment):
        if isinstance(x, RawBits):
            return ("x: raw bits (epx.raw_bits) are not taken here; pass a torch tensor or a "
                    "NumPy array of ml_dtypes.bfloat16 / float8_e4m3fn")
        ops.framework_name(x, "ElasticBuffer.dispatch")
        if topk_idx is None:
            return "topk_idx is required without a handle"
        if num_experts is None:
            return "num_experts is required without a handle"
        if tokens <= 0:
            return "num_max_tokens_per_rank is needed (here or at construction)"
        if alignment < 1:
            return "expert_alignment must be >= 1, not %d" % alignment
        if int(num_experts) <= 0 or int(num_experts) % self.num_ranks != 0:
            return "num_experts %d is not a positive multiple of the %d ranks" % (
                int(num_experts), self.num_ranks)
        if len(x.shape) != 2 or len(topk_idx.shape) != 2:
            return "x and topk_idx must be 2-D, not %s and %s" % (tuple(x.shape),
                                                                tuple(topk_idx.shape))
        if int(topk_idx.shape[0]) != int(x.shape[0]):
            return "topk_idx has %d rows for %d tokens" % (int(topk_idx.shape[0]),
                                                           int(x.shape[0]))
        if int(x.shape[0]) > tokens:
            return "x has %d tokens, more than num_max_tokens_per_rank (%d)" % (
                int(x.shape[0]), tokens)
        return None

    @staticmethod
    def _stats_problem(stats, local):
        if stats is not None and tuple(int(d) for d in stats.shape) != (local,):
            return ("cumulative_local_expert_recv_stats has shape %s, expected [%d] (the "
                    "local experts)" % (tuple(stats.shape), local))
        return None

    @staticmethod
    def _ids_problem(idx, num_experts):
        """Expert ids must be -1 (none) or in [0, num_experts), as epx's dispatch wants
        (found here, before any epx operation, rather than by the kernels)."""
        bad = np.argwhere((idx < -1) | (idx >= num_experts))
        if len(bad):
            t, j = (int(v) for v in bad[0])
            return ("topk_idx[%d][%d] is %d, expected -1 (none) or an expert id in 0..%d"
                    % (t, j, int(idx[t, j]), num_experts - 1))
        return None

    @staticmethod
    def _distinct_problem(idx):
        """Each token's experts must differ: the expanded layout has one row per (token,
        expert), and epx counts a token once per expert."""
        if idx.shape[1] < 2:
            return None
        valid = np.where(idx >= 0, idx, -1 - np.arange(idx.shape[1]))
        ordered = np.sort(valid, axis=1)
        twice = np.nonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))[0]
        if len(twice):
            return ("topk_idx names an expert twice in token %d (%s); each token's experts "
                    "must differ" % (int(twice[0]), idx[int(twice[0])].tolist()))
        return None

    def _epx_buffers(self):
        return [self._main]

    def _release_buffers(self):
        buffer, self._main, self._shape = self._main, None, None
        if buffer is not None:
            try:
                buffer.destroy()
            except EpxError:
                pass  # a failed buffer is freed locally; nothing more to do

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
        if handle is not None:
            return self._dispatch_cached(x, topk_idx, topk_weights, handle, num_experts,
                                         num_max_tokens_per_rank, expert_alignment,
                                         do_cpu_sync, do_expand, previous_event,
                                         use_tma_aligned_col_major_sf,
                                         cumulative_local_expert_recv_stats,
                                         async_with_compute_stream)
        op = "ElasticBuffer.dispatch"
        tokens = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
            else int(num_max_tokens_per_rank)
        alignment = 1 if expert_alignment is None else int(expert_alignment)
        problem, shape = None, None
        try:  # every argument error here becomes this rank's verdict in _agree
            x_main = x[0] if isinstance(x, tuple) else x
            problem = self._fresh_problem(x_main, topk_idx, num_experts, tokens, alignment)
            if problem is None:
                num_experts, num_topk = int(num_experts), int(topk_idx.shape[1])
                local = num_experts // self.num_ranks
                idx_in = ops.to_host(topk_idx).astype(np.int64)
                problem = self._stats_problem(cumulative_local_expert_recv_stats, local) or \
                    self._ids_problem(idx_in, num_experts) or self._distinct_problem(idx_in)
                in_rank = _ops.layout(idx_in, num_experts, self.num_ranks)[2]
                shape = (int(x_main.shape[1]), num_experts, num_topk, tokens)
                if previous_event is not None:
                    previous_event.current_stream_wait()
        except Exception as error:  # noqa: BLE001 - reported on every rank below
            problem = "%s: %s" % (type(error).__name__, error)
        main, most_tokens = self._agree(None if problem else shape, op, problem,
                                        0 if problem else len(in_rank))
        routing = ops.Routing(self._group().allgather(ops.routing_record(in_rank, most_tokens)),
                              tokens)

        # Expanded rows are copied out of the buffer by the expansion itself: views here.
        recv_x, recv_idx, recv_w, counts, epx_handle, _ = self._collective(
            main.dispatch, x, topk_idx=topk_idx, topk_weights=topk_weights,
            expert_alignment=alignment, copy=not do_expand)
        # The peers are past the dispatch: a failure here (out of memory, a device error)
        # fails the buffers too, so that their next operation stops instead of waiting.
        try:
            if do_expand:
                recv_idx = _copy(recv_idx)  # kept by the handle
            n = epx_handle.num_recv_tokens
            src_ids = routing.source_ids(self.rank_idx)
            if len(src_ids) != n:
                self._refuse("%s: %d rows arrived, the ranks' routing says %d" % (
                    op, n, len(src_ids)))
            recv_x_main, recv_sf = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            expansion = ops.expansion_of(recv_idx, local, alignment, n)
            src_rank = src_ids // tokens
            head = np.stack([src_ids, src_rank], axis=1).astype(np.int32)
            if hasattr(expansion, "slots_device"):  # torch: the slots are on the rows' device
                import torch
                meta = torch.cat([ops.like(head, x_main), expansion.slots_device], dim=1)
            else:
                meta = ops.like(np.concatenate([head, expansion.slots], axis=1), x_main)
            up = self.num_scaleup_ranks
            peer_psum = ops.like(np.cumsum(np.bincount(src_rank % up, minlength=up)).astype(
                np.int32), x_main)
            worst = do_cpu_sync is not None and not do_cpu_sync
            handle = EPHandle(
                do_expand=bool(do_expand), num_experts=num_experts, expert_alignment=alignment,
                num_max_tokens_per_rank=tokens, num_sms=int(num_sms) or _V1Buffer.num_sms,
                topk_idx=_copy(topk_idx) if do_handle_copy else topk_idx,
                num_recv_tokens=self._worst_rows(tokens) if worst else n,
                num_expanded_tokens=(self._worst_expanded_rows(tokens, local, num_topk, alignment)
                                     if worst else expansion.rows),
                num_recv_tokens_per_expert_list=[] if worst else list(counts),
                psum_num_recv_tokens_per_scaleup_rank=peer_psum,
                psum_num_recv_tokens_per_expert=(
                    _on(expansion.psum, x_main) if do_expand
                    else ops.like(np.cumsum(counts).astype(np.int32), x_main)),
                num_unaligned_recv_tokens_per_expert=ops.like(
                    expansion.counts.astype(np.int32), x_main),
                recv_src_metadata=meta,
                dst_buffer_slot_idx=ops.like(routing.destination_rows(self.rank_idx, in_rank),
                                             x_main))
            handle._owner, handle._main, handle._epx, handle._received = self, main, epx_handle, n
            handle._expansion, handle._recv_topk_idx, handle._worst = expansion, recv_idx, worst
            self._add_stats(cumulative_local_expert_recv_stats, expansion.counts)
            outputs = self._shape_outputs(recv_x_main, recv_sf, recv_idx, recv_w, handle,
                                          do_expand, use_tma_aligned_col_major_sf)
            return outputs + (handle, self._event(x_main, async_with_compute_stream))
        except Exception as error:
            if not self._failed:
                self._fail_buffers(EpxError(Status.ERR_INTERNAL, "%s: %s: %s" % (
                    op, type(error).__name__, error)))
            raise

    def _worst_rows(self, tokens):
        return self.num_ranks * tokens

    def _worst_expanded_rows(self, tokens, local, topk, alignment):
        """DeepEP's bound on expanded rows without a CPU sync."""
        rows = self.num_ranks * tokens * min(topk, local) + (alignment - 1) * local
        return ops.align(rows, alignment)

    def _check_handle(self, handle, op):
        if not isinstance(handle, EPHandle) or getattr(handle, "_owner", None) is not self or \
                handle._main is not self._main or self._main is None:
            self._refuse("%s: handle is not from this buffer's current epx buffers (another "
                         "buffer's, or a dispatch of another shape or a failed call made new "
                         "ones)" % op)

    @staticmethod
    def _problem_of(check):
        """check()'s argument problem (text, or None); an exception it raises is one too, so
        that the call can be failed on every rank (_refuse) rather than raised here only."""
        try:
            return check()
        except Exception as error:  # noqa: BLE001 - reported on every rank
            return "%s: %s" % (type(error).__name__, error)

    @staticmethod
    def _cached_problem(x, topk_idx, handle, num_experts, num_max_tokens_per_rank,
                        expert_alignment, do_cpu_sync, do_expand, stats):
        given = (handle.num_experts if num_experts is None else int(num_experts),
                 handle.expert_alignment if expert_alignment is None else int(expert_alignment),
                 handle.num_max_tokens_per_rank if num_max_tokens_per_rank is None
                 else int(num_max_tokens_per_rank))
        if isinstance(x, RawBits):
            return "x: raw bits (epx.raw_bits) are not taken here"
        if topk_idx is not None:
            return "cached mode (handle given) takes no topk_idx, as DeepEP"
        if do_cpu_sync:
            return "cannot do CPU sync with a cached handle, as DeepEP"
        if stats is not None:
            return ("cumulative_local_expert_recv_stats is not taken in cached mode (the rows "
                    "were counted by the dispatch that made the handle)")
        if given != (handle.num_experts, handle.expert_alignment,
                     handle.num_max_tokens_per_rank):
            return ("num_experts, expert_alignment and num_max_tokens_per_rank must be the "
                    "handle's")
        if bool(do_expand) != handle.do_expand:
            return ("do_expand=%s with a handle of do_expand=%s (combine follows the handle's "
                    "layout)" % (bool(do_expand), handle.do_expand))
        ops.framework_name(x, "ElasticBuffer.dispatch")
        return None

    def _dispatch_cached(self, x, topk_idx, topk_weights, handle, num_experts,
                         num_max_tokens_per_rank, expert_alignment, do_cpu_sync, do_expand,
                         previous_event, col_major_sf, stats, async_finish):
        op = "ElasticBuffer.dispatch"
        self._check_handle(handle, op)
        x_main = x[0] if isinstance(x, tuple) else x
        problem = self._problem_of(lambda: self._cached_problem(
            x_main, topk_idx, handle, num_experts, num_max_tokens_per_rank, expert_alignment,
            do_cpu_sync, do_expand, stats))
        if problem is not None:
            self._refuse("%s: %s" % (op, problem))
        self._wait_for(previous_event, op)
        main = handle._main
        if topk_weights is not None:
            # epx's cached dispatch moves rows only; with weights, a fresh epx dispatch of
            # the handle's top-k (the same routing, so the same rows in the same order).
            recv_x, _, recv_w, _, fresh, _ = self._collective(
                main.dispatch, x, topk_idx=handle.topk_idx, topk_weights=topk_weights,
                expert_alignment=handle.expert_alignment, copy=not do_expand)
            fresh.destroy()
        else:
            recv_x, _, _, _, _, _ = self._collective(main.dispatch, x, handle=handle._epx,
                                                     copy=not do_expand)
            recv_w = None
        recv_x_main, recv_sf = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        outputs = self._shape_outputs(recv_x_main, recv_sf, handle._recv_topk_idx, recv_w,
                                      handle, do_expand, col_major_sf)
        return outputs + (handle, self._event(x_main, async_finish))

    def _shape_outputs(self, recv_x, recv_sf, recv_idx, recv_w, handle, do_expand,
                       col_major_sf):
        """(recv_x or (recv_x, recv_sf), recv_topk_idx, recv_topk_weights) in the layout
        asked for: expanded or not, padded to DeepEP's worst case when the handle's
        dispatch had no CPU sync."""
        if do_expand:
            expansion = handle._expansion
            rows = expansion.rows
            if handle._worst:
                local = handle.num_experts // self.num_ranks
                rows = self._worst_expanded_rows(handle.num_max_tokens_per_rank, local,
                                                 int(handle.topk_idx.shape[1]),
                                                 handle.expert_alignment)
            out_x = ops.expand_rows(recv_x, expansion, rows, recv_x)
            out_sf = ops.expand_rows(recv_sf, expansion, rows, recv_x)
            out_w = ops.expand_weights(recv_w, expansion, rows, recv_x)
            out_idx = None
        elif handle._worst:
            rows = self._worst_rows(handle.num_max_tokens_per_rank)
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
    def _combine_problem(x, handle, topk_weights, bias):
        if isinstance(bias, tuple) and len(bias) != 2:
            return "bias must be a tensor or a pair of tensors, not %d" % len(bias)
        if isinstance(x, RawBits):
            return "x: raw bits (epx.raw_bits) are not taken here"
        ops.framework_name(x, "ElasticBuffer.combine")
        if handle.do_expand:
            allowed = {handle._expansion.rows, handle.num_expanded_tokens}
            what = "the handle's expanded rows"
        else:
            allowed = {handle._received, handle.num_recv_tokens}
            what = "the handle's received rows"
        rows = int(x.shape[0])
        if rows not in allowed:
            return "x has %d rows, expected %s (%s)" % (
                rows, " or ".join(str(r) for r in sorted(allowed)), what)
        if topk_weights is not None:
            want = (rows,) if handle.do_expand else (rows, int(handle.topk_idx.shape[1]))
            if tuple(int(d) for d in topk_weights.shape) != want:
                return "topk_weights has shape %s, expected %s" % (
                    tuple(topk_weights.shape), want)
        return None

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0,
                previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream=False, allocate_on_comm_stream=False):
        """DeepEP V2's combine (collective): (combined_x, combined_topk_weights, event).

        x has the handle's received rows ([n, hidden], or the worst-case rows of a dispatch
        without CPU sync, of which the first n are read), or with an expanded handle its
        expanded rows, which
        are first summed per received row in top-k order (fp32, one rounding: DeepEP's
        reduction within a rank). topk_weights ([n, k], or [rows] expanded) come back
        summed per token ([num_tokens, k], each entry from the rank of its expert). The
        sum over ranks is epx's combine in DeepEP V2's order (bias_0 + bias_1 first, then
        each rank's row where its last top-k entry stands; across nodes per node first,
        each node where its last entry stands; rank order on the CUDA backend across
        nodes)."""
        op = "ElasticBuffer.combine"
        self._check_handle(handle, op)
        if handle.do_expand and not self.allow_multiple_reduction:
            # The same on every rank (a constructor argument): no rank enters the combine.
            raise NotImplementedError(
                "ElasticBuffer.combine: the expanded layout with allow_multiple_reduction=False "
                "(one reduction over every top-k entry) is not supported: epx sums each rank's "
                "rows before the ranks' sums")
        problem = self._problem_of(lambda: self._combine_problem(x, handle, topk_weights, bias))
        if problem is not None:
            self._refuse("%s: %s" % (op, problem))
        self._wait_for(previous_event, op)
        n = handle._received
        try:
            if handle.do_expand:
                slots = getattr(handle._expansion, "slots_device", None)
                if slots is None or not hasattr(x, "new_zeros"):
                    slots = handle._expansion.slots
                rows = ops.reduce_expanded(x, slots, int(x.shape[1]))
                weights = ops.weights_of_slots(topk_weights, slots) \
                    if topk_weights is not None else None
            else:
                rows = x[:n]
                weights = topk_weights[:n] if topk_weights is not None else None
        except Exception as error:
            self._fail_buffers(EpxError(Status.ERR_INVALID_ARG, "%s: %s" % (op, error)))
            raise
        combined_x, combined_w, _ = self._collective(handle._main.combine, rows, handle._epx,
                                                     weights, bias,
                                                     order_topk_idx=self._order_of(handle))
        return combined_x, combined_w, self._event(x, async_with_compute_stream)

    def _order_of(self, handle):
        """DeepEP V2's summation order (each rank's row where its last top-k entry stands,
        epx_combine_args_t.order_topk_idx): the dispatch's topk_idx, except on the CUDA
        backend across nodes, which does not take it yet (rank order there)."""
        group = self._group()
        if group.backend == "cuda" and 0 < group.ranks_per_node < group.world_size:
            return None
        return handle.topk_idx

    def __repr__(self):
        return ("deep_ep.ElasticBuffer(epx, rank=%d of %d, shape %s)"
                % (self.rank_idx, self.num_ranks, self._shape))


def _not_epx(name):
    def method(self, *args, **kwargs):
        raise NotImplementedError("deep_ep.ElasticBuffer.%s is not supported by epx (it moves "
                                  "MoE dispatch and combine only)" % name)
    method.__name__ = name
    return method


# DeepEP V2's Engram, pipeline send/recv and all-gather / reduce-scatter calls.
for _name in ("engram_write", "engram_fetch", "pp_set_config", "pp_send", "pp_recv",
              "create_agrs_session", "destroy_agrs_session", "agrs_new_session",
              "agrs_set_config", "agrs_get_inplace_tensor", "all_gather"):
    setattr(ElasticBuffer, _name, _not_epx(_name))


def _on(array, reference):
    """A device tensor as it is, or a NumPy array as `reference`'s kind."""
    return array if hasattr(array, "new_zeros") else ops.like(array, reference)


def _copy(tensor):
    if tensor is None:
        return None
    return tensor.clone() if hasattr(tensor, "clone") else np.array(tensor, copy=True)
