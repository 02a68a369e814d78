"""Every Buffer method on every rank, checked against the NumPy model (reference.py).

Run under `epx launch -n N -- python3 -m pytest -q python/tests/test_buffer.py`.
"""

import ctypes

import numpy as np
import pytest

import epx
from checks import assert_bf16_equal, assert_recv_x
from drained import async_error
from reference import BF16, Case


def check_dispatch(tensors, case, rank, out, expect_fp8=False):
    recv_x, recv_idx, recv_weights, counts, handle, event = out
    want = case.dispatch(rank)
    assert_recv_x(tensors, recv_x, want, expect_fp8)
    if recv_idx is not None:
        np.testing.assert_array_equal(tensors.get(recv_idx), want["recv_idx"])
    if recv_weights is not None:
        np.testing.assert_array_equal(tensors.get(recv_weights), want["recv_weights"])
    assert counts == want["counts"]
    assert isinstance(handle, epx.Handle)
    assert handle.num_recv_tokens == len(want["src"])
    assert handle.num_tokens == case.tokens_of(rank)
    assert handle.num_local_experts == case.experts_per_rank
    assert handle.num_recv_tokens_per_expert_list == counts
    assert isinstance(event, epx.EventOverlap)
    return want


def test_buffer_attributes(group, make_buffer):
    case = Case(group.world_size)
    buffer = make_buffer(case)
    assert buffer.rank == group.rank and buffer.group_size == group.world_size
    assert buffer.num_local_experts == case.experts_per_rank
    assert epx.Buffer.buffer_size(group, 24, 256, 8, 3) > 0
    assert "epx.Buffer" in repr(buffer)


def test_get_dispatch_layout(group, tensors, make_buffer):
    case = Case(group.world_size, seed=11)
    buffer = make_buffer(case)
    _, _, idx, _ = case.inputs(group.rank)
    per_rank, per_rdma_rank, per_expert, in_rank, event = buffer.get_dispatch_layout(
        tensors.put(idx), case.num_experts)
    want_rank, want_expert, want_in_rank = case.layout(group.rank)
    assert per_rdma_rank is None
    np.testing.assert_array_equal(tensors.get(per_rank), want_rank)
    np.testing.assert_array_equal(tensors.get(per_expert), want_expert)
    np.testing.assert_array_equal(tensors.get(in_rank), want_in_rank)
    assert tensors.get(in_rank).dtype == np.bool_
    event.current_stream_wait()


@pytest.mark.parametrize("alignment", [1, 4])
def test_dispatch_bf16(group, tensors, make_buffer, alignment):
    case = Case(group.world_size, seed=21, alignment=alignment)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(group.rank)
    layout = buffer.get_dispatch_layout(tensors.put(idx), case.num_experts)
    out = buffer.dispatch(tensors.put(x), num_tokens_per_rank=layout[0],
                          is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                          topk_idx=tensors.put(idx), topk_weights=tensors.put(w),
                          expert_alignment=alignment)
    check_dispatch(tensors, case, group.rank, out)
    assert tensors.get(out[0]).dtype == BF16


def test_dispatch_fp8(group, tensors, make_buffer):
    case = Case(group.world_size, seed=31, dtype="fp8")
    buffer = make_buffer(case)
    x, scales, idx, w = case.inputs(group.rank)
    out = buffer.dispatch((tensors.put(x), tensors.put(scales)), topk_idx=tensors.put(idx),
                          topk_weights=tensors.put(w))
    assert isinstance(out[0], tuple)
    check_dispatch(tensors, case, group.rank, out, expect_fp8=True)


def test_dispatch_without_weights(group, tensors, make_buffer):
    case = Case(group.world_size, seed=41)
    buffer = make_buffer(case)
    x, _, idx, _ = case.inputs(group.rank)
    out = buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx))
    assert out[2] is None
    check_dispatch(tensors, case, group.rank, out)


def test_dispatch_empty_rank(group, tensors, make_buffer):
    case = Case(group.world_size, seed=51, empty_rank=group.world_size - 1)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(group.rank)
    out = buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx), topk_weights=tensors.put(w))
    check_dispatch(tensors, case, group.rank, out)
    combined, _, _ = buffer.combine(out[0], out[4])
    assert tensors.get(combined).shape == (case.tokens_of(group.rank), case.hidden)


