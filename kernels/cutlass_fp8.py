"""Block-scaled FP8 grouped GEMM from CUTLASS for Hopper (csrc/fp8_blockwise_grouped.cu).

The same math as the Triton block kernel and the reference (the checkpoint's 128 x 128 weight scales, activations in
1 x 128 groups, float32 promotion every 128 of K), on CUTLASS's warp-specialised sm90 mainloop. Needs nvcc (built
and run with CUDA 13.0) and the CUTLASS headers of the nvidia-cutlass package (`pip install 'moecompile[cutlass]'`):
the library is built on first use, cached in a folder the caller names (the runtime: $MOECOMPILE_CACHE) by a hash
of the source and the compiler, and loaded with ctypes: nothing depends on the PyTorch C++ ABI. The caller may name a
prebuilt library instead ($MOECOMPILE_CUTLASS_LIB) and the CUDA toolkit to build with ($CUDA_HOME).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "fp8_blockwise_grouped.cu"
ERRORS = {1: "workspace too small", 2: "argument kernels failed", 3: "shape not supported", 4: "initialisation failed",
          5: "launch failed", 6: "CUDA error"}
BLOCK = 128


class CutlassUnavailable(RuntimeError):
    """The CUTLASS library cannot be built or loaded here (no nvcc, no headers, build error)."""


def _cutlass_root() -> Path:
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise CutlassUnavailable("the CUTLASS headers are not installed (pip install nvidia-cutlass)")
    root = Path(next(iter(spec.submodule_search_locations))) / "source"
    if not (root / "include" / "cutlass" / "cutlass.h").is_file():
        raise CutlassUnavailable(f"no CUTLASS headers under {root}")
    return root


def _nvcc(cuda_home: str | None) -> str:
    nvcc = str(Path(cuda_home) / "bin" / "nvcc") if cuda_home else shutil.which("nvcc")
    if not nvcc or not Path(nvcc).is_file():
        raise CutlassUnavailable("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    return nvcc


def build_command(output: Path, cuda_home: str | None = None) -> list[str]:
    """The nvcc command that builds the library (sm_90a: wgmma and setmaxnreg need the arch-specific target) with
    cuda_home's nvcc, else the one on PATH."""
    root = _cutlass_root()
    return [_nvcc(cuda_home), "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
            "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC", "-shared", "-cudart", "static",
            f"-I{root / 'include'}", f"-I{root / 'tools' / 'util' / 'include'}", str(SOURCE), "-o", str(output)]


def _cached_path(cache_dir: Path, cuda_home: str | None) -> Path:
    command = build_command(Path("out.so"), cuda_home)
    version = subprocess.run([command[0], "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(command).encode() + version.encode()).hexdigest()[:16]
    return Path(cache_dir) / f"fp8_blockwise_grouped-{key}.so"


def build(output: Path, cuda_home: str | None = None) -> Path:
    """Compile the library to `output` (written under a temporary name, then renamed: never half a file)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent) as tmp:
        partial = Path(tmp) / output.name
        done = subprocess.run(build_command(partial, cuda_home), capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise CutlassUnavailable(f"building {SOURCE.name} failed: {tail}")
        os.replace(partial, output)
    return output


@functools.cache
def library(prebuilt: str | None = None, cache_dir: Path | None = None, cuda_home: str | None = None) -> ctypes.CDLL:
    """The loaded library: `prebuilt` if named, else the one built into cache_dir (on first use)."""
    if not prebuilt and cache_dir is None:
        raise ValueError("name a prebuilt library or the cache folder to build it in")
    path = Path(prebuilt) if prebuilt else _cached_path(cache_dir, cuda_home)
    if not path.is_file():
        if prebuilt:
            raise CutlassUnavailable(f"MOECOMPILE_CUTLASS_LIB={prebuilt} does not exist")
        logging.getLogger("moecompile").warning("building the CUTLASS FP8 kernel with nvcc (once, about a minute): %s",
                                                path)
        build(path, cuda_home)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        raise CutlassUnavailable(f"cannot load {path}: {error}") from None
    lib.moecompile_fp8_blockwise_grouped.restype = ctypes.c_int
    # experts, n, k, rows, sm_count; a, sa, w, sw, offsets, out, workspace; workspace bytes, stream, needed
    size_out = ctypes.POINTER(ctypes.c_size_t)
    lib.moecompile_fp8_blockwise_grouped.argtypes = ([ctypes.c_int] * 5 + [ctypes.c_void_p] * 7
                                                     + [ctypes.c_size_t, ctypes.c_void_p, size_out])
    return lib


def supported(*sizes: int) -> bool:
    """The GEMMs' K and N must be whole 128-blocks (the scale grid); rows of any count."""
    return all(size % BLOCK == 0 for size in sizes)


def weight_scales(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The checkpoint's scale_inv [E, N/128, K/128] as the kernel reads it: [E, K/128, N/128] (MN-major)."""
    return scale_inv.float().transpose(1, 2).contiguous()


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor,
                 w_scale_t: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
    """out[r] = (a[r] a_scale) (w[e] w_scale)^T in bf16 for the rows r of each expert e's group.

    a: [rows, K] e4m3; a_scale: [rows, K/128] float32 (1 x 128 scale_inv); offsets: [E] int32 cumulative group
    ends; w: [E, N, K] e4m3; w_scale_t: [E, K/128, N/128] float32 (weight_scales); lib: library(). Rows at or past
    offsets[-1] are left unspecified."""
    rows, k = a.shape
    experts, n, _ = w.shape
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=a.device)
    if rows == 0:
        return out
    offsets = offsets.to(torch.int32).contiguous()
    tensors = (a.contiguous(), a_scale.float().contiguous(), w.contiguous(), w_scale_t.contiguous())
    shape = (experts, n, k, rows, _sm_count(a.device.index or 0))
    pointers = [t.data_ptr() for t in tensors] + [offsets.data_ptr(), out.data_ptr()]
    needed = ctypes.c_size_t(0)
    lib.moecompile_fp8_blockwise_grouped(*shape, *pointers, None, 0, None, ctypes.byref(needed))
    workspace = torch.empty(needed.value, dtype=torch.uint8, device=a.device)
    with torch.cuda.device(a.device):  # the library launches on the current device
        code = lib.moecompile_fp8_blockwise_grouped(*shape, *pointers, workspace.data_ptr(), needed.value,
                                                    torch.cuda.current_stream().cuda_stream, None)
    if code:
        raise RuntimeError(f"CUTLASS FP8 grouped GEMM: {ERRORS.get(code, code)} (rows {rows}, N {n}, K {k}, "
                           f"{experts} experts)")
    return out
