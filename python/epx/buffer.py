"""Buffer: DeepEP's `deep_ep.Buffer`, in shape, over the epx C API.

Methods, arguments and return values follow deep_ep.Buffer (normal mode here, low-latency
mode in low_latency.py), so an existing
integration can switch with small edits; docs/PYTHON.md lists the differences.
"""

import ctypes
import weakref

from . import _capi, _dlpack, _exit, _frameworks, _tensor
from .errors import EpxError, Status, check, invalid_argument
from .events import EventOverlap
from .group import Group
from .low_latency import LowLatencyMixin

_DISPATCH_DTYPES = {"bf16": _capi.DTYPE_BF16, "bfloat16": _capi.DTYPE_BF16,
                    "fp8": _capi.DTYPE_FP8_E4M3, "fp8_e4m3": _capi.DTYPE_FP8_E4M3,
                    "float8_e4m3fn": _capi.DTYPE_FP8_E4M3}


def _token_dtype(what, value):
    """The epx dtype of "bf16" / "fp8" (or a torch / NumPy dtype of those); raises
    EpxError ERR_INVALID_ARG naming `what` otherwise."""
    name = str(value).lower()
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name not in _DISPATCH_DTYPES:
        raise invalid_argument("Buffer: %s %r is not bf16 or fp8" % (what, value))
    return _DISPATCH_DTYPES[name]


def _shape_config(max_tokens_per_rank, hidden, num_experts, num_topk, dispatch_dtype,
                  max_low_latency_tokens, low_latency_dtype):
    """A new epx_buffer_config_t of the MoE shape (both dtypes by name, as the constructor
    takes them; max_low_latency_tokens None or 0 for none); other fields at defaults."""
    config = _capi.new(_capi.BufferConfig)
    config.max_tokens_per_rank = int(max_tokens_per_rank)
    config.hidden = int(hidden)
    config.num_experts = int(num_experts)
    config.num_topk = int(num_topk)
    config.dispatch_dtype = _DISPATCH_DTYPES[str(dispatch_dtype).lower()]
    config.max_low_latency_tokens = int(max_low_latency_tokens or 0)
    config.low_latency_dtype = _token_dtype("low_latency_dtype", low_latency_dtype)
    return config


_DEVICE_TYPES_OF = {"host": (_dlpack.CPU, _dlpack.CUDA_HOST),
                    "cuda": (_dlpack.CUDA, _dlpack.CUDA_MANAGED)}


def _resolve_group(what, group, backend):
    """An epx.Group from what a Buffer call takes: an epx.Group, a torch.distributed
    ProcessGroup (a new epx.Group over its allgather) or None (Group.from_env)."""
    if group is None:
        return Group.from_env(backend)
    if isinstance(group, Group):
        return group
    if not (hasattr(group, "rank") and hasattr(group, "size")):
        raise invalid_argument("%s: group must be an epx.Group, a torch.distributed "
                               "ProcessGroup or None, not %s" % (what, type(group).__name__))
    return Group.from_process_group(group, backend=backend)


class Config:
    """Placeholder for deep_ep.Config: accepted by dispatch/combine and ignored (epx sizes
    its kernels from the buffer's num_sms)."""

    def __init__(self, num_sms=0, *tuning):
        self.num_sms = num_sms
        self.tuning = tuning


class Handle:
    """The routing of one dispatch (epx_handle_t): pass it to combine, and to dispatch
    again (cached mode) to reuse the routing. Opaque, unlike DeepEP's tuple.

    Attributes: num_tokens (tokens this rank sent), num_recv_tokens, num_local_experts,
    expert_alignment, num_recv_tokens_per_expert_list.
    """

    def __init__(self, buffer, pointer, num_recv_tokens_per_expert_list, framework=None,
                 raw=False):
        self._buffer = buffer
        self._ptr = pointer
        # The dispatch's framework and raw-bits mode: get_combine_input returns a view of
        # the same kind as that dispatch's outputs.
        self._framework = framework
        self._raw = raw
        info = _capi.new(_capi.HandleInfo)
        check(_capi.api().epx_handle_get_info(pointer, ctypes.byref(info)), "handle_get_info")
        self.num_tokens = info.num_tokens
        self.num_recv_tokens = info.num_recv_tokens
        self.num_local_experts = info.num_local_experts
        self.expert_alignment = info.expert_alignment
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list

    @property
    def alive(self):
        return self._ptr is not None

    def destroy(self):
        """Free the routing now (otherwise when the handle is garbage collected)."""
        if self._ptr is not None:
            _capi.api().epx_handle_destroy(self._ptr)
            self._ptr = None

    def __del__(self):
        try:
            self.destroy()
        except Exception:
            pass

    def __repr__(self):
        return ("epx.Handle(num_tokens=%d, num_recv_tokens=%d, num_local_experts=%d%s)"
                % (self.num_tokens, self.num_recv_tokens, self.num_local_experts,
                   "" if self.alive else ", destroyed"))


