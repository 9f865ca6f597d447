"""One registry from (op name, device type) to kernel.

Every op has a reference kernel (plain PyTorch, runs on any device); a device-specific kernel registered for a
device type takes precedence there. MOECOMPILE_KERNELS=reference forces the reference kernels everywhere, which
is how device kernels are checked against them.
"""
from __future__ import annotations

import importlib
import os
from typing import Callable

import torch

from moecompile.kernels import reference

REFERENCE = "reference"
_KERNELS: dict[tuple[str, str], Callable] = {}
# device kernels, imported on first use of their device type (they need triton, which CPU installs may lack)
DEVICE_MODULES = {"cuda": "moecompile.runtime.cuda"}
_loaded: set[str] = set()


def register_kernel(op: str, device_type: str, fn: Callable | None = None):
    """Register fn as op's kernel on device_type ("cpu", "cuda", ... or "reference"). Usable as a decorator."""
    def add(fn):
        _KERNELS[(op, device_type)] = fn
        return fn
    return add(fn) if fn is not None else add


def kernel_for(op: str, device: torch.device | str) -> Callable:
    device_type = torch.device(device).type
    if device_type not in _loaded:
        _loaded.add(device_type)
        if device_type in DEVICE_MODULES:
            importlib.import_module(DEVICE_MODULES[device_type])
    if os.environ.get("MOECOMPILE_KERNELS") != REFERENCE and (op, device_type) in _KERNELS:
        return _KERNELS[(op, device_type)]
    try:
        return _KERNELS[(op, REFERENCE)]
    except KeyError:
        raise KeyError(f"no kernel registered for moecompile op {op!r}") from None


def reference_kernel(op: str) -> Callable:
    """op's reference kernel, whatever the device and MOECOMPILE_KERNELS say."""
    return _KERNELS[(op, REFERENCE)]


def registered_kernels() -> dict[tuple[str, str], Callable]:
    return dict(_KERNELS)


for _op in ("route", "route_backward", "dispatch", "dispatch_backward", "experts", "experts_train",
            "experts_backward", "combine", "combine_backward", "route_grouped", "route_grouped_backward",
            "route_dispatch", "route_dispatch_backward", "quantize_fp8", "experts_fp8"):
    register_kernel(_op, REFERENCE, getattr(reference, _op))
