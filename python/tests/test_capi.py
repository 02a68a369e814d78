"""The ctypes mirror (epx/_capi.py) matches include/epx.h.

Two independent checks: a C compiler reports sizeof and offsetof of every field of every
struct (skipped without a compiler), and the library itself accepts the `size` field of
every config and argument struct (a mismatch is EPX_ERR_INVALID_ARG).
"""

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

import epx
from epx import _capi

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compiler():
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def test_layout_matches_c_compiler(tmp_path):
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler to read epx.h's layout")
    lines = ["#include <stddef.h>", "#include <stdio.h>", "#include \"epx.h\"", "int main(void) {"]
    for c_name, struct in _capi.STRUCTS.items():
        lines.append('printf("%s size %%zu\\n", sizeof(%s));' % (c_name, c_name))
        for field, _ in struct._fields_:
            lines.append('printf("%s %s %%zu\\n", offsetof(%s, %s));'
                         % (c_name, field, c_name, field))
    lines += ["return 0; }"]
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines) + "\n")
    program = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", os.path.join(REPO, "include"), str(source), "-o",
                    str(program)], check=True)
    output = subprocess.run([str(program)], check=True, capture_output=True, text=True).stdout
    expected = {}
    for c_name, struct in _capi.STRUCTS.items():
        expected["%s size" % c_name] = ctypes.sizeof(struct)
        for field, _ in struct._fields_:
            expected["%s %s" % (c_name, field)] = getattr(struct, field).offset
    got = {}
    for line in output.splitlines():
        key, value = line.rsplit(" ", 1)
        got[key] = int(value)
    assert got == expected


def test_size_fields_accepted_by_the_library():
    """Each struct with a `size` field goes through a call that checks it."""
    api = _capi.api()
    group = epx.Group.create(0, 1, backend="host")  # epx_group_config_t
    config = _capi.new(_capi.BufferConfig)
    config.max_tokens_per_rank, config.hidden, config.num_experts, config.num_topk = 4, 128, 2, 1
    size = ctypes.c_size_t()
    assert api.epx_buffer_size(group.pointer, ctypes.byref(config), ctypes.byref(size)) == 0
    buffer = epx.Buffer(group, max_tokens_per_rank=4, hidden=128, num_experts=2, num_topk=1)
    x = np.zeros((4, 128), dtype=np.uint16)
    idx = np.zeros((4, 1), dtype=np.int64)
    # epx_layout_args_t, epx_dispatch_args_t, epx_dispatch_result_t, epx_combine_args_t:
    buffer.get_dispatch_layout(idx)
    recv, _, _, _, handle, _ = buffer.dispatch(epx.raw_bits(x), topk_idx=idx)
    buffer.combine(epx.raw_bits(recv), handle)
    # epx_ll_dispatch_args_t, epx_ll_dispatch_result_t, epx_ll_combine_args_t and
    # epx_ll_combine_result_t (epx_ll_handle_t travels inside them):
    ll = epx.Buffer(group, low_latency_mode=True, num_max_dispatch_tokens_per_rank=4,
                    hidden=128, num_experts=2, num_topk=1)
    recv, _, ll_handle, _, _ = ll.low_latency_dispatch(epx.raw_bits(x), idx, use_fp8=False)
    ll.low_latency_combine(epx.raw_bits(recv), idx, np.ones((4, 1), np.float32), ll_handle)
    ll.destroy()
    # And a wrong size is refused, so the checks above are real.
    bad = _capi.new(_capi.BufferConfig)
    bad.size += 8
    assert api.epx_buffer_size(group.pointer, ctypes.byref(bad), ctypes.byref(size)) == 1
    assert "config.size" in api.last_error()
    buffer.destroy()
    group.destroy()


def test_tensor_constructor_round_trip():
    api = _capi.api()
    t = api.epx_tensor_2d(1234, _capi.DTYPE_FP32, 5, 7)
    assert (t.data, t.dtype, t.ndim, list(t.shape), list(t.strides)) == \
        (1234, _capi.DTYPE_FP32, 2, [5, 7, 0], [0, 0, 0])
    for dtype, size in _capi.DTYPE_SIZES.items():
        assert api.epx_dtype_size(dtype) == size
        assert api.epx_dtype_name(dtype).decode() == _capi.DTYPE_NAMES[dtype]


def test_status_table_matches_library():
    api = _capi.api()
    for name, value in _capi.STATUS:
        assert api.epx_status_name(value).decode() == "EPX_" + name
    assert api.epx_status_name(len(_capi.STATUS)).decode() != "EPX_" + _capi.STATUS[-1][0]


def test_version():
    assert epx.library_version()[:2] == (_capi.VERSION_MAJOR, _capi.VERSION_MINOR)
    assert os.path.exists(epx.library_path()) or epx.library_path().startswith("libepx")