class _Call:
    """The arguments of one operation, resolved, with this rank's argument errors."""

    def __init__(self, buffer, op, first):
        self.buffer = buffer
        self.op = op
        self.problems = []
        self.framework = None
        self.device = None
        self.stream = None
        inner = first.array if isinstance(first, _tensor.RawBits) else first
        try:
            self.framework = _frameworks.of(inner)
            self.device = self.framework.device_of(inner)
            self.stream = self.framework.current_stream(self.device)
        except Exception as error:  # not a tensor at all: reported by tensor() below
            self.framework = _frameworks.named("numpy") if self.framework is None \
                else self.framework
            self.device = (_dlpack.CPU, 0)
            self.problems.append(invalid_argument(
                "%s: x: expected a tensor or array, got %s (%s)"
                % (op, type(inner).__name__, error)))

    def tensor(self, obj, name, required=False):
        """The Arg for an input (None if obj is None), or None after recording a problem."""
        if obj is None:
            if required:
                self.problems.append(invalid_argument("%s: %s is required" % (self.op, name)))
            return None
        try:
            arg = _tensor.resolve(obj, "%s: %s" % (self.op, name), self.stream)
        except EpxError as error:
            self.problems.append(error)
            return None
        if arg.dtype == _capi.DTYPE_INVALID:
            self.fail("%s has dtype %s, which epx does not take (it takes bf16 and "
                      "float8_e4m3fn tokens, float32 weights and scales, int64 expert ids)"
                      % (name, arg.type_name))
            return None
        self.buffer._check_device(arg, self)
        return arg

    def fail(self, message):
        self.problems.append(invalid_argument("%s: %s" % (self.op, message)))


