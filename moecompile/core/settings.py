"""Every environment variable moecompile reads, read here and nowhere else (a leaf: the standard library and
core.errors only).

Each function reads the environment when called, so a changed environment takes effect (tests use
monkeypatch.setenv); a caller that wants one value for the whole process reads it once, at import.
"""
from __future__ import annotations

import os
from pathlib import Path

from moecompile.core.errors import MoECompileError


def _one_of(name: str, default: str, allowed: tuple[str, ...]) -> str:
    """The variable's value, or default when unset; a value outside `allowed` is a one-line error, not a silent
    fallback to some other kernel."""
    value = os.environ.get(name, default)
    if value not in allowed:
        raise MoECompileError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return value


EXPERT_GEMMS = ("auto", "grouped_mm", "triton", "triton_decode", "triton_tma", "triton_persistent", "quack")
FIRST_PROJECTION_GEMMS = (*EXPERT_GEMMS, "quack_gathered")  # QuACK reading its rows through the dispatch order


def kernels() -> str | None:
    """MOECOMPILE_KERNELS: "reference" runs the reference kernels on every device (how device kernels are checked
    against them); anything else, or unset, lets a device's own kernels run."""
    return os.environ.get("MOECOMPILE_KERNELS")


def ffn_in() -> str:
    """MOECOMPILE_FFN_IN: the CUDA kernel of the experts' first projection: auto (the tuned choice per shape),
    grouped_mm, triton, triton_decode, triton_tma, triton_persistent, quack (the quack extra, Hopper) or quack_gathered
    (quack reading each expert's rows from the token matrix where the layer skips the dispatch's row copy)."""
    return _one_of("MOECOMPILE_FFN_IN", "auto", FIRST_PROJECTION_GEMMS)


def ffn_out() -> str:
    """MOECOMPILE_FFN_OUT: the same for the second projection."""
    return _one_of("MOECOMPILE_FFN_OUT", "auto", EXPERT_GEMMS)


def fold_combine() -> str:
    """MOECOMPILE_FOLD_COMBINE: the combine's backward folded into the experts' QuACK backward GEMMs in training
    (gated experts without an output bias): auto, where the GEMMs it gathers have tuned configurations
    (runtime/choices.folds_combine); on, wherever it applies; off, never."""
    return _one_of("MOECOMPILE_FOLD_COMBINE", "auto", ("auto", "on", "off"))


def programmatic_launch() -> str:
    """MOECOMPILE_PDL: kernels launched as programmatic dependents on Hopper and later, each starting to launch while
    the one before it finishes: auto (default) moecompile's decode kernels (routing, direct experts) and inductor's
    kernels of one-token decode steps; on, inductor's kernels of every compiled graph too; off, none."""
    return _one_of("MOECOMPILE_PDL", "auto", ("auto", "on", "off"))


def fp8_gemm() -> str:
    """MOECOMPILE_FP8_GEMM: the FP8 expert GEMMs' scaling on CUDA: auto, rowwise or block."""
    return _one_of("MOECOMPILE_FP8_GEMM", "auto", ("auto", "rowwise", "block"))


def fp8_block_kernel() -> str:
    """MOECOMPILE_FP8_BLOCK_KERNEL: the kernel of block-scaled FP8 batches on sm_90: auto, cutlass, gluon or
    triton."""
    return _one_of("MOECOMPILE_FP8_BLOCK_KERNEL", "auto", ("auto", "cutlass", "gluon", "triton"))


def cutlass_lib() -> str | None:
    """MOECOMPILE_CUTLASS_LIB: a prebuilt CUTLASS FP8 library to load instead of building one."""
    return os.environ.get("MOECOMPILE_CUTLASS_LIB")


def cache_dir() -> Path:
    """MOECOMPILE_CACHE: where built kernels are cached (default ~/.cache/moecompile)."""
    return Path(os.environ.get("MOECOMPILE_CACHE", Path.home() / ".cache" / "moecompile"))


def cuda_home() -> str | None:
    """CUDA_HOME, else CUDA_PATH: the CUDA toolkit whose nvcc builds the CUTLASS kernel (else nvcc on PATH)."""
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels in its interpreter (on CPU, in the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def print_graph() -> bool:
    """MOECOMPILE_PRINT_GRAPH: print the graph after each compile pass (set and not "0")."""
    return os.environ.get("MOECOMPILE_PRINT_GRAPH", "") not in ("", "0")


def local_rank() -> int | None:
    """LOCAL_RANK (torchrun): this process's GPU on its host; None when unset."""
    value = os.environ.get("LOCAL_RANK")
    return None if value is None else int(value)


def world_size(default: str | None = None) -> str | None:
    """WORLD_SIZE (torchrun), as set; `default` when unset."""
    return os.environ.get("WORLD_SIZE", default)


def cifar10_dir() -> str | None:
    """CIFAR10_DIR: where the vision example looks for CIFAR-10 first."""
    return os.environ.get("CIFAR10_DIR")
