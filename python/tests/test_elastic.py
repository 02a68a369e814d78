"""epx.deep_ep.ElasticBuffer (DeepEP V2's API) on every rank, checked against the NumPy model.

Run under `epx launch -n N -- python3 -m pytest -q python/tests/test_elastic.py` (also as
virtual nodes: EPX_RANKS_PER_NODE). Every test is collective.
"""

import inspect

import numpy as np
import pytest

import epx
import epx.deep_ep as deep_ep
from epx import Status
from drained import async_error
from reference import BF16, Case

MAX_TOKENS = 32


# DeepEP's API is torch's: epx.deep_ep is tested with torch tensors and NumPy arrays.
pytestmark = pytest.mark.usefixtures("numpy_or_torch_only")


def make_buffer(group, **kwargs):
    return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=256,
                                 explicitly_destroy=True, **kwargs)


def make_case(group, **kwargs):
    kwargs.setdefault("num_experts", 4 * group.world_size)
    return Case(group.world_size, ranks_per_node=group.ranks_per_node, **kwargs)


def dispatch(buffer, tensors, case, rank, **kwargs):
    x, scales, idx, w = case.inputs(rank)
    x_in = (tensors.put(x), tensors.put(scales)) if scales is not None else tensors.put(x)
    return buffer.dispatch(x_in, topk_idx=tensors.put(idx), topk_weights=tensors.put(w),
                           num_experts=case.num_experts, **kwargs)


def recv_of(tensors, recv_x):
    if isinstance(recv_x, tuple):
        return tensors.get(recv_x[0]), tensors.get(recv_x[1])
    return tensors.get(recv_x), None


def bits(array):
    return array.view(np.uint8 if array.dtype.itemsize == 1 else np.uint16)


def test_signatures_match_deep_ep_v2():
    """DeepEP 2.1's parameter names and defaults, in its order."""
    init = inspect.signature(deep_ep.ElasticBuffer.__init__).parameters
    assert list(init)[1:] == [
        "group", "num_bytes", "num_cpu_bytes", "num_max_tokens_per_rank", "hidden",
        "num_topk", "use_fp8_dispatch", "deterministic", "allow_hybrid_mode",
        "allow_multiple_reduction", "prefer_overlap_with_compute", "sl_idx",
        "num_allocated_qps", "num_cpu_timeout_secs", "num_gpu_timeout_secs",
        "explicitly_destroy"]
    assert list(inspect.signature(deep_ep.ElasticBuffer.dispatch).parameters)[1:] == [
        "x", "topk_idx", "topk_weights", "cumulative_local_expert_recv_stats", "num_experts",
        "num_max_tokens_per_rank", "expert_alignment", "num_sms", "num_qps", "previous_event",
        "previous_event_before_epilogue", "async_with_compute_stream",
        "allocate_on_comm_stream", "handle", "do_handle_copy", "do_cpu_sync", "do_expand",
        "do_zero_padding", "use_tma_aligned_col_major_sf"]
    assert list(inspect.signature(deep_ep.ElasticBuffer.combine).parameters)[1:] == [
        "x", "handle", "topk_weights", "bias", "num_sms", "num_qps", "previous_event",
        "previous_event_before_epilogue", "async_with_compute_stream",
        "allocate_on_comm_stream"]


