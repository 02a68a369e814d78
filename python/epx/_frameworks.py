"""What the package needs from each array framework, behind one small interface.

The framework of a call is picked from the type of its first tensor argument (the root of
``type(x).__module__``): numpy, torch, cupy or jax. Outputs come back as that framework's
tensors, on the input's device; CUDA work goes on that framework's current stream.
Frameworks are imported only when a caller's tensor comes from them.
"""

import importlib

from . import _capi, _dlpack
from .errors import invalid_argument

# epx dtype -> (DLPack code, bits) for a tensor a framework can import natively, and the
# raw unsigned integer type of the same width for frameworks that cannot.
_NATIVE_CODE = {
    _capi.DTYPE_BF16: (_dlpack.BFLOAT, 16),
    _capi.DTYPE_FP8_E4M3: (_dlpack.FLOAT8_E4M3FN, 8),
    _capi.DTYPE_FP32: (_dlpack.FLOAT, 32),
    _capi.DTYPE_INT64: (_dlpack.INT, 64),
    _capi.DTYPE_INT32: (_dlpack.INT, 32),
    _capi.DTYPE_BOOL: (_dlpack.BOOL, 8),
}
_RAW_CODE = {_capi.DTYPE_BF16: (_dlpack.UINT, 16), _capi.DTYPE_FP8_E4M3: (_dlpack.UINT, 8)}


class Framework:
    """Base: the numpy behaviour, and the hooks each framework overrides."""

    name = "?"
    # epx dtypes this framework reads natively through DLPack (others come as raw bits
    # and are then viewed as the framework's own type, if it has one).
    native = frozenset([_capi.DTYPE_FP32, _capi.DTYPE_INT64, _capi.DTYPE_INT32,
                        _capi.DTYPE_BOOL])

    def device_of(self, tensor):
        """(DLPack device type, id) of a tensor of this framework."""
        return tuple(tensor.__dlpack_device__())

    def current_stream(self, device):
        """The CUDA stream (int) to run on for `device`, None for the CPU."""
        return None

    def record_event(self, device):
        """An event recorded on the current stream of `device` (None on the CPU)."""
        return None

    def wait_event(self, event):
        """Make the current stream wait for `event`."""

    def from_view(self, view, dtype, raw):
        """A tensor of this framework over `view` (a _dlpack.DLPackView), zero-copy."""
        raise NotImplementedError

    def empty(self, shape, dtype, raw, device, like):
        raise NotImplementedError

    def copy(self, tensor):
        raise NotImplementedError

    def finish(self, tensor):
        """An output allocated by empty(), after epx wrote it, as the caller gets it."""
        return tensor

    def keep_alive(self, tensor):
        """Something to hold so that `tensor`'s memory stays valid until an event fires."""
        return tensor

    # Helpers for subclasses.
    def export_code(self, dtype, raw):
        if raw or dtype not in self.native:
            return _RAW_CODE.get(dtype, _NATIVE_CODE[dtype])
        return _NATIVE_CODE[dtype]


def _view_with(view, code_bits):
    return _dlpack.DLPackView(view.data, view.shape, view.strides, code_bits[0], code_bits[1],
                              view.device, view.owner)


class NumpyFramework(Framework):
    name = "numpy"

    def __init__(self):
        self.np = importlib.import_module("numpy")
        try:
            self.ml_dtypes = importlib.import_module("ml_dtypes")
        except ImportError:
            self.ml_dtypes = None

    def device_of(self, tensor):
        return (_dlpack.CPU, 0)

    def numpy_dtype(self, dtype, raw):
        np = self.np
        if dtype == _capi.DTYPE_BF16:
            if raw or self.ml_dtypes is None:
                return np.dtype(np.uint16)
            return np.dtype(self.ml_dtypes.bfloat16)
        if dtype == _capi.DTYPE_FP8_E4M3:
            if raw or self.ml_dtypes is None:
                return np.dtype(np.uint8)
            return np.dtype(self.ml_dtypes.float8_e4m3fn)
        return np.dtype({_capi.DTYPE_FP32: np.float32, _capi.DTYPE_INT64: np.int64,
                         _capi.DTYPE_INT32: np.int32, _capi.DTYPE_BOOL: np.bool_}[dtype])

    def from_view(self, view, dtype, raw):
        array = self.np.from_dlpack(_view_with(view, self.export_code(dtype, raw)))
        wanted = self.numpy_dtype(dtype, raw)
        return array if array.dtype == wanted else array.view(wanted)

    def empty(self, shape, dtype, raw, device, like):
        return self.np.empty(shape, dtype=self.numpy_dtype(dtype, raw))

    def copy(self, tensor):
        return tensor.copy()


