"""Low-latency mode of epx.Buffer: DeepEP's low_latency_* methods over the epx_ll_* C API.

A mixin of Buffer (buffer.py), kept apart because the two modes share nothing but the
buffer: normal mode routes with an opaque epx_handle_t and variable-sized outputs, while
low-latency mode has a fixed [L, M * R, hidden] layout, two alternating slots and a
send/receive split (docs/LOW_LATENCY.md).
"""

import ctypes

from . import _capi, _frameworks, _tensor, errors
from .errors import check, invalid_argument
from .group import Group


class LowLatencyHandle(tuple):
    """The identity of one low-latency step (epx_ll_handle_t), from low_latency_dispatch.

    As DeepEP's handle it is a tuple (recv_src_info, recv_layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts); the tensors are views into
    the step's slot. Pass it to low_latency_combine and get_next_low_latency_combine_buffer.
    It lasts until the second dispatch after its own (a later use raises EpxError
    ERR_INVALID_STATE); there is nothing to free.

    Attributes besides the tuple: src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts, num_tokens (tokens this rank dispatched), num_masked_entries
    ((token, expert) entries not sent because the expert's rank is masked; -1 where the
    backend cannot count without a host sync).
    """

    def __new__(cls, buffer, value, src_info, layout_range, num_tokens, num_masked_entries,
                framework, raw):
        self = super().__new__(cls, (src_info, layout_range, buffer.num_max_dispatch_tokens_per_rank,
                                     buffer.hidden, buffer.num_experts))
        self._buffer = buffer
        self._value = value
        self._framework = framework
        self._raw = raw
        self.src_info = src_info
        self.layout_range = layout_range
        self.num_max_dispatch_tokens_per_rank = buffer.num_max_dispatch_tokens_per_rank
        self.hidden = buffer.hidden
        self.num_experts = buffer.num_experts
        self.num_tokens = num_tokens
        self.num_masked_entries = num_masked_entries
        return self

    def __repr__(self):
        return ("epx.LowLatencyHandle(slot=%d, dispatch=%d, num_tokens=%d)"
                % (self._value.internal[1], self._value.internal[2], self.num_tokens))