@pytest.mark.parametrize("dtype,alignment", [("bf16", 1), ("fp8", 4)])
def test_dispatch_matches_the_model(group, tensors, dtype, alignment):
    case = make_case(group, dtype=dtype, alignment=alignment, seed=11)
    buffer = make_buffer(group)
    rank, want = group.rank, case.dispatch(group.rank)
    stats = tensors.put(np.full(case.experts_per_rank, 5, dtype=np.int32))
    recv_x, recv_idx, recv_w, handle, event = dispatch(
        buffer, tensors, case, rank, expert_alignment=alignment,
        cumulative_local_expert_recv_stats=stats)
    got_x, got_sf = recv_of(tensors, recv_x)
    np.testing.assert_array_equal(bits(got_x), bits(want["recv_x"]))
    if dtype == "fp8":
        np.testing.assert_array_equal(got_sf, want["recv_scales"])
    np.testing.assert_array_equal(tensors.get(recv_idx), want["recv_idx"])
    np.testing.assert_array_equal(tensors.get(recv_w), want["recv_weights"])
    n = len(want["src"])
    assert handle.num_recv_tokens == n and not handle.do_expand
    meta = tensors.get(handle.recv_src_metadata)
    assert meta.shape == (n, 2 + case.num_topk) and meta.dtype == np.int32
    np.testing.assert_array_equal(meta[:, 0], [s * MAX_TOKENS + t for s, t in want["src"]])
    np.testing.assert_array_equal(meta[:, 1], [s for s, _ in want["src"]])
    # Counts: aligned per expert (list and inclusive prefix sum), unaligned in the stats.
    assert handle.num_recv_tokens_per_expert_list == want["counts"]
    np.testing.assert_array_equal(tensors.get(handle.psum_num_recv_tokens_per_expert),
                                  np.cumsum(want["counts"]))
    unaligned = np.bincount(want["recv_idx"][want["recv_idx"] >= 0],
                            minlength=case.experts_per_rank)
    np.testing.assert_array_equal(tensors.get(stats), unaligned + 5)
    # Rows per scale-up peer (the ranks of one node index): tokens from ranks s with
    # s % ranks_per_node == i, inclusive prefix sum.
    up = buffer.num_scaleup_ranks
    per_peer = np.bincount([s % up for s, _ in want["src"]], minlength=up)
    np.testing.assert_array_equal(tensors.get(handle.psum_num_recv_tokens_per_scaleup_rank),
                                  np.cumsum(per_peer))
    # Each token's row on each rank: where that rank's metadata names it.
    _, _, idx, _ = case.inputs(rank)
    slots = tensors.get(handle.dst_buffer_slot_idx)
    in_rank = case.layout(rank)[2]
    assert slots.shape == in_rank.shape
    assert ((slots >= 0) == in_rank).all()
    mine = [i for i, (s, _) in enumerate(want["src"]) if s == rank]
    np.testing.assert_array_equal(slots[in_rank[:, rank], rank], mine)
    assert event.event is None
    buffer.destroy()


def test_expanded_layout(group, tensors):
    case = make_case(group, alignment=4, seed=12)
    buffer = make_buffer(group)
    want = case.dispatch(group.rank)
    recv_x, recv_idx, _, handle, _ = dispatch(buffer, tensors, case, group.rank)
    ex_x, ex_idx, ex_w, ex_handle, _ = dispatch(buffer, tensors, case, group.rank,
                                                expert_alignment=4, do_expand=True,
                                                do_zero_padding=True)
    assert ex_idx is None and ex_handle.do_expand
    ex_x, ex_w = tensors.get(ex_x), tensors.get(ex_w)
    slots = tensors.get(ex_handle.recv_src_metadata)[:, 2:]
    idx = want["recv_idx"]
    assert ((slots >= 0) == (idx >= 0)).all()
    counts = np.bincount(idx[idx >= 0], minlength=case.experts_per_rank)
    aligned = (counts + 3) // 4 * 4
    starts = np.concatenate(([0], np.cumsum(aligned)[:-1]))
    np.testing.assert_array_equal(tensors.get(ex_handle.psum_num_recv_tokens_per_expert),
                                  starts + counts)
    np.testing.assert_array_equal(tensors.get(ex_handle.num_unaligned_recv_tokens_per_expert),
                                  counts)
    assert ex_handle.num_expanded_tokens == aligned.sum() == ex_x.shape[0]
    used = np.zeros(ex_x.shape[0], dtype=bool)
    for e in range(case.experts_per_rank):
        rows, cols = np.nonzero(idx == e)
        # An expert's rows: its entries in received-row order, from its aligned start.
        np.testing.assert_array_equal(slots[rows, cols], starts[e] + np.arange(rows.size))
        np.testing.assert_array_equal(bits(ex_x[slots[rows, cols]]), bits(want["recv_x"][rows]))
        np.testing.assert_array_equal(ex_w[slots[rows, cols]], want["recv_weights"][rows, cols])
        used[slots[rows, cols]] = True
    assert (bits(ex_x[~used]) == 0).all() and (ex_w[~used] == 0).all()
    buffer.destroy()


