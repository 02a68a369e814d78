"""Groups: from the environment, from caller callbacks, from a torch process group.

Run under `epx launch -n N -- python3 -m pytest -q python/tests/test_group.py`.
"""

import hashlib
import os
import shutil
import tempfile
import time

import numpy as np
import pytest

import epx
from epx import Status
from reference import Case

try:
    import torch
    import torch.distributed as dist
except ImportError:
    torch = None


def shared_dir(tag):
    """A directory every rank of this launch agrees on (from the rendezvous id)."""
    key = os.environ.get("EPX_UNIQUE_ID", "single") + tag
    path = os.path.join(tempfile.gettempdir(),
                        "epx-test-" + hashlib.sha1(key.encode()).hexdigest()[:16])
    os.makedirs(path, exist_ok=True)
    return path


class FileAllgather:
    """An allgather through files, standing in for a framework's collective."""

    def __init__(self, rank, world_size, directory):
        self.rank, self.world_size, self.directory = rank, world_size, directory
        self.calls = 0

    def __call__(self, data):
        step = self.calls
        self.calls += 1
        mine = os.path.join(self.directory, "%d.%d" % (step, self.rank))
        with open(mine + ".tmp", "wb") as f:
            f.write(data)
        os.rename(mine + ".tmp", mine)
        parts = []
        deadline = time.time() + 60
        for r in range(self.world_size):
            path = os.path.join(self.directory, "%d.%d" % (step, r))
            while not os.path.exists(path):
                if time.time() > deadline:
                    raise TimeoutError("rank %d never wrote %s" % (r, path))
                time.sleep(0.001)
            with open(path, "rb") as f:
                parts.append(f.read())
        return b"".join(parts)


def test_group_from_env(group):
    assert group.rank == int(os.environ.get("EPX_RANK", "0"))
    assert group.world_size == int(os.environ.get("EPX_WORLD_SIZE", "1") or 1)
    assert group.size() == group.world_size
    assert group.backend in ("host", "cuda")
    assert epx.launched() == ("EPX_WORLD_SIZE" in os.environ)
    group.barrier()
    assert "epx.Group" in repr(group)


def test_group_allgather(group):
    """Group.allgather (epx_group_allgather): rank i's bytes at index i on every rank."""
    mine = bytes([group.rank % 256]) * 3 + b"epx"
    gathered = group.allgather(mine)
    assert gathered == [bytes([r % 256]) * 3 + b"epx" for r in range(group.world_size)]
    with pytest.raises(epx.EpxError) as info:  # refused before any rank waits
        group.allgather(b"")
    assert info.value.status == Status.ERR_INVALID_ARG
    assert "bytes is 0" in info.value.message


def test_group_from_callbacks_runs_a_dispatch(group):
    allgather = FileAllgather(group.rank, group.world_size, shared_dir("callbacks"))
    barrier_calls = []

    def barrier():
        barrier_calls.append(1)
        allgather(b"b")

    with epx.Group.from_callbacks(group.rank, group.world_size, allgather, barrier,
                                  backend=group.backend) as cgroup:
        assert (cgroup.rank, cgroup.world_size) == (group.rank, group.world_size)
        assert allgather.calls > 0
        cgroup.barrier()
        assert barrier_calls
        case = Case(group.world_size, seed=3)
        buffer = epx.Buffer(cgroup, max_tokens_per_rank=case.num_tokens, hidden=case.hidden,
                            num_experts=case.num_experts, num_topk=case.num_topk)
        if group.backend == "host":
            x, _, idx, w = case.inputs(group.rank)
            recv_x, _, _, _, _, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w)
            np.testing.assert_array_equal(recv_x.view(np.uint16),
                                          case.dispatch(group.rank)["recv_x"].view(np.uint16))
    assert buffer._ptr is None  # destroyed with its group
    with pytest.raises(epx.EpxError, match="used after destroy"):
        buffer.dispatch(np.zeros((1, case.hidden), dtype=np.uint16))
    group.barrier()
    if group.rank == 0:
        shutil.rmtree(allgather.directory, ignore_errors=True)


def test_callback_exception_becomes_bootstrap_error():
    class Broken(Exception):
        pass

    def allgather(data):
        raise Broken("no network today")

    with pytest.raises(epx.EpxError) as info:
        epx.Group.from_callbacks(0, 1, allgather, backend="host")
    assert info.value.status == Status.ERR_BOOTSTRAP
    assert "allgather callback" in info.value.message
    assert "(the callback raised Broken: no network today)" in info.value.message
    assert isinstance(info.value.__cause__, Broken)

    with pytest.raises(epx.EpxError) as info:
        epx.Group.from_callbacks(0, 1, lambda data: data * 2, backend="host")
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "returned" in str(info.value.__cause__)


