"""Buffer's low-latency methods on every rank, checked against a NumPy model of
docs/LOW_LATENCY.md ("Semantics"): rows per local expert ordered by source rank, then
token; the fp8 cast per 128 channels; the combine's weighted sum in fp32 in top-k order.

Run under `epx launch -n N -- python3 -m pytest -q python/tests/test_low_latency.py`.
Every test is collective: each rank runs the same calls and checks its own results.
On the CUDA backend the tensors are torch tensors on the GPU (python/tests/run_gpu.sh);
the masked-entry counts are -1 there (the GPU does not sync with the host to count them).
"""

import ctypes
import ctypes.util
import time

import numpy as np
import pytest

import epx
from epx import Status
from reference import BF16, FP8

F32 = np.float32


class LowLatencyCase:
    """Seeded inputs of every rank, and what each rank must receive and combine."""

    def __init__(self, world, max_tokens=8, hidden=512, experts_per_rank=3, num_topk=3, seed=1):
        self.world = world
        self.max_tokens = max_tokens
        self.hidden = hidden
        self.experts_per_rank = experts_per_rank
        self.num_experts = experts_per_rank * world
        self.num_topk = num_topk
        self.seed = seed

    def tokens_of(self, rank):
        return self.max_tokens - rank % 3  # ranks send different counts, never above M

    def inputs(self, rank):
        """x [T, hidden] bf16, topk_idx [T, k] int64, topk_weights [T, k] fp32 of `rank`."""
        rng = np.random.default_rng([self.seed, rank])
        n, k = self.tokens_of(rank), self.num_topk
        # Per-row magnitudes spread over decades, so the fp8 scales differ per group.
        magnitude = 10.0 ** rng.uniform(-3, 2, (n, 1))
        x = (rng.uniform(-1, 1, (n, self.hidden)) * magnitude).astype(F32).astype(BF16)
        idx = np.empty((n, k), dtype=np.int64)
        for t in range(n):
            idx[t] = rng.choice(self.num_experts, k, replace=self.num_experts < k)
        idx[rng.uniform(size=(n, k)) < 0.2] = -1
        if n and k >= 2 and idx[0, 0] >= 0:
            idx[0, 1] = idx[0, 0]  # an expert named twice: one row, two combine entries
        weights = rng.uniform(0.01, 1.0, (n, k)).astype(F32)
        return x, idx, weights

    def home(self, expert):
        return int(expert) // self.experts_per_rank

    def dispatch(self, rank, masked=()):
        """Per local expert: the list of (source rank, token); and layout_range [L, R]."""
        rows = [[] for _ in range(self.experts_per_rank)]
        layout = np.zeros((self.experts_per_rank, self.world), dtype=np.int64)
        for local in range(self.experts_per_rank):
            expert = rank * self.experts_per_rank + local
            for s in range(self.world):
                if s in masked:
                    continue
                _, idx, _ = self.inputs(s)
                begin = len(rows[local])
                rows[local] += [(s, t) for t in range(idx.shape[0]) if expert in set(idx[t])]
                layout[local, s] = (begin << 32) | (len(rows[local]) - begin)
        return rows, layout

    def expert_output(self, rank, local, row):
        """What expert `local` of `rank` returns for a received bf16 row (any shape)."""
        return (row.astype(F32) * F32(0.5 * (local + 1)) + F32(rank)).astype(BF16)

    def combine(self, rank, masked=()):
        """combined_x [T, hidden] bf16 and the count of top-k entries that added nothing
        because their expert's rank is masked."""
        x, idx, weights = self.inputs(rank)
        acc = np.zeros((x.shape[0], self.hidden), dtype=F32)
        skipped = 0
        for t in range(x.shape[0]):
            for j in range(self.num_topk):
                e = idx[t, j]
                if e < 0:
                    continue
                if self.home(e) in masked:
                    skipped += 1
                    continue
                y = self.expert_output(self.home(e), e % self.experts_per_rank, x[t])
                acc[t] = fma32(weights[t, j], y, acc[t])
        return acc.astype(BF16), skipped