def test_cached_dispatch_reuses_the_routing(group, tensors):
    case = make_case(group, seed=13)
    buffer = make_buffer(group)
    want = case.dispatch(group.rank)
    _, recv_idx, _, handle, _ = dispatch(buffer, tensors, case, group.rank)
    other = (np.asarray(case.inputs(group.rank)[0], np.float32) * 2).astype(BF16)
    # The rows of `other` where the model received x: each row is twice the model's.
    recv_x, again_idx, again_w, same, _ = buffer.dispatch(tensors.put(other), handle=handle)
    assert same is handle and again_w is None
    np.testing.assert_array_equal(tensors.get(recv_x).astype(np.float32),
                                  want["recv_x"].astype(np.float32) * 2)
    np.testing.assert_array_equal(tensors.get(again_idx), tensors.get(recv_idx))
    _, _, w, ex_handle, _ = dispatch(buffer, tensors, case, group.rank, do_expand=True)
    _, w_idx, cached_w, _, _ = buffer.dispatch(
        tensors.put(other), handle=ex_handle,
        topk_weights=tensors.put(case.inputs(group.rank)[3]), do_expand=True)
    assert w_idx is None
    np.testing.assert_array_equal(tensors.get(cached_w), tensors.get(w))
    cached_x, _, _, _, _ = buffer.dispatch(tensors.put(other), handle=ex_handle, do_expand=True)
    slots = tensors.get(ex_handle.recv_src_metadata)[:, 2:]
    r, c = np.nonzero(slots >= 0)
    np.testing.assert_array_equal(tensors.get(cached_x)[slots[r, c]].astype(np.float32),
                                  want["recv_x"][r].astype(np.float32) * 2)
    with pytest.raises(Exception, match="takes no topk_idx"):
        buffer.dispatch(tensors.put(other), topk_idx=tensors.put(case.inputs(group.rank)[2]),
                        handle=handle)
    buffer.destroy()


def test_worst_case_shapes_without_cpu_sync(group, tensors):
    case = make_case(group, seed=14, alignment=2)
    buffer = make_buffer(group)
    rank, want = group.rank, case.dispatch(group.rank)
    n, rows = len(want["src"]), group.world_size * MAX_TOKENS
    recv_x, recv_idx, recv_w, handle, _ = dispatch(buffer, tensors, case, rank,
                                                   do_cpu_sync=False, expert_alignment=2)
    got_x, got_idx, got_w = tensors.get(recv_x), tensors.get(recv_idx), tensors.get(recv_w)
    assert got_x.shape[0] == rows and got_idx.shape[0] == rows and got_w.shape[0] == rows
    assert handle.num_recv_tokens == rows
    np.testing.assert_array_equal(bits(got_x[:n]), bits(want["recv_x"]))
    np.testing.assert_array_equal(got_idx[:n], want["recv_idx"])
    np.testing.assert_array_equal(got_w[:n], want["recv_weights"])
    assert (got_idx[n:] == -1).all() and (got_w[n:] == 0).all()
    assert handle.num_recv_tokens_per_expert_list == []
    # A cached dispatch of that handle keeps the worst-case shapes, expanded too.
    again, _, _, _, _ = buffer.dispatch(tensors.put(case.inputs(rank)[0]), handle=handle)
    assert tensors.get(again).shape[0] == rows
    ex_x, _, _, ex_handle, _ = dispatch(buffer, tensors, case, rank, do_cpu_sync=False,
                                        do_expand=True, expert_alignment=2)
    local, k = case.experts_per_rank, case.num_topk
    bound = (rows * min(k, local) + local + 1) // 2 * 2
    assert tensors.get(ex_x).shape[0] == bound == ex_handle.num_expanded_tokens
    # combine reads the received rows of worst-case inputs.
    x_rows = np.zeros((rows, case.hidden), dtype=BF16)
    x_rows[:n] = case.combine_input(rank, want["src"], lambda s: case.inputs(s)[0])
    combined, _, _ = buffer.combine(tensors.put(x_rows), handle, topk_weights=recv_w)
    want_x, _ = case.combine(rank, lambda s: case.inputs(s)[0])
    np.testing.assert_array_equal(bits(tensors.get(combined)), bits(want_x))
    buffer.destroy()