def test_combine(group, tensors, make_buffer):
    case = Case(group.world_size, seed=61)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(group.rank)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
        tensors.put(x), topk_idx=tensors.put(idx), topk_weights=tensors.put(w))
    want = case.dispatch(group.rank)
    rows = case.combine_input(group.rank, want["src"], lambda s: case.inputs(s)[0])
    weights = tensors.get(recv_w) * np.float32(group.rank + 1)
    combined, combined_w, event = buffer.combine(tensors.put(rows), handle,
                                                 topk_weights=tensors.put(weights))
    want_x, want_w = case.combine(group.rank, lambda s: case.inputs(s)[0])
    assert_bf16_equal(tensors.get(combined), want_x, group.backend)
    np.testing.assert_allclose(tensors.get(combined_w), want_w, rtol=1e-6, atol=1e-6)
    assert event.event is None


def test_combine_from_registered_tensor(group, tensors, make_buffer):
    """A registered tensor as combine's x: the same result; misuse named (collective)."""
    case = Case(group.world_size, seed=63)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(group.rank)
    _, _, _, _, handle, _ = buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx),
                                            topk_weights=tensors.put(w))
    want = case.dispatch(group.rank)
    rows = case.combine_input(group.rank, want["src"], lambda s: case.inputs(s)[0])
    # One spare row, so a rank that receives nothing still registers some memory.
    spare = np.zeros((rows.shape[0] + 1, case.hidden), dtype=rows.dtype)
    spare[: rows.shape[0]] = rows
    tensor = tensors.put(spare)
    buffer.register(tensor)
    with pytest.raises(epx.EpxError, match="overlaps"):
        buffer.register(tensor)
    combined, _, _ = buffer.combine(tensor[: rows.shape[0]], handle)
    want_x, _ = case.combine(group.rank, lambda s: case.inputs(s)[0])
    assert_bf16_equal(tensors.get(combined), want_x, group.backend)
    buffer.deregister(tensor)
    with pytest.raises(epx.EpxError, match="not the start of a range"):
        buffer.deregister(tensor)


def test_combine_auto_register(group, tensors, make_buffer):
    """auto_register=True: combine from tensors of its own, mapped on demand (the CUDA
    backend; the host backend copies): the same results, a fresh tensor each call."""
    case = Case(group.world_size, seed=64)
    buffer = make_buffer(case, auto_register=True)
    x, _, idx, w = case.inputs(group.rank)
    _, _, _, _, handle, _ = buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx),
                                            topk_weights=tensors.put(w))
    want = case.dispatch(group.rank)
    rows = case.combine_input(group.rank, want["src"], lambda s: case.inputs(s)[0])
    want_x, _ = case.combine(group.rank, lambda s: case.inputs(s)[0])
    kept = tensors.put(rows)
    for fresh in (True, False, True, False):
        combined, _, _ = buffer.combine(tensors.put(rows) if fresh else kept, handle)
        assert_bf16_equal(tensors.get(combined), want_x, group.backend)


def _address(tensor):
    """The address a tensor's data starts at, as the C library sees it."""
    return epx._tensor.resolve(tensor, "tensor").data


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_combine_input_view(group, tensors, make_buffer, monkeypatch, dtype):
    """Expert outputs written into get_combine_input's view, which combine reads in place."""
    case = Case(group.world_size, seed=62, dtype=dtype)
    buffer = make_buffer(case)
    x, scales, idx, w = case.inputs(group.rank)
    x_in = (tensors.put(x), tensors.put(scales)) if dtype == "fp8" else tensors.put(x)
    _, _, recv_w, _, handle, _ = buffer.dispatch(x_in, topk_idx=tensors.put(idx),
                                                 topk_weights=tensors.put(w))
    if tensors.name == "jax":
        with pytest.raises(epx.EpxError, match="JAX arrays are immutable"):
            buffer.get_combine_input(handle)
        return
    view = buffer.get_combine_input(handle)
    want = case.dispatch(group.rank)
    n = len(want["src"])
    assert tuple(view.shape) == (n, case.hidden)
    assert tensors.get(view).dtype == BF16
    # A view of the buffer's region, the same memory every time.
    api = epx._capi.api()
    region = epx._capi.Tensor()
    assert api.epx_get_combine_input(buffer.pointer, handle._ptr, ctypes.byref(region)) == 0
    assert _address(view) == region.data
    assert _address(buffer.get_combine_input(handle)) == region.data

    rows = case.combine_input(group.rank, want["src"], lambda s: case.inputs(s)[0])
    if tensors.name == "torch":
        view.copy_(tensors.put(rows))
    else:
        view[...] = rows
    # combine hands the view itself to the library: no copy on the Python side.
    passed = []
    combine = api.epx_combine

    def spy(buffer_pointer, args, stream):
        passed.append(args._obj.x.data)
        return combine(buffer_pointer, args, stream)

    monkeypatch.setattr(api, "epx_combine", spy)
    weights = tensors.get(recv_w) * np.float32(group.rank + 1)
    combined, combined_w, _ = buffer.combine(view, handle, topk_weights=tensors.put(weights))
    monkeypatch.undo()
    assert passed == [region.data]
    want_x, want_w = case.combine(group.rank, lambda s: case.inputs(s)[0])
    assert_bf16_equal(tensors.get(combined), want_x, group.backend)
    np.testing.assert_allclose(tensors.get(combined_w), want_w, rtol=1e-6, atol=1e-6)

    # Refused locally (the peers are not waiting): a destroyed handle, another buffer's.
    other = make_buffer(case)
    with pytest.raises(epx.EpxError, match="another buffer"):
        other.get_combine_input(handle)
    handle.destroy()
    with pytest.raises(epx.EpxError, match="destroyed"):
        buffer.get_combine_input(handle)


