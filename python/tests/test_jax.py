"""JAX arrays in and out (CPU backend): every output is a jax.Array, equal to what the same
inputs give as NumPy arrays and to the models of reference.py and test_low_latency.py.

Run under `epx launch -n N -- python3 -m pytest -q python/tests/test_jax.py` with
`pip install "jax[cpu]"` (scripts/setup installs it into .venv, and CI runs these tests);
skipped when jax is not importable (ctest reports that as SKIP (optional) first).
Every test is collective: each rank runs the same calls and checks its own results.

JAX arrays are immutable, so the package returns JAX outputs as copies (docs/PYTHON.md,
"Tensors"), never as views into the buffer. The tests check that too: an output keeps
its values after later operations rewrite the memory it was copied from.
"""

import numpy as np
import pytest

import epx
from epx import Status
from reference import BF16, FP8, Case
from test_low_latency import LowLatencyCase, cast_fp8, check_layout

try:
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_enable_x64", True)  # int64 expert ids (conftest.py does it too)
except ImportError:
    jax = jnp = None

# Every test is collected and skipped, rather than the module: a run of this file alone
# then exits 0 (pytest exits 5 when it collects nothing, and `epx launch` reports that as
# a failed rank).
pytestmark = pytest.mark.skipif(jax is None,
                                reason="jax is not installed (pip install \"jax[cpu]\")")

F32 = np.float32


@pytest.fixture
def host_group(group):
    if group.backend != "host":
        pytest.skip("JAX arrays live in host memory; the %s backend takes device memory"
                    % group.backend)
    return group


class JaxArrays:
    """put/get for the checks shared with test_low_latency.py; get() insists on jax.Array."""

    name = "jax"

    def put(self, array):
        if array is None:
            return None
        out = jnp.asarray(np.ascontiguousarray(array))
        assert out.dtype == array.dtype, (out.dtype, array.dtype)
        return out

    def get(self, tensor):
        if tensor is None:
            return None
        assert isinstance(tensor, jax.Array), type(tensor)
        assert [d.platform for d in tensor.devices()] == ["cpu"]
        return np.asarray(tensor)


class NumpyArrays:
    name = "numpy"

    def put(self, array):
        return None if array is None else np.ascontiguousarray(array)

    def get(self, tensor):
        assert isinstance(tensor, np.ndarray), type(tensor)
        return tensor


J = JaxArrays()
N = NumpyArrays()


def bits(array):
    """Bit patterns, for exact comparison of bf16/fp8 (NaN-safe)."""
    return array.view(np.uint16 if array.dtype == BF16 else np.uint8)


# Buffers come from conftest's make_buffer / ll_buffer: every test here also asks for
# host_group, which skips off the host backend.


# ---------------------------------------------------------------- normal mode


def test_get_dispatch_layout(host_group, make_buffer):
    case = Case(host_group.world_size, seed=211)
    buffer = make_buffer(case)
    _, _, idx, _ = case.inputs(host_group.rank)
    got = buffer.get_dispatch_layout(J.put(idx), case.num_experts)
    ref = buffer.get_dispatch_layout(N.put(idx), case.num_experts)
    want = case.layout(host_group.rank)
    assert got[1] is None
    for jax_out, numpy_out, model, dtype in zip((got[0], got[2], got[3]),
                                                (ref[0], ref[2], ref[3]), want,
                                                (np.int32, np.int32, np.bool_)):
        out = J.get(jax_out)
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, N.get(numpy_out))
        np.testing.assert_array_equal(out, model)


