"""One registry from (op name, device type) to kernel.

Every op has a reference kernel (plain PyTorch, runs on any device); a device-specific kernel registered for a
device type takes precedence there when it supports what the call needs. MOECOMPILE_KERNELS=reference forces the
reference kernels everywhere, which is how device kernels are checked against them.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from moecompile.core import settings
from moecompile.kernels import reference

REFERENCE = "reference"
# What a kernel may declare it supports beyond an op's base arguments:
INTERLEAVED = "interleaved"  # the experts ops' trailing (interleaved, alpha, limit): GPT-OSS's clamped SwiGLU
KEPT_H = "h"  # experts_backward's h=: experts_train's kept first projection (else the kernel recomputes it)
FEATURES = frozenset({INTERLEAVED, KEPT_H})
# device kernels, imported on first use of their device type (they need triton, which CPU installs may lack)
DEVICE_MODULES = {"cuda": "moecompile.runtime.cuda"}
_loaded: set[str] = set()


@dataclass(frozen=True)
class Kernel:
    """A registered kernel and the optional features (FEATURES) it takes."""
    fn: Callable
    supports: frozenset[str] = frozenset()


_KERNELS: dict[tuple[str, str], Kernel] = {}


def register_kernel(op: str, device_type: str, fn: Callable | None = None, *, supports: Iterable[str] = ()):
    """Register fn as op's kernel on device_type ("cpu", "cuda", ... or "reference"), declaring the optional
    features it takes (FEATURES); calls needing others run the reference kernel. Usable as a decorator."""
    supports = frozenset(supports)
    if not supports <= FEATURES:
        raise ValueError(f"unknown kernel features {sorted(supports - FEATURES)}; known: {sorted(FEATURES)}")

    def add(fn):
        _KERNELS[(op, device_type)] = Kernel(fn, supports)
        return fn
    return add(fn) if fn is not None else add


def _load(device_type: str) -> None:
    _loaded.add(device_type)
    if device_type not in DEVICE_MODULES:
        return
    try:
        importlib.import_module(DEVICE_MODULES[device_type])
    except ImportError as e:  # no triton: the reference kernels (plain PyTorch) also run on CUDA
        warnings.warn(f"moecompile: {device_type.upper()} kernels unavailable ({e}); using the reference kernels",
                      stacklevel=3)


def kernel_entry(op: str, device: torch.device | str, needs: Iterable[str] = ()) -> Kernel:
    """op's Kernel record for device: the device's own when registered, not forced off by MOECOMPILE_KERNELS and
    supporting every feature in `needs`; else the reference kernel."""
    device_type = torch.device(device).type
    if device_type not in _loaded:
        _load(device_type)
    entry = _KERNELS.get((op, device_type))
    if entry is not None and settings.kernels() != REFERENCE and entry.supports.issuperset(needs):
        return entry
    try:
        return _KERNELS[(op, REFERENCE)]
    except KeyError:
        raise KeyError(f"no kernel registered for moecompile op {op!r}") from None


def kernel_for(op: str, device: torch.device | str, needs: Iterable[str] = ()) -> Callable:
    """op's kernel function for device (kernel_entry)."""
    return kernel_entry(op, device, needs).fn


def reference_kernel(op: str) -> Callable:
    """op's reference kernel, whatever the device and MOECOMPILE_KERNELS say."""
    return _KERNELS[(op, REFERENCE)].fn


def registered_kernels() -> dict[tuple[str, str], Callable]:
    return {key: entry.fn for key, entry in _KERNELS.items()}


for _op in ("route", "route_backward", "dispatch", "dispatch_backward", "combine", "combine_backward",
            "route_grouped", "route_grouped_backward", "route_dispatch", "route_dispatch_backward", "experts_gathered",
            "quantize_fp8", "experts_fp8", "routed_experts_fp8", "linear_fp8", "decode_attention",
            "experts_combine_train", "experts_combine_backward", "experts_combine_backward_reads_y"):
    register_kernel(_op, REFERENCE, getattr(reference, _op))
for _op in ("experts", "experts_train", "routed_experts"):
    register_kernel(_op, REFERENCE, getattr(reference, _op), supports={INTERLEAVED})
register_kernel("experts_backward", REFERENCE, reference.experts_backward, supports={INTERLEAVED, KEPT_H})