class TorchFramework(Framework):
    name = "torch"
    native = Framework.native | {_capi.DTYPE_BF16}

    def __init__(self):
        self.torch = importlib.import_module("torch")
        self.fp8 = getattr(self.torch, "float8_e4m3fn", None)

    def torch_dtype(self, dtype, raw):
        t = self.torch
        if dtype == _capi.DTYPE_BF16:
            return t.uint16 if raw else t.bfloat16
        if dtype == _capi.DTYPE_FP8_E4M3:
            return t.uint8 if raw or self.fp8 is None else self.fp8
        return {_capi.DTYPE_FP32: t.float32, _capi.DTYPE_INT64: t.int64,
                _capi.DTYPE_INT32: t.int32, _capi.DTYPE_BOOL: t.bool}[dtype]

    def device_of(self, tensor):
        device = tensor.device
        if device.type == "cuda":
            return (_dlpack.CUDA, device.index if device.index is not None else
                    self.torch.cuda.current_device())
        if device.type == "cpu":
            return (_dlpack.CPU, 0)
        return tuple(tensor.__dlpack_device__())

    def _cuda(self, device):
        return self.torch.device("cuda", device[1])

    def current_stream(self, device):
        if device[0] != _dlpack.CUDA:
            return None
        return self.torch.cuda.current_stream(self._cuda(device)).cuda_stream

    def record_event(self, device):
        if device[0] != _dlpack.CUDA:
            return None
        event = self.torch.cuda.Event()
        event.record(self.torch.cuda.current_stream(self._cuda(device)))
        return event

    def wait_event(self, event):
        event.wait(self.torch.cuda.current_stream())

    def from_view(self, view, dtype, raw):
        wanted = self.torch_dtype(dtype, raw)
        tensor = self.torch.utils.dlpack.from_dlpack(_view_with(view, self.export_code(dtype, raw)))
        return tensor if tensor.dtype == wanted else tensor.view(wanted)

    def empty(self, shape, dtype, raw, device, like):
        target = self._cuda(device) if device[0] == _dlpack.CUDA else self.torch.device("cpu")
        return self.torch.empty(shape, dtype=self.torch_dtype(dtype, raw), device=target)

    def copy(self, tensor):
        return tensor.clone()


class CupyFramework(Framework):
    """CuPy has no bfloat16 or float8 dtype: those come back as uint16/uint8 bits."""

    name = "cupy"

    def __init__(self):
        self.cupy = importlib.import_module("cupy")

    def current_stream(self, device):
        return self.cupy.cuda.get_current_stream().ptr

    def record_event(self, device):
        event = self.cupy.cuda.Event()
        event.record(self.cupy.cuda.get_current_stream())
        return event

    def wait_event(self, event):
        self.cupy.cuda.get_current_stream().wait_event(event)

    def cupy_dtype(self, dtype):
        c = self.cupy
        return {_capi.DTYPE_BF16: c.uint16, _capi.DTYPE_FP8_E4M3: c.uint8,
                _capi.DTYPE_FP32: c.float32, _capi.DTYPE_INT64: c.int64,
                _capi.DTYPE_INT32: c.int32, _capi.DTYPE_BOOL: c.bool_}[dtype]

    def from_view(self, view, dtype, raw):
        return self.cupy.from_dlpack(_view_with(view, self.export_code(dtype, True)))

    def empty(self, shape, dtype, raw, device, like):
        with self.cupy.cuda.Device(device[1]):
            return self.cupy.empty(shape, dtype=self.cupy_dtype(dtype))

    def copy(self, tensor):
        return tensor.copy()


class JaxFramework(Framework):
    """JAX arrays are immutable: outputs are built in NumPy and handed over (CPU only)."""

    name = "jax"

    def __init__(self):
        self.jnp = importlib.import_module("jax.numpy")
        self.numpy = NumpyFramework()

    def device_of(self, tensor):
        return tuple(tensor.__dlpack_device__())

    def from_view(self, view, dtype, raw):
        # A copy, finished before this returns: a JAX array must never change under the
        # program's feet, and later operations rewrite the buffer memory. jnp.array(copy=
        # True) copies; block_until_ready() waits until it has read the buffer, for JAX
        # versions that copy host memory asynchronously (0.10 copies within the call).
        host = self.numpy.from_view(view, dtype, raw)
        array = self.jnp.array(host, copy=True)
        if array.dtype != host.dtype:
            # Without jax_enable_x64, JAX silently narrows int64 to int32, which would
            # destroy values such as layout_range's (begin << 32 | count).
            raise invalid_argument(
                "an output of dtype %s (shape %s) cannot be a JAX array with "
                "jax_enable_x64 off: JAX would narrow it to %s and change its values; call "
                "jax.config.update(\"jax_enable_x64\", True) before using epx with JAX"
                % (host.dtype, list(host.shape), array.dtype))
        array.block_until_ready()
        return array

    def empty(self, shape, dtype, raw, device, like):
        return self.numpy.empty(shape, dtype, raw, device, like)

    def finish(self, array):
        return self.jnp.asarray(array)

    def copy(self, tensor):
        return tensor


_cache = {}
_CLASSES = {"numpy": NumpyFramework, "torch": TorchFramework, "cupy": CupyFramework,
            "jax": JaxFramework, "jaxlib": JaxFramework}


def of(tensor):
    """The Framework of a tensor, by the module its type comes from (numpy if unknown)."""
    root = type(tensor).__module__.split(".")[0]
    key = root if root in _CLASSES else "numpy"
    framework = _cache.get(key)
    if framework is None:
        framework = _cache[key] = _CLASSES[key]()
    return framework


def named(name):
    framework = _cache.get(name)
    if framework is None:
        framework = _cache[name] = _CLASSES[name]()
    return framework
