"""Every registered kernel compiles with NVRTC for sm_90 and sm_120, with no GPU;
the disk cache answers the second time; cache keys and argument packing."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from sparkd.backend.cuda.compiler import (  # noqa: E402
    CompileError,
    all_kernel_specs,
    cache_key,
    compile_options,
    compile_specs,
    source_files,
    specs_by_source,
    toolkit_options,
)
from sparkd.backend.cuda.launch import dim3, pack_args  # noqa: E402
from sparkd.backend.cuda.tensor_map import TensorMap  # noqa: E402
from sparkd.backend.cuda.tensor import DeviceTensor  # noqa: E402
from sparkd.backend.dtypes import DType  # noqa: E402

ARCHS = ["sm_90", "sm_120"]
ELF_MAGIC = b"\x7fELF"


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(autouse=True)
def _cache_dir(kernel_cache, monkeypatch):
    monkeypatch.setenv("SPARKD_CACHE_DIR", str(kernel_cache))


def test_kernels_are_registered():
    specs = all_kernel_specs()
    assert specs, "no launcher module under sparkd/backend/cuda/kernels/ exposes SPECS"
    assert len(set(specs)) == len(specs)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_registered_kernel_compiles_and_then_comes_from_the_cache(arch):
    for source, names in specs_by_source(all_kernel_specs()).items():
        first = compile_specs(source, names, arch)
        assert first.cubin.startswith(ELF_MAGIC)
        assert sorted(first.lowered_names) == sorted(set(names))
        again = compile_specs(source, names, arch)
        assert again.from_cache and again.cubin == first.cubin and again.lowered_names == first.lowered_names


def test_kernels_build_cli_prints_one_line_per_kernel(capsys):
    from sparkd.cli.kernels import run_build

    assert run_build(argparse.Namespace(arch=ARCHS, jobs=2)) == 0  # two processes
    lines = capsys.readouterr().out.splitlines()
    kernel_lines = [line for line in lines if line.split()[1:2] and line.split()[1] in ARCHS]
    assert len(kernel_lines) == len(ARCHS) * len(all_kernel_specs())
    assert lines[-1].startswith(f"{len(kernel_lines)}/{len(kernel_lines)} kernels built")


def test_cli_fails_on_a_bad_arch(capsys):
    from sparkd.cli.kernels import run_build

    assert run_build(argparse.Namespace(arch=["sm90"], jobs=1)) == 1
    assert "FAIL" in capsys.readouterr().out


# ---- cache keys ----

def _write_kernel(directory, header_body: str):
    (directory / "inc").mkdir(parents=True, exist_ok=True)
    (directory / "inc" / "scale.cuh").write_text(f"#pragma once\n{header_body}\n")
    (directory / "k.cu").write_text('#include "inc/scale.cuh"\n'
                                    "template <typename T> __global__ void k(T* x) { x[threadIdx.x] *= kScale; }\n")


def test_cache_key_follows_included_headers(tmp_path):
    _write_kernel(tmp_path, "constexpr float kScale = 2.f;")
    options = toolkit_options("sm_90")
    files = source_files("k.cu", tmp_path)
    assert sorted(files) == ["inc/scale.cuh", "k.cu"]
    key = cache_key(files, ["k<float>"], options)
    assert cache_key(files, ["k<float>"], options) == key
    assert cache_key(files, ["k<double>"], options) != key
    assert cache_key(files, ["k<float>"], toolkit_options("sm_120")) != key
    _write_kernel(tmp_path, "constexpr float kScale = 3.f;")
    assert cache_key(source_files("k.cu", tmp_path), ["k<float>"], options) != key


def test_a_changed_header_recompiles(tmp_path):
    _write_kernel(tmp_path, "constexpr float kScale = 2.f;")
    assert not compile_specs("k.cu", ["k<float>"], "sm_90", kernel_dir=tmp_path).from_cache
    assert compile_specs("k.cu", ["k<float>"], "sm_90", kernel_dir=tmp_path).from_cache
    _write_kernel(tmp_path, "constexpr float kScale = 4.f;")
    assert not compile_specs("k.cu", ["k<float>"], "sm_90", kernel_dir=tmp_path).from_cache


def test_a_copy_of_the_sources_elsewhere_comes_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKD_CACHE_DIR", str(tmp_path / "cache"))
    for copy in ("a", "b"):
        _write_kernel(tmp_path / copy, "constexpr float kScale = 2.f;")
    first = compile_specs("k.cu", ["k<float>"], "sm_90", kernel_dir=tmp_path / "a")
    second = compile_specs("k.cu", ["k<float>"], "sm_90", kernel_dir=tmp_path / "b")
    assert not first.from_cache and second.from_cache and second.cubin == first.cubin


def test_compile_errors_carry_the_nvrtc_log(tmp_path):
    (tmp_path / "bad.cu").write_text("__global__ void bad(float* x) { x[0] = undefined_name; }\n")
    with pytest.raises(CompileError, match="undefined_name"):
        compile_specs("bad.cu", ["bad"], "sm_90", kernel_dir=tmp_path)
    with pytest.raises(CompileError, match="not found"):
        compile_specs("missing.cu", ["k"], "sm_90", kernel_dir=tmp_path)
    with pytest.raises(ValueError, match="arch"):
        compile_options("90")


# ---- argument packing ----

def test_pack_args_puts_each_value_in_its_own_slot():
    tensor = DeviceTensor(0x7F00_0000_1000, (4,), DType.float32)
    args = [tensor, np.int32(-5), np.uint32(7), np.int64(-(2**40)), np.uint64(2**63), np.float32(1.5)]
    slots, pointers = pack_args(args)
    raw = slots.view(np.uint8).reshape(len(args), 8)
    assert raw[0].view(np.uint64)[0] == 0x7F00_0000_1000
    assert raw[1, :4].view(np.int32)[0] == -5
    assert raw[2, :4].view(np.uint32)[0] == 7
    assert raw[3].view(np.int64)[0] == -(2**40)
    assert raw[4].view(np.uint64)[0] == 2**63
    assert raw[5, :4].view(np.float32)[0] == 1.5
    np.testing.assert_array_equal(pointers, slots.ctypes.data + 8 * np.arange(len(args)))


def test_pack_args_points_a_tensor_map_argument_at_its_own_128_bytes():
    words = np.arange(16, dtype=np.uint64) * 0x0101_0101
    tensor_map = TensorMap(words)
    slots, pointers = pack_args([np.int32(3), tensor_map, np.int32(4)])
    assert pointers[1] == words.ctypes.data
    assert pointers[0] == slots.ctypes.data and pointers[2] == slots.ctypes.data + 16
    assert slots[2] == 4


def test_a_tensor_map_is_sixteen_words():
    with pytest.raises(ValueError, match="16 uint64 words"):
        TensorMap(np.zeros(15, dtype=np.uint64))


@pytest.mark.parametrize("bad", [3, 2.5, np.float64(1.0), "x"])
def test_pack_args_refuses_values_without_a_c_type(bad):
    with pytest.raises(TypeError, match="argument 1"):
        pack_args([np.int32(0), bad])


def test_dim3():
    assert dim3(5) == (5, 1, 1) and dim3((2, 3)) == (2, 3, 1) and dim3([1, 2, 3]) == (1, 2, 3)
    with pytest.raises(ValueError):
        dim3((0, 1))


def test_no_generic_lambdas_in_kernel_sources():
    """NVRTC 13.0 (the lent H200's) treats a generic lambda in device code as a host
    function and rejects it in JIT mode, while newer NVRTCs accept it: a kernel that
    builds here can fail there. Use a struct with a template member instead."""
    import re
    from pathlib import Path

    sources = sorted(Path(__file__).resolve().parents[1].joinpath("cukernels").glob("*.cu*"))
    assert sources
    generic = re.compile(r"\]\s*\([^)]*\bauto\b")
    offenders = [f"{path.name}:{number}: {line.strip()}" for path in sources
                 for number, line in enumerate(path.read_text().splitlines(), 1) if generic.search(line)]
    assert not offenders, "generic lambdas in kernel sources:\n" + "\n".join(offenders)