def test_combine_of_dispatch_is_sum_over_ranks(group, tensors, make_buffer):
    """combine(dispatch(x)) = x times the number of ranks each token went to."""
    case = Case(group.world_size, seed=71, num_topk=2)
    buffer = make_buffer(case)
    x, _, idx, _ = case.inputs(group.rank)
    recv_x, _, _, _, handle, _ = buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx))
    combined, weights, _ = buffer.combine(recv_x, handle)
    assert weights is None
    _, _, in_rank = case.layout(group.rank)
    want = (x.astype(np.float32) * in_rank.sum(axis=1, keepdims=True)).astype(BF16)
    assert_bf16_equal(tensors.get(combined), want, group.backend)


def test_cached_dispatch_reuses_handle(group, tensors, make_buffer):
    case = Case(group.world_size, seed=81)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(group.rank)
    first = buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx), topk_weights=tensors.put(w))
    handle = first[4]
    want = case.dispatch(group.rank)
    for step in range(3):
        # New token values, same routing: every rank sends x * (step + 2).
        x2 = (x.astype(np.float32) * (step + 2)).astype(BF16)
        recv_x, recv_idx, recv_w, counts, new_handle, event = buffer.dispatch(
            tensors.put(x2), handle=handle)
        assert recv_idx is None and recv_w is None and counts is None and new_handle is None
        expect = (want["recv_x"].astype(np.float32) * (step + 2)).astype(BF16)
        np.testing.assert_array_equal(tensors.get(recv_x).view(np.uint16), expect.view(np.uint16))
        # Combine through the same handle, every time.
        combined, _, _ = buffer.combine(recv_x, handle)
        _, _, in_rank = case.layout(group.rank)
        assert_bf16_equal(tensors.get(combined),
                          (x2.astype(np.float32) * in_rank.sum(axis=1, keepdims=True)).astype(BF16),
                          group.backend)


def test_views_and_copies(group, tensors, make_buffer):
    """Default outputs are views valid until the next operation; copy=True owns its data."""
    case = Case(group.world_size, seed=91)
    buffer = make_buffer(case)
    x, _, idx, _ = case.inputs(group.rank)
    view, _, _, _, handle, _ = buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx))
    owned, _, _, _, handle2, _ = buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx),
                                                 copy=True)
    saved = tensors.get(owned).copy()
    zeros = np.zeros_like(x)
    buffer.dispatch(tensors.put(zeros), handle=handle2)
    np.testing.assert_array_equal(tensors.get(owned).view(np.uint16), saved.view(np.uint16))
    if tensors.name != "jax" and len(saved) and np.any(saved.astype(np.float32) != 0):
        # The view now shows the last dispatch (zeros): it pointed into the buffer.
        assert np.all(tensors.get(view).astype(np.float32) == 0)
    handle.destroy()
    assert not handle.alive


def test_copy_outputs_default(group, tensors, make_buffer):
    case = Case(group.world_size, seed=92)
    buffer = make_buffer(case, copy_outputs=True)
    x, _, idx, _ = case.inputs(group.rank)
    recv, _, _, _, handle, _ = buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx))
    saved = tensors.get(recv).copy()
    buffer.dispatch(tensors.put(np.zeros_like(x)), handle=handle)
    np.testing.assert_array_equal(tensors.get(recv).view(np.uint16), saved.view(np.uint16))


