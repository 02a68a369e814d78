"""epx.deep_ep (DeepEP's API) on every rank, checked against the NumPy model and epx.Buffer.

Run under `epx launch -n N -- python3 -m pytest -q python/tests/test_deep_ep.py`. Every
test is collective: each rank makes the same calls and checks its own results. The calls
are written as code written for deep_ep.Buffer makes them (keyword names, tuples).
"""

import inspect

import numpy as np
import pytest

import epx
import epx.deep_ep as deep_ep
from checks import assert_bf16_equal, assert_recv_x
from drained import async_error
from reference import BF16, Case
from test_low_latency import LowLatencyCase

NVL_BYTES = 64 << 20


# DeepEP's API is torch's: epx.deep_ep is tested with torch tensors and NumPy arrays.
pytestmark = pytest.mark.usefixtures("numpy_or_torch_only")


def make_buffer(group, **kwargs):
    kwargs.setdefault("num_nvl_bytes", NVL_BYTES)
    return deep_ep.Buffer(group, explicitly_destroy=True, **kwargs)


def spans_nodes(group):
    return 0 < group.ranks_per_node < group.world_size


def make_case(group, **kwargs):
    """The model of `group`: across nodes, combine sums per node first."""
    return Case(group.world_size, ranks_per_node=group.ranks_per_node, **kwargs)


def layout_of(buffer, tensors, case, rank):
    _, _, idx, _ = case.inputs(rank)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(
        tensors.put(idx), case.num_experts)
    if case.ranks_per_node == case.world:
        assert per_rdma is None
    else:
        # DeepEP's num_tokens_per_rdma_rank: tokens sent to each node, once per node.
        in_node = case.layout(rank)[2].reshape(idx.shape[0], -1, case.ranks_per_node)
        np.testing.assert_array_equal(tensors.get(per_rdma), in_node.any(axis=2).sum(axis=0))
        assert tensors.get(per_rdma).dtype == np.int32
    return per_rank, per_expert, in_rank