@pytest.mark.parametrize("num_bias", [0, 1, 2])
def test_combine_and_expanded_combine(group, tensors, num_bias):
    case = make_case(group, seed=15)
    buffer = make_buffer(group)
    rank, want = group.rank, case.dispatch(group.rank)
    _, recv_idx, recv_w, handle, _ = dispatch(buffer, tensors, case, rank)
    _, _, ex_w, ex_handle, _ = dispatch(buffer, tensors, case, rank, do_expand=True)

    def x_of(s):
        return case.inputs(s)[0]

    rows = case.combine_input(rank, want["src"], x_of)
    rng = np.random.default_rng([case.seed, 99, rank])
    bias = [rng.uniform(-1, 1, (case.num_tokens, case.hidden)).astype(BF16)
            for _ in range(num_bias)]
    bias_arg = None if num_bias == 0 else (
        tensors.put(bias[0]) if num_bias == 1 else tuple(tensors.put(b) for b in bias))
    combined, combined_w, _ = buffer.combine(tensors.put(rows), handle,
                                             topk_weights=recv_w, bias=bias_arg)
    want_x, _ = case.combine(rank, x_of, bias=bias)
    np.testing.assert_array_equal(bits(tensors.get(combined)), bits(want_x))
    _, _, idx, w = case.inputs(rank)
    np.testing.assert_array_equal(tensors.get(combined_w), np.where(idx >= 0, w, 0))

    # Expanded: each entry's row is a share of `rows`; the library sums a received row's
    # shares in top-k order (fp32, one rounding) before the ranks' sum.
    slots = tensors.get(ex_handle.recv_src_metadata)[:, 2:]
    shares = np.zeros((ex_handle.num_expanded_tokens, case.hidden), dtype=BF16)
    partial = np.zeros((len(want["src"]), case.hidden), dtype=np.float32)
    for j in range(case.num_topk):
        r = np.nonzero(slots[:, j] >= 0)[0]
        share = (rows[r].astype(np.float32) * np.float32(0.25 * (j + 1))).astype(BF16)
        shares[slots[r, j]] = share
        partial[r] += share.astype(np.float32)
    ex_combined, ex_combined_w, _ = buffer.combine(tensors.put(shares), ex_handle,
                                                   topk_weights=ex_w, bias=bias_arg)
    # The same as a plain combine of the summed shares.
    plain, _, _ = buffer.combine(tensors.put(partial.astype(BF16)), handle, bias=bias_arg)
    np.testing.assert_array_equal(bits(tensors.get(ex_combined)), bits(tensors.get(plain)))
    np.testing.assert_array_equal(tensors.get(ex_combined_w), np.where(idx >= 0, w, 0))
    buffer.destroy()


def test_refusals_name_the_cause(group, tensors):
    case = make_case(group, seed=16)
    buffer = make_buffer(group, allow_multiple_reduction=False)
    x, _, idx, w = case.inputs(group.rank)
    # Before any buffer exists: every rank refuses alike (a vote, then no buffer made).
    with pytest.raises(epx.EpxError, match="num_experts is required"):
        buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx))
    with pytest.raises(epx.EpxError, match="topk_idx is required"):
        buffer.dispatch(tensors.put(x), num_experts=case.num_experts)
    _, _, _, ex_handle, _ = dispatch(buffer, tensors, case, group.rank, do_expand=True)
    shares = np.zeros((ex_handle.num_expanded_tokens, case.hidden), dtype=BF16)
    with pytest.raises(NotImplementedError, match="allow_multiple_reduction=False"):
        buffer.combine(tensors.put(shares), ex_handle)
    for name in ("engram_write", "engram_fetch", "pp_send", "pp_recv", "all_gather",
                 "create_agrs_session"):
        with pytest.raises(NotImplementedError, match=name):
            getattr(buffer, name)()
    buffer.destroy()
    with pytest.raises(NotImplementedError, match="num_cpu_bytes"):
        deep_ep.ElasticBuffer(group, num_bytes=4 << 20, num_cpu_bytes=2 << 20)