class LowLatencyMixin:
    """The low-latency methods of Buffer (see Buffer for the constructor arguments)."""

    num_max_dispatch_tokens_per_rank = 0

    # ------------------------------------------------------------ helpers

    def _ll_call(self, op, first):
        # buffer.py's _Call, imported late: buffer.py imports this module.
        from .buffer import _Call
        self.pointer  # raises after destroy()
        return _Call(self, op, first)

    def _ll_check_shape(self, call, num_max_dispatch_tokens_per_rank, num_experts):
        if not self.num_max_dispatch_tokens_per_rank:
            return  # low-latency mode off: the library says so (ERR_INVALID_STATE)
        if (num_max_dispatch_tokens_per_rank is not None and
                int(num_max_dispatch_tokens_per_rank) != self.num_max_dispatch_tokens_per_rank):
            call.fail("num_max_dispatch_tokens_per_rank is %d but the buffer was made with %d"
                      % (num_max_dispatch_tokens_per_rank, self.num_max_dispatch_tokens_per_rank))
        if num_experts is not None and int(num_experts) != self.num_experts:
            call.fail("num_experts is %d but the buffer was made for %d"
                      % (num_experts, self.num_experts))

    def _ll_check_handle(self, call, handle):
        if not isinstance(handle, LowLatencyHandle):
            call.fail("handle must be the epx.LowLatencyHandle of this buffer's "
                      "low_latency_dispatch, not %s" % type(handle).__name__)
            return None
        if handle._buffer is not self:
            call.fail("handle was made by another buffer")
            return None
        return handle

    def _ll_check_jax(self, call, return_recv_hook, written):
        """JAX arrays are immutable and JAX outputs are copies made when the call returns
        (_frameworks.JaxFramework): a receive hook cannot fill them in later, and epx must
        not write into a caller's JAX array. `written`: (name, tensor or None) of the
        arguments epx writes into."""
        if return_recv_hook and call.framework is not None and call.framework.name == "jax":
            call.fail("return_recv_hook=True cannot be used with JAX arrays: JAX outputs are "
                      "copies made when the call returns, before hook() receives the data")
        for name, tensor in written:
            if tensor is not None and _frameworks.of(tensor).name == "jax":
                call.fail("%s cannot be a JAX array: JAX arrays are immutable, and epx writes "
                          "it" % name)

    def _ll_hook(self, handle, stream, what, keepalive, after=None):
        """The receive hook of one SEND_ONLY operation: calls epx_ll_receive.

        The receive reads the tensors given to the send (combine's topk_idx, weights and
        out) and writes the combine's result struct, so the hook holds them until it has
        run: a caller's temporaries stay valid. `after` runs once the receive is done.
        """
        held = [keepalive]

        def hook():
            status = _capi.api().epx_ll_receive(self.pointer, handle._value, stream)
            if not errors.peer_lost(status):
                check(status, "ll_receive (%s)" % what)
            if after is not None:
                after()
            held.clear()
            if status != 0:  # a peer was lost; the outputs are written all the same
                raise errors.peer_lost_error(status, "ll_receive (%s)" % what, None)

        return hook

    def _ll_combine_view(self, handle, framework, raw):
        tensor = _capi.Tensor()
        check(_capi.api().epx_ll_get_combine_buffer(self.pointer, handle._value,
                                                    ctypes.byref(tensor)),
              "ll_get_combine_buffer")
        return tensor, self._view_in(tensor, framework, raw)

    # ------------------------------------------------------------ dispatch

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank=None,
                             num_experts=None, cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True,
                             round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        """Send each token to the ranks of its experts, into a fixed layout (collective).

        x: [num_tokens, hidden] bf16, num_tokens <= num_max_dispatch_tokens_per_rank.
        topk_idx: [num_tokens, num_topk] int64 global expert ids, -1 = none.
        num_max_dispatch_tokens_per_rank, num_experts: as DeepEP; checked against the
            buffer's (None = the buffer's).
        cumulative_local_expert_recv_stats: [L] int32 (optional), recv_count is added to
            it by the receive (after hook() with return_recv_hook).
        dispatch_wait_recv_cost_stats: [num_ranks] int64 (optional): for each source rank,
            the receive adds the nanoseconds from its start until that rank's tokens had
            arrived (DeepEP counts SM clock cycles), so a slow rank shows as the largest
            entry; masked ranks add nothing. CUDA: low-latency kernels 2 only (the
            default; kernels 1 raise ERR_UNSUPPORTED).
        use_fp8: cast to fp8 e4m3 with one fp32 scale per 128 channels; round_scale:
            power-of-two scales; use_ue8m0: scales as exponent bytes, four per int32.
        async_finish: return an EventOverlap recorded after the operation.
        return_recv_hook: only send; `hook()` receives (outputs are valid after it).

        Returns (recv_x, recv_count, handle, event, hook). recv_x is [L, M * R, hidden]
        bf16, or with use_fp8 a tuple (recv_x fp8 e4m3, scales [L, M * R, hidden / 128]
        fp32, or [L, M * R, hidden / 512] int32 with use_ue8m0); recv_count [L] int32
        counts the valid rows per local expert. Rows of one expert are ordered by source
        rank, then source token. All are views into the step's slot, valid until the
        second dispatch after this one. hook is None without return_recv_hook.
        """
        call = self._ll_call("low_latency_dispatch", x)
        x_arg = call.tensor(x, "x", required=True)
        idx_arg = call.tensor(topk_idx, "topk_idx", required=True)
        self._ll_check_shape(call, num_max_dispatch_tokens_per_rank, num_experts)
        stats_arg = call.tensor(cumulative_local_expert_recv_stats,
                                "cumulative_local_expert_recv_stats")
        wait_arg = call.tensor(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats")
        self._ll_check_jax(call, return_recv_hook,
                           (("cumulative_local_expert_recv_stats",
                             cumulative_local_expert_recv_stats),
                            ("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats)))
        if call.problems:
            # Low-latency argument errors do not poison the buffer (epx.h): raise here;
            # the peers' call ends in a timeout that names this rank.
            raise call.problems[0]

        args = _capi.new(_capi.LLDispatchArgs)
        args.x = x_arg.c_tensor()
        args.topk_idx = idx_arg.c_tensor()
        args.use_fp8 = int(bool(use_fp8))
        args.round_scale = int(bool(round_scale))
        args.use_ue8m0 = int(bool(use_ue8m0))
        args.flags = _capi.LL_SEND_ONLY if return_recv_hook else 0
        if stats_arg is not None:
            args.cumulative_local_expert_recv_stats = stats_arg.c_tensor()
        if wait_arg is not None:
            args.wait_recv_cost_stats = wait_arg.c_tensor()
        result = _capi.new(_capi.LLDispatchResult)
        status = _capi.api().epx_ll_dispatch(self.pointer, ctypes.byref(args),
                                             ctypes.byref(result), call.stream)
        if not errors.peer_lost(status):
            check(status, "ll_dispatch")

        raw = x_arg.raw
        recv_x = self._view(result.recv_x, call, raw, False)
        recv_scales = self._view(result.recv_x_scales, call, False, False)
        recv_count = self._view(result.recv_count, call, False, False)
        src_info = self._view(result.recv_src_info, call, False, False)
        layout_range = self._view(result.recv_layout_range, call, False, False)
        value = _capi.LLHandle.from_buffer_copy(result.handle)
        handle = LowLatencyHandle(self, value, src_info, layout_range, x_arg.shape[0],
                                  int(result.num_masked_entries), call.framework, raw)
        hook = (self._ll_hook(handle, call.stream, "dispatch",
                              (x_arg, idx_arg, stats_arg, wait_arg))
                if return_recv_hook else None)
        event = self._end(call, async_finish, (x, topk_idx, recv_x, recv_scales, recv_count,
                                               cumulative_local_expert_recv_stats,
                                               dispatch_wait_recv_cost_stats))
        recv_x_out = (recv_x, recv_scales) if use_fp8 else recv_x
        out = (recv_x_out, recv_count, handle, event, hook)
        if status != 0:  # a peer was lost and masked; the step completed without it
            raise errors.peer_lost_error(status, "ll_dispatch", out)
        return out

    # ------------------------------------------------------------ combine

    def get_next_low_latency_combine_buffer(self, handle):
        """The zero-copy combine input of `handle`'s step: a bf16 [L, M * R, hidden] view
        of the memory combine sends from (of the dispatch's framework; raw uint16 bits
        when it took raw bits). Write expert e's output for received row i at [e, i] and
        call low_latency_combine(that view, ..., zero_copy=True). Local."""
        call = self._ll_call("get_next_low_latency_combine_buffer", None)
        call.problems = []  # no tensor argument: the "x is not a tensor" note does not apply
        handle = self._ll_check_handle(call, handle)
        if call.problems:
            raise call.problems[0]
        framework = handle._framework or _frameworks.named("numpy")
        if framework.name == "jax":
            raise invalid_argument("get_next_low_latency_combine_buffer: JAX arrays are "
                                   "immutable; pass the expert outputs to "
                                   "low_latency_combine instead")
        return self._ll_combine_view(handle, framework, handle._raw)[1]

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False,
                            out=None, combine_wait_recv_cost_stats=None):
        """Send the expert outputs back to their tokens' ranks, weighted and summed there
        (collective).

        x: [L, M * R, hidden] bf16 expert outputs, row i of expert e for received row i.
        topk_idx, topk_weights: [num_tokens, num_topk] int64 / fp32, as given to this
            step's dispatch. handle: from that dispatch (received).
        zero_copy: x was written into get_next_low_latency_combine_buffer(handle); that
            memory is sent and x itself is not read.
        use_logfmt: not supported.
        return_recv_hook: only send; `hook()` receives and writes the output.
        out: [num_tokens, hidden] bf16 to write into (default: a new tensor).
        combine_wait_recv_cost_stats: [num_ranks] int64 (optional): for each expert rank,
            the receive adds the nanoseconds from its start until that rank's outputs
            had arrived (as dispatch_wait_recv_cost_stats).

        Returns (combined_x, event, hook); out[t] = bf16(sum over j of w[t, j] *
        y(t, idx[t, j])) in fp32 and j order, each entry added with one fused
        multiply-add, -1 and masked experts skipped.
        """
        if use_logfmt:
            raise NotImplementedError("low_latency_combine: use_logfmt is not supported by "
                                      "epx (combine sends bf16)")
        call = self._ll_call("low_latency_combine", x)
        handle = self._ll_check_handle(call, handle)
        x_arg = None if zero_copy else call.tensor(x, "x", required=True)
        idx_arg = call.tensor(topk_idx, "topk_idx", required=True)
        weights_arg = call.tensor(topk_weights, "topk_weights", required=True)
        out_arg = call.tensor(out, "out")
        wait_arg = call.tensor(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats")
        self._ll_check_jax(call, return_recv_hook,
                           (("out", out),
                            ("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats)))
        if call.problems:
            raise call.problems[0]

        args = _capi.new(_capi.LLCombineArgs)
        args.handle = handle._value
        if zero_copy:
            args.x = self._ll_combine_view(handle, call.framework, False)[0]
        else:
            args.x = x_arg.c_tensor()
        args.topk_idx = idx_arg.c_tensor()
        args.topk_weights = weights_arg.c_tensor()
        fw = call.framework
        raw = handle._raw if zero_copy else x_arg.raw
        if out is None:
            out = fw.empty((idx_arg.shape[0], self.hidden), _capi.DTYPE_BF16, raw, call.device,
                           x)
            out_arg = _tensor.resolve(out, "out", call.stream, _capi.DTYPE_BF16)
        args.out = out_arg.c_tensor()
        args.flags = _capi.LL_SEND_ONLY if return_recv_hook else 0
        if wait_arg is not None:
            args.wait_recv_cost_stats = wait_arg.c_tensor()
        result = _capi.new(_capi.LLCombineResult)
        status = _capi.api().epx_ll_combine(self.pointer, ctypes.byref(args),
                                            ctypes.byref(result), call.stream)
        if not errors.peer_lost(status):
            check(status, "ll_combine")
        self.last_combine_masked_entries = int(result.num_masked_entries)
        out = fw.finish(out)
        def received():
            # The receive wrote the final masked count into `result` (include/epx.h).
            self.last_combine_masked_entries = int(result.num_masked_entries)

        hook = (self._ll_hook(handle, call.stream, "combine",
                              (x_arg, idx_arg, weights_arg, out_arg, out, result, wait_arg),
                              received)
                if return_recv_hook else None)
        event = self._end(call, async_finish, (x, topk_idx, topk_weights, out,
                                               combine_wait_recv_cost_stats))
        if status != 0:  # a peer was lost and masked; the step completed without it
            raise errors.peer_lost_error(status, "ll_combine", (out, event, hook))
        return out, event, hook

    # ------------------------------------------------------------ buffer state

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank=None, hidden=None,
                                 num_experts=None):
        """Forget both slots: every low-latency handle becomes invalid. Local; refused
        (ERR_INVALID_STATE) while an operation is sent and not received. The arguments
        are DeepEP's and are only checked against the buffer's."""
        call = self._ll_call("clean_low_latency_buffer", None)
        call.problems = []
        self._ll_check_shape(call, num_max_dispatch_tokens_per_rank, num_experts)
        if hidden is not None and int(hidden) != self.hidden:
            call.fail("hidden is %d but the buffer was made for %d" % (hidden, self.hidden))
        if call.problems:
            raise call.problems[0]
        check(_capi.api().epx_ll_clean_buffer(self.pointer, call.stream),
              "ll_clean_buffer")

    def mask_rank(self, rank):
        """Leave `rank` out of this rank's later low-latency calls (a failed peer). Every
        surviving rank must mask the same ranks before the same call. Local; not undone."""
        check(_capi.api().epx_ll_mask_rank(self.pointer, int(rank)), "ll_mask_rank")

    def get_masked_ranks(self):
        """The ranks masked on this rank (by mask_rank, or by a failed wait), ascending."""
        mask = (ctypes.c_int32 * self.group_size)()
        check(_capi.api().epx_ll_get_masked(self.pointer, mask, self.group_size),
              "ll_get_masked")
        return [rank for rank in range(self.group_size) if mask[rank]]

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """DeepEP's name: mask=True masks the rank. mask=False is refused: a rank comes
        back only as a new process, through a rejoin (rejoin / Buffer.create_rejoin)."""
        if not mask:
            raise NotImplementedError(
                "low_latency_update_mask_buffer: mask=False is not supported: epx unmasks a "
                "rank only when a new process takes its place through a rejoin "
                "(survivors: Buffer.rejoin(new_group); the newcomer: "
                "Buffer.create_rejoin(new_group, ...); docs/STABILITY.md \"Rejoin\")")
        self.mask_rank(rank_to_mask)

    def rejoin(self, group):
        """Survivor side of a rejoin: take the ranks this buffer masked back, as new
        processes (epx_ll_rejoin; docs/STABILITY.md "Rejoin"). CPU backend only.

        group: the new group that every rank formed from a fresh rendezvous (a unique id
        a survivor makes and hands to the newcomers), with the same world size and rank
        numbers: an epx.Group (or a torch.distributed ProcessGroup, over which an
        epx.Group is made and owned by the buffer). Collective over it, with the
        newcomers' Buffer.create_rejoin(group, ...); call it between steps (no
        low-latency operation sent and not received).

        On success the newcomers are unmasked and the next dispatch includes every rank;
        low-latency handles from before are stale; the buffer belongs to `group`
        (self.group; destroy the buffer before it; a group the buffer made itself, as from
        Group.from_env, is destroyed here since nothing uses it any more), and serves
        low-latency mode only (normal-mode calls raise ERR_INVALID_STATE).

        On failure raises EpxError and the buffer is as it was (serving, the ranks still
        masked): ERR_INVALID_ARG at once for the buffer's own group or a group in which
        this process has another rank or world size; ERR_INVALID_STATE when a masked rank
        does not come back, a newcomer is not masked here, an operation is in flight, or
        the lost process still runs; ERR_REMOTE naming a rank that refused;
        ERR_UNSUPPORTED on the CUDA backend (NVSHMEM cannot add a process to a running
        job). Try again with a new group.
        """
        from .buffer import _resolve_group  # buffer.py imports this module
        if group is None:
            raise invalid_argument("rejoin: group is None: pass the new group every rank "
                                   "formed for the rejoin")
        owns = not isinstance(group, Group)
        group = _resolve_group("rejoin", group, self.backend)
        try:
            check(_capi.api().epx_ll_rejoin(self.pointer, group.pointer), "ll_rejoin")
        except BaseException:  # Ctrl-C in a callback too
            if owns:
                group.destroy()
            raise
        old, old_owned = self.group, self._owns_group
        old._buffers.discard(self)
        group._buffers.add(self)
        self.group, self._owns_group = group, owns
        if old_owned and old is not group:
            old.destroy()  # local (include/epx.h); the buffer no longer uses it

    def low_latency_query_mask_buffer(self, mask_status):
        """DeepEP's name: writes 1 for masked ranks, 0 for others, into the int32
        [num_ranks] tensor mask_status (host memory)."""
        masked = set(self.get_masked_ranks())
        for rank in range(self.group_size):
            mask_status[rank] = 1 if rank in masked else 0