def dispatch_both(buffer, case, rank):
    """The same dispatch with JAX then NumPy inputs; NumPy outputs copied (copy=True)."""
    x, scales, idx, w = case.inputs(rank)
    results = []
    for arrays in (J, N):
        x_in = (arrays.put(x), arrays.put(scales)) if scales is not None else arrays.put(x)
        results.append(buffer.dispatch(x_in, topk_idx=arrays.put(idx),
                                       topk_weights=arrays.put(w), copy=arrays is N))
    return results


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_dispatch_and_combine(host_group, make_buffer, dtype):
    rank = host_group.rank
    case = Case(host_group.world_size, seed=221, dtype=dtype)
    buffer = make_buffer(case)
    (jx, jidx, jw, jcounts, jhandle, _), (nx, nidx, nw, ncounts, nhandle, _) = \
        dispatch_both(buffer, case, rank)
    want = case.dispatch(rank)
    if dtype == "fp8":
        assert isinstance(jx, tuple)
        (jx, jscales), (nx, nscales) = jx, nx
        assert J.get(jscales).dtype == F32
        np.testing.assert_array_equal(J.get(jscales), N.get(nscales))
        np.testing.assert_array_equal(J.get(jscales), want["recv_scales"])
    got_x = J.get(jx)
    assert got_x.dtype == (FP8 if dtype == "fp8" else BF16)
    np.testing.assert_array_equal(bits(got_x), bits(N.get(nx)))
    np.testing.assert_array_equal(bits(got_x), bits(want["recv_x"]))
    assert J.get(jidx).dtype == np.int64 and J.get(jw).dtype == F32
    np.testing.assert_array_equal(J.get(jidx), N.get(nidx))
    np.testing.assert_array_equal(J.get(jidx), want["recv_idx"])
    np.testing.assert_array_equal(J.get(jw), N.get(nw))
    np.testing.assert_array_equal(J.get(jw), want["recv_weights"])
    assert jcounts == ncounts == want["counts"]
    assert jhandle.num_recv_tokens == nhandle.num_recv_tokens == len(want["src"])
    with pytest.raises(epx.EpxError, match="JAX arrays are immutable"):
        buffer.get_combine_input(jhandle)

    # Combine the same rows through either handle, as JAX and as NumPy arrays.
    rows = case.combine_input(rank, want["src"], lambda s: case.inputs(s)[0])
    weights = want["recv_weights"] * F32(rank + 1)
    jcombined, jcombined_w, _ = buffer.combine(J.put(rows), jhandle, topk_weights=J.put(weights))
    ncombined, ncombined_w, _ = buffer.combine(N.put(rows), nhandle, topk_weights=N.put(weights))
    want_x, want_w = case.combine(rank, lambda s: case.inputs(s)[0])
    got = J.get(jcombined)
    assert got.dtype == BF16 and got.shape == (case.tokens_of(rank), case.hidden)
    np.testing.assert_array_equal(bits(got), bits(N.get(ncombined)))
    np.testing.assert_array_equal(bits(got), bits(want_x))  # exact: host backend order
    np.testing.assert_array_equal(J.get(jcombined_w), N.get(ncombined_w))
    np.testing.assert_allclose(J.get(jcombined_w), want_w, rtol=1e-6, atol=1e-6)


def test_outputs_are_copies(host_group, make_buffer):
    """A NumPy output is a view that the next dispatch rewrites; a JAX output keeps its
    values (jax.Array is immutable)."""
    rank = host_group.rank
    case = Case(host_group.world_size, seed=231)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(rank)
    want = case.dispatch(rank)
    jx, jidx, jw, _, handle, _ = buffer.dispatch(J.put(x), topk_idx=J.put(idx),
                                                 topk_weights=J.put(w))
    nx, _, _, _, _, _ = buffer.dispatch(N.put(x), handle=handle)  # a view, same memory
    buffer.dispatch(N.put(np.zeros_like(x)), handle=handle)
    if len(want["src"]):
        assert not np.any(N.get(nx).astype(F32))  # the view shows the last dispatch
    np.testing.assert_array_equal(bits(J.get(jx)), bits(want["recv_x"]))
    np.testing.assert_array_equal(J.get(jidx), want["recv_idx"])
    np.testing.assert_array_equal(J.get(jw), want["recv_weights"])


def test_cached_dispatch(host_group, make_buffer):
    rank = host_group.rank
    case = Case(host_group.world_size, seed=241)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(rank)
    handle = buffer.dispatch(J.put(x), topk_idx=J.put(idx), topk_weights=J.put(w))[4]
    want = case.dispatch(rank)
    _, _, in_rank = case.layout(rank)
    x2 = (x.astype(F32) * 3).astype(BF16)
    recv_x, recv_idx, recv_w, counts, new_handle, _ = buffer.dispatch(J.put(x2), handle=handle)
    assert recv_idx is None and recv_w is None and counts is None and new_handle is None
    expect = (want["recv_x"].astype(F32) * 3).astype(BF16)
    np.testing.assert_array_equal(bits(J.get(recv_x)), bits(expect))
    combined, weights, _ = buffer.combine(recv_x, handle)  # a JAX output fed back in
    assert weights is None
    np.testing.assert_array_equal(
        bits(J.get(combined)),
        bits((x2.astype(F32) * in_rank.sum(axis=1, keepdims=True)).astype(BF16)))


