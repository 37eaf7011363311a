"""The trampoline (``realgpu/_torch_shim.cpp``) built without torch, over a host-backed core.

The shim needs only ``c10::Error``/``c10::OutOfMemoryError`` and the ``TORCH_CHECK`` macros from
torch; with a stand-in header for those it builds with the system's C++ compiler, so its calls
into ``TorchPath`` are checked here, where CI has no torch: the Python callables interpreted, the
compiled C entries by address in the compiled build (``tests/policies/test_compiled.py`` runs this
file against a compiled copy), whose free takes the pointer and size as C integers.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from realgpu.torch_allocator import _SHIM_SOURCE, host_allocator_core

_C10_STAND_IN = """
#pragma once
#include <stdexcept>
#include <string>
namespace c10 {
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
  const char* what_without_backtrace() const { return what(); }
};
struct OutOfMemoryError : Error { using Error::Error; };
}
#define TORCH_CHECK(cond, msg) do { if (!(cond)) throw c10::Error(msg); } while (0)
#define TORCH_CHECK_WITH(kind, cond, msg) do { if (!(cond)) throw c10::kind(msg); } while (0)
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    include = Path(sysconfig.get_paths()["include"])
    if compiler is None or not (include / "Python.h").is_file():
        pytest.skip("no C++ compiler or no Python headers to build the shim with")
    root = tmp_path_factory.mktemp("shim")
    (root / "c10" / "util").mkdir(parents=True)
    (root / "c10" / "util" / "Exception.h").write_text(_C10_STAND_IN)
    lib_path = root / "shim.so"
    subprocess.run(
        [compiler, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{root}", f"-I{include}"]
        + [str(_SHIM_SOURCE), "-o", str(lib_path)],
        check=True,
        capture_output=True,
    )
    lib = ctypes.PyDLL(str(lib_path))
    lib.poollab_set_callbacks.argtypes = [ctypes.py_object, ctypes.py_object, ctypes.c_int]
    lib.poollab_set_entries.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p]
    lib.poollab_probe_malloc.argtypes = [
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    lib.poollab_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    yield lib
    lib.poollab_set_callbacks(None, None, 0)


@pytest.mark.parametrize("spec", ["size-class", "best-fit"])
def test_the_trampoline_serves_a_policy_through_the_path(shim, spec):
    core = host_allocator_core(spec)
    shim.poollab_set_callbacks(core.malloc, core.free, 0)
    entries = core.path.entry_addresses()  # None interpreted: the callables are called
    if entries is not None:
        shim.poollab_set_entries(core.path, *entries)
    assert shim.poollab_uses_entries() == (entries is not None)
    message = ctypes.create_string_buffer(512)
    ptrs = []
    for size in (1000, 4096, 1 << 20, 3, 70_000, 1000):
        out = ctypes.c_void_p()
        code = shim.poollab_probe_malloc(size, None, ctypes.byref(out), message, 512)
        assert code == 0, message.value
        ptrs.append((out.value, size))
    assert len(core.live) == len(ptrs) and all(p in core.live for p, _ in ptrs)
    assert all(p % 512 == 0 for p, _ in ptrs)
    for ptr, size in ptrs:
        shim.poollab_free(ptr, size, 0, None)
    assert len(core.live) == 0 and core.errors == [] and core.policy.num_live == 0
    ptr, size = ptrs[0]
    shim.poollab_free(ptr, size, 0, None)  # a double free: kept in errors, nothing raised
    assert len(core.errors) == 1 and f"0x{ptr:x} ({size:,} B)" in str(core.errors[0])
    shim.poollab_set_callbacks(None, None, 0)


def test_thinned_samples_still_give_generates_breakdown(shim):
    # past the shim's capacity its samples are thinned (one call in ``stride``): the benchmark's
    # breakdown of generate's calls printed "?" for every figure on runs of 120+ rounds; kept
    # sample i is call i * stride, so a window of calls still has its samples
    import importlib.util
    from types import SimpleNamespace

    from realgpu.torch_allocator import Shim

    bench_path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_torch_alloc.py"
    spec = importlib.util.spec_from_file_location("bench_torch_alloc_thinned", bench_path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    reader = Shim(shim._name)
    core = host_allocator_core("size-class")
    reader.bind(core)
    reader.lib.poollab_set_sample_capacity.argtypes = [ctypes.c_size_t]
    reader.lib.poollab_set_sample_capacity(8)
    try:
        build = [reader.probe_malloc(1 << 20)[1] for _ in range(6)]  # "the model's build"
        marks = bench._CallMarks(SimpleNamespace(shim=reader, core=core, pool=core.pool))
        ptrs = [reader.probe_malloc(4096)[1] for _ in range(34)]
        for p in ptrs:
            reader.call_free(p, 4096)
        marks.stop()
        c = reader.counters()
        # 40 mallocs into 8 slots: the stride doubled to 8, calls 0, 8, ..., 32 kept
        assert c["n_calls_malloc"] == 40 and c["sample_stride_malloc"] == 8
        assert reader.samples(0).size == 5 and c["sample_stride_free"] == 8  # 34 frees: 5 kept
        window, stride = reader.calls_samples(0, 6, 40)
        assert stride == 8 and window.size == 4  # calls 8, 16, 24, 32
        b = marks.breakdown(SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: False)))
    finally:
        reader.lib.poollab_set_sample_capacity(1 << 21)
        reader.bind(None)
    assert b["gen_n_malloc"] == 34 and b["gen_n_free"] == 34 and b["gen_malloc_sample_stride"] == 8
    assert 0 < b["gen_malloc_p50_us"] <= b["gen_malloc_p99_us"] and b["gen_free_mean_us"] > 0
    line = bench.generate_breakdown_text(b)
    assert "malloc mean ?" not in line and "(34 calls, 1 in 8 timed;" in line
    for p in build:
        core.free(p, 1 << 20, 0, 0)
    core.close()
    assert core.errors == []


def test_samples_of_calls_refuses_a_reading_that_does_not_fit_its_stride():
    import numpy as np

    from realgpu.torch_allocator import samples_of_calls

    kept = np.arange(5, dtype=np.int64) * 100  # calls 0, 8, 16, 24, 32 of 40
    window, stride = samples_of_calls(kept, 8, 40, 6, 40)
    assert stride == 8 and window.tolist() == [100, 200, 300, 400]
    assert samples_of_calls(kept[:1], 1, 1, 0, 1)[0].tolist() == [0]
    for bad in ((kept, 8, 48), (kept, 3, 15), (kept, 0, 40)):
        with pytest.raises(ValueError, match="samples of .* calls at stride"):
            samples_of_calls(*bad, 0, 1)
