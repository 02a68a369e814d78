"""deep_ep.Buffer on epx: DeepEP V1's constructor, methods, arguments and results.

DeepEP sizes its buffers in bytes and takes the MoE shape per call; an epx buffer is made
for one shape. So this Buffer makes its epx buffers when a call first shows the shape,
and makes them again (collectively: every rank makes the same calls) when a call shows
another one:
  - normal mode: one epx buffer per (hidden, num_experts, num_topk), holding as many
    tokens per rank as fit in num_nvl_bytes (EpxError ERR_CAPACITY beyond that);
  - low-latency mode (low_latency.py): one per (num_max_dispatch_tokens_per_rank, hidden,
    num_experts, num_topk), sized by epx from that shape.
docs/PYTHON.md ("DeepEP drop-in") lists what differs from DeepEP.
"""

import ctypes

from .. import _capi, _dlpack
from ..buffer import Buffer as _EpxBuffer
from ..buffer import Handle as _EpxHandle
from ..buffer import _Call
from ..errors import EpxError, Status, check, invalid_argument
from ..events import EventOverlap
from ..group import Group
from . import _ops
from ._lifetime import Lifetime
from .config import Config
from .low_latency import LowLatencyMethods

# Tokens per rank of an epx normal-mode buffer at most (its config's limit).
_MAX_TOKENS_PER_RANK = 1 << 24
# get_low_latency_rdma_size_hint's answers in this process: bytes -> {(M, hidden, R, E)}.
_LOW_LATENCY_HINTS = {}


class DispatchHandle(tuple):
    """DeepEP's intranode handle: (rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head).

    rank_prefix_matrix is an int32 [num_ranks, num_ranks] tensor on the device of the
    dispatch: [s][r] = tokens that ranks 0..s sent to rank r. is_token_in_rank is the
    tensor given to dispatch (None when it was not given). epx has no channels and no
    send heads, and keeps the received rows' sources inside the library: the other four
    are None. The routing itself is the epx.Handle in `.epx_handle` (kept alive by this
    tuple); pass the tuple to combine and to dispatch(handle=...) as with DeepEP.
    """

    def __new__(cls, epx_handle, rank_prefix_matrix, is_token_in_rank):
        self = super().__new__(cls, (rank_prefix_matrix, None, None, None, is_token_in_rank,
                                     None))
        self.epx_handle = epx_handle
        return self


class InternodeDispatchHandle(tuple):
    """DeepEP's internode handle (a group spanning nodes): (is_token_in_rank,
    rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix,
    recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum,
    recv_src_meta, send_rdma_head, send_nvl_head).

    is_token_in_rank is the tensor given to dispatch (None when it was not given);
    recv_gbl_rank_prefix_sum (handle[-4], what DeepEP's test_internode reads) is an int32
    [num_ranks] tensor on the device of the dispatch: [s] = tokens this rank received from
    ranks 0..s (received rows come in source rank order). epx has no channels, no
    per-node forwarding state and keeps the rows' sources inside the library: the other
    eight are None. The routing is the epx.Handle in `.epx_handle`, as in DispatchHandle.
    """

    def __new__(cls, epx_handle, recv_gbl_rank_prefix_sum, is_token_in_rank):
        self = super().__new__(cls, (is_token_in_rank, None, None, None, None, None,
                                     recv_gbl_rank_prefix_sum, None, None, None))
        self.epx_handle = epx_handle
        return self


def _group_of(group, comm):
    """(epx.Group, whether this Buffer made it) for DeepEP's group / comm arguments."""
    if isinstance(group, Group):
        return group, False
    if group is None and comm is not None:
        def allgather(data):
            return b"".join(comm.allgather(data))
        return Group.from_callbacks(comm.Get_rank(), comm.Get_size(), allgather,
                                    comm.Barrier), True
    if group is None:
        return Group.from_env(), True
    if not (hasattr(group, "rank") and hasattr(group, "size")):
        raise invalid_argument("deep_ep.Buffer: group must be a torch.distributed "
                               "ProcessGroup, an epx.Group or None, not %s"
                               % type(group).__name__)
    return Group.from_process_group(group), True