def test_input_from_pending_computation(host_group, make_buffer):
    """x is the result of a jitted computation that may still be running when dispatch
    reads it: JAX's __dlpack__ must wait for it (JAX dispatches asynchronously)."""
    rank = host_group.rank
    case = Case(host_group.world_size, seed=251)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(rank)

    @jax.jit
    def slow_identity(x32, m):
        # Tens of milliseconds of matmuls that x depends on, adding exactly zero.
        def body(_, carry):
            v, m = carry
            m = jnp.tanh(m @ m)
            return v + jnp.sum(m) * 0.0, m
        v, _ = jax.lax.fori_loop(0, 16, body, (x32, m))
        return v.astype(jnp.bfloat16)

    m = jnp.full((384, 384), 1e-3, jnp.float32)
    x_jax = slow_identity(J.put(x.astype(F32)), m)  # returns before the result is ready
    recv_x, recv_idx, _, _, _, _ = buffer.dispatch(x_jax, topk_idx=J.put(idx),
                                                   topk_weights=J.put(w))
    want = case.dispatch(rank)
    np.testing.assert_array_equal(bits(J.get(recv_x)), bits(want["recv_x"]))
    np.testing.assert_array_equal(J.get(recv_idx), want["recv_idx"])


def test_int64_outputs_without_x64(host_group, make_buffer):
    """With jax_enable_x64 off, JAX would narrow int64 outputs to int32; epx refuses
    rather than return changed values. topk_idx stays a NumPy int64 array (JAX cannot
    make one then); the framework of the outputs is x's."""
    rank = host_group.rank
    case = Case(host_group.world_size, seed=261)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(rank)
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(epx.EpxError) as error:
            buffer.dispatch(J.put(x), topk_idx=idx, topk_weights=w)
    finally:
        jax.config.update("jax_enable_x64", True)
    assert error.value.status == Status.ERR_INVALID_ARG
    assert "jax_enable_x64" in error.value.message and "int64" in error.value.message
    # The dispatch itself completed on every rank: the buffer is still usable.
    out = buffer.dispatch(J.put(x), topk_idx=J.put(idx), topk_weights=J.put(w))
    np.testing.assert_array_equal(J.get(out[1]), case.dispatch(rank)["recv_idx"])


# ---------------------------------------------------------------- low-latency mode


def expert_outputs(case, rank, rows):
    """[L, M * R, hidden] bf16: the model's expert output for every received row, from the
    source token's bf16 x (so it does not depend on how dispatch sent the row)."""
    y = np.zeros((case.experts_per_rank, case.max_tokens * case.world, case.hidden), BF16)
    for local, expected in enumerate(rows):
        for i, (s, t) in enumerate(expected):
            y[local, i] = case.expert_output(rank, local, case.inputs(s)[0][t])
    return y


def ll_step(buffer, arrays, case, rank, **kwargs):
    x, idx, _ = case.inputs(rank)
    return buffer.low_latency_dispatch(arrays.put(x), arrays.put(idx), case.max_tokens,
                                       case.num_experts, **kwargs)


@pytest.mark.parametrize("use_fp8,round_scale,use_ue8m0",
                         [(False, False, False), (True, False, False), (True, True, True)],
                         ids=["bf16", "fp8", "fp8-ue8m0"])