def test_callback_exception_later_is_named():
    """A callback that fails after the group is made (a peer's process gone, say) is named
    in the error of the call it failed, not only in the group's creation."""
    class PeerGone(Exception):
        pass

    state = {"fail": None}

    def allgather(data):
        if state["fail"] is not None:
            raise state["fail"]
        return data

    with epx.Group.from_callbacks(0, 1, allgather, backend="host") as cgroup:
        state["fail"] = PeerGone("Connection closed by peer [10.0.0.2]:4711")
        with pytest.raises(epx.EpxError) as info:
            cgroup.barrier()
        assert info.value.status == Status.ERR_BOOTSTRAP
        assert info.value.message.endswith(
            "(the callback raised PeerGone: Connection closed by peer [10.0.0.2]:4711)")
        assert info.value.__cause__ is state["fail"]
        # The bootstrap stays failed (the ranks may be out of step), naming the cause.
        with pytest.raises(epx.EpxError, match="an earlier exchange failed"):
            cgroup.allgather(b"x")
    state["fail"] = None
    with epx.Group.from_callbacks(0, 1, allgather, backend="host") as cgroup:
        # Ctrl-C inside a callback stays a KeyboardInterrupt, not an EpxError.
        state["fail"] = KeyboardInterrupt()
        with pytest.raises(KeyboardInterrupt):
            cgroup.allgather(b"x")


def test_callback_failure_is_kept_for_one_call_only():
    """errors.check takes a callback's recorded exception at the next C call's answer,
    whatever it is, and names it only in an EPX_ERR_BOOTSTRAP error."""
    from epx import errors

    errors.note_callback_failure(RuntimeError("peer gone"))
    errors.check(0)  # the call ran the callback and still succeeded: the record goes
    with pytest.raises(epx.EpxError) as info:
        errors.check(int(Status.ERR_BOOTSTRAP), "bootstrap")
    assert "callback raised" not in info.value.message and info.value.__cause__ is None

    errors.note_callback_failure(RuntimeError("peer gone"))
    with pytest.raises(epx.EpxError) as info:
        errors.check(int(Status.ERR_INVALID_ARG), "allgather")
    assert "callback raised" not in info.value.message
    with pytest.raises(epx.EpxError) as info:  # taken by the call before
        errors.check(int(Status.ERR_BOOTSTRAP), "bootstrap")
    assert "callback raised" not in info.value.message

    errors.note_callback_failure(RuntimeError("peer gone"))
    with pytest.raises(epx.EpxError) as info:
        errors.check(int(Status.ERR_BOOTSTRAP), "bootstrap")
    assert info.value.message.endswith("(the callback raised RuntimeError: peer gone)")

    errors.note_callback_failure(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):  # even from a call that succeeded
        errors.check(0)
    errors.check(0)


def test_create_from_unique_id_of_one():
    uid = epx.get_unique_id()
    assert uid.startswith("epx")
    with epx.Group.create(0, 1, uid, backend="host") as single:
        assert single.world_size == 1
    with pytest.raises(epx.EpxError) as info:
        epx.Group.create(0, 2, None, backend="host")
    assert info.value.status == Status.ERR_INVALID_ARG and "unique_id" in info.value.message
    with pytest.raises(epx.EpxError, match="backend 'tpu'"):
        epx.Group.create(0, 1, backend="tpu")


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_group_from_torch_process_group(group):
    if not dist.is_initialized():
        path = os.path.join(shared_dir("torch"), "init")
        dist.init_process_group("gloo", init_method="file://" + path, rank=group.rank,
                                world_size=group.world_size)
    case = Case(group.world_size, seed=4)
    buffer = epx.Buffer(dist.group.WORLD, max_tokens_per_rank=case.num_tokens, hidden=case.hidden,
                        num_experts=case.num_experts, num_topk=case.num_topk,
                        backend=group.backend)
    assert buffer.group.process_group is dist.group.WORLD
    assert (buffer.rank, buffer.group_size) == (group.rank, group.world_size)
    device = "cuda" if buffer.backend == "cuda" else "cpu"
    x, _, idx, _ = case.inputs(group.rank)
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).to(device)
    recv_x = buffer.dispatch(xt, topk_idx=torch.from_numpy(idx).to(device))[0]
    assert isinstance(recv_x, torch.Tensor) and recv_x.dtype == torch.bfloat16
    np.testing.assert_array_equal(recv_x.cpu().view(torch.int16).numpy(),
                                  case.dispatch(group.rank)["recv_x"].view(np.int16))
    buffer.destroy()
