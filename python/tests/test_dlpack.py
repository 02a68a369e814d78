"""DLPack in and out (single process): capsule parsing, exported views, their lifetime."""

import gc

import ml_dtypes
import numpy as np
import pytest

import epx
from epx import _capi, _dlpack, _frameworks, _tensor

try:
    import torch
except ImportError:
    torch = None


def view_over(array, code, bits):
    strides = [s // array.itemsize for s in array.strides]
    return _dlpack.DLPackView(array.ctypes.data, array.shape, strides, code, bits,
                              (_dlpack.CPU, 0), array)


def test_export_round_trip_to_numpy():
    base = _dlpack.live_exports()
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.from_dlpack(view_over(array, _dlpack.FLOAT, 32))
    np.testing.assert_array_equal(out, array)
    array[1, 2] = -1  # zero-copy: the consumer sees the producer's memory
    assert out[1, 2] == -1
    assert _dlpack.live_exports() == base + 1
    del out
    gc.collect()
    assert _dlpack.live_exports() == base


@pytest.mark.parametrize("versioned", [False, True])
def test_export_capsule_fields(versioned):
    base = _dlpack.live_exports()
    array = np.zeros((2, 8), dtype=np.int64)[:, :5]  # row stride 8
    view = view_over(array, _dlpack.INT, 64)
    capsule = view.__dlpack__(max_version=(1, 0) if versioned else None)
    parsed = _dlpack.parse_capsule(capsule)
    assert (parsed.data, parsed.shape, parsed.strides) == (array.ctypes.data, (2, 5), (8, 1))
    assert (parsed.code, parsed.bits, parsed.lanes) == (_dlpack.INT, 64, 1)
    assert (parsed.device_type, parsed.device_id) == (_dlpack.CPU, 0)
    # An unconsumed capsule frees its managed tensor when it goes away.
    del capsule, parsed
    gc.collect()
    assert _dlpack.live_exports() == base


def test_export_refuses_copy_and_other_devices():
    view = view_over(np.zeros(4, dtype=np.float32), _dlpack.FLOAT, 32)
    with pytest.raises(BufferError):
        view.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        view.__dlpack__(dl_device=(_dlpack.CUDA, 0))
    assert view.__dlpack_device__() == (_dlpack.CPU, 0)


def test_import_numpy_strided():
    array = np.zeros((4, 16), dtype=np.float32)[::2, 2:10]
    arg = _tensor.resolve(array, "t")
    assert arg.dtype == _capi.DTYPE_FP32
    assert arg.data == array.ctypes.data
    assert arg.shape == (2, 8) and arg.strides == (32, 1)
    t = arg.c_tensor()
    assert list(t.shape) == [2, 8, 0] and list(t.strides) == [32, 1, 0]


@pytest.mark.parametrize("dtype,expected", [(ml_dtypes.bfloat16, _capi.DTYPE_BF16),
                                            (ml_dtypes.float8_e4m3fn, _capi.DTYPE_FP8_E4M3),
                                            (np.int64, _capi.DTYPE_INT64),
                                            (np.int32, _capi.DTYPE_INT32),
                                            (np.bool_, _capi.DTYPE_BOOL),
                                            (np.float16, _capi.DTYPE_INVALID)])
def test_import_dtypes(dtype, expected):
    array = np.zeros((3, 4), dtype=dtype)
    arg = _tensor.resolve(array, "t")
    assert arg.dtype == expected
    assert arg.data == array.ctypes.data and arg.shape == (3, 4)


def test_raw_bits():
    bits = np.zeros((2, 8), dtype=np.uint16)
    assert _tensor.resolve(epx.raw_bits(bits), "x").dtype == _capi.DTYPE_BF16
    assert _tensor.resolve(epx.raw_bits(bits.view(np.uint8), "fp8"), "x").dtype == \
        _capi.DTYPE_FP8_E4M3
    with pytest.raises(epx.EpxError, match="16-bit integer"):
        _tensor.resolve(epx.raw_bits(bits.view(np.uint8)), "x")
    with pytest.raises(epx.EpxError, match="not one of"):
        epx.raw_bits(bits, "fp16")


def test_empty_tensor_gets_a_pointer():
    arg = _tensor.resolve(np.zeros((0, 8), dtype=np.int64), "t")
    assert arg.c_tensor().data  # NULL would read as "not given"


def test_numpy_framework_views():
    fw = _frameworks.named("numpy")
    bits = np.arange(8, dtype=np.uint16).reshape(2, 4)
    view = view_over(bits, _dlpack.UINT, 16)
    out = fw.from_view(view, _capi.DTYPE_BF16, raw=False)
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out.view(np.uint16), bits)
    assert fw.from_view(view, _capi.DTYPE_BF16, raw=True).dtype == np.uint16


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_torch_import_and_export():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:]
    arg = _tensor.resolve(t, "t")
    assert arg.data == t.data_ptr() and arg.shape == (3, 3) and arg.strides == (4, 1)
    fw = _frameworks.named("torch")
    bits = np.arange(8, dtype=np.uint16).reshape(2, 4)
    out = fw.from_view(view_over(bits, _dlpack.UINT, 16), _capi.DTYPE_BF16, raw=False)
    assert out.dtype == torch.bfloat16
    assert out.view(torch.int16).numpy().tolist() == bits.astype(np.int16).tolist()
    grad = torch.zeros(2, 4, dtype=torch.bfloat16, requires_grad=True)
    assert _tensor.resolve(grad, "g").dtype == _capi.DTYPE_BF16  # no __dlpack__ for these