def test_low_latency_dispatch_and_combine(host_group, ll_buffer, use_fp8, round_scale,
                                          use_ue8m0):
    rank = host_group.rank
    case = LowLatencyCase(host_group.world_size, seed=271)
    buffer = ll_buffer(case)
    flags = dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
    recv, recv_count, handle, _, hook = ll_step(buffer, J, case, rank, **flags)
    assert hook is None and isinstance(handle, epx.LowLatencyHandle)
    rows = check_layout(J, case, rank, recv_count, handle)  # counts, src_info, layout_range
    assert J.get(handle.src_info).dtype == np.int32
    assert J.get(handle.layout_range).dtype == np.int64
    recv_x, scales = recv if use_fp8 else (recv, None)
    got_x = J.get(recv_x)
    assert got_x.dtype == (FP8 if use_fp8 else BF16)
    assert got_x.shape == (case.experts_per_rank, case.max_tokens * case.world, case.hidden)
    got_scales = J.get(scales) if use_fp8 else None
    if use_fp8:
        assert got_scales.dtype == (np.int32 if use_ue8m0 else F32)
    for local, expected in enumerate(rows):
        n = len(expected)
        x = np.array([case.inputs(s)[0][t] for s, t in expected], BF16).reshape(n, case.hidden)
        if not use_fp8:
            np.testing.assert_array_equal(bits(got_x[local, :n]), bits(x))
            continue
        q, want_scales, exponent = cast_fp8(x, round_scale)
        np.testing.assert_array_equal(bits(got_x[local, :n]), bits(q))
        if use_ue8m0:
            exponent_bytes = got_scales[local, :n].view(np.uint8)
            np.testing.assert_array_equal(exponent_bytes, exponent + 127)
        else:
            np.testing.assert_array_equal(got_scales[local, :n], want_scales)

    # The same step with NumPy inputs gives the same bits (views, compared right away).
    n_recv, n_count, n_handle, _, _ = ll_step(buffer, N, case, rank, **flags)
    n_x, n_scales = n_recv if use_fp8 else (n_recv, None)
    for local, expected in enumerate(rows):
        n = len(expected)
        np.testing.assert_array_equal(bits(got_x[local, :n]), bits(n_x[local, :n]))
        if use_fp8:
            np.testing.assert_array_equal(got_scales[local, :n], n_scales[local, :n])
    np.testing.assert_array_equal(J.get(recv_count), n_count)
    np.testing.assert_array_equal(J.get(handle.layout_range), n_handle.layout_range)

    # Combine the JAX step with JAX expert outputs, ids and weights.
    _, idx, weights = case.inputs(rank)
    y = expert_outputs(case, rank, rows)
    with pytest.raises(epx.EpxError, match="JAX arrays are immutable"):
        buffer.get_next_low_latency_combine_buffer(handle)
    combined, _, hook = buffer.low_latency_combine(J.put(y), J.put(idx), J.put(weights), handle)
    assert hook is None
    want, _ = case.combine(rank)
    got = J.get(combined)
    assert got.dtype == BF16 and got.shape == (case.tokens_of(rank), case.hidden)
    np.testing.assert_array_equal(bits(got), bits(want))

    # Two more dispatches reuse both slots; the first step's JAX outputs are copies.
    other = LowLatencyCase(host_group.world_size, seed=272)
    for _ in range(2):
        ll_step(buffer, N, other, rank, **flags)
    for local, expected in enumerate(rows):
        n = len(expected)
        np.testing.assert_array_equal(bits(J.get(recv_x)[local, :n]), bits(got_x[local, :n]))
    np.testing.assert_array_equal(J.get(recv_count), [len(r) for r in rows])
    np.testing.assert_array_equal(bits(J.get(combined)), bits(want))


def test_low_latency_int64_without_x64(host_group, ll_buffer):
    """layout_range packs (begin << 32 | count) in int64: narrowed to int32 it would lose
    begin. With jax_enable_x64 off the dispatch raises instead."""
    rank = host_group.rank
    case = LowLatencyCase(host_group.world_size, seed=281)
    buffer = ll_buffer(case)
    x, idx, _ = case.inputs(rank)
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(epx.EpxError, match="jax_enable_x64") as error:
            buffer.low_latency_dispatch(J.put(x), idx, case.max_tokens, case.num_experts,
                                        use_fp8=False)
    finally:
        jax.config.update("jax_enable_x64", True)
    assert error.value.status == Status.ERR_INVALID_ARG
    recv_x, recv_count, handle, _, _ = ll_step(buffer, J, case, rank, use_fp8=False)
    check_layout(J, case, rank, recv_count, handle)


def hook_result_or_refusal(call):
    """Run a low-latency call with return_recv_hook=True and its hook. JAX outputs are
    copies made when the call returns, so the only correct behaviours are refusing the
    call with ERR_INVALID_ARG or outputs that are right after hook(). Returns the outputs,
    or None if refused."""
    try:
        out = call()
    except epx.EpxError as error:
        assert error.status == Status.ERR_INVALID_ARG, error
        assert "return_recv_hook" in error.message, error
        return None
    out[-1]()  # the hook
    return out