class Buffer(LowLatencyMixin):
    """Communication memory sized for one MoE shape, and the operations on it.

    Arguments (DeepEP's first, accepted for compatibility):
        group: an epx.Group, a torch.distributed ProcessGroup (its allgather is the
            bootstrap), or None for the group `epx launch` set up (epx.Group.from_env()).
        num_nvl_bytes, num_rdma_bytes, num_qps_per_rank, allow_nvlink_for_low_latency_mode,
        allow_mnnvl: ignored: epx sizes its memory from the MoE shape below.
        low_latency_mode: also reserve low-latency memory (low_latency_* methods); needs
            num_max_dispatch_tokens_per_rank.
        explicitly_destroy: if True, you call destroy(); otherwise it also happens when the
            buffer is garbage collected.
    epx's own (keyword-only, required unless noted):
        max_tokens_per_rank: the most tokens any rank passes to one dispatch (normal
            mode; defaults to num_max_dispatch_tokens_per_rank with low_latency_mode).
        num_max_dispatch_tokens_per_rank: with low_latency_mode, the most tokens any rank
            passes to one low_latency_dispatch (1..65536; config.max_low_latency_tokens).
        hidden, num_experts, num_topk: the MoE shape (every rank passes the same).
        dispatch_dtype: "bf16" (default; also carries fp8) or "fp8".
        low_latency_dtype: "bf16" (default) sizes the low-latency rows for bf16, so
            low_latency_dispatch takes use_fp8 True or False; "fp8" (or
            torch.float8_e4m3fn) sizes them for fp8 (half the bytes per dispatch row),
            and low_latency_dispatch then refuses use_fp8=False
            (config.low_latency_dtype).
        num_sms: SMs per rank for the GPU kernels (default Buffer.num_sms; 0 = EPX_NUM_SMS).
        backend: "auto", "host" or "cuda", when the group is made here.
        copy_outputs: default for the `copy` argument of dispatch (see there).
        auto_register: True maps a combine input outside the buffer for the peers the
            first time its allocation is seen and reads it in place from then on (no
            register() call needed; one small host exchange per combine); False copies
            it into the buffer; None (default) follows EPX_AUTO_REGISTER
            (config.auto_register; docs/DESIGN.md section 7).

    A process that replaces a lost rank makes its buffer with Buffer.create_rejoin
    (same arguments), while the survivors call rejoin() (docs/STABILITY.md "Rejoin").
    """

    num_sms = 0

    def __init__(self, group=None, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True,
                 allow_mnnvl=False, explicitly_destroy=False, *, max_tokens_per_rank=None,
                 hidden=None, num_experts=None, num_topk=None, dispatch_dtype="bf16",
                 num_sms=None, backend="auto", copy_outputs=False,
                 num_max_dispatch_tokens_per_rank=None, low_latency_dtype="bf16",
                 auto_register=None, _rejoin=False):
        self._ptr = None
        self._handles = weakref.WeakSet()
        if low_latency_mode:
            if not num_max_dispatch_tokens_per_rank or int(num_max_dispatch_tokens_per_rank) <= 0:
                raise invalid_argument(
                    "Buffer: low_latency_mode needs num_max_dispatch_tokens_per_rank > 0 "
                    "(the most tokens a rank passes to one low_latency_dispatch)")
            if max_tokens_per_rank is None:
                max_tokens_per_rank = num_max_dispatch_tokens_per_rank
        elif num_max_dispatch_tokens_per_rank:
            raise invalid_argument("Buffer: num_max_dispatch_tokens_per_rank is given but "
                                   "low_latency_mode is False")
        missing = [name for name, value in (("max_tokens_per_rank", max_tokens_per_rank),
                                            ("hidden", hidden), ("num_experts", num_experts),
                                            ("num_topk", num_topk)) if value is None]
        if missing:
            raise invalid_argument(
                "Buffer: %s must be given: epx sizes the buffer from the MoE shape, not from "
                "num_nvl_bytes/num_rdma_bytes" % ", ".join(missing))
        if str(dispatch_dtype).lower() not in _DISPATCH_DTYPES:
            raise invalid_argument("Buffer: dispatch_dtype %r is not bf16 or fp8"
                                   % (dispatch_dtype,))
        ll_dtype = _token_dtype("low_latency_dtype", low_latency_dtype)

        if _rejoin and not low_latency_mode:
            raise invalid_argument("Buffer.create_rejoin: a rejoin joins a running "
                                   "low-latency buffer: low_latency_mode must be True")
        self._owns_group = not isinstance(group, Group)
        group = _resolve_group("Buffer", group, backend)
        self.group = group
        self.rank = group.rank
        self.group_size = group.world_size
        self.backend = group.backend
        self.device = group.device
        self.explicitly_destroy = explicitly_destroy
        self.copy_outputs = bool(copy_outputs)

        config = _shape_config(max_tokens_per_rank, hidden, num_experts, num_topk,
                               dispatch_dtype, num_max_dispatch_tokens_per_rank,
                               low_latency_dtype)
        config.num_sms = int(Buffer.num_sms if num_sms is None else num_sms)
        config.auto_register = 0 if auto_register is None else (1 if auto_register else -1)
        self._config = config
        self.low_latency_mode = bool(low_latency_mode)
        self.low_latency_dtype = "fp8" if ll_dtype == _capi.DTYPE_FP8_E4M3 else "bf16"
        self.num_max_dispatch_tokens_per_rank = config.max_low_latency_tokens
        self.max_tokens_per_rank = config.max_tokens_per_rank
        self.hidden = config.hidden
        self.num_experts = config.num_experts
        self.num_topk = config.num_topk
        self.num_local_experts = config.num_experts // max(self.group_size, 1)

        pointer = _capi.epx_buffer_p()
        if _rejoin:
            status = _capi.api().epx_buffer_create_rejoin(group.pointer, ctypes.byref(config),
                                                          ctypes.byref(pointer))
        else:
            status = _capi.api().epx_buffer_create(group.pointer, ctypes.byref(config),
                                                   ctypes.byref(pointer))
        try:
            check(status, "buffer_create_rejoin" if _rejoin else "buffer_create")
        except BaseException:  # Ctrl-C in a callback too
            if self._owns_group:
                group.destroy()
            raise
        self._ptr = pointer
        group._buffers.add(self)
        self._view_device = ((_dlpack.CUDA, self.device) if self.backend == "cuda"
                             else (_dlpack.CPU, 0))

    @classmethod
    def create_rejoin(cls, group, **kwargs):
        """A newcomer's buffer: join the survivors' running low-latency buffer in place of
        a lost rank (epx_buffer_create_rejoin; docs/STABILITY.md "Rejoin").

        Collective with the survivors' Buffer.rejoin(group). `group` is the new group
        that every rank, survivors and newcomers, formed from a fresh rendezvous with the
        same world size, this process holding the lost rank's number (an epx.Group, or
        what the constructor takes). kwargs are the constructor's keyword arguments and
        must give the survivors' config: the same max_tokens_per_rank, hidden,
        num_experts, num_topk, dispatch_dtype, num_max_dispatch_tokens_per_rank,
        low_latency_dtype (low_latency_mode defaults to True and must be). The buffer
        serves low-latency mode only (normal-mode calls raise ERR_INVALID_STATE).

        Raises EpxError as the C call: ERR_INVALID_STATE when no survivor has a running
        buffer to join or when a survivor has not masked this rank, ERR_INVALID_ARG for
        configs that differ, ERR_UNSUPPORTED on the CUDA backend, ERR_REMOTE naming the
        rank that refused; nothing is made on failure.
        """
        kwargs.setdefault("low_latency_mode", True)
        return cls(group, _rejoin=True, **kwargs)

    # ------------------------------------------------------------ lifetime

    def destroy(self):
        """Free the buffer (and its handles); views it returned become invalid. Idempotent."""
        if self._ptr is None:
            return
        for handle in list(self._handles):
            handle.destroy()
        pointer, self._ptr = self._ptr, None
        check(_capi.api().epx_buffer_destroy(pointer), "buffer_destroy")
        if self._owns_group:
            self.group.destroy()

    def __del__(self):
        try:
            if _exit.leaving() is not None and self._ptr is not None:
                # No vote on the way out of a dying process (epx/_exit.py).
                self._abandon("rank %d is exiting on an uncaught exception (%s)"
                              % (self.group.rank, _exit.leaving()))
            else:
                self.destroy()
        except Exception:
            pass

    def _abandon(self, reason):
        """Abort (the peers hear of it) and free on this rank only: no vote, so no wait for
        peers (for an owner leaving without the collective destroy())."""
        if self._ptr is None:
            return
        try:
            self.abort(reason)
        except EpxError:
            pass  # already failed: destroy() frees it locally anyway
        self.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        # Collective even on an exception: the peers may be on their way to the same
        # destroy (an abort here would leave them waiting in its vote). A rank that raised
        # while its peers are inside an operation should abort() before leaving.
        self.destroy()

    @property
    def pointer(self):
        if self._ptr is None:
            raise EpxError(Status.ERR_INVALID_STATE, "buffer: used after destroy()")
        return self._ptr

    def get_async_error(self):
        """(Status, message) of the first asynchronous failure; (Status.SUCCESS, "") if none."""
        error = ctypes.c_int(0)
        text = ctypes.create_string_buffer(1024)
        check(_capi.api().epx_get_async_error(self.pointer, ctypes.byref(error), text,
                                              len(text)), "get_async_error")
        return Status(error.value), text.value.decode("utf-8", "replace")

    @staticmethod
    def buffer_size(group, max_tokens_per_rank, hidden, num_experts, num_topk,
                    dispatch_dtype="bf16", num_max_dispatch_tokens_per_rank=0,
                    low_latency_dtype="bf16"):
        """Bytes of communication memory per rank for this shape (nothing allocated),
        low-latency memory included when num_max_dispatch_tokens_per_rank > 0 (rows
        sized for low_latency_dtype, as in the constructor)."""
        config = _shape_config(max_tokens_per_rank, hidden, num_experts, num_topk,
                               dispatch_dtype, num_max_dispatch_tokens_per_rank,
                               low_latency_dtype)
        size = ctypes.c_size_t(0)
        check(_capi.api().epx_buffer_size(group.pointer, ctypes.byref(config),
                                          ctypes.byref(size)), "buffer_size")
        return size.value

    # ------------------------------------------------------------ DeepEP statics

    @staticmethod
    def set_num_sms(new_num_sms):
        """SMs per rank for buffers created afterwards (0 = EPX_NUM_SMS)."""
        if int(new_num_sms) < 0:
            raise invalid_argument("set_num_sms: %d is negative" % new_num_sms)
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def capture():
        """An EventOverlap recorded on torch's current CUDA stream (no event without CUDA)."""
        try:
            import torch
            if torch.cuda.is_available():
                framework = _frameworks.named("torch")
                device = (_dlpack.CUDA, torch.cuda.current_device())
                return EventOverlap(framework.record_event(device), None, framework)
        except ImportError:
            pass
        return EventOverlap(None)

    @staticmethod
    def get_dispatch_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def is_sm90_compiled():
        """True: epx's fp8 paths need no sm_90 features (DeepEP's tests use this to decide
        whether to run their fp8 cases)."""
        return True

    # ------------------------------------------------------------ helpers

    def _check_device(self, arg, call):
        allowed = _DEVICE_TYPES_OF.get(self.backend, ())
        device_type, device_id = arg.device
        if device_type not in allowed:
            call.fail("%s is on %s, but this buffer uses the %s backend (%s memory)"
                      % (arg.name.split(": ", 1)[-1], _tensor.device_name(arg.device),
                         self.backend, "host" if self.backend == "host" else
                         "cuda:%d" % self.device))
        elif self.backend == "cuda" and device_type == _dlpack.CUDA and device_id != self.device:
            call.fail("%s is on cuda:%d, but this rank's buffer is on cuda:%d"
                      % (arg.name.split(": ", 1)[-1], device_id, self.device))

    def _raise_problems(self, call):
        """Fail this collective on every rank for an argument error found here.

        The peers are already in (or about to enter) the same operation: a rank that just
        raised would leave them waiting until the timeout. So the buffer is aborted
        (epx_buffer_abort), which tells the peers (they get EPX_ERR_REMOTE naming this
        rank) and marks the buffer failed, exactly as for an argument error the C library
        finds itself.
        """
        problem = call.problems[0]
        if call.op in ("dispatch", "combine"):
            self.abort(problem)
        raise problem

    def abort(self, reason="aborted by the caller"):
        """Fail this buffer on every rank (epx_buffer_abort): the peers' current or next
        operation ends with EPX_ERR_REMOTE naming this rank, and every later call on the
        buffer raises. `reason` (text or an EpxError) is the message recorded."""
        if isinstance(reason, EpxError):
            status, text = reason.status, reason.message
        else:
            status, text = Status.ERR_INVALID_STATE, str(reason)
        check(_capi.api().epx_buffer_abort(self.pointer, int(status), text.encode()),
              "buffer_abort")

    def _check_handle(self, call, handle, required):
        if handle is None:
            if required:
                call.fail("handle is required (from dispatch)")
            return None
        if not isinstance(handle, Handle):
            call.fail("handle must be an epx.Handle from this buffer's dispatch, not %s"
                      % type(handle).__name__)
            return None
        if handle._buffer is not self:
            call.fail("handle was made by another buffer")
            return None
        if not handle.alive:
            call.fail("handle was destroyed")
            return None
        return handle

    def _view(self, tensor, call, raw, copy):
        """A caller-framework tensor over an epx_tensor_t result (None if not given)."""
        out = self._view_in(tensor, call.framework, raw)
        return call.framework.copy(out) if copy and out is not None else out

    def _view_in(self, tensor, framework, raw):
        """A tensor of `framework` over buffer memory described by `tensor`, zero-copy."""
        if not tensor.data and tensor.ndim == 0:
            return None
        ndim = tensor.ndim
        shape = [tensor.shape[i] for i in range(ndim)]
        strides = [tensor.strides[i] for i in range(ndim)]
        if not any(strides):
            strides = [1] * ndim
            for i in range(ndim - 2, -1, -1):
                strides[i] = strides[i + 1] * shape[i + 1]
        view = _dlpack.DLPackView(tensor.data or 0, shape, strides, 0, 0, self._view_device,
                                  self)
        return framework.from_view(view, tensor.dtype, raw)

    def _begin(self, previous_event):
        self.pointer  # raises after destroy()
        if previous_event is not None:
            previous_event.current_stream_wait()

    def _end(self, call, async_finish, tensors):
        if not async_finish:
            return EventOverlap(None)
        event = call.framework.record_event(call.device)
        return EventOverlap(event, tuple(t for t in tensors if t is not None) if event else None,
                            call.framework)

    # ------------------------------------------------------------ layout

    def get_dispatch_layout(self, topk_idx, num_experts=None, previous_event=None,
                            async_finish=False, allocate_on_comm_stream=False):
        """Count tokens per rank and expert (local, no communication).

        Returns (num_tokens_per_rank [num_ranks] int32, None (num_tokens_per_rdma_rank),
        num_tokens_per_expert [num_experts] int32, is_token_in_rank [num_tokens, num_ranks]
        bool, EventOverlap). Outputs are new tensors of topk_idx's framework and device.
        """
        self._begin(previous_event)
        call = _Call(self, "get_dispatch_layout", topk_idx)
        idx = call.tensor(topk_idx, "topk_idx", required=True)
        if num_experts is not None and int(num_experts) != self.num_experts:
            call.fail("num_experts is %d but the buffer was made for %d"
                      % (num_experts, self.num_experts))
        if call.problems:
            raise call.problems[0]  # local operation: no peer is waiting
        tokens = idx.shape[0]
        fw = call.framework
        per_rank = fw.empty((self.group_size,), _capi.DTYPE_INT32, False, call.device, topk_idx)
        per_expert = fw.empty((self.num_experts,), _capi.DTYPE_INT32, False, call.device,
                              topk_idx)
        in_rank = fw.empty((tokens, self.group_size), _capi.DTYPE_BOOL, False, call.device,
                           topk_idx)
        args = _capi.new(_capi.LayoutArgs)
        args.topk_idx = idx.c_tensor()
        args.num_tokens_per_rank = _tensor.resolve(per_rank, "num_tokens_per_rank").c_tensor()
        args.num_tokens_per_expert = _tensor.resolve(per_expert,
                                                     "num_tokens_per_expert").c_tensor()
        args.is_token_in_rank = _tensor.resolve(in_rank, "is_token_in_rank").c_tensor()
        check(_capi.api().epx_get_dispatch_layout(self.pointer, ctypes.byref(args),
                                                  call.stream), "get_dispatch_layout")
        per_rank, per_expert, in_rank = (fw.finish(t) for t in (per_rank, per_expert, in_rank))
        event = self._end(call, async_finish, (topk_idx, per_rank, per_expert, in_rank))
        return per_rank, None, per_expert, in_rank, event

    # ------------------------------------------------------------ dispatch

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False,
                 copy=None):
        """Send each token to every rank that hosts one of its experts (collective).

        x: [num_tokens, hidden] bf16, or a tuple (x fp8 e4m3, x_scales [num_tokens,
            hidden/128] fp32).
        handle: from an earlier dispatch: cached mode (same routing, no topk_idx/weights).
        num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert: accepted for DeepEP compatibility and not needed (epx
            computes the layout itself).
        topk_idx: [num_tokens, num_topk] int64 (-1 = none); topk_weights: same, fp32.
        expert_alignment: per-expert counts rounded up to this.
        num_worst_tokens: > 0 = worst-case mode (no host sync on the GPU backend; outputs
            sized for max_tokens_per_rank * num_ranks rows).
        config, allocate_on_comm_stream: ignored.
        previous_event: waited on (by the current stream) before the operation.
        async_finish: return an EventOverlap recorded after the operation.
        copy: True = return tensors the caller owns; False = views into the buffer, valid
            until this rank's next operation on the buffer. Default: the buffer's
            copy_outputs (False).

        Returns (recv_x (a tuple (recv_x, recv_x_scales) for fp8), recv_topk_idx,
        recv_topk_weights, num_recv_tokens_per_expert_list, handle, event); in cached mode
        (recv_x, None, None, None, None, event), as DeepEP does.
        """
        self._begin(previous_event)
        copy = self.copy_outputs if copy is None else bool(copy)
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        call = _Call(self, "dispatch", x)
        x_arg = call.tensor(x, "x", required=True)
        scales_arg = call.tensor(x_scales, "x_scales")
        idx_arg = call.tensor(topk_idx, "topk_idx")
        weights_arg = call.tensor(topk_weights, "topk_weights")
        handle = self._check_handle(call, handle, required=False)
        if handle is None and topk_idx is None and not call.problems:
            call.fail("topk_idx is required without a handle (a handle selects cached mode)")
        if call.problems:
            self._raise_problems(call)

        args = _capi.new(_capi.DispatchArgs)
        args.x = x_arg.c_tensor()
        if scales_arg is not None:
            args.x_scales = scales_arg.c_tensor()
        if idx_arg is not None:
            args.topk_idx = idx_arg.c_tensor()
        if weights_arg is not None:
            args.topk_weights = weights_arg.c_tensor()
        if handle is not None:
            args.handle = handle._ptr
        args.expert_alignment = int(expert_alignment or 0)
        args.flags = _capi.DISPATCH_WORST_CASE if num_worst_tokens and num_worst_tokens > 0 else 0
        result = _capi.new(_capi.DispatchResult)
        check(_capi.api().epx_dispatch(self.pointer, ctypes.byref(args), ctypes.byref(result),
                                       call.stream), "dispatch")

        raw = x_arg.raw
        recv_x = self._view(result.recv_x, call, raw, copy)
        recv_scales = self._view(result.recv_x_scales, call, False, copy)
        recv_x_out = (recv_x, recv_scales) if x_scales is not None else recv_x
        if handle is not None:
            event = self._end(call, async_finish, (x, x_scales, recv_x, recv_scales))
            return recv_x_out, None, None, None, None, event

        counts = []
        if result.num_recv_tokens_per_expert:
            counts = [int(result.num_recv_tokens_per_expert[i])
                      for i in range(result.num_local_experts)]
        new_handle = Handle(self, result.handle, counts, call.framework, raw)
        self._handles.add(new_handle)
        recv_idx = self._view(result.recv_topk_idx, call, False, copy)
        recv_weights = self._view(result.recv_topk_weights, call, False, copy)
        event = self._end(call, async_finish, (x, x_scales, topk_idx, topk_weights, recv_x,
                                               recv_scales, recv_idx, recv_weights))
        return recv_x_out, recv_idx, recv_weights, counts, new_handle, event

    # ------------------------------------------------------------ combine

    def get_combine_input(self, handle):
        """Where to compute the expert outputs for `handle`, so combine needs no copy.

        Returns a bf16 [rows, hidden] tensor that is a view of memory inside the epx
        buffer (rows = handle.num_recv_tokens; max_tokens_per_rank * num_ranks in
        worst-case mode on the GPU), of the framework and device of the dispatch that made
        the handle (raw uint16 bits when that dispatch took raw bits). Write the expert
        output of received row i into row i (e.g. torch's ``out=``, or ``view.copy_()``)
        and pass the view as combine's x: the peers read it where it is, which is
        combine's fast path; any other x is first copied into the buffer. Works for bf16
        and fp8 dispatches alike (the view is bf16 either way). The memory is yours until
        the next combine returns; write it again after each dispatch. Local: no
        communication. JAX arrays are immutable, so JAX callers cannot use it.
        """
        self.pointer  # raises after destroy()
        if not isinstance(handle, Handle):
            raise invalid_argument("get_combine_input: handle must be an epx.Handle from this "
                                   "buffer's dispatch, not %s" % type(handle).__name__)
        if handle._buffer is not self:
            raise invalid_argument("get_combine_input: handle was made by another buffer")
        if not handle.alive:
            raise invalid_argument("get_combine_input: handle was destroyed")
        framework = handle._framework or _frameworks.named("numpy")
        if framework.name == "jax":
            raise invalid_argument("get_combine_input: JAX arrays are immutable, so a JAX "
                                   "program cannot write into the buffer; pass the expert "
                                   "outputs to combine as a separate array")
        tensor = _capi.Tensor()
        check(_capi.api().epx_get_combine_input(self.pointer, handle._ptr,
                                                ctypes.byref(tensor)), "get_combine_input")
        return self._view_in(tensor, framework, handle._raw)

    def register(self, tensor):
        """Let combine read `tensor` in place (collective: every rank, its own tensor).

        For the tensor an engine computes its expert outputs into, allocated once: a
        combine whose x lies inside it is read by the peers where it is, with no copy into
        the buffer (the CUDA backend maps it over CUDA IPC; the CPU backend records it and
        copies as before). On the GPU the memory must come from cudaMalloc (PyTorch's
        caching allocator without expandable segments, whose blocks are multiples of 2 MiB
        as they should be: peers read other allocation sizes up to 1.7x slower); call
        deregister() before freeing it. At most 8 tensors at a time; each rank's may not
        overlap another or the buffer.
        """
        data, nbytes = self._span(tensor, "register")
        check(_capi.api().epx_buffer_register(self.pointer, data, nbytes), "buffer_register")

    def deregister(self, tensor):
        """Undo register(tensor) (collective); afterwards the tensor may be freed."""
        data, _ = self._span(tensor, "deregister")
        check(_capi.api().epx_buffer_deregister(self.pointer, data), "buffer_deregister")

    @staticmethod
    def _span(tensor, op):
        """(first byte, bytes up to the last element's end) of a tensor."""
        arg = _tensor.resolve(tensor, "%s: tensor" % op)
        itemsize = max(arg.bits // 8, 1)
        if not all(arg.shape):
            return arg.data, 0
        strides = arg.strides
        if strides is None:  # C-contiguous
            strides, step = [], 1
            for size in reversed(arg.shape):
                strides.insert(0, step)
                step *= size
        last = sum((size - 1) * stride for size, stride in zip(arg.shape, strides))
        return arg.data, (last + 1) * itemsize

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False, order_topk_idx=None):
        """Send each received row back to its token's rank, summed there (collective).

        x: [num_recv_tokens, hidden] bf16, rows in the order dispatch returned them. Best
            the view of get_combine_input(handle), computed into: read in place, no copy
            (x is passed to the library as it is, never copied here, whatever it is).
        handle: from that dispatch. topk_weights: [num_recv_tokens, num_topk] fp32, summed
        the same way. bias: a [num_tokens, hidden] bf16 tensor or a pair of them, added to
        the result (DeepEP's order: the sum starts from bias_0 + bias_1, in fp32).
        order_topk_idx: the dispatch's topk_idx [num_tokens, num_topk] int64, to add each
        token's rows in DeepEP V2's order (a rank's row where its last entry stands) instead
        of rank order (epx_combine_args_t.order_topk_idx; one node only on CUDA).

        Returns (combined_x [num_tokens, hidden] bf16, combined_topk_weights or None,
        event), new tensors of x's framework.
        """
        self._begin(previous_event)
        call = _Call(self, "combine", x)
        x_arg = call.tensor(x, "x", required=True)
        weights_arg = call.tensor(topk_weights, "topk_weights")
        biases = bias if isinstance(bias, tuple) else (bias,)
        if len(biases) > 2:
            call.fail("bias is a tuple of %d tensors; DeepEP's bias is one tensor or two"
                      % len(biases))
        bias_args = [call.tensor(b, "bias[%d]" % i) for i, b in enumerate(biases[:2])]
        order_arg = call.tensor(order_topk_idx, "order_topk_idx")
        handle = self._check_handle(call, handle, required=True)
        if call.problems:
            self._raise_problems(call)

        fw = call.framework
        out_x = fw.empty((handle.num_tokens, self.hidden), _capi.DTYPE_BF16, x_arg.raw,
                         call.device, x)
        out_weights = None
        args = _capi.new(_capi.CombineArgs)
        args.handle = handle._ptr
        args.x = x_arg.c_tensor()
        args.out_x = _tensor.resolve(out_x, "out_x", call.stream, _capi.DTYPE_BF16).c_tensor()
        for i, bias_arg in enumerate(bias_args):
            if bias_arg is not None:
                args.bias[i] = bias_arg.c_tensor()
        if order_arg is not None:
            args.order_topk_idx = order_arg.c_tensor()
        if weights_arg is not None:
            out_weights = fw.empty((handle.num_tokens, self.num_topk), _capi.DTYPE_FP32, False,
                                   call.device, x)
            args.topk_weights = weights_arg.c_tensor()
            args.out_topk_weights = _tensor.resolve(out_weights, "out_topk_weights").c_tensor()
        check(_capi.api().epx_combine(self.pointer, ctypes.byref(args), call.stream), "combine")
        out_x = fw.finish(out_x)
        if out_weights is not None:
            out_weights = fw.finish(out_weights)
        event = self._end(call, async_finish, (x, topk_weights, order_topk_idx, out_x,
                                               out_weights))
        return out_x, out_weights, event

    # ------------------------------------------------------------ low latency (low_latency.py)

    @staticmethod
    def get_low_latency_rdma_size_hint(*args, **kwargs):
        raise NotImplementedError("get_low_latency_rdma_size_hint: epx sizes its memory from "
                                  "the MoE shape; Buffer.buffer_size(group, ..., "
                                  "num_max_dispatch_tokens_per_rank=M) gives the bytes per rank")

    def get_local_buffer_tensor(self, *args, **kwargs):
        raise NotImplementedError("get_local_buffer_tensor: epx does not expose its raw "
                                  "buffer memory; get_combine_input(handle) gives the part "
                                  "meant for the caller (combine's input)")

    def __repr__(self):
        return ("epx.Buffer(rank=%d of %d, backend=%s, max_tokens_per_rank=%d, hidden=%d, "
                "num_experts=%d, num_topk=%d%s)"
                % (self.rank, self.group_size, self.backend, self.max_tokens_per_rank,
                   self.hidden, self.num_experts, self.num_topk,
                   "" if self._ptr is not None else ", destroyed"))
