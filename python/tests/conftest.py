"""Shared fixtures. Multi-rank test files run on every rank at once under `epx launch`;
every test there is collective, so skips and parameters must be the same on every rank."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
try:
    import epx  # the installed package, or the one PYTHONPATH names
except ImportError:
    sys.path.insert(0, os.path.join(REPO, "python"))  # a checkout used as is
    import epx  # noqa: E402
import numpy as np  # noqa: E402
from reference import BF16, FP8  # noqa: E402

try:
    import torch
except ImportError:
    torch = None

try:
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_enable_x64", True)  # int64 expert ids
except ImportError:
    jax = None

if torch is not None and torch.cuda.is_available():
    # One GPU per local rank, as epx.Group picks it (local rank modulo visible devices).
    torch.cuda.set_device(int(os.environ.get("EPX_LOCAL_RANK", "0") or 0) %
                          torch.cuda.device_count())


@pytest.fixture(scope="session")
def group():
    g = epx.Group.from_env(os.environ.get("EPXTEST_BACKEND", "auto"))
    yield g
    g.destroy()


class NumpyTensors:
    """Inputs as NumPy arrays (host backend)."""

    name = "numpy"

    def broadcast_rows(self, tensor, shape):
        return np.broadcast_to(tensor[:1], shape)

    def put(self, array):
        return None if array is None else np.ascontiguousarray(array)

    def get(self, tensor):
        return None if tensor is None else np.asarray(tensor)


class TorchTensors:
    """Inputs as torch tensors: on the GPU for the cuda backend, else on the CPU."""

    name = "torch"

    def __init__(self, device):
        self.device = device

    def broadcast_rows(self, tensor, shape):
        return tensor[:1].expand(*shape)

    def put(self, array):
        if array is None:
            return None
        if array.dtype == BF16:
            t = torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
        elif array.dtype == FP8:
            t = torch.from_numpy(np.ascontiguousarray(array).view(np.uint8)).view(
                torch.float8_e4m3fn)
        else:
            t = torch.from_numpy(np.ascontiguousarray(array))
        return t.to(self.device)

    def get(self, tensor):
        if tensor is None:
            return None
        t = tensor.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(BF16)
        if t.dtype == getattr(torch, "float8_e4m3fn", None):
            return t.view(torch.uint8).numpy().view(FP8)
        return t.numpy()


class JaxTensors:
    """Inputs as JAX arrays (CPU; outputs are copies, never views)."""

    name = "jax"

    def put(self, array):
        return None if array is None else jnp.asarray(np.ascontiguousarray(array))

    def get(self, tensor):
        return None if tensor is None else np.asarray(tensor)


def tensor_kinds(backend):
    kinds = []
    if backend == "host":
        kinds.append(NumpyTensors())
        if torch is not None:
            kinds.append(TorchTensors("cpu"))
        if jax is not None:
            kinds.append(JaxTensors())
    elif torch is not None:
        kinds.append(TorchTensors("cuda:%d" % torch.cuda.current_device()))
    return kinds


def _backend_for_params():
    # Decided without creating a group, identically on every rank.
    wanted = os.environ.get("EPXTEST_BACKEND", "auto")
    if wanted in ("host", "cuda"):
        return wanted
    if torch is not None and torch.cuda.is_available():
        return "cuda"
    return "host"


@pytest.fixture
def tensors1():
    """The first tensor kind of this backend (NumPy on the CPU, torch on the GPU)."""
    kinds = tensor_kinds(_backend_for_params())
    if not kinds:
        pytest.skip("no array framework for this backend (the GPU tests need torch)")
    return kinds[0]


@pytest.fixture
def numpy_or_torch_only(request):
    """Skips the test's JAX case (for APIs that take torch tensors and NumPy arrays)."""
    callspec = getattr(request.node, "callspec", None)
    kind = callspec.params.get("tensors") if callspec is not None else None
    if kind is not None and kind.name == "jax":
        pytest.skip("epx.deep_ep takes torch tensors and NumPy arrays, not JAX arrays")


def pytest_generate_tests(metafunc):
    if "tensors" in metafunc.fixturenames:
        kinds = tensor_kinds(_backend_for_params())
        metafunc.parametrize("tensors", kinds, ids=[k.name for k in kinds])


@pytest.fixture
def make_buffer(group):
    made = []

    def make(case, **kwargs):
        buffer = epx.Buffer(group, max_tokens_per_rank=max(case.num_tokens, 1),
                            hidden=case.hidden, num_experts=case.num_experts,
                            num_topk=case.num_topk, **kwargs)
        made.append(buffer)
        return buffer

    yield make
    for buffer in made:
        buffer.destroy()


@pytest.fixture
def ll_buffer(group):
    made = []

    def make(case, **kwargs):
        buffer = epx.Buffer(group, low_latency_mode=True,
                            num_max_dispatch_tokens_per_rank=case.max_tokens, hidden=case.hidden,
                            num_experts=case.num_experts, num_topk=case.num_topk, **kwargs)
        made.append(buffer)
        return buffer

    yield make
    for buffer in made:
        buffer.destroy()
