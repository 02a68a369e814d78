"""Rejoin in low-latency mode from Python (Buffer.rejoin, Buffer.create_rejoin; CPU
backend; docs/STABILITY.md "Rejoin").

    python3 -m pytest -q python/tests/test_rejoin.py        (one process; ctest python.rejoin)

- test_rejoin_refusals: groups of one rank: each bad argument raises its EpxError and
  leaves the buffer serving.
- test_rejoin_after_a_kill: this process plays the serving system. It starts WORLD worker
  processes (this file run as a script) that form a group from a unique id and run a
  checked step; it kills rank VICTIM (SIGKILL; rank 0, the old group's rendezvous hub),
  the survivors' next step loses it (the step completes without it, masked), a fully
  masked step follows, then a new process with the victim's rank number rejoins over a
  group made from a second unique id and every rank runs a step with all ranks in. Every
  step is checked against test_low_latency's NumPy model. Every wait has a timeout.

The CUDA backend's refusal (ERR_UNSUPPORTED) needs a GPU and is not tested here.
"""

import os
import queue
import subprocess
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import epx
except ImportError:  # a checkout used as is
    sys.path.insert(0, os.path.dirname(HERE))
    import epx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from epx import EpxError, Status  # noqa: E402
from test_low_latency import (LowLatencyCase, check_bf16_rows, check_combined,  # noqa: E402
                              check_layout, combine, dispatch, expert_outputs)

WORLD = 3
VICTIM = 0
GROUP_TIMEOUT_MS = 1500    # the first group's: a silent rank is masked after this
REJOIN_TIMEOUT_MS = 20000  # the rejoin group's: a newcomer may wait for the survivors
PHASE_TIMEOUT_S = 60       # the driver's wait for each phase of every worker


class Numpy:
    """The tensor kind of test_low_latency's helpers: NumPy arrays (CPU backend)."""

    name = "numpy"

    def put(self, array):
        return None if array is None else np.ascontiguousarray(array)

    def get(self, tensor):
        return None if tensor is None else np.asarray(tensor)


def buffer_kwargs(case):
    return dict(low_latency_mode=True, num_max_dispatch_tokens_per_rank=case.max_tokens,
                hidden=case.hidden, num_experts=case.num_experts, num_topk=case.num_topk)


def checked_step(buffer, case, rank, masked=(), lose=False):
    """One low-latency step checked against the model with `masked` left out. With
    lose=True a wait of the step must lose a peer (EpxError ERR_TIMEOUT / ERR_REMOTE,
    carrying the results of the step completed without it)."""
    tensors = Numpy()
    lost = []
    try:
        recv_x, recv_count, handle, _, _ = dispatch(buffer, tensors, case, rank)
    except EpxError as error:
        assert lose and error.status in (Status.ERR_TIMEOUT, Status.ERR_REMOTE), error
        lost.append(error)
        recv_x, recv_count, handle, _, _ = error.result
    rows = check_layout(tensors, case, rank, recv_count, handle, masked)
    check_bf16_rows(tensors, case, recv_x, rows)
    y = expert_outputs(case, rank, tensors.get(recv_x), tensors.get(recv_count))
    try:
        combined, _, _ = combine(buffer, tensors, case, rank, y, handle)
    except EpxError as error:
        assert lose and error.status in (Status.ERR_TIMEOUT, Status.ERR_REMOTE), error
        lost.append(error)
        combined = error.result[0]
    check_combined(tensors, case, rank, combined, masked)
    assert bool(lost) == lose, lost


# ---------------------------------------------------------------- arguments


def expect_error(status, call, *args, **kwargs):
    with pytest.raises(EpxError) as error:
        call(*args, **kwargs)
    assert error.value.status == status, error.value
    return error.value


def test_rejoin_refusals():
    case = LowLatencyCase(1, seed=5)
    first = epx.Group.create(0, 1, backend="host")
    second = epx.Group.create(0, 1, backend="host")
    buffer = epx.Buffer(first, **buffer_kwargs(case))
    normal_only = epx.Buffer(first, max_tokens_per_rank=case.max_tokens, hidden=case.hidden,
                             num_experts=case.num_experts, num_topk=case.num_topk)
    try:
        # Survivor side. The buffer's own group: refused at once, on this rank alone.
        error = expect_error(Status.ERR_INVALID_ARG, buffer.rejoin, first)
        assert "own group" in error.message
        expect_error(Status.ERR_INVALID_ARG, buffer.rejoin, None)
        expect_error(Status.ERR_INVALID_ARG, buffer.rejoin, "a group")
        error = expect_error(Status.ERR_INVALID_STATE, normal_only.rejoin, second)
        assert "low-latency" in error.message
        # An operation in flight.
        _, _, _, _, hook = dispatch(buffer, Numpy(), case, 0, return_recv_hook=True)
        error = expect_error(Status.ERR_INVALID_STATE, buffer.rejoin, second)
        assert "in flight" in error.message
        hook()
        # Nobody masked and nobody new.
        error = expect_error(Status.ERR_INVALID_STATE, buffer.rejoin, second)
        assert "nobody to take back" in error.message
        assert buffer.group is first and first._buffers and second.world_size == 1
        checked_step(buffer, case, 0)  # every refusal left the buffer as it was

        # Unmasking is only a rejoin.
        with pytest.raises(NotImplementedError, match="rejoin"):
            buffer.low_latency_update_mask_buffer(0, mask=False)

        # Newcomer side.
        with pytest.raises(EpxError, match="low_latency_mode") as error:
            epx.Buffer.create_rejoin(second, **dict(buffer_kwargs(case),
                                                    low_latency_mode=False))
        assert error.value.status == Status.ERR_INVALID_ARG
        expect_error(Status.ERR_INVALID_ARG, epx.Buffer.create_rejoin, second,
                     hidden=case.hidden)  # no MoE shape
        # Every rank of the group is new: there is no running buffer to join.
        error = expect_error(Status.ERR_INVALID_STATE, epx.Buffer.create_rejoin, second,
                             **buffer_kwargs(case))
        assert "no running buffer" in error.message
        assert not second._buffers  # nothing was made

        # A destroyed buffer, a destroyed group.
        normal_only.destroy()
        expect_error(Status.ERR_INVALID_STATE, normal_only.rejoin, second)
        second.destroy()
        expect_error(Status.ERR_INVALID_STATE, buffer.rejoin, second)
        expect_error(Status.ERR_INVALID_STATE, epx.Buffer.create_rejoin, second,
                     **buffer_kwargs(case))
        checked_step(buffer, case, 0)
    finally:
        buffer.destroy()
        normal_only.destroy()
        second.destroy()
        first.destroy()