def fma32(w, y, acc):
    """fmaf(w, y, acc) elementwise (one rounding), as the library's combine adds an entry:
    w fp32, y bf16, acc fp32. The product is exact in fp64 (24 + 8 significant bits); the
    fp64 sum s may be rounded, and its exact error e comes from TwoSum. Rounding s to
    fp32 then gives fmaf's result except where s lies exactly halfway between two fp32
    values and e is not zero: there the exact sum is on e's side, so s moves one fp64 step
    that way first (no other fp32 rounding boundary lies between s and the exact sum)."""
    p = np.float64(w) * y.astype(np.float64)
    a = np.asarray(acc, dtype=np.float64)
    s = a + p
    b = s - a
    e = (a - (s - b)) + (p - b)
    r = s.astype(F32)
    r64 = r.astype(np.float64)
    other = np.nextafter(r, np.where(s > r64, F32(np.inf), F32(-np.inf))).astype(np.float64)
    halfway = (s != r64) & (s == (r64 + other) / 2) & (e != 0)
    if np.any(halfway):
        s = np.where(halfway, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
        r = s.astype(F32)
    return r


def test_fma32_is_fmaf():
    """The model's fma32 against the C library's fmaf, bit for bit: random entries, and
    sums that fall exactly halfway between two fp32 values in fp64."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.fmaf.restype = ctypes.c_float
    libm.fmaf.argtypes = [ctypes.c_float] * 3
    rng = np.random.default_rng(7)
    w = rng.uniform(0.01, 1.0, 4000).astype(F32)
    y = (rng.uniform(-1, 1, 4000) * 10.0 ** rng.uniform(-6, 3, 4000)).astype(F32).astype(BF16)
    acc = (rng.uniform(-1, 1, 4000) * 10.0 ** rng.uniform(-6, 3, 4000)).astype(F32)
    # Ties in fp64 that fmaf resolves by the bits beyond: acc = 1, w * y just under 2^-24.
    w[:3] = [F32(10475530 * 2.0 ** -30), F32(0.5), F32(1.0)]
    y[:3] = np.array([205 * 2.0 ** -25, 2.0 ** -24 + 2.0 ** -32, -(2.0 ** -25)], F32).astype(BF16)
    acc[:3] = [F32(1.0), F32(1.0), F32(1.0)]
    got = fma32(w, y, acc)
    want = np.array([libm.fmaf(float(a), float(b), float(c))
                     for a, b, c in zip(w, y.astype(F32), acc)], F32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def cast_fp8(x, round_scale):
    """The library's cast (docs/LOW_LATENCY.md "fp8"): q fp8 [T, hidden], scales fp32
    [T, hidden / 128], exponents int [T, hidden / 128] (round_scale only)."""
    groups = x.astype(F32).reshape(x.shape[0], -1, 128)
    amax = np.maximum(np.abs(groups).max(axis=2), F32(1e-4)).astype(F32)
    if round_scale:
        fraction, exponent = np.frexp((amax / F32(448)).astype(F32))
        exponent = exponent - (fraction == 0.5)
        scales = np.ldexp(F32(1), exponent).astype(F32)
        multiplier = np.ldexp(F32(1), -exponent).astype(F32)
    else:
        exponent = None
        scales = (amax / F32(448)).astype(F32)
        multiplier = (F32(448) / amax).astype(F32)
    q = (groups * multiplier[:, :, None]).astype(F32).astype(FP8).reshape(x.shape)
    return q, scales, exponent


def assert_masked_count(group, got, want):
    """A count of masked entries: exact on the host backend; the CUDA backend may report
    -1 instead (it does not sync with the host to count)."""
    if group.backend == "cuda" and got == -1:
        return
    assert got == want


def dispatch(buffer, tensors, case, rank, **kwargs):
    x, idx, _ = case.inputs(rank)
    kwargs.setdefault("use_fp8", False)
    return buffer.low_latency_dispatch(tensors.put(x), tensors.put(idx), case.max_tokens,
                                       case.num_experts, **kwargs)


def check_layout(tensors, case, rank, recv_count, handle, masked=()):
    """Counts, source info and layout_range; returns the expected rows."""
    rows, layout = case.dispatch(rank, masked)
    counts = tensors.get(recv_count)
    assert counts.dtype == np.int32 and list(counts) == [len(r) for r in rows]
    src_info = tensors.get(handle.src_info)
    layout_range = tensors.get(handle.layout_range)
    assert src_info.shape == (case.experts_per_rank, case.max_tokens * case.world)
    for local, expected in enumerate(rows):
        assert list(src_info[local, :len(expected)]) == [t for _, t in expected]
        for s in range(case.world):
            if s not in masked:
                assert layout_range[local, s] == layout[local, s], (local, s)
    assert handle.num_tokens == case.tokens_of(rank)
    assert handle[2:] == (case.max_tokens, case.hidden, case.num_experts)
    return rows


def check_bf16_rows(tensors, case, recv_x, rows):
    got = tensors.get(recv_x)
    assert got.dtype == BF16
    assert got.shape == (case.experts_per_rank, case.max_tokens * case.world, case.hidden)
    for local, expected in enumerate(rows):
        want = np.array([case.inputs(s)[0][t] for s, t in expected], dtype=BF16)
        np.testing.assert_array_equal(got[local, :len(expected)].view(np.uint16),
                                      want.reshape(-1, case.hidden).view(np.uint16))


def expert_outputs(case, rank, recv_x, counts, into=None):
    """The expert outputs for every received row, [L, M * R, hidden] bf16."""
    out = np.zeros(recv_x.shape, dtype=BF16) if into is None else into
    for local in range(case.experts_per_rank):
        n = int(counts[local])
        out[local, :n] = case.expert_output(rank, local, recv_x[local, :n])
    return out


def combine(buffer, tensors, case, rank, y, handle, **kwargs):
    _, idx, weights = case.inputs(rank)
    return buffer.low_latency_combine(tensors.put(y) if y is not None else None, tensors.put(idx),
                                      tensors.put(weights), handle, **kwargs)


def check_combined(tensors, case, rank, combined, masked=()):
    want, _ = case.combine(rank, masked)
    np.testing.assert_array_equal(tensors.get(combined).view(np.uint16), want.view(np.uint16))


# ---------------------------------------------------------------- dispatch and combine


def test_bf16_dispatch_and_combine(group, tensors1, ll_buffer):
    case = LowLatencyCase(group.world_size, seed=3)
    buffer = ll_buffer(case)
    assert buffer.low_latency_mode and buffer.num_max_dispatch_tokens_per_rank == case.max_tokens
    recv_x, recv_count, handle, event, hook = dispatch(buffer, tensors1, case, group.rank)
    assert hook is None and isinstance(event, epx.EventOverlap)
    assert isinstance(handle, epx.LowLatencyHandle)
    assert_masked_count(group, handle.num_masked_entries, 0)
    rows = check_layout(tensors1, case, group.rank, recv_count, handle)
    check_bf16_rows(tensors1, case, recv_x, rows)

    y = expert_outputs(case, group.rank, tensors1.get(recv_x), tensors1.get(recv_count))
    combined, event, hook = combine(buffer, tensors1, case, group.rank, y, handle)
    assert hook is None
    check_combined(tensors1, case, group.rank, combined)
    assert_masked_count(group, buffer.last_combine_masked_entries, 0)

    # out= is written in place; the same step may be combined again.
    x, _, _ = case.inputs(group.rank)
    out = tensors1.put(np.zeros_like(x))
    combined, _, _ = combine(buffer, tensors1, case, group.rank, y, handle, out=out)
    assert combined is out
    check_combined(tensors1, case, group.rank, out)


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_fp8_dispatch(group, tensors1, ll_buffer, round_scale, use_ue8m0):
    case = LowLatencyCase(group.world_size, seed=5)
    buffer = ll_buffer(case)
    (recv_x, scales), recv_count, handle, _, _ = dispatch(
        buffer, tensors1, case, group.rank, use_fp8=True, round_scale=round_scale,
        use_ue8m0=use_ue8m0)
    rows = check_layout(tensors1, case, group.rank, recv_count, handle)
    got_x, got_scales = tensors1.get(recv_x), tensors1.get(scales)
    assert got_x.dtype == FP8
    groups = case.hidden // 128
    if use_ue8m0:
        assert got_scales.dtype == np.int32 and got_scales.shape[-1] == case.hidden // 512
        # Exponent byte of channel group g in byte g % 4 of word g / 4 (little-endian).
        exponent_bytes = got_scales.view(np.uint8).reshape(got_scales.shape[:2] + (groups,))
    else:
        assert got_scales.dtype == np.float32 and got_scales.shape[-1] == groups
    for local, expected in enumerate(rows):
        n = len(expected)
        if not n:
            continue
        x = np.array([case.inputs(s)[0][t] for s, t in expected], dtype=BF16)
        q, want_scales, exponent = cast_fp8(x, round_scale)
        got_q = got_x[local, :n]
        if use_ue8m0:
            np.testing.assert_array_equal(exponent_bytes[local, :n], exponent + 127)
            row_scales = np.ldexp(F32(1), exponent_bytes[local, :n].astype(np.int32) - 127)
        else:
            np.testing.assert_array_equal(got_scales[local, :n], want_scales)
            row_scales = got_scales[local, :n]
        # The dequantised values are x within e4m3's rounding: half a unit in the last of
        # 3 mantissa bits (2^-4 relative), or half the smallest subnormal (2^-10 * scale).
        dequantised = got_q.astype(F32).reshape(n, groups, 128) * row_scales[:, :, None]
        x32 = x.astype(F32).reshape(n, groups, 128)
        bound = np.abs(x32) * 2.0 ** -4 + row_scales[:, :, None] * 2.0 ** -10
        assert np.all(np.abs(dequantised - x32) <= bound)
        # And the bits are the cast of docs/LOW_LATENCY.md (round to nearest even).
        np.testing.assert_array_equal(got_q.view(np.uint8), q.view(np.uint8))


def test_recv_hook(group, tensors1, ll_buffer):
    case = LowLatencyCase(group.world_size, seed=7)
    buffer = ll_buffer(case)
    recv_x, recv_count, handle, _, hook = dispatch(buffer, tensors1, case, group.rank,
                                                   return_recv_hook=True)
    assert callable(hook)
    hook()  # the data is complete only now
    rows = check_layout(tensors1, case, group.rank, recv_count, handle)
    check_bf16_rows(tensors1, case, recv_x, rows)
    with pytest.raises(epx.EpxError) as error:
        hook()  # nothing pending any more
    assert error.value.status == Status.ERR_INVALID_STATE

    y = expert_outputs(case, group.rank, tensors1.get(recv_x), tensors1.get(recv_count))
    combined, _, hook = combine(buffer, tensors1, case, group.rank, y, handle,
                                return_recv_hook=True)
    hook()
    check_combined(tensors1, case, group.rank, combined)


def test_two_steps_alternate(group, tensors1, ll_buffer):
    """Step 2's dispatch is sent before step 1's combine: the slots alternate."""
    cases = [LowLatencyCase(group.world_size, seed=11), LowLatencyCase(group.world_size, seed=12)]
    buffer = ll_buffer(cases[0])
    for _ in range(2):  # twice round, so each slot is reused once
        steps = [dispatch(buffer, tensors1, case, group.rank, return_recv_hook=True)
                 for case in cases]
        assert steps[0][2]._value.internal[1] != steps[1][2]._value.internal[1]
        for step in steps:
            step[4]()
        outputs = []
        for case, (recv_x, recv_count, handle, _, _) in zip(cases, steps):
            rows = check_layout(tensors1, case, group.rank, recv_count, handle)
            check_bf16_rows(tensors1, case, recv_x, rows)
            y = expert_outputs(case, group.rank, tensors1.get(recv_x), tensors1.get(recv_count))
            outputs.append(combine(buffer, tensors1, case, group.rank, y, handle,
                                   return_recv_hook=True))
        for case, (combined, _, hook) in zip(cases, outputs):
            hook()
            check_combined(tensors1, case, group.rank, combined)


def test_zero_copy_combine(group, tensors1, ll_buffer):
    case = LowLatencyCase(group.world_size, seed=13)
    buffer = ll_buffer(case)
    recv_x, recv_count, handle, _, _ = dispatch(buffer, tensors1, case, group.rank)
    view = buffer.get_next_low_latency_combine_buffer(handle)
    got = tensors1.get(view)
    assert got.dtype == BF16 and got.shape == tensors1.get(recv_x).shape
    if tensors1.name == "numpy":
        expert_outputs(case, group.rank, recv_x, recv_count, into=view)
    elif tensors1.name == "torch":
        # Written in place on torch's current stream, which the library uses too.
        view.copy_(tensors1.put(expert_outputs(case, group.rank, tensors1.get(recv_x),
                                               tensors1.get(recv_count))))
    else:
        pytest.skip("%s arrays cannot be written in place" % tensors1.name)
    _, idx, weights = case.inputs(group.rank)
    combined, _, _ = buffer.low_latency_combine(view, tensors1.put(idx), tensors1.put(weights),
                                                handle, zero_copy=True)
    check_combined(tensors1, case, group.rank, combined)
    # zero_copy sends the buffer's memory whatever x is.
    combined, _, _ = combine(buffer, tensors1, case, group.rank, np.zeros((1, 1), BF16), handle,
                             zero_copy=True)
    check_combined(tensors1, case, group.rank, combined)


# ---------------------------------------------------------------- masks


def test_mask_rank(group, tensors1, ll_buffer):
    if group.world_size < 2:
        pytest.skip("masking needs a peer")
    case = LowLatencyCase(group.world_size, seed=17)
    buffer = ll_buffer(case)
    victim = group.world_size - 1
    masked = (victim,)
    assert buffer.get_masked_ranks() == []
    if group.rank == victim:
        # The masked rank sits the step out (as a failed peer would); it cannot mask itself.
        with pytest.raises(epx.EpxError) as error:
            buffer.mask_rank(victim)
        assert error.value.status == Status.ERR_INVALID_ARG
        return
    buffer.mask_rank(victim)
    assert buffer.get_masked_ranks() == [victim]
    status = np.full(group.world_size, 7, dtype=np.int32)
    buffer.low_latency_query_mask_buffer(status)
    assert list(status) == [int(r == victim) for r in range(group.world_size)]

    recv_x, recv_count, handle, _, _ = dispatch(buffer, tensors1, case, group.rank)
    _, idx, _ = case.inputs(group.rank)
    pairs = sum(len({int(e) for e in row if e >= 0 and case.home(e) == victim}) for row in idx)
    assert_masked_count(group, handle.num_masked_entries, pairs)
    rows = check_layout(tensors1, case, group.rank, recv_count, handle, masked)
    check_bf16_rows(tensors1, case, recv_x, rows)
    y = expert_outputs(case, group.rank, tensors1.get(recv_x), tensors1.get(recv_count))
    combined, _, _ = combine(buffer, tensors1, case, group.rank, y, handle)
    check_combined(tensors1, case, group.rank, combined, masked)
    assert_masked_count(group, buffer.last_combine_masked_entries,
                        case.combine(group.rank, masked)[1])
    # Split: the count is final once the receive hook ran.
    combined, _, hook = combine(buffer, tensors1, case, group.rank, y, handle,
                                return_recv_hook=True)
    hook()
    check_combined(tensors1, case, group.rank, combined, masked)
    assert_masked_count(group, buffer.last_combine_masked_entries,
                        case.combine(group.rank, masked)[1])
    assert buffer.get_masked_ranks() == [victim]  # no wait gave up on another rank


# ---------------------------------------------------------------- wait times

WAIT_BASE = 10 ** 10  # 10 s: the entries start here, so a receive that overwrote would show


def check_waits(what, before, after, late, rank):
    """One operation's wait_recv_cost_stats: each entry grew by a time >= 0; when rank
    `late` (or None) started 0.5 s late, every other rank added more than 0.3 s for it,
    and for every other rank at least 0.2 s less (each rank timed on its own)."""
    added = after.astype(np.int64) - before
    assert after.dtype == np.int64 and np.all(added >= 0), (what, before, after)
    if late is None or rank == late:
        return
    assert added[late] > 300_000_000, (what, added)
    others = np.delete(added, late)
    assert np.all(others <= added[late] - 200_000_000), (what, added)


@pytest.mark.parametrize("hooks", [False, True], ids=["blocking", "recv_hook"])
def test_wait_recv_cost_stats(group, tensors1, ll_buffer, hooks):
    """dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats ([num_ranks] int64):
    each receive adds, for each rank, the nanoseconds it waited for that rank's data, so
    the entries accumulate across calls, and a rank that starts 0.5 s late is the largest
    entry on every other rank. Step 0 is on time; the last rank sleeps before its dispatch
    of step 1 and before its combine of step 2. The last rank, because on the GPU a
    dispatch's send waits for the lower ranks' counts, which a receive hook does not time
    (docs/LOW_LATENCY.md). The results stay the model's."""
    case = LowLatencyCase(group.world_size, seed=31)
    buffer = ll_buffer(case)
    world, rank = group.world_size, group.rank
    late = world - 1 if world > 1 else None
    base = WAIT_BASE + np.arange(world, dtype=np.int64)
    dispatch_stats, combine_stats = tensors1.put(base.copy()), tensors1.put(base.copy())
    for step in range(3):
        group.barrier()  # on a loaded machine the ranks drift apart
        before = tensors1.get(dispatch_stats).copy()
        if step == 1 and rank == late:
            time.sleep(0.5)
        recv_x, recv_count, handle, _, hook = dispatch(
            buffer, tensors1, case, rank, dispatch_wait_recv_cost_stats=dispatch_stats,
            return_recv_hook=hooks)
        if hooks:
            hook()
        rows = check_layout(tensors1, case, rank, recv_count, handle)
        check_bf16_rows(tensors1, case, recv_x, rows)
        check_waits("dispatch %d" % step, before, tensors1.get(dispatch_stats),
                    late if step == 1 else None, rank)

        y = expert_outputs(case, rank, tensors1.get(recv_x), tensors1.get(recv_count))
        group.barrier()
        before = tensors1.get(combine_stats).copy()
        if step == 2 and rank == late:
            time.sleep(0.5)
        combined, _, hook = combine(buffer, tensors1, case, rank, y, handle,
                                    combine_wait_recv_cost_stats=combine_stats,
                                    return_recv_hook=hooks)
        if hooks:
            hook()
        check_combined(tensors1, case, rank, combined)
        check_waits("combine %d" % step, before, tensors1.get(combine_stats),
                    late if step == 2 else None, rank)


def test_wait_recv_cost_stats_refused(group, tensors1, ll_buffer):
    """A stats tensor of the wrong dtype or length is refused on every rank alike, naming
    it, before anything is sent: the buffer stays usable and the tensor untouched."""
    case = LowLatencyCase(group.world_size, seed=37)
    buffer = ll_buffer(case)
    world = group.world_size
    for name, wrong in (("int32", np.zeros(world, np.int32)),
                        ("length", np.zeros(world + 1, np.int64))):
        with pytest.raises(epx.EpxError) as error:
            dispatch(buffer, tensors1, case, group.rank,
                     dispatch_wait_recv_cost_stats=tensors1.put(wrong))
        assert error.value.status == Status.ERR_INVALID_ARG, name
        assert "wait_recv_cost_stats" in error.value.message, name
    recv_x, recv_count, handle, _, _ = dispatch(buffer, tensors1, case, group.rank)
    check_layout(tensors1, case, group.rank, recv_count, handle)
    y = expert_outputs(case, group.rank, tensors1.get(recv_x), tensors1.get(recv_count))
    with pytest.raises(epx.EpxError) as error:
        combine(buffer, tensors1, case, group.rank, y, handle,
                combine_wait_recv_cost_stats=tensors1.put(np.zeros(world, np.int32)))
    assert error.value.status == Status.ERR_INVALID_ARG
    assert "wait_recv_cost_stats" in error.value.message
    combined, _, _ = combine(buffer, tensors1, case, group.rank, y, handle)
    check_combined(tensors1, case, group.rank, combined)


# ---------------------------------------------------------------- misuse


def expect_state_error(call, *args, **kwargs):
    with pytest.raises(epx.EpxError) as error:
        call(*args, **kwargs)
    assert error.value.status == Status.ERR_INVALID_STATE, error.value
    return error.value


def test_misuse_is_invalid_state(group, tensors1, ll_buffer):
    case = LowLatencyCase(group.world_size, seed=19)
    buffer = ll_buffer(case)
    recv_x, recv_count, first, _, hook1 = dispatch(buffer, tensors1, case, group.rank,
                                                   return_recv_hook=True)
    y = np.zeros(tensors1.get(recv_x).shape, dtype=BF16)
    # A combine before its dispatch was received.
    expect_state_error(combine, buffer, tensors1, case, group.rank, y, first)
    _, _, second, _, hook2 = dispatch(buffer, tensors1, case, group.rank, return_recv_hook=True)
    # A third operation in flight, and cleaning with operations in flight.
    expect_state_error(dispatch, buffer, tensors1, case, group.rank)
    expect_state_error(buffer.clean_low_latency_buffer, case.max_tokens, case.hidden,
                       case.num_experts)
    hook1()
    hook2()
    # The refused calls had no effect: the first step still combines correctly.
    y = expert_outputs(case, group.rank, tensors1.get(recv_x), tensors1.get(recv_count))
    combined, _, _ = combine(buffer, tensors1, case, group.rank, y, first)
    check_combined(tensors1, case, group.rank, combined)
    # A third dispatch reuses the first slot: the first handle is stale.
    dispatch(buffer, tensors1, case, group.rank)
    expect_state_error(combine, buffer, tensors1, case, group.rank, y, first)
    expect_state_error(buffer.get_next_low_latency_combine_buffer, first)
    # Cleaning forgets every step.
    buffer.clean_low_latency_buffer()
    expect_state_error(combine, buffer, tensors1, case, group.rank, y, second)


def test_low_latency_needs_low_latency_mode(group, tensors1):
    case = LowLatencyCase(group.world_size)
    with epx.Buffer(group, max_tokens_per_rank=case.max_tokens, hidden=case.hidden,
                    num_experts=case.num_experts, num_topk=case.num_topk) as buffer:
        error = expect_state_error(dispatch, buffer, tensors1, case, group.rank)
        assert "max_low_latency_tokens" in error.message
    with pytest.raises(epx.EpxError) as error:
        epx.Buffer(group, low_latency_mode=True, hidden=case.hidden,
                   num_experts=case.num_experts, num_topk=case.num_topk)
    assert error.value.status == Status.ERR_INVALID_ARG


def test_argument_errors_are_local(group, tensors1, ll_buffer):
    """Python-side argument errors raise on every rank alike, before anything is sent."""
    case = LowLatencyCase(group.world_size, seed=23)
    buffer = ll_buffer(case)
    x, idx, _ = case.inputs(group.rank)
    with pytest.raises(epx.EpxError) as error:
        buffer.low_latency_dispatch(tensors1.put(x), tensors1.put(idx), case.max_tokens + 1,
                                    case.num_experts)
    assert error.value.status == Status.ERR_INVALID_ARG
    assert "num_max_dispatch_tokens_per_rank" in error.value.message
    with pytest.raises(epx.EpxError) as error:
        buffer.low_latency_combine(None, tensors1.put(idx), None, "not a handle")
    assert error.value.status == Status.ERR_INVALID_ARG
    with pytest.raises(NotImplementedError):
        buffer.low_latency_combine(None, idx, None, None, use_logfmt=True)
    # The buffer still works.
    recv_x, recv_count, handle, _, _ = dispatch(buffer, tensors1, case, group.rank)
    check_layout(tensors1, case, group.rank, recv_count, handle)


# ---------------------------------------------------------------- rows sized for fp8


def test_fp8_sized_buffer(group, tensors1, ll_buffer):
    """low_latency_dtype="fp8" sizes the rows for fp8: less memory, a bf16 dispatch is
    refused before anything is sent (every rank alike, the buffer stays usable), and an
    fp8 step gives the same bits and the same combine as on a bf16-sized buffer."""
    case = LowLatencyCase(group.world_size, seed=29)
    shape = dict(max_tokens_per_rank=case.max_tokens, hidden=case.hidden,
                 num_experts=case.num_experts, num_topk=case.num_topk,
                 num_max_dispatch_tokens_per_rank=case.max_tokens)
    bf16_bytes = epx.Buffer.buffer_size(group, **shape)
    fp8_bytes = epx.Buffer.buffer_size(group, low_latency_dtype="fp8", **shape)
    assert 0 < fp8_bytes < bf16_bytes
    assert epx.Buffer.buffer_size(group, low_latency_dtype="float8_e4m3fn", **shape) == fp8_bytes
    with pytest.raises(epx.EpxError) as error:
        epx.Buffer.buffer_size(group, low_latency_dtype="fp32", **shape)
    assert error.value.status == Status.ERR_INVALID_ARG
    assert "low_latency_dtype" in error.value.message

    buffer = ll_buffer(case, low_latency_dtype="fp8")
    assert buffer.low_latency_dtype == "fp8"
    with pytest.raises(epx.EpxError) as error:
        dispatch(buffer, tensors1, case, group.rank, use_fp8=False)
    assert error.value.status == Status.ERR_INVALID_ARG
    assert "low_latency_dtype" in error.value.message and "use_fp8" in error.value.message

    (recv_x, scales), recv_count, handle, _, _ = dispatch(buffer, tensors1, case, group.rank,
                                                          use_fp8=True)
    rows = check_layout(tensors1, case, group.rank, recv_count, handle)
    got_x, got_scales = tensors1.get(recv_x), tensors1.get(scales)
    assert got_x.dtype == FP8
    assert got_x.shape == (case.experts_per_rank, case.max_tokens * case.world, case.hidden)
    y = np.zeros(got_x.shape, dtype=BF16)
    for local, expected in enumerate(rows):
        if not expected:
            continue
        x = np.array([case.inputs(s)[0][t] for s, t in expected], dtype=BF16)
        q, want_scales, _ = cast_fp8(x, round_scale=False)
        n = len(expected)
        np.testing.assert_array_equal(got_x[local, :n].view(np.uint8), q.view(np.uint8))
        np.testing.assert_array_equal(got_scales[local, :n], want_scales)
        # The experts answer from the tokens they stand for, so the combine is the model's.
        y[local, :n] = case.expert_output(group.rank, local, x)
    combined, _, _ = combine(buffer, tensors1, case, group.rank, y, handle)
    check_combined(tensors1, case, group.rank, combined)