def test_combine_adds_in_deep_ep_v2_order(group, tensors):
    """DeepEP V2 adds a token's rows from its ranks where each rank's last top-k entry
    stands (its reference, bit for bit), not in rank order; across nodes each node's
    partial where its last entry stands. Rows that cancel (+2^16 from a token's lowest
    receiving rank, -2^16 from its highest, small values between, biases first) make the
    sum depend on that order, so ElasticBuffer.combine must match a model adding in V2's
    order (rank order on the CUDA backend across nodes: not supported there yet)."""
    case = make_case(group, seed=29)
    buffer = make_buffer(group)
    rank, world, hidden = group.rank, group.world_size, case.hidden
    per_rank = case.experts_per_rank
    per_node = group.ranks_per_node if 0 < group.ranks_per_node < world else world
    v2_order = not (group.backend == "cuda" and per_node < world)

    def receivers(s, t):
        ids = case.inputs(s)[2][t]
        return sorted({int(i) // per_rank for i in ids if i >= 0})

    def row_of(r, s, t):  # what rank r sends back for token t of rank s
        got = receivers(s, t)
        if len(got) >= 3 and r in (got[0], got[-1]):
            return np.full(hidden, 65536.0 if r == got[0] else -65536.0, dtype=np.float32)
        rng = np.random.default_rng(1000003 * r + 1009 * s + t)
        return (rng.standard_normal(hidden) * 0.01).astype(BF16).astype(np.float32)

    def model(t, bias_row, in_v2_order):
        ids = case.inputs(rank)[2][t]
        seq = receivers(rank, t)
        if in_v2_order:
            last = {int(i) // per_rank: j for j, i in enumerate(ids) if i >= 0}
            seq = sorted(last, key=last.get)
        acc = bias_row.astype(np.float32).copy()
        for i, r in enumerate(seq):
            if per_node == world:
                acc += row_of(r, rank, t)
            elif all(q // per_node != r // per_node for q in seq[i + 1:]):
                part = np.zeros(hidden, dtype=np.float32)
                for q in seq[:i + 1]:
                    if q // per_node == r // per_node:
                        part += row_of(q, rank, t)
                acc += part.astype(BF16).astype(np.float32)
        return acc.astype(BF16)

    _, _, _, handle, _ = dispatch(buffer, tensors, case, rank)
    src = case.dispatch(rank)["src"]
    rows = np.stack([row_of(rank, s, t) for s, t in src]).astype(BF16) if src else \
        np.zeros((0, hidden), dtype=BF16)
    n = case.inputs(rank)[2].shape[0]
    bias = (np.random.default_rng(rank).standard_normal((n, hidden)) * 0.5).astype(BF16)
    combined, _, _ = buffer.combine(tensors.put(rows), handle, bias=tensors.put(bias))
    want = np.stack([model(t, bias[t], v2_order) for t in range(n)]) if n else bias
    np.testing.assert_array_equal(bits(tensors.get(combined)), bits(want))
    if v2_order and per_node == world and world >= 4 and n >= 16:
        ranked = np.stack([model(t, bias[t], False) for t in range(n)])
        assert (bits(ranked) != bits(want)).any(), "the case does not tell the orders apart"
    buffer.destroy()


def refused_on_one_rank(group, call, *words, buffer=None):
    """call() fails on every rank: naming the cause on rank 0 (the one given a bad
    argument), as ERR_REMOTE naming rank 0 elsewhere (never a wait for the timeout). On a
    GPU a peer's operation may return before it meets the failure (its kernels wait on the
    device): the failure is then the buffer's async error once the stream has drained."""
    if group.rank != 0 and buffer is not None and group.backend == "cuda":
        try:
            call()
        except epx.EpxError as error:
            assert error.status == Status.ERR_REMOTE, error.message
            assert "rank 0" in error.message, error.message
            return
        status, message = async_error(buffer._main)
        assert status == Status.ERR_REMOTE and "rank 0" in message, (status, message)
        return
    with pytest.raises(epx.EpxError) as caught:
        call()
    if group.rank == 0:
        for word in words:
            assert word in caught.value.message, caught.value.message
    else:
        assert caught.value.status == Status.ERR_REMOTE, caught.value.message
        assert "rank 0" in caught.value.message, caught.value.message


def test_collected_without_destroy_leaves_no_wait(group, tensors, capfd):
    """A buffer made with explicitly_destroy=True and dropped without destroy() (as when
    a rank leaves on an exception) is aborted and freed on that rank alone: no collective
    step that would wait for peers who never come. The peers' next call on it ends with
    ERR_REMOTE naming that rank."""
    case = make_case(group, seed=23)
    buffer = make_buffer(group)
    recv_x, _, recv_w, handle, _ = dispatch(buffer, tensors, case, group.rank)
    group.barrier()
    if group.rank == 0:
        import gc
        del buffer, handle, recv_x, recv_w
        gc.collect()
        assert "collected without destroy()" in capfd.readouterr().err
        group.barrier()
        return
    group.barrier()
    refused_on_one_rank(group, lambda: buffer.combine(recv_x, handle, topk_weights=recv_w),
                        buffer=buffer)
    buffer.destroy()


class BrokenEvent:
    """A previous_event whose wait fails (as a caller's broken event would)."""

    def current_stream_wait(self):
        raise RuntimeError("the event is broken")


@pytest.mark.parametrize("mistake", ["stats", "twice", "expert id", "tokens", "topk rows",
                                     "handle",
                                     "combine rows", "combine weights", "first call",
                                     "shape change", "bias", "event", "combine event"])
def test_a_mistake_on_one_rank_fails_the_call_everywhere(group, tensors, mistake):
    case = make_case(group, seed=17)
    buffer = make_buffer(group)
    rank = group.rank
    x, _, idx, w = case.inputs(rank)
    bad = rank == 0
    if mistake == "first call":
        # No epx buffer yet: rank 0's 1-D topk_idx is refused at the ranks' exchange.
        flat = idx[:, 0].copy() if bad else idx
        refused_on_one_rank(group, lambda: buffer.dispatch(
            tensors.put(x), topk_idx=tensors.put(flat), num_experts=case.num_experts),
            "must be 2-D")
        recv_x, _, _, _, _ = dispatch(buffer, tensors, case, rank)
        np.testing.assert_array_equal(bits(tensors.get(recv_x)),
                                      bits(case.dispatch(rank)["recv_x"]))
        buffer.destroy()
        return
    _, _, recv_w, handle, _ = dispatch(buffer, tensors, case, rank)
    if mistake == "shape change":
        stats = np.zeros(case.experts_per_rank + (1 if bad else 0), dtype=np.int32)
        call = lambda: dispatch(buffer, tensors, case, rank,  # noqa: E731
                                num_max_tokens_per_rank=2 * MAX_TOKENS,
                                cumulative_local_expert_recv_stats=tensors.put(stats))
        words = ("cumulative_local_expert_recv_stats",)
    elif mistake == "bias":
        rows = case.combine_input(rank, case.dispatch(rank)["src"], lambda s: case.inputs(s)[0])
        b = tensors.put(np.zeros((case.num_tokens, case.hidden), dtype=BF16))
        call = lambda: buffer.combine(tensors.put(rows), handle,  # noqa: E731
                                      bias=(b, b, b) if bad else (b, b))
        words = ("bias must be a tensor or a pair",)
    elif mistake == "stats":
        stats = np.zeros(case.experts_per_rank + (1 if bad else 0), dtype=np.int32)
        call = lambda: dispatch(buffer, tensors, case, rank,  # noqa: E731
                                cumulative_local_expert_recv_stats=tensors.put(stats))
        words = ("cumulative_local_expert_recv_stats",)
    elif mistake == "twice":
        idx2 = idx.copy()
        if bad:
            idx2[1, :2] = case.num_experts - 1
        call = lambda: buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx2),  # noqa
                                       num_experts=case.num_experts)
        words = ("names an expert twice in token 1",)
    elif mistake == "expert id":
        idx2 = idx.copy()
        if bad:
            idx2[1, 0] = case.num_experts
        call = lambda: buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx2),  # noqa
                                       num_experts=case.num_experts)
        words = ("topk_idx[1][0] is %d, expected -1 (none) or an expert id" % case.num_experts,)
    elif mistake == "tokens":
        more = np.concatenate([x] * 3) if bad else x
        more_idx = np.concatenate([idx] * 3) if bad else idx
        call = lambda: buffer.dispatch(tensors.put(more), topk_idx=tensors.put(more_idx),  # noqa
                                       num_experts=case.num_experts)
        words = ("x has %d tokens, more than num_max_tokens_per_rank" % (3 * len(x)),)
    elif mistake == "topk rows":
        fewer = idx[:-1] if bad else idx
        call = lambda: buffer.dispatch(tensors.put(x), topk_idx=tensors.put(fewer),  # noqa
                                       num_experts=case.num_experts)
        words = ("topk_idx has %d rows for %d tokens" % (len(x) - 1, len(x)),)
    elif mistake in ("event", "combine event"):
        event = BrokenEvent() if bad else None
        if mistake == "event":
            call = lambda: buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx),  # noqa
                                           num_experts=case.num_experts, previous_event=event)
            words = ("RuntimeError: the event is broken",)
        else:
            rows = case.combine_input(rank, case.dispatch(rank)["src"],
                                      lambda s: case.inputs(s)[0])
            call = lambda: buffer.combine(tensors.put(rows), handle,  # noqa: E731
                                          previous_event=event)
            words = ("previous_event: RuntimeError: the event is broken",)
    elif mistake == "handle":
        call = lambda: buffer.dispatch(tensors.put(x), handle=handle,  # noqa: E731
                                       topk_idx=tensors.put(idx) if bad else None)
        words = ("takes no topk_idx",)
    else:
        rows = np.zeros((handle.num_recv_tokens - (1 if bad else 0), case.hidden), dtype=BF16)
        weights = recv_w
        if mistake == "combine weights":
            rows = np.zeros((handle.num_recv_tokens, case.hidden), dtype=BF16)
            weights = tensors.put(np.zeros((handle.num_recv_tokens, case.num_topk + bad),
                                           dtype=np.float32))
        call = lambda: buffer.combine(tensors.put(rows), handle,  # noqa: E731
                                      topk_weights=weights)
        words = ("topk_weights has shape",) if mistake == "combine weights" else \
            ("x has %d rows" % (handle.num_recv_tokens - 1),)
    refused_on_one_rank(group, call, *words, buffer=buffer)
    # The buffer is made again by the next dispatch, on every rank.
    recv_x, _, _, _, _ = dispatch(buffer, tensors, case, rank)
    np.testing.assert_array_equal(bits(tensors.get(recv_x)), bits(case.dispatch(rank)["recv_x"]))
    buffer.destroy()