# ---------------------------------------------------------------- a real rejoin


class Worker:
    """One worker process: commands go to its stdin, the phases it reached come from
    its stdout (read by a thread, so that every wait here has a timeout)."""

    def __init__(self, role, rank, ids):
        env = dict(os.environ, EPXTEST_REJOIN_WORKER="1")
        self.role, self.rank = role, rank
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), role, str(rank)] + list(ids),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env)
        self.lines = queue.Queue()
        self.stderr = []  # its lines, then None at the end
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put),
                         daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr.append),
                         daemon=True).start()

    @staticmethod
    def _read(stream, put):
        for line in stream:
            put(line.rstrip("\n"))
        put(None)

    def errors(self):
        return "\n".join(line for line in self.stderr if line is not None)

    def send(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def expect(self, phase):
        try:
            line = self.lines.get(timeout=PHASE_TIMEOUT_S)
        except queue.Empty:
            line = "(no line within %d s)" % PHASE_TIMEOUT_S
        if line != phase:
            self.proc.kill()
            self.proc.wait(timeout=PHASE_TIMEOUT_S)
            pytest.fail("%s rank %d: expected %r, got %r; exit %s; stderr:\n%s"
                        % (self.role, self.rank, phase, line, self.proc.returncode,
                           self.errors()))

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=PHASE_TIMEOUT_S)  # reaped: the survivors see it gone


def test_rejoin_after_a_kill():
    ids = [epx.get_unique_id(), epx.get_unique_id()]
    workers = [Worker("original", rank, ids) for rank in range(WORLD)]
    newcomer = None
    try:
        for phase in ("formed", "step all"):
            for worker in workers:
                worker.expect(phase)
        workers[VICTIM].kill()
        survivors = [w for w in workers if w.rank != VICTIM]
        for worker in survivors:
            worker.send("lose")
        for phase in ("step lost", "step masked"):
            for worker in survivors:
                worker.expect(phase)
        newcomer = Worker("newcomer", VICTIM, ids)
        for worker in survivors:
            worker.send("rejoin")
        everyone = survivors + [newcomer]
        for phase in ("rejoined", "step all", "done"):
            for worker in everyone:
                worker.expect(phase)
        for worker in everyone:
            assert worker.proc.wait(timeout=PHASE_TIMEOUT_S) == 0, worker.errors()
    finally:
        for worker in workers + ([newcomer] if newcomer else []):
            worker.kill()


def worker_main(role, rank, first_id, rejoin_id):
    """A worker of test_rejoin_after_a_kill (see the module's docstring)."""

    def say(phase):
        print(phase, flush=True)

    def command():
        return sys.stdin.readline().strip()  # the driver times the whole worker out

    case = LowLatencyCase(WORLD, seed=23)
    kwargs = buffer_kwargs(case)
    if role == "original":
        first = epx.Group.create(rank, WORLD, first_id, backend="host",
                                 timeout_ms=GROUP_TIMEOUT_MS)
        buffer = epx.Buffer(first, **kwargs)
        say("formed")
        checked_step(buffer, case, rank)
        say("step all")
        assert command() == "lose"  # the victim is killed before this
        checked_step(buffer, case, rank, masked=(VICTIM,), lose=True)
        assert buffer.get_masked_ranks() == [VICTIM]
        status, message = buffer.get_async_error()
        assert status in (Status.ERR_TIMEOUT, Status.ERR_REMOTE), (status, message)
        say("step lost")
        checked_step(buffer, case, rank, masked=(VICTIM,))
        say("step masked")
        assert command() == "rejoin"
        second = epx.Group.create(rank, WORLD, rejoin_id, backend="host",
                                  timeout_ms=REJOIN_TIMEOUT_MS)
        buffer.rejoin(second)
        assert buffer.group is second and buffer in second._buffers
        assert buffer not in first._buffers
        first.destroy()  # the buffer no longer uses it
        assert buffer.get_async_error()[0] == Status.SUCCESS
    else:
        second = epx.Group.create(rank, WORLD, rejoin_id, backend="host",
                                  timeout_ms=REJOIN_TIMEOUT_MS)
        buffer = epx.Buffer.create_rejoin(second, **kwargs)
        assert buffer.group is second and buffer.rank == rank
    assert buffer.get_masked_ranks() == []
    say("rejoined")
    checked_step(buffer, LowLatencyCase(WORLD, seed=29), rank)
    say("step all")
    buffer.destroy()  # collective over the new group
    second.destroy()
    say("done")


if __name__ == "__main__" and os.environ.get("EPXTEST_REJOIN_WORKER") == "1":
    worker_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
