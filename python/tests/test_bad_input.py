"""Bad inputs raise epx.EpxError with a status and a message that names the culprit, on
the rank that made the mistake; the other ranks get EPX_ERR_REMOTE naming that rank
(never a hang). Each case uses a fresh buffer: a failed collective leaves its buffer
unusable, by design.

Run under `epx launch -n N -- python3 -m pytest -q python/tests/test_bad_input.py`.
"""

import numpy as np
import pytest

import epx
from epx import Status
from drained import async_error
from reference import Case


def expect_failure(group, call, bad_rank, status, *words, buffer=None):
    """`call` fails on every rank: as (status, words) on bad_rank, as REMOTE elsewhere.

    With `buffer` given, a peer may also see the failure asynchronously (the CUDA
    backend's combine does not wait on the host): then buffer.get_async_error() must
    report it once the stream has drained.
    """
    if buffer is not None and group.rank != bad_rank:
        try:
            call()
        except epx.EpxError as error:
            assert error.status == Status.ERR_REMOTE, str(error)
            assert "rank %d" % bad_rank in error.message, str(error)
            return error
        status_seen, message = async_error(buffer)
        assert status_seen == Status.ERR_REMOTE, (status_seen, message)
        assert "rank %d" % bad_rank in message, message
        return None
    with pytest.raises(epx.EpxError) as info:
        call()
    error = info.value
    assert isinstance(error.status, Status)
    assert error.message and error.status_name in str(error)
    if group.rank == bad_rank or bad_rank is None:
        assert error.status == status, str(error)
        for word in words:
            assert word in error.message, (word, str(error))
    else:
        assert error.status == Status.ERR_REMOTE, str(error)
        assert "rank %d" % bad_rank in error.message, str(error)
    return error


def last_rank(group):
    return group.world_size - 1


def test_expert_id_out_of_range(group, tensors1, make_buffer):
    T = tensors1
    case = Case(group.world_size)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(group.rank)
    bad = last_rank(group)
    if group.rank == bad:
        idx = idx.copy()
        idx[3, 1] = case.num_experts + 5
    x, idx, w = T.put(x), T.put(idx), T.put(w)
    error = expect_failure(group, lambda: buffer.dispatch(x, topk_idx=idx, topk_weights=w), bad,
                           Status.ERR_INVALID_ARG, "topk_idx[3][1]", str(case.num_experts + 5))
    # The buffer is unusable afterwards, on every rank, with the first error.
    with pytest.raises(epx.EpxError) as again:
        buffer.dispatch(x, topk_idx=idx, topk_weights=w)
    assert again.value.status == error.status
    status, message = buffer.get_async_error()
    assert status == error.status and message


def test_layout_rejects_bad_ids_locally(group, tensors1, make_buffer):
    T = tensors1
    case = Case(group.world_size)
    buffer = make_buffer(case)
    _, _, idx, _ = case.inputs(group.rank)
    if group.backend == "host":
        bad = idx.copy()
        bad[0, 0] = -7
        with pytest.raises(epx.EpxError) as info:
            buffer.get_dispatch_layout(T.put(bad), case.num_experts)
        assert info.value.status == Status.ERR_INVALID_ARG and "-7" in info.value.message
    with pytest.raises(epx.EpxError, match="num_experts is 3"):
        buffer.get_dispatch_layout(T.put(idx), 3)
    with pytest.raises(epx.EpxError, match="topk_idx has dtype int32"):
        buffer.get_dispatch_layout(T.put(idx.astype(np.int32)))
    # Layout is local: the buffer still works.
    got = buffer.get_dispatch_layout(T.put(idx), case.num_experts)[0]
    np.testing.assert_array_equal(T.get(got), case.layout(group.rank)[0])


@pytest.mark.parametrize("what", ["float32", "float16", "int32_idx", "hidden", "list", "4d",
                                  "broadcast", "raw_bits_float", "scales_without_fp8"])