def dispatch_by_topk(buffer, tensors, case, rank, call=None):
    """`call` (buffer.dispatch by default) of rank's inputs routed by top-k, with the
    layout from get_dispatch_layout: (its six results, is_token_in_rank)."""
    x, _, idx, w = case.inputs(rank)
    per_rank, per_expert, in_rank = layout_of(buffer, tensors, case, rank)
    results = (call or buffer.dispatch)(
        tensors.put(x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=tensors.put(idx), topk_weights=tensors.put(w))
    return results, in_rank


def rank_prefix(case):
    """[s][r] = tokens ranks 0..s send to rank r, from every rank's model layout."""
    counts = np.array([case.layout(s)[2].sum(axis=0) for s in range(case.world)])
    return np.cumsum(counts, axis=0).astype(np.int32)


def check_recv(tensors, case, rank, recv_x, recv_idx, recv_weights, counts, handle, fp8=False):
    want = case.dispatch(rank)
    assert_recv_x(tensors, recv_x, want, fp8)
    if recv_idx is not None:
        np.testing.assert_array_equal(tensors.get(recv_idx), want["recv_idx"])
        np.testing.assert_array_equal(tensors.get(recv_weights), want["recv_weights"])
    assert counts == want["counts"]
    check_handle(tensors, case, rank, handle)
    return want


def check_handle(tensors, case, rank, handle):
    """DeepEP's handle tuple: intranode, rank_prefix_matrix first; internode,
    recv_gbl_rank_prefix_sum fourth from the end (what DeepEP's tests read)."""
    assert isinstance(handle, tuple)
    if case.ranks_per_node == case.world:
        assert len(handle) == 6
        prefix, want = handle[0], rank_prefix(case)
    else:
        assert len(handle) == 10 and isinstance(handle, deep_ep.InternodeDispatchHandle)
        prefix, want = handle[-4], rank_prefix(case)[:, rank]
    np.testing.assert_array_equal(tensors.get(prefix), want)
    assert tensors.get(prefix).dtype == np.int32


# ---------------------------------------------------------------- surface


def test_signatures_match_deep_ep():
    """DeepEP 567632d's parameter names and defaults, in its order."""
    params = inspect.signature(deep_ep.Buffer.__init__).parameters
    assert list(params)[1:] == [
        "group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
        "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric", "explicitly_destroy",
        "enable_shrink", "comm"]
    assert params["num_qps_per_rank"].default == 24
    dispatch = list(inspect.signature(deep_ep.Buffer.dispatch).parameters)[1:]
    assert dispatch == ["x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank",
                        "is_token_in_rank", "num_tokens_per_expert", "topk_idx", "topk_weights",
                        "expert_alignment", "num_worst_tokens", "config", "previous_event",
                        "async_finish", "allocate_on_comm_stream"]
    combine = list(inspect.signature(deep_ep.Buffer.combine).parameters)[1:]
    assert combine == ["x", "handle", "topk_weights", "bias", "config", "previous_event",
                       "async_finish", "allocate_on_comm_stream"]
    ll = list(inspect.signature(deep_ep.Buffer.low_latency_dispatch).parameters)[1:]
    assert ll == ["x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
                  "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats",
                  "use_fp8", "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"]


def test_statics_and_config():
    assert deep_ep.Buffer.is_sm90_compiled() is True
    assert deep_ep.Buffer.num_sms == 20
    config = deep_ep.Config(24, 8, 256)
    assert (config.num_sms, config.num_max_nvl_chunked_send_tokens,
            config.num_max_nvl_chunked_recv_tokens, config.num_max_rdma_chunked_send_tokens,
            config.num_max_rdma_chunked_recv_tokens) == (24, 8, 256, 6, 256)
    # The hint holds NVL_HINT_TOKENS_PER_RANK tokens of the standard shape.
    hint = config.get_nvl_buffer_size_hint(7168 * 2, 8)
    assert hint > 4096 * 8 * 7168 * 4
    assert config.get_rdma_buffer_size_hint(7168 * 2, 8) == 2 * hint
    # DeepEP's standard low-latency shape: about 1.9 GB per rank for bf16 rows.
    ll = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert 1.8e9 < ll < 2.0e9
    assert deep_ep.Buffer.get_dispatch_config(8).num_sms == deep_ep.Buffer.num_sms
    assert isinstance(deep_ep.Buffer.get_combine_config(8), deep_ep.Config)
    assert deep_ep.EventOverlap is epx.EventOverlap


def test_not_implemented_names_the_feature(group):
    buffer = make_buffer(group, low_latency_mode=True, num_rdma_bytes=1)
    for call, name in ((buffer.get_comm_stream, "get_comm_stream"),
                       (buffer.low_latency_clean_mask_buffer, "low_latency_clean_mask_buffer")):
        with pytest.raises(NotImplementedError, match=name):
            call()
    with pytest.raises(NotImplementedError, match="get_local_buffer_tensor"):
        buffer.get_local_buffer_tensor(None)
    with pytest.raises(NotImplementedError, match="mask=False"):
        buffer.low_latency_update_mask_buffer(0, mask=False)
    buffer.destroy()


def test_destroy_needs_explicitly_destroy(group):
    buffer = deep_ep.Buffer(group, NVL_BYTES)
    with pytest.raises(epx.EpxError, match="explicitly_destroy"):
        buffer.destroy()
    buffer._release()
    buffer = make_buffer(group)
    buffer.destroy()
    x = np.zeros((1, 256), dtype=BF16)
    with pytest.raises(epx.EpxError, match="after destroy"):
        buffer.dispatch(x, num_tokens_per_expert=np.zeros(group.world_size, np.int32),
                        topk_idx=np.zeros((1, 1), np.int64))


def test_collected_without_destroy_leaves_no_wait(group, tensors, capfd):
    """A buffer made with explicitly_destroy=True and dropped without destroy() (a rank
    leaving on an exception) is aborted and freed on that rank alone, with no collective
    step that would wait for peers who never come; the peers' next call ends with
    ERR_REMOTE naming that rank. (DeepEP's warns and leaks.)"""
    case = make_case(group, seed=6)
    buffer = make_buffer(group)
    x, _, idx, w = case.inputs(group.rank)
    per_rank, per_expert, in_rank = layout_of(buffer, tensors, case, group.rank)
    recv_x, _, _, _, handle, _ = buffer.dispatch(
        tensors.put(x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=tensors.put(idx),
        topk_weights=tensors.put(w))
    group.barrier()
    if group.rank == 0:
        import gc
        del buffer, handle, recv_x
        gc.collect()
        assert "collected without destroy()" in capfd.readouterr().err
        group.barrier()
        return
    group.barrier()
    with pytest.raises(epx.EpxError) as caught:
        buffer.combine(recv_x, handle)
        if group.backend == "cuda":
            # The kernels may meet the abort after the call returned: the async error.
            raise epx.EpxError(*async_error(buffer._normal))
    assert caught.value.status == epx.Status.ERR_REMOTE, caught.value.message
    assert "rank 0" in caught.value.message, caught.value.message
    buffer.destroy()


# ---------------------------------------------------------------- normal mode


def test_layout_before_and_after_the_first_dispatch(group, tensors):
    case = make_case(group, seed=3)
    buffer = make_buffer(group)
    want_rank, want_expert, want_in_rank = case.layout(group.rank)
    x, _, idx, w = case.inputs(group.rank)
    for when in ("before", "after"):
        per_rank, per_expert, in_rank = layout_of(buffer, tensors, case, group.rank)
        np.testing.assert_array_equal(tensors.get(per_rank), want_rank, err_msg=when)
        np.testing.assert_array_equal(tensors.get(per_expert), want_expert, err_msg=when)
        np.testing.assert_array_equal(tensors.get(in_rank), want_in_rank, err_msg=when)
        assert tensors.get(in_rank).dtype == np.bool_
        assert tensors.get(per_rank).dtype == np.int32
        if when == "before":
            assert buffer._normal is None  # computed without an epx buffer
            buffer.dispatch(tensors.put(x), num_tokens_per_expert=per_expert,
                            is_token_in_rank=in_rank, num_tokens_per_rank=per_rank,
                            topk_idx=tensors.put(idx), topk_weights=tensors.put(w))
    assert buffer._normal is not None
    buffer.destroy()


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("with_topk", [False, True])
def test_dispatch_combine(group, tensors, dtype, with_topk):
    """DeepEP's test_intranode flow: layout, dispatch (with or without top-k), cached
    dispatch, combine; outputs owned by the caller."""
    case = make_case(group, seed=5, dtype=dtype)
    buffer = make_buffer(group)
    x, scales, idx, w = case.inputs(group.rank)
    per_rank, per_expert, in_rank = layout_of(buffer, tensors, case, group.rank)
    x_in = tensors.put(x)
    if dtype == "fp8":
        # Column-major scales, as DeepEP's test passes them.
        x_in = (x_in, tensors.put(scales.T.copy()).T)
    dispatch_args = {"x": x_in, "num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank,
                     "num_tokens_per_expert": per_expert, "config": deep_ep.Config(24, 8, 256)}
    if with_topk:
        dispatch_args.update({"topk_idx": tensors.put(idx), "topk_weights": tensors.put(w)})
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(**dispatch_args)
    assert isinstance(event, epx.EventOverlap)
    assert (recv_idx is None) == (not with_topk)
    want = check_recv(tensors, case, group.rank, recv_x, recv_idx, recv_w, counts, handle,
                      fp8=dtype == "fp8")
    if spans_nodes(group):
        assert handle[0] is in_rank and handle[1] is None
    else:
        assert handle[4] is in_rank and handle[1] is None
    recv_x_only = recv_x[0] if dtype == "fp8" else recv_x
    kept = np.array(tensors.get(recv_x_only), copy=True)

    # Cached dispatch: same routing, new values; the first outputs are the caller's.
    x2 = (x.astype(np.float32) * 2).astype(BF16) if dtype == "bf16" else x
    cached_in = tensors.put(x2) if dtype == "bf16" else x_in
    cached, none_idx, none_w, none_counts, none_handle, _ = buffer.dispatch(
        cached_in, handle=handle, config=deep_ep.Config(24, 8, 256))
    assert none_idx is none_w is none_counts is none_handle is None
    np.testing.assert_array_equal(tensors.get(recv_x_only), kept)
    if dtype == "bf16":
        np.testing.assert_array_equal(tensors.get(cached).astype(np.float32),
                                      want["recv_x"].astype(np.float32) * 2)

    # Combine: each rank sends back its rows; the home rank sums them.
    rows = case.combine_input(group.rank, want["src"], lambda s: case.inputs(s)[0])
    combine_args = {"x": tensors.put(rows), "handle": handle}
    if with_topk:
        combine_args["topk_weights"] = tensors.put(tensors.get(recv_w) * np.float32(
            group.rank + 1))
    combined, combined_w, _ = buffer.combine(**combine_args)
    want_x, want_w = case.combine(group.rank, lambda s: case.inputs(s)[0])
    assert_bf16_equal(tensors.get(combined), want_x, group.backend)
    if with_topk:
        np.testing.assert_allclose(tensors.get(combined_w), want_w, rtol=1e-6, atol=1e-6)
    else:
        assert combined_w is None
    buffer.destroy()


def test_worst_case_dispatch(group, tensors):
    """num_worst_tokens: that many rows, the received prefix equal to a host-sync
    dispatch's, top-k ids -1 past it, an empty count list."""
    case = make_case(group, seed=7)
    buffer = make_buffer(group)
    x, _, idx, w = case.inputs(group.rank)
    per_rank, per_expert, in_rank = layout_of(buffer, tensors, case, group.rank)
    args = {"x": tensors.put(x), "num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank,
            "num_tokens_per_expert": per_expert, "topk_idx": tensors.put(idx),
            "topk_weights": tensors.put(w)}
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(**args)
    n = len(case.dispatch(group.rank)["src"])
    worst = case.num_tokens * group.world_size
    w_x, w_idx, w_w, empty, w_handle, _ = buffer.dispatch(num_worst_tokens=worst, **args)
    assert empty == []
    assert tuple(w_x.shape) == (worst, case.hidden)
    assert w_idx.shape[0] == worst and w_w.shape[0] == worst
    np.testing.assert_array_equal(tensors.get(w_x)[:n].view(np.uint16),
                                  tensors.get(recv_x).view(np.uint16))
    np.testing.assert_array_equal(tensors.get(w_idx)[:n], tensors.get(recv_idx))
    np.testing.assert_array_equal(tensors.get(w_w)[:n], tensors.get(recv_w))
    assert (tensors.get(w_idx)[n:] == -1).all()
    check_handle(tensors, case, group.rank, w_handle)
    # Combine takes the worst-case rows (the padding is not read).
    combined, _, _ = buffer.combine(w_x, w_handle)
    plain, _, _ = buffer.combine(recv_x, handle)
    np.testing.assert_array_equal(tensors.get(combined).view(np.uint16),
                                  tensors.get(plain).view(np.uint16))
    buffer.destroy()


def test_combine_bias(group, tensors):
    case = make_case(group, seed=9)
    buffer = make_buffer(group)
    (_, _, _, _, handle, _), _ = dispatch_by_topk(buffer, tensors, case, group.rank)
    x_of = lambda s: case.inputs(s)[0]  # noqa: E731
    rows = tensors.put(case.combine_input(group.rank, case.dispatch(group.rank)["src"], x_of))
    rng = np.random.default_rng([9, group.rank])
    bias = [rng.uniform(-1, 1, (case.num_tokens, case.hidden)).astype(BF16) for _ in range(2)]
    one, _, _ = buffer.combine(rows, handle, bias=tensors.put(bias[0]))
    two, _, _ = buffer.combine(rows, handle, bias=(tensors.put(bias[0]), tensors.put(bias[1])))
    # Biases that cancel (+2^24, -2^24) tell the order apart: first, they leave the rows'
    # sum exact; after the rows, the fp32 sum next to 2^24 would keep even integers only.
    big = np.full((case.num_tokens, case.hidden), 2.0 ** 24, dtype=np.float32)
    cancel = [big.astype(BF16), (-big).astype(BF16)]
    three, _, _ = buffer.combine(rows, handle,
                                 bias=(tensors.put(cancel[0]), tensors.put(cancel[1])))
    # The model: the biases first (fp32), then the rows in rank order on one node, or the
    # nodes' sums rounded to bf16 in node order across nodes; one rounding at the end.
    for got, parts in ((one, bias[:1]), (two, bias), (three, cancel)):
        want, _ = case.combine(group.rank, x_of, bias=parts)
        assert_bf16_equal(tensors.get(got), want, group.backend)
    buffer.destroy()


def test_combine_input_mapped_on_demand(group, tensors, monkeypatch):
    """The normal-mode buffer reads combine's x in place (Buffer.auto_register True, the
    default), copies it in (False) or follows EPX_AUTO_REGISTER (None); the results are
    the same either way."""
    case = make_case(group, seed=15)
    for setting, want in ((True, 1), (False, -1), (None, 0)):
        monkeypatch.setattr(deep_ep.Buffer, "auto_register", setting)
        buffer = make_buffer(group)
        (recv_x, _, _, _, handle, _), _ = dispatch_by_topk(buffer, tensors, case, group.rank)
        assert buffer._normal._config.auto_register == want
        want_rows = check_recv(tensors, case, group.rank, recv_x, None, None,
                               case.dispatch(group.rank)["counts"], handle)
        rows = case.combine_input(group.rank, want_rows["src"], lambda s: case.inputs(s)[0])
        combined, _, _ = buffer.combine(tensors.put(rows), handle)
        want_x, _ = case.combine(group.rank, lambda s: case.inputs(s)[0])
        assert_bf16_equal(tensors.get(combined), want_x, group.backend)
        buffer.destroy()


def test_internode_names(group, tensors):
    """internode_dispatch and internode_combine (which DeepEP's dispatch and combine call
    across nodes) are dispatch and combine, on one node as across nodes."""
    case = make_case(group, seed=13)
    buffer = make_buffer(group)
    (recv_x, recv_idx, recv_w, counts, handle, _), _ = dispatch_by_topk(
        buffer, tensors, case, group.rank, buffer.internode_dispatch)
    want = check_recv(tensors, case, group.rank, recv_x, recv_idx, recv_w, counts, handle)
    rows = case.combine_input(group.rank, want["src"], lambda s: case.inputs(s)[0])
    combined, _, _ = buffer.internode_combine(tensors.put(rows), handle)
    want_x, _ = case.combine(group.rank, lambda s: case.inputs(s)[0])
    assert_bf16_equal(tensors.get(combined), want_x, group.backend)
    buffer.destroy()


def test_new_shape_makes_a_new_buffer(group, tensors):
    """Another hidden size: a new epx buffer; the old handles are refused by name."""
    buffer = make_buffer(group)
    handles = []
    for hidden in (256, 512):
        case = make_case(group, seed=11, hidden=hidden)
        x, _, idx, w = case.inputs(group.rank)
        per_rank, per_expert, in_rank = layout_of(buffer, tensors, case, group.rank)
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            tensors.put(x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=tensors.put(idx),
            topk_weights=tensors.put(w))
        check_recv(tensors, case, group.rank, recv_x, recv_idx, recv_w, counts, handle)
        handles.append((handle, recv_x))
    with pytest.raises(epx.EpxError, match="replaced"):
        buffer.combine(handles[0][1], handles[0][0])
    buffer.destroy()


def test_capacity_follows_num_nvl_bytes(group):
    """The epx buffer holds as many tokens per rank as fit in num_nvl_bytes."""
    case = make_case(group)
    def size(tokens):
        return epx.Buffer.buffer_size(group, tokens, case.hidden, case.num_experts,
                                      case.num_topk)

    buffer = make_buffer(group, num_nvl_bytes=size(40))
    tokens = buffer._tokens_for(case.hidden, case.num_experts, case.num_topk)
    assert tokens >= 40 and size(tokens) <= size(40) < size(tokens + 1)
    with pytest.raises(epx.EpxError, match="too small"):
        make_buffer(group, num_nvl_bytes=1000)._tokens_for(case.hidden, case.num_experts,
                                                           case.num_topk)
    buffer.destroy()


def test_without_num_nvl_bytes(group):
    case = make_case(group)
    x, _, idx, w = case.inputs(group.rank)
    buffer = make_buffer(group, num_nvl_bytes=0)
    with pytest.raises(epx.EpxError, match="num_nvl_bytes"):
        buffer.dispatch(x, num_tokens_per_expert=np.zeros(case.num_experts, np.int32),
                        topk_idx=idx, topk_weights=w)
    buffer.destroy()


# ---------------------------------------------------------------- low-latency mode


def test_shrink_buffer_made_early_then_another_shape(group, tensors1):
    """enable_shrink: the constructor makes the low-latency buffer for the hinted shape; a
    call of another shape makes a new one (collectively), and clean (collective in this
    mode: a dispatch of no tokens) works after it. A hint of several shapes for the same
    bytes leaves the making to the first call, with a warning."""
    tensors = tensors1
    case = LowLatencyCase(group.world_size)
    m, world = case.max_tokens, group.world_size
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(m, case.hidden, world,
                                                          case.num_experts)
    buffer = make_buffer(group, num_nvl_bytes=0, num_rdma_bytes=hint, low_latency_mode=True,
                         enable_shrink=True)
    assert buffer._ll is not None
    x, idx, w = case.inputs(group.rank)
    wide = np.concatenate([x, x], axis=1)
    recv, count, handle, _, _ = buffer.low_latency_dispatch(
        tensors.put(wide), tensors.put(idx), m, case.num_experts, use_fp8=False)
    assert buffer._ll_shape == (m, 2 * case.hidden, case.num_experts, case.num_topk)
    buffer.clean_low_latency_buffer(m, 2 * case.hidden, case.num_experts)
    buffer.destroy()
    # The same bytes for (M, E) and (E, M): ambiguous, so made by the first call.
    a = deep_ep.Buffer.get_low_latency_rdma_size_hint(2, 256, world, 4 * world)
    b = deep_ep.Buffer.get_low_latency_rdma_size_hint(4 * world, 256, world, 2)
    assert a == b
    with pytest.warns(UserWarning, match="several shapes"):
        buffer = make_buffer(group, num_nvl_bytes=0, num_rdma_bytes=a, low_latency_mode=True,
                             enable_shrink=True)
    assert buffer._ll is None
    buffer.destroy()


def assert_waits_added(got, base):
    """wait_recv_cost_stats that started at `base`: every entry had a time >= 0 added
    (none written over), and the receives took some time."""
    assert got.dtype == np.int64 and np.all(got >= base) and np.any(got > base), got - base


@pytest.mark.parametrize("use_fp8", [False, True])
@pytest.mark.parametrize("return_recv_hook", [False, True])
@pytest.mark.parametrize("shrink", [False, True])
def test_low_latency(group, tensors1, use_fp8, return_recv_hook, shrink):
    """DeepEP's test_low_latency flow through deep_ep against epx.Buffer's own results.
    With enable_shrink (and the hint's bytes) the low-latency buffer is made by the
    constructor, for up to 11 experts a token (the calls' top-k padded with -1)."""
    tensors = tensors1
    case = LowLatencyCase(group.world_size)
    m = case.max_tokens
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(m, case.hidden, group.world_size,
                                                          case.num_experts)
    buffer = make_buffer(group, num_nvl_bytes=0, num_rdma_bytes=hint, low_latency_mode=True,
                         num_qps_per_rank=case.experts_per_rank, enable_shrink=shrink)
    assert (buffer._ll is not None) == shrink
    reference = epx.Buffer(group, low_latency_mode=True, num_max_dispatch_tokens_per_rank=m,
                           hidden=case.hidden, num_experts=case.num_experts,
                           num_topk=case.num_topk)
    x, idx, w = case.inputs(group.rank)
    stats = tensors.put(np.zeros(case.experts_per_rank, dtype=np.int32))
    # The wait times (ns) pass through to epx: they grow from 10 s (test_low_latency.py
    # checks their values).
    wait_base = 10 ** 10 + np.arange(group.world_size, dtype=np.int64)
    dispatch_waits = tensors.put(wait_base.copy())
    for _ in range(2):  # twice: the statistics accumulate
        recv, recv_count, handle, event, hook = buffer.low_latency_dispatch(
            tensors.put(x), tensors.put(idx), m, case.num_experts,
            cumulative_local_expert_recv_stats=stats,
            dispatch_wait_recv_cost_stats=dispatch_waits, use_fp8=use_fp8,
            async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
        hook() if return_recv_hook else event.current_stream_wait()
    assert_waits_added(tensors.get(dispatch_waits), wait_base)
    want, want_count, want_handle, _, _ = reference.low_latency_dispatch(
        tensors.put(x), tensors.put(idx), m, case.num_experts, use_fp8=use_fp8)
    np.testing.assert_array_equal(tensors.get(recv_count), tensors.get(want_count))
    np.testing.assert_array_equal(tensors.get(stats), 2 * tensors.get(want_count))
    for got_t, want_t in zip(handle[:2], want_handle[:2]):
        np.testing.assert_array_equal(tensors.get(got_t), tensors.get(want_t))
    assert tuple(handle[2:]) == (m, case.hidden, case.num_experts)
    counts = tensors.get(recv_count)
    if use_fp8:
        for got_t, want_t in zip(recv, want):
            got_np, want_np = tensors.get(got_t), tensors.get(want_t)
            for e in range(case.experts_per_rank):
                np.testing.assert_array_equal(got_np[e, :counts[e]].view(np.uint8),
                                              want_np[e, :counts[e]].view(np.uint8))
    else:
        got_np, want_np = tensors.get(recv), tensors.get(want)
        for e in range(case.experts_per_rank):
            np.testing.assert_array_equal(got_np[e, :counts[e]].view(np.uint16),
                                          want_np[e, :counts[e]].view(np.uint16))
    # Zero-copy combine of the expert outputs, as DeepEP's test does it.
    rows, _ = case.dispatch(group.rank)
    y = np.zeros((case.experts_per_rank, m * group.world_size, case.hidden), dtype=BF16)
    for e in range(case.experts_per_rank):
        for i, (s, t) in enumerate(rows[e]):
            y[e, i] = case.expert_output(group.rank, e, case.inputs(s)[0][t])
    zero_copy = buffer.get_next_low_latency_combine_buffer(handle)
    if tensors.name == "torch":
        zero_copy[:, :, :] = tensors.put(y)
    else:
        zero_copy[...] = y
    out = tensors.put(np.empty((x.shape[0], case.hidden), dtype=BF16))
    combine_waits = tensors.put(wait_base.copy())
    combined, event, hook = buffer.low_latency_combine(
        tensors.put(y), tensors.put(idx), tensors.put(w), handle, zero_copy=True,
        async_finish=not return_recv_hook, return_recv_hook=return_recv_hook, out=out,
        combine_wait_recv_cost_stats=combine_waits)
    hook() if return_recv_hook else event.current_stream_wait()
    want_x, _ = case.combine(group.rank)
    assert_bf16_equal(tensors.get(combined), want_x, group.backend)
    assert_waits_added(tensors.get(combine_waits), wait_base)
    # use_logfmt: the same exact bf16 combine, with a warning (once per process).
    import epx.deep_ep.low_latency as ll_methods
    ll_methods._LOGFMT_WARNED.clear()
    with pytest.warns(UserWarning, match="use_logfmt is accepted"):
        logfmt, _, _ = buffer.low_latency_combine(tensors.put(y), tensors.put(idx),
                                                  tensors.put(w), handle, use_logfmt=True)
    assert_bf16_equal(tensors.get(logfmt), want_x, group.backend)
    buffer.clean_low_latency_buffer(m, case.hidden, case.num_experts)
    mask = np.zeros(group.world_size, dtype=np.int32)
    buffer.low_latency_query_mask_buffer(mask)
    assert not mask.any()
    reference.destroy()
    buffer.destroy()
