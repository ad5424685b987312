"""NVRTC: compile `cukernels/*.cu` to CUBIN, cache it on disk, load and launch kernels.

A kernel is named by a `KernelSpec(source, name)`: the `.cu` file and a C++ name
expression such as "add_rmsnorm_kernel<__nv_bfloat16>", lowered to its mangled name
by NVRTC. All registered names of one source compile into one module, so
`sparkd kernels build` fills exactly the cache entries the server later reads.

Compiling needs no GPU (pass the arch); loading and launching do.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import pkgutil
import re
import tempfile
import threading
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from cuda.bindings import driver, nvrtc

from .driver import call, device_arch, ensure_context
from .launch import Kernel

KERNEL_DIR = Path(__file__).resolve().parents[3] / "cukernels"
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class KernelSpec:
    source: str  # file name under cukernels/, e.g. "rmsnorm.cu"
    name: str  # C++ name expression, e.g. "rmsnorm_kernel<float>"


@dataclass(frozen=True)
class CompiledModule:
    source: str
    arch: str  # the target the CUBIN is for, e.g. "sm_90a" for a source that asked for it
    cubin: bytes
    lowered_names: dict[str, str] = field(hash=False)  # name expression -> mangled symbol
    from_cache: bool = False


class CompileError(RuntimeError):
    """NVRTC rejected a source; the message carries its log."""


def cache_dir() -> Path:
    root = os.environ.get("SPARKD_CACHE_DIR")
    return Path(root) / "kernels" if root else Path.home() / ".cache" / "sparkd" / "kernels"


@cache
def _cudart_include_dir() -> str:
    from cuda.pathfinder import find_nvidia_header_directory

    found = find_nvidia_header_directory("cudart")
    if found is None:
        raise CompileError("CUDA headers (cuda_bf16.h) not found: pip install nvidia-cuda-runtime")
    return str(found)


# Instructions of one chip only (sm_90a: wgmma, setmaxnreg) need its arch-specific target,
# whose CUBIN loads on that compute capability alone. A source that tests the target's
# feature macro asks for it; on other targets the code it guards compiles out.
_ARCH_FEATURE_MACROS = {"sm_90": b"__CUDA_ARCH_FEAT_SM90_ALL"}


def target_arch(files: dict[str, bytes], arch: str) -> str:
    """The arch to compile `files` (from `source_files`) for: `arch`, or its arch-specific
    variant ("sm_90a") when the source or a header it includes mentions that variant's feature macro."""
    macro = _ARCH_FEATURE_MACROS.get(arch)
    return f"{arch}a" if macro is not None and any(macro in text for text in files.values()) else arch


def toolkit_options(arch: str) -> list[str]:
    """The options but the kernel directory's include path: what the cache key holds. No
    --use_fast_math: fp32 kernels must match numpy to 1e-5."""
    if not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise ValueError(f"arch must look like sm_90, got {arch!r}")
    return [f"-arch={arch}", "--std=c++17", f"-I{_cudart_include_dir()}"]


def compile_options(arch: str, kernel_dir: Path = KERNEL_DIR) -> list[str]:
    return [*toolkit_options(arch), f"-I{kernel_dir}"]


def source_files(source: str, kernel_dir: Path = KERNEL_DIR) -> dict[str, bytes]:
    """The source and every quoted header it includes, transitively, relative path -> bytes.

    Headers that are not in `kernel_dir` belong to the toolkit; the NVRTC version
    in the cache key covers them."""
    files: dict[str, bytes] = {}
    pending = [kernel_dir / source]
    while pending:
        path = pending.pop()
        rel = path.resolve().relative_to(kernel_dir.resolve()).as_posix()
        if rel in files:
            continue
        if not path.is_file():
            raise CompileError(f"kernel source {rel} not found in {kernel_dir}")
        files[rel] = path.read_bytes()
        for include in _INCLUDE.findall(files[rel].decode()):
            for candidate in (path.parent / include, kernel_dir / include):
                if candidate.is_file():
                    pending.append(candidate)
                    break
    return files


def cache_key(files: dict[str, bytes], names: Sequence[str], options: Sequence[str]) -> str:
    """Changes whenever the source, an included header, the names, the options or NVRTC change."""
    _, major, minor = nvrtc.nvrtcVersion()
    digest = hashlib.sha256(f"nvrtc {major}.{minor}".encode())
    for rel in sorted(files):
        digest.update(rel.encode() + b"\0" + hashlib.sha256(files[rel]).digest())
    for item in (*options, "--names--", *sorted(names)):
        digest.update(item.encode() + b"\0")
    return digest.hexdigest()[:32]