class Buffer(Lifetime, LowLatencyMethods):
    """DeepEP's deep_ep.Buffer over epx (the constructor is collective, as DeepEP's).

    group: a torch.distributed ProcessGroup (its collectives are epx's bootstrap), an
        epx.Group, or None: then `comm` (an mpi4py communicator) or, without one, the
        group `epx launch` set up.
    num_nvl_bytes: the normal-mode budget: the epx buffer made at the first dispatch holds
        as many tokens per rank as fit in it (0: no normal mode).
    num_rdma_bytes: with low_latency_mode, > 0 enables the low-latency calls; epx sizes
        that memory from the first call's shape (get_low_latency_rdma_size_hint gives it).
    num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric: accepted;
        they tune transports epx does not use.
    explicitly_destroy: destroy() must be called (and is refused otherwise, as DeepEP's).
    enable_shrink: epx buffers can always mask ranks; with it, and num_rdma_bytes from
        get_low_latency_rdma_size_hint, the low-latency buffer is made here (collectively,
        for that shape and up to 11 experts per token, DeepEP's limit), so that a rank
        absent from the first low_latency_dispatch is masked like any silent peer.
    """

    num_sms = 20
    # The normal-mode buffers' config.auto_register: True (epx.deep_ep's default) reads
    # combine's x in place, False copies it in, None follows EPX_AUTO_REGISTER.
    auto_register = True

    def __init__(self, group=None, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 use_fabric=False, explicitly_destroy=False, enable_shrink=False, comm=None):
        self._epx_group, self._owns_group = _group_of(group, comm)
        self.group = group if group is not None else (comm if comm is not None
                                                      else self._epx_group)
        self.rank = self._epx_group.rank
        self.group_size = self._epx_group.world_size
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        self.runtime = None  # DeepEP's C++ runtime: epx has none to expose
        self._normal = None       # epx.Buffer of the normal mode, made by the first dispatch
        self._normal_shape = None  # (hidden, num_experts, num_topk) it was made for
        self._layout_shape = None  # (num_experts, num_topk) of the last get_dispatch_layout
        self._init_low_latency()
        if self.low_latency_mode and self.enable_shrink:
            self._make_low_latency_early(_LOW_LATENCY_HINTS.get(self.num_rdma_bytes))

    # ------------------------------------------------------------ lifetime

    def _epx_buffers(self):
        return [self._normal, self._ll]

    def _release_buffers(self):
        for buffer in (self._normal, self._ll):
            if buffer is not None:
                buffer.destroy()
        self._normal = self._ll = None

    # ------------------------------------------------------------ statics

    @staticmethod
    def is_sm90_compiled():
        """True: epx's fp8 paths need no sm_90 features (they work on every backend)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms):
        """SMs of the normal-mode kernels of buffers made from now on (config.num_sms of a
        call that makes the buffer wins)."""
        if int(new_num_sms) <= 0:
            raise ValueError("set_num_sms: %d is not a positive SM count" % new_num_sms)
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def capture():
        """An EventOverlap recorded on torch's current CUDA stream (no event without CUDA)."""
        return _EpxBuffer.capture()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts):
        """Bytes of epx low-latency memory per rank for this shape (rows sized for bf16).
        The shape is remembered with the bytes: a Buffer made with enable_shrink and these
        num_rdma_bytes makes its low-latency buffer for it at once (low_latency.py), on
        every rank that called this (all should, as DeepEP's examples do)."""
        from .config import low_latency_bytes
        shape = (int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_ranks),
                 int(num_experts))
        size = low_latency_bytes(shape[0], shape[1], shape[3])
        _LOW_LATENCY_HINTS.setdefault(size, set()).add(shape)
        return size

    @staticmethod
    def get_dispatch_config(num_ranks):
        """Config(Buffer.num_sms) with DeepEP's default chunk sizes (epx reads num_sms)."""
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        return Config(Buffer.num_sms)

    def get_comm_stream(self):
        raise NotImplementedError("deep_ep.Buffer.get_comm_stream: epx has no communication "
                                  "stream; operations run on the caller's current stream")

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        raise NotImplementedError("deep_ep.Buffer.get_local_buffer_tensor: epx does not expose "
                                  "its raw buffer memory")

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None,
                           num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                           num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment=1, num_worst_tokens=0, config=None,
                           previous_event=None, async_finish=False,
                           allocate_on_comm_stream=False):
        """DeepEP's internode dispatch, which its dispatch calls for a group spanning
        nodes: dispatch itself (epx takes the internode path by the group)."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                             is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                             expert_alignment, num_worst_tokens, config, previous_event,
                             async_finish, allocate_on_comm_stream)

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config=None,
                          previous_event=None, async_finish=False,
                          allocate_on_comm_stream=False):
        """DeepEP's internode combine: combine itself."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event,
                            async_finish, allocate_on_comm_stream)

    # ------------------------------------------------------------ the normal-mode buffer

    def _spans_nodes(self):
        group = self._group()
        return 0 < group.ranks_per_node < group.world_size

    def _normal_budget(self):
        """Bytes the normal-mode epx buffer may take: num_nvl_bytes, plus num_rdma_bytes
        for a group spanning nodes (DeepEP's internode mode uses both). With
        low_latency_mode the low-latency buffer is separate memory on top (DeepEP shares
        its RDMA buffer between the modes)."""
        return self.num_nvl_bytes + (self.num_rdma_bytes if self._spans_nodes() else 0)

    def _tokens_for(self, hidden, num_experts, num_topk):
        """The most tokens per rank whose epx buffer fits in the normal-mode budget."""
        group = self._group()
        budget = self._normal_budget()
        what = "num_nvl_bytes + num_rdma_bytes" if self._spans_nodes() else "num_nvl_bytes"

        def size(tokens):
            return _EpxBuffer.buffer_size(group, tokens, hidden, num_experts, num_topk)

        if size(1) > budget:
            raise EpxError(Status.ERR_CAPACITY,
                           "deep_ep.Buffer: %s = %d is too small for one token per rank of "
                           "hidden %d (epx needs %d bytes); Config.get_nvl_buffer_size_hint "
                           "(and get_rdma_buffer_size_hint across nodes) gives a size"
                           % (what, budget, hidden, size(1)))
        low, high = 1, _MAX_TOKENS_PER_RANK // max(self.group_size, 1)
        while low < high:
            middle = (low + high + 1) // 2
            if size(middle) <= budget:
                low = middle
            else:
                high = middle - 1
        return low

    def _normal_buffer(self, hidden, num_experts, num_topk, config):
        """The epx buffer for this shape (num_topk None: any), made on first need."""
        group = self._group()
        current = self._normal_shape
        if current is not None and current[:2] == (hidden, num_experts) and \
                num_topk in (None, current[2]):
            return self._normal
        if num_topk is None:
            num_topk = self._layout_shape[1] if self._layout_shape is not None and \
                self._layout_shape[0] == num_experts else 1
        if self.num_nvl_bytes <= 0:
            raise EpxError(Status.ERR_INVALID_STATE,
                           "deep_ep.Buffer: dispatch needs num_nvl_bytes > 0 (the buffer was "
                           "made with num_nvl_bytes=0)")
        tokens = self._tokens_for(hidden, num_experts, num_topk)
        if self._normal is not None:
            self._normal.destroy()
            self._normal = self._normal_shape = None
        num_sms = config.num_sms if config is not None else Buffer.num_sms
        # DeepEP's combine takes the expert outputs, a tensor outside the buffer: mapped
        # for the peers on demand and read in place, not copied in (Buffer.auto_register;
        # docs/DESIGN.md section 7).
        self._normal = _EpxBuffer(group, max_tokens_per_rank=tokens, hidden=hidden,
                                  num_experts=num_experts, num_topk=num_topk, num_sms=num_sms,
                                  auto_register=Buffer.auto_register)
        self._normal_shape = (hidden, num_experts, num_topk)
        return self._normal

    # ------------------------------------------------------------ layout

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None,
                            async_finish=False, allocate_on_comm_stream=False):
        """(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
        is_token_in_rank, event), as DeepEP's (local). num_tokens_per_rdma_rank is None on
        one node; for a group spanning nodes an int32 [num_nodes] tensor, the tokens sent
        to each node (a token counts once per node). Before the first dispatch of this
        shape there is no epx buffer to run it on; it is then computed with the
        framework's own operations."""
        num_topk = int(topk_idx.shape[1])
        self._layout_shape = (int(num_experts), num_topk)
        current = self._normal_shape
        spans = self._spans_nodes()
        if current is not None and current[1:] == self._layout_shape:
            # Across nodes the event comes after the tokens per node, computed below.
            per_rank, _, per_expert, in_rank, event = self._normal.get_dispatch_layout(
                topk_idx, num_experts, previous_event, async_finish and not spans)
        else:
            if previous_event is not None:
                previous_event.current_stream_wait()
            per_rank, per_expert, in_rank = _ops.layout(topk_idx, int(num_experts),
                                                        self.group_size)
            event = None
        per_node = None
        if spans:
            per_node = _ops.tokens_per_node(in_rank, self._group().ranks_per_node)
        if event is None or spans:
            event = self._event(topk_idx, async_finish)
        return per_rank, per_node, per_expert, in_rank, event

    @staticmethod
    def _event(tensor, async_finish):
        if not async_finish:
            return EventOverlap(None)
        from .. import _frameworks
        framework = _frameworks.of(tensor)
        device = framework.device_of(tensor)
        return EventOverlap(framework.record_event(device), None, framework)

    # ------------------------------------------------------------ dispatch

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's dispatch (collective): tokens to the ranks of their experts, on one
        node or, for a group spanning nodes, through epx's internode path.

        Fresh mode routes by topk_idx when given, else by is_token_in_rank with the
        per-expert counts of num_tokens_per_expert. Returns (recv_x or (recv_x,
        recv_x_scales), recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event) of tensors the caller owns; cached mode (handle=) returns (recv_x,
        None, None, None, None, event). num_worst_tokens > 0: outputs of that many rows,
        recv_topk_idx -1 past the received rows, an empty list, no host synchronisation on
        the GPU. The handle is a DispatchHandle on one node, an InternodeDispatchHandle
        across nodes.
        """
        x_main, x_scales = x if isinstance(x, tuple) else (x, None)
        if handle is not None:
            epx_handle = self._epx_handle(handle, "dispatch")
            if topk_idx is not None or topk_weights is not None:
                raise invalid_argument("dispatch: cached mode (handle given) takes no topk_idx "
                                       "or topk_weights, as DeepEP")
            recv_x, _, _, _, _, event = epx_handle._buffer.dispatch(
                x, handle=epx_handle, previous_event=previous_event,
                async_finish=async_finish, copy=True)
            return recv_x, None, None, None, None, event

        hidden = int(x_main.shape[1])
        if num_tokens_per_expert is not None:
            num_experts = int(num_tokens_per_expert.shape[0])
        elif self._layout_shape is not None:
            num_experts = self._layout_shape[0]
        else:
            raise invalid_argument("dispatch: num_tokens_per_expert is required in fresh mode "
                                   "(from get_dispatch_layout)")
        num_topk = int(topk_idx.shape[1]) if topk_idx is not None else None
        buffer = self._normal_buffer(hidden, num_experts, num_topk, config)
        return self._dispatch_fresh(buffer, x_main, x_scales, is_token_in_rank,
                                    num_tokens_per_expert, topk_idx, topk_weights,
                                    expert_alignment, int(num_worst_tokens or 0),
                                    previous_event, async_finish)

    def _dispatch_fresh(self, buffer, x, x_scales, is_token_in_rank, num_tokens_per_expert,
                        topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                        previous_event, async_finish):
        buffer._begin(previous_event)
        call = _Call(buffer, "dispatch", x)
        x_arg = call.tensor(x, "x", required=True)
        scales_arg = call.tensor(x_scales, "x_scales")
        by_topk = topk_idx is not None
        if by_topk:
            idx_arg = call.tensor(topk_idx, "topk_idx")
            weights_arg = call.tensor(topk_weights, "topk_weights")
        else:
            if topk_weights is not None:
                call.fail("topk_weights needs topk_idx")
            in_rank_arg = call.tensor(is_token_in_rank, "is_token_in_rank", required=True)
            counts_arg = call.tensor(num_tokens_per_expert, "num_tokens_per_expert",
                                     required=True)
        if call.problems:
            buffer._raise_problems(call)

        args = _capi.new(_capi.DispatchArgs)
        args.x = x_arg.c_tensor()
        if scales_arg is not None:
            args.x_scales = scales_arg.c_tensor()
        if by_topk:
            args.topk_idx = idx_arg.c_tensor()
            if weights_arg is not None:
                args.topk_weights = weights_arg.c_tensor()
        else:
            args.is_token_in_rank = in_rank_arg.c_tensor()
            args.num_tokens_per_expert = counts_arg.c_tensor()
        args.expert_alignment = int(expert_alignment or 0)
        args.flags = _capi.DISPATCH_WORST_CASE if num_worst_tokens > 0 else 0
        result = _capi.new(_capi.DispatchResult)
        check(_capi.api().epx_dispatch(buffer.pointer, ctypes.byref(args), ctypes.byref(result),
                                       call.stream), "dispatch")

        raw = x_arg.raw
        views = [buffer._view(result.recv_x, call, raw, False),
                 buffer._view(result.recv_x_scales, call, False, False),
                 buffer._view(result.recv_topk_idx, call, False, False),
                 buffer._view(result.recv_topk_weights, call, False, False)]
        counts = []
        if num_worst_tokens > 0:
            # Rows of the caller's worst case; top-k ids -1 and weights 0 past the rows
            # received, as DeepEP pads them.
            owned = [_ops.take_rows(v, num_worst_tokens, call.framework) for v in views]
            count_device = None
            if result.num_recv_tokens < 0:
                count = _capi.Tensor()
                count.data = ctypes.cast(result.num_recv_tokens_device, ctypes.c_void_p).value
                count.dtype = _capi.DTYPE_INT32
                count.ndim = 1
                count.shape[0] = 1
                count_device = buffer._view_in(count, call.framework, False)
            _ops.pad_rows(owned[2], int(result.num_recv_tokens), count_device, -1)
            _ops.pad_rows(owned[3], int(result.num_recv_tokens), count_device, 0)
        else:
            owned = [call.framework.copy(v) if v is not None else None for v in views]
            if result.num_recv_tokens_per_expert:
                counts = [int(result.num_recv_tokens_per_expert[i])
                          for i in range(result.num_local_experts)]
        epx_handle = _EpxHandle(buffer, result.handle, counts, call.framework, raw)
        buffer._handles.add(epx_handle)
        matrix = self._rank_prefix_matrix(buffer, epx_handle, call)
        if self._spans_nodes():
            handle = InternodeDispatchHandle(
                epx_handle, call.framework.copy(matrix[:, self.rank]), is_token_in_rank)
        else:
            handle = DispatchHandle(epx_handle, matrix, is_token_in_rank)
        recv_x, recv_scales, recv_idx, recv_weights = owned
        event = buffer._end(call, async_finish, (x, x_scales, topk_idx, topk_weights,
                                                 is_token_in_rank, num_tokens_per_expert,
                                                 recv_x, recv_scales, recv_idx, recv_weights))
        recv_x_out = (recv_x, recv_scales) if x_scales is not None else recv_x
        return recv_x_out, recv_idx, recv_weights, counts, handle, event

    @staticmethod
    def _rank_prefix_matrix(buffer, epx_handle, call):
        """The handle's int32 [R, R] matrix as a tensor of the call's framework, on the
        buffer's device, kept valid by the epx handle it belongs to."""
        tensor = _capi.Tensor()
        check(_capi.api().epx_handle_get_rank_prefix_matrix(epx_handle._ptr,
                                                            ctypes.byref(tensor)),
              "handle_get_rank_prefix_matrix")
        world = tensor.shape[0]
        view = _dlpack.DLPackView(tensor.data, (world, world), (world, 1), 0, 0,
                                  buffer._view_device, epx_handle)
        return call.framework.from_view(view, _capi.DTYPE_INT32, False)

    def _epx_handle(self, handle, op):
        epx_handle = getattr(handle, "epx_handle", handle)
        if not isinstance(epx_handle, _EpxHandle):
            raise invalid_argument("%s: handle must be the handle of this buffer's dispatch, not "
                                   "%s" % (op, type(handle).__name__))
        if epx_handle._buffer is not self._normal:
            raise invalid_argument("%s: the handle's buffer was replaced (a dispatch of another "
                                   "shape made a new one) or belongs to another deep_ep.Buffer"
                                   % op)
        return epx_handle

    # ------------------------------------------------------------ combine

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's combine (collective): each received row back to its token's rank,
        summed there (no weights), plus bias (a tensor or a pair, added in fp32); across
        nodes the sum is taken per node first (docs/INTERNODE.md, "Combine: summation
        order").

        Returns (combined_x, combined_topk_weights or None, event)."""
        epx_handle = self._epx_handle(handle, "combine")
        buffer = epx_handle._buffer
        rows = epx_handle.num_recv_tokens
        if rows >= 0 and x is not None and hasattr(x, "shape") and int(x.shape[0]) > rows:
            # Worst-case outputs have padding rows; the library takes the rows received.
            x = x[:rows]
            if topk_weights is not None:
                topk_weights = topk_weights[:rows]
        return buffer.combine(x, epx_handle, topk_weights, bias, None, previous_event,
                              async_finish)

    def __repr__(self):
        return ("deep_ep.Buffer(epx, rank=%d of %d, num_nvl_bytes=%d, num_rdma_bytes=%d, "
                "normal shape %s, low-latency shape %s)"
                % (self.rank, self.group_size, self.num_nvl_bytes, self.num_rdma_bytes,
                   self._normal_shape, self._ll_shape))