# JAX outputs are copies made when low_latency_dispatch/combine return, but with
# return_recv_hook=True the data only arrive in hook(): the package refuses the
# combination (EpxError, ERR_INVALID_ARG) rather than return stale arrays.
def test_low_latency_dispatch_hook(host_group, ll_buffer):
    rank = host_group.rank
    case = LowLatencyCase(host_group.world_size, seed=291)
    buffer = ll_buffer(case)
    out = hook_result_or_refusal(lambda: ll_step(buffer, J, case, rank, use_fp8=False,
                                                 return_recv_hook=True))
    if out is not None:
        recv_x, recv_count, handle, _, _ = out
        rows = check_layout(J, case, rank, recv_count, handle)
        for local, expected in enumerate(rows):
            want = np.array([case.inputs(s)[0][t] for s, t in expected], BF16)
            np.testing.assert_array_equal(bits(J.get(recv_x)[local, :len(expected)]),
                                          bits(want.reshape(-1, case.hidden)))


def test_low_latency_combine_hook(host_group, ll_buffer):
    rank = host_group.rank
    case = LowLatencyCase(host_group.world_size, seed=292)
    buffer = ll_buffer(case)
    _, recv_count, handle, _, _ = ll_step(buffer, J, case, rank, use_fp8=False)
    rows = check_layout(J, case, rank, recv_count, handle)
    _, idx, weights = case.inputs(rank)
    y = J.put(expert_outputs(case, rank, rows))
    out = hook_result_or_refusal(lambda: buffer.low_latency_combine(
        y, J.put(idx), J.put(weights), handle, return_recv_hook=True))
    if out is not None:
        np.testing.assert_array_equal(bits(J.get(out[0])), bits(case.combine(rank)[0]))


# low_latency_combine(..., out=a JAX array) would write into an immutable jax.Array
# (and any array sharing its memory): refused with EpxError naming out.
def test_low_latency_combine_out(host_group, ll_buffer):
    rank = host_group.rank
    case = LowLatencyCase(host_group.world_size, seed=293)
    buffer = ll_buffer(case)
    _, recv_count, handle, _, _ = ll_step(buffer, J, case, rank, use_fp8=False)
    rows = check_layout(J, case, rank, recv_count, handle)
    x, idx, weights = case.inputs(rank)
    out = jnp.zeros(x.shape, jnp.bfloat16)
    try:
        combined, _, _ = buffer.low_latency_combine(J.put(expert_outputs(case, rank, rows)),
                                                    J.put(idx), J.put(weights), handle, out=out)
    except epx.EpxError as error:
        assert error.status == Status.ERR_INVALID_ARG and "out" in error.message, error
        return
    assert not np.any(J.get(out).astype(F32)), "the caller's JAX array was written"
    np.testing.assert_array_equal(bits(J.get(combined)), bits(case.combine(rank)[0]))


# The wait-time stats are written by the receive, so a JAX array (immutable) is refused
# for them, on every rank alike before anything is sent; the buffer stays usable.
def test_low_latency_wait_stats_refused(host_group, ll_buffer):
    rank = host_group.rank
    case = LowLatencyCase(host_group.world_size, seed=297)
    buffer = ll_buffer(case)
    stats = jnp.zeros(host_group.world_size, jnp.int64)
    with pytest.raises(epx.EpxError, match="JAX arrays are immutable") as error:
        ll_step(buffer, J, case, rank, use_fp8=False, dispatch_wait_recv_cost_stats=stats)
    assert error.value.status == Status.ERR_INVALID_ARG
    assert "dispatch_wait_recv_cost_stats" in error.value.message
    _, recv_count, handle, _, _ = ll_step(buffer, J, case, rank, use_fp8=False)
    rows = check_layout(J, case, rank, recv_count, handle)
    _, idx, weights = case.inputs(rank)
    with pytest.raises(epx.EpxError, match="JAX arrays are immutable") as error:
        buffer.low_latency_combine(J.put(expert_outputs(case, rank, rows)), J.put(idx),
                                   J.put(weights), handle, combine_wait_recv_cost_stats=stats)
    assert "combine_wait_recv_cost_stats" in error.value.message