def compile_specs(source: str, names: Iterable[str], arch: str, kernel_dir: Path = KERNEL_DIR) -> CompiledModule:
    """Compile `names` of `source` (a file in `kernel_dir`) for `arch` (see `target_arch`), through the on-disk cache."""
    names = sorted(set(names))
    files = source_files(source, kernel_dir)
    arch = target_arch(files, arch)
    options = compile_options(arch, kernel_dir)
    # The kernel directory's files are hashed, not its path: a copy of the sources elsewhere (another
    # checkout, another install) shares the cache.
    key = cache_key(files, names, toolkit_options(arch))
    cached = _read_cache(key)
    if cached is not None:
        cubin, lowered = cached
        return CompiledModule(source, arch, cubin, lowered, from_cache=True)
    cubin, lowered = _nvrtc_compile(source, files[source], names, options)
    _write_cache(key, cubin, lowered)
    return CompiledModule(source, arch, cubin, lowered)


def _nvrtc_compile(source: str, text: bytes, names: list[str], options: list[str]) -> tuple[bytes, dict[str, str]]:
    program = _nvrtc(nvrtc.nvrtcCreateProgram(text, source.encode(), 0, [], []), source)
    try:
        for name in names:
            _nvrtc(nvrtc.nvrtcAddNameExpression(program, name.encode()), source)
        status, = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC failed to compile {source} ({' '.join(options[:2])}):\n{_program_log(program)}")
        size = _nvrtc(nvrtc.nvrtcGetCUBINSize(program), source)
        cubin = bytearray(size)
        _nvrtc(nvrtc.nvrtcGetCUBIN(program, cubin), source)
        lowered = {name: _nvrtc(nvrtc.nvrtcGetLoweredName(program, name.encode()), source).decode() for name in names}
        return bytes(cubin), lowered
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _nvrtc(result, source: str):
    status, *values = result
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        message = nvrtc.nvrtcGetErrorString(status)[1].decode()
        raise CompileError(f"NVRTC error on {source}: {message}")
    return values[0] if values else None


def _program_log(program) -> str:
    size = _nvrtc(nvrtc.nvrtcGetProgramLogSize(program), "log")
    log = bytearray(size)
    _nvrtc(nvrtc.nvrtcGetProgramLog(program, log), "log")
    return log.rstrip(b"\0").decode(errors="replace")


def _read_cache(key: str) -> tuple[bytes, dict[str, str]] | None:
    directory = cache_dir()
    try:
        meta = json.loads((directory / f"{key}.json").read_text())
        return (directory / f"{key}.cubin").read_bytes(), meta["lowered_names"]
    except (OSError, ValueError, KeyError):
        return None


def _write_cache(key: str, cubin: bytes, lowered: dict[str, str]) -> None:
    # The .json is written last and read first, so a reader never sees a half-written entry.
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_write(directory / f"{key}.cubin", cubin)
    _atomic_write(directory / f"{key}.json", json.dumps({"lowered_names": lowered}).encode())


def _atomic_write(path: Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, path)


# ---- the registry of kernels ----

def all_kernel_specs() -> list[KernelSpec]:
    """Every `SPECS` entry of the launcher modules in sparkd/backend/cuda/kernels/."""
    package_name = f"{__package__}.kernels"
    package = importlib.import_module(package_name)
    specs: dict[KernelSpec, None] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package_name}.{info.name}")
        specs.update(dict.fromkeys(getattr(module, "SPECS", [])))
    return list(specs)


def specs_by_source(specs: Iterable[KernelSpec]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for spec in specs:
        grouped.setdefault(spec.source, []).append(spec.name)
    return grouped


def __getattr__(name: str):
    # Launcher modules import this one for KernelSpec, so the registry is built on first use.
    if name == "ALL_KERNEL_SPECS":
        return all_kernel_specs()
    raise AttributeError(name)


# ---- loading on the device ----

_modules: dict[tuple[str, frozenset[str]], tuple[driver.CUmodule, dict[str, str]]] = {}
_kernels: dict[KernelSpec, Kernel] = {}
_load_lock = threading.Lock()


def get_kernel(spec: KernelSpec) -> Kernel:
    """The loaded kernel for the current device, compiling (or reading the cache) on first use."""
    kernel = _kernels.get(spec)
    if kernel is None:
        with _load_lock:
            kernel = _kernels.get(spec) or _load_kernel(spec)
            _kernels[spec] = kernel
    return kernel


def _load_kernel(spec: KernelSpec) -> Kernel:
    ensure_context()
    names = frozenset(specs_by_source(all_kernel_specs()).get(spec.source, [])) | {spec.name}
    module_key = (spec.source, names)
    if module_key not in _modules:
        compiled = compile_specs(spec.source, names, device_arch())
        image = np.frombuffer(compiled.cubin, dtype=np.uint8)
        _modules[module_key] = (call(driver.cuModuleLoadData, image.ctypes.data), compiled.lowered_names)
    module, lowered = _modules[module_key]
    function = call(driver.cuModuleGetFunction, module, lowered[spec.name].encode())
    return Kernel(spec.name, function)