def test_strided_input_rows(group, tensors, make_buffer):
    case = Case(group.world_size, seed=93)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(group.rank)
    wide = np.zeros((x.shape[0], case.hidden * 2), dtype=BF16)
    wide[:, :case.hidden] = x
    strided = tensors.put(wide)[:, :case.hidden]  # row stride 2 * hidden
    out = buffer.dispatch(strided, topk_idx=tensors.put(idx), topk_weights=tensors.put(w))
    check_dispatch(tensors, case, group.rank, out)


def test_events(group, tensors, make_buffer):
    case = Case(group.world_size, seed=94)
    buffer = make_buffer(case)
    x, _, idx, _ = case.inputs(group.rank)
    previous = epx.Buffer.capture()
    out = buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx), previous_event=previous,
                          async_finish=True)
    event = out[5]
    with event:
        pass
    event.current_stream_wait()
    assert event.extra_tensors is None
    check_dispatch(tensors, case, group.rank, out)
    combined, _, event = buffer.combine(out[0], out[4], async_finish=True)
    event.current_stream_wait()


def test_worst_case_mode(group, tensors, make_buffer):
    case = Case(group.world_size, seed=95)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(group.rank)
    out = buffer.dispatch(tensors.put(x), topk_idx=tensors.put(idx), topk_weights=tensors.put(w),
                          num_worst_tokens=case.num_tokens * group.world_size)
    want = case.dispatch(group.rank)
    n = len(want["src"])
    np.testing.assert_array_equal(tensors.get(out[0])[:n].view(np.uint16),
                                  want["recv_x"].view(np.uint16))
    np.testing.assert_array_equal(tensors.get(out[1])[:n], want["recv_idx"])


def test_raw_bits(group, make_buffer):
    """NumPy without a bf16 type: uint16 bit patterns in, uint16 bit patterns out."""
    if group.backend != "host":
        pytest.skip("NumPy arrays need the host backend")
    case = Case(group.world_size, seed=96)
    buffer = make_buffer(case)
    x, _, idx, w = case.inputs(group.rank)
    recv_x, _, _, _, handle, _ = buffer.dispatch(epx.raw_bits(x.view(np.uint16)), topk_idx=idx,
                                                 topk_weights=w)
    assert recv_x.dtype == np.uint16
    np.testing.assert_array_equal(recv_x, case.dispatch(group.rank)["recv_x"].view(np.uint16))
    combined, _, _ = buffer.combine(epx.raw_bits(recv_x), handle)
    assert combined.dtype == np.uint16
    # The combine-input view follows the dispatch: raw bits in, raw bits out.
    assert buffer.get_combine_input(handle).dtype == np.uint16


def test_buffer_from_env_owns_its_group(group):
    buffer = epx.Buffer(None, max_tokens_per_rank=8, hidden=128, num_experts=group.world_size * 2,
                        num_topk=2, backend=group.backend)
    assert buffer.group is not group and buffer.group.world_size == group.world_size
    inner = buffer.group
    buffer.destroy()
    with pytest.raises(epx.EpxError) as info:
        inner.barrier()
    assert info.value.status == epx.Status.ERR_INVALID_STATE


def test_collected_while_leaving_on_an_exception_aborts(group, tensors, monkeypatch, capfd):
    """A buffer collected while its process dies on an uncaught exception (sys.excepthook
    ran: epx/_exit.py) does not vote with its peers (they wait in their next operation,
    here a combine): it aborts, and the peers' combine ends with ERR_REMOTE naming it."""
    case = Case(group.world_size, seed=43)
    x, _, idx, w = case.inputs(group.rank)
    buffer = epx.Buffer(group, max_tokens_per_rank=max(case.num_tokens, 1), hidden=case.hidden,
                        num_experts=case.num_experts, num_topk=case.num_topk)
    recv_x, _, _, _, handle, _ = buffer.dispatch(
        tensors.put(x), topk_idx=tensors.put(idx), topk_weights=tensors.put(w))
    if group.rank == 0:
        import gc

        from epx import _exit
        monkeypatch.setattr(_exit, "_reason", "RuntimeError: simulated")
        del buffer, recv_x, handle
        gc.collect()
        return
    with pytest.raises(epx.EpxError) as caught:
        buffer.combine(recv_x, handle)
        if group.backend == "cuda":
            raise epx.EpxError(*async_error(buffer))
    assert caught.value.status == epx.Status.ERR_REMOTE, caught.value.message
    assert "rank 0" in caught.value.message, caught.value.message
    if group.backend == "host":  # the CUDA backend's abort word carries no text
        assert "uncaught exception" in caught.value.message, caught.value.message
    buffer.destroy()