def test_fp8_expanded_column_major_scales(group, tensors):
    case = make_case(group, dtype="fp8", alignment=4, seed=18)
    buffer = make_buffer(group)
    want = case.dispatch(group.rank)
    recv_x, _, _, handle, _ = dispatch(buffer, tensors, case, group.rank, expert_alignment=4,
                                       do_expand=True, use_tma_aligned_col_major_sf=True)
    ex_x, ex_sf = recv_of(tensors, recv_x)
    rows = handle.num_expanded_tokens
    assert ex_x.shape[0] == rows and ex_sf.shape == (rows, case.hidden // 128)
    # Column major: one pack's rows contiguous, columns 4-row aligned apart.
    itemsize = ex_sf.dtype.itemsize
    assert ex_sf.strides == (itemsize, ((rows + 3) // 4 * 4) * itemsize)
    slots = tensors.get(handle.recv_src_metadata)[:, 2:]
    r, c = np.nonzero(slots >= 0)
    np.testing.assert_array_equal(bits(ex_x[slots[r, c]]), bits(want["recv_x"][r]))
    np.testing.assert_array_equal(ex_sf[slots[r, c]], want["recv_scales"][r])
    buffer.destroy()


def test_handle_copy_and_a_rank_without_tokens(group, tensors):
    case = make_case(group, seed=19, empty_rank=group.world_size - 1)
    buffer = make_buffer(group)
    x, _, idx, w = case.inputs(group.rank)
    idx_in = tensors.put(idx)
    _, _, _, handle, _ = buffer.dispatch(tensors.put(x), topk_idx=idx_in,
                                         topk_weights=tensors.put(w),
                                         num_experts=case.num_experts, do_handle_copy=False)
    assert handle.topk_idx is idx_in
    _, _, _, copied, _ = dispatch(buffer, tensors, case, group.rank)
    assert copied.topk_idx is not idx_in
    np.testing.assert_array_equal(tensors.get(copied.topk_idx), idx)
    want = case.dispatch(group.rank)
    assert handle.num_recv_tokens == len(want["src"])
    rows = case.combine_input(group.rank, want["src"], lambda s: case.inputs(s)[0])
    combined, _, _ = buffer.combine(tensors.put(rows), handle)
    want_x, _ = case.combine(group.rank, lambda s: case.inputs(s)[0])
    np.testing.assert_array_equal(bits(tensors.get(combined)), bits(want_x))
    buffer.destroy()


def test_sizes_and_domains(group):
    buffer = make_buffer(group)
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(group, 4096, 7168, num_topk=8)
    assert hint % (2 << 20) == 0 and hint > 4096 * group.world_size * 7168 * 4
    assert buffer.num_bytes == deep_ep.ElasticBuffer.get_buffer_size_hint(group, MAX_TOKENS,
                                                                          256)
    nodes, per_node = buffer.get_logical_domain_size()
    assert nodes * per_node == group.world_size
    if 0 < group.ranks_per_node < group.world_size:
        assert per_node == group.ranks_per_node
    assert buffer.scaleup_rank_idx == group.rank % per_node
    assert buffer.get_theoretical_num_sms(64, 8) == deep_ep.Buffer.num_sms
    buffer.barrier()
    buffer.destroy()