def test_bad_tensor(group, tensors1, make_buffer, what):
    T = tensors1
    case = Case(group.world_size)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(group.rank)
    bad = last_rank(group)
    expected = {
        "float32": (Status.ERR_INVALID_ARG, "x has dtype fp32"),
        "float16": (Status.ERR_INVALID_ARG, "x has dtype float16"),
        "int32_idx": (Status.ERR_INVALID_ARG, "topk_idx has dtype int32, expected int64"),
        "hidden": (Status.ERR_INVALID_ARG, "x has shape [24, 128], expected [*, 256]"),
        "list": (Status.ERR_INVALID_ARG, "x: expected a tensor", "list"),
        "4d": (Status.ERR_INVALID_ARG, "x has 4 dimensions"),
        "broadcast": (Status.ERR_INVALID_ARG, "topk_weights", "broadcast"),
        "raw_bits_float": (Status.ERR_INVALID_ARG, "raw_bits(bf16) needs a 16-bit integer"),
        "scales_without_fp8": (Status.ERR_INVALID_ARG, "x_scales given but x is bf16"),
    }[what]
    scales = None
    if group.rank == bad:
        if what == "float32":
            x = x.astype(np.float32)
        elif what == "float16":
            x = x.astype(np.float16)
        elif what == "int32_idx":
            idx = idx.astype(np.int32)
        elif what == "hidden":
            x = np.ascontiguousarray(x[:, :128])
        elif what == "list":
            x = x.tolist()
        elif what == "4d":
            x = x.reshape(1, 1, *x.shape)
        elif what == "raw_bits_float":
            x = epx.raw_bits(x.astype(np.float32))
        elif what == "scales_without_fp8":
            scales = np.ones((x.shape[0], case.hidden // 128), dtype=np.float32)
    if isinstance(x, epx.RawBits):
        x = epx.raw_bits(T.put(x.array))
    elif not isinstance(x, list):
        x = T.put(x)
    idx, w = T.put(idx), T.put(w)
    if group.rank == bad and what == "broadcast":
        w = T.broadcast_rows(w, tuple(w.shape))
    xs = (x, T.put(scales)) if scales is not None else x
    expect_failure(group, lambda: buffer.dispatch(xs, topk_idx=idx, topk_weights=w), bad,
                   *expected)


def test_too_many_tokens(group, tensors1):
    T = tensors1
    case = Case(group.world_size)
    buffer = epx.Buffer(group, max_tokens_per_rank=case.num_tokens - 1, hidden=case.hidden,
                        num_experts=case.num_experts, num_topk=case.num_topk)
    try:
        x, _, idx, w = case.inputs(group.rank)
        bad = 0
        if group.rank != bad:
            x, idx, w = x[:4], idx[:4], w[:4]
        x, idx, w = T.put(x), T.put(idx), T.put(w)
        expect_failure(group, lambda: buffer.dispatch(x, topk_idx=idx, topk_weights=w), bad,
                       Status.ERR_CAPACITY, "24 tokens", "max_tokens_per_rank 23")
    finally:
        buffer.destroy()


@pytest.mark.parametrize("what", ["not_a_handle", "destroyed", "other_buffer", "rows", "dtype",
                                  "no_handle_no_idx"])
def test_bad_combine(group, tensors1, make_buffer, what):
    T = tensors1
    case = Case(group.world_size, seed=5)
    buffer = make_buffer(case)
    other = make_buffer(case)
    x, _, idx, w = (T.put(a) for a in case.inputs(group.rank))
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, copy=True)
    bad = last_rank(group)
    rows = recv_x
    expected = {
        "not_a_handle": (Status.ERR_INVALID_ARG, "handle must be an epx.Handle", "tuple"),
        "destroyed": (Status.ERR_INVALID_ARG, "handle was destroyed"),
        "other_buffer": (Status.ERR_INVALID_ARG, "handle was made by another buffer"),
        "rows": (Status.ERR_INVALID_ARG, "x has shape [%d, 256], expected [%d, 256]"
                 % (len(T.get(recv_x)) + 1, len(T.get(recv_x)))),
        "dtype": (Status.ERR_INVALID_ARG, "x has dtype fp32, expected bf16"),
        "no_handle_no_idx": (Status.ERR_INVALID_ARG, "topk_idx is required without a handle"),
    }[what]
    if what == "no_handle_no_idx":
        call = (lambda: buffer.dispatch(x)) if group.rank == bad else \
            (lambda: buffer.dispatch(x, topk_idx=idx))
        expect_failure(group, call, bad, *expected)
        return
    if group.rank == bad:
        if what == "not_a_handle":
            handle = (1, 2, 3)
        elif what == "destroyed":
            handle.destroy()
        elif what == "other_buffer":
            other_handle = other.dispatch(x, topk_idx=idx)[4]
        elif what == "rows":
            rows = T.put(np.concatenate([T.get(recv_x), T.get(recv_x)[:1]]))
        elif what == "dtype":
            rows = T.put(T.get(recv_x).astype(np.float32))
    elif what == "other_buffer":
        other.dispatch(x, topk_idx=idx)
    use = other_handle if (what == "other_buffer" and group.rank == bad) else handle
    expect_failure(group, lambda: buffer.combine(rows, use), bad, *expected,
                   buffer=buffer if group.backend == "cuda" else None)


def test_bad_buffer_config(group):
    with pytest.raises(epx.EpxError) as info:
        epx.Buffer(group, max_tokens_per_rank=8, hidden=100, num_experts=group.world_size * 2,
                   num_topk=2)
    assert info.value.status == Status.ERR_INVALID_ARG and "hidden" in info.value.message
    with pytest.raises(epx.EpxError) as info:
        epx.Buffer(group, max_tokens_per_rank=8, hidden=128)
    assert "num_experts" in info.value.message and "num_topk" in info.value.message
    if group.world_size > 1:
        # Every rank must pass the same shape; rank 0 alone differs.
        hidden = 256 if group.rank == 0 else 128
        with pytest.raises(epx.EpxError) as info:
            epx.Buffer(group, max_tokens_per_rank=8, hidden=hidden,
                       num_experts=group.world_size * 2, num_topk=2)
        assert info.value.status == Status.ERR_INVALID_ARG
        assert "differs" in info.value.message
    # The group is still usable after a refused buffer.
    group.barrier()


def test_error_class():
    error = epx.EpxError(1, "dispatch: x is required")
    assert error.status is Status.ERR_INVALID_ARG
    assert str(error) == "EPX_ERR_INVALID_ARG: dispatch: x is required"
    assert isinstance(error, RuntimeError)
    assert epx.EpxError(99, "?").status_name == "EPX_STATUS_99"


def test_buffer_abort(group, tensors1, make_buffer):
    """Buffer.abort (epx_buffer_abort): the peers' next operation fails naming this rank,
    and every later call on this rank's buffer raises the aborting status."""
    T = tensors1
    case = Case(group.world_size)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(group.rank)
    bad = last_rank(group)
    if group.rank == bad:
        buffer.abort(epx.EpxError(Status.ERR_INVALID_ARG, "the caller found x bad"))
    expect_failure(group, lambda: buffer.dispatch(T.put(x), topk_idx=T.put(idx),
                                                  topk_weights=T.put(w)),
                   bad, Status.ERR_INVALID_ARG, "the caller found x bad")


def test_buffer_abort_refuses_success(group, tensors1, make_buffer):
    """A status that is not an error is refused, and the buffer stays usable."""
    case = Case(group.world_size)
    buffer = make_buffer(case)
    with pytest.raises(epx.EpxError) as info:
        _capi_abort(buffer, int(Status.SUCCESS))
    assert info.value.status == Status.ERR_INVALID_ARG
    assert "not an error status" in info.value.message
    with pytest.raises(epx.EpxError) as info:
        _capi_abort(buffer, 999)
    assert info.value.status == Status.ERR_INVALID_ARG
    assert buffer.get_async_error()[0] == Status.SUCCESS


def _capi_abort(buffer, status):
    from epx import _capi
    from epx.errors import check
    check(_capi.api().epx_buffer_abort(buffer.pointer, status, b"x"), "buffer_abort")
