"""The conversion knobs (experts, top_k, capacity_factor, method): each default and each check, decided here once.

Every entry point (moecompile.convert's ConvertOptions, which the CLI fills, moecompile.moeize, the graph pass
moeize, MoEConfig, MoEBlock's per-call top_k, calibration) calls these. Torch-free: a bad option fails before torch
is imported. What capacity_factor means: MoEConfig's docstring; what it keeps and when it drops: capacity and
never_drops below.
"""
from __future__ import annotations

import math

from moecompile.core.errors import MoECompileError

EXPERTS = 16  # moeize() and the graph pass without `experts` (the CLI requires --experts)
TOP_K = 2  # experts per token: conversion and MoEConfig
# dropless: a converted block equals what the conversion says it equals until the user asks for a capacity, which
# is a training knob (fixed-size expert buffers); every default of capacity_factor (MoEConfig, conversions,
# calibration, the CLI) is this one
CAPACITY_FACTOR = 0.0
METHODS = ("upcycle", "split")
METHOD = "upcycle"
SHARD_SIZE = "5GB"  # a written checkpoint's safetensors files are sharded above this size
FORMATS = ("auto", "hf", "moecompile")  # convert's output: auto = the family's native HF MoE class where one fits
# the calibrated split's recipe (`convert --method split --calib`): its defaults for the CLI and the benchmarks
CALIB_SOURCE = "mixed"  # calibration text: "mixed", "stdlib" or a text file's path
CALIB_DEVICE = "cpu"  # where calibration runs unless told (the checkpoint is the same on any device)
CALIB_TOKENS = 270000  # about all of the standard library's calibration sentences
# (layer-wise distillation steps per FFN, end-to-end steps after them) by where calibration runs: a CPU gets the
# shorter recipe, a GPU affords the longer one
CALIB_STEPS = {"cpu": (500, 500), "cuda": (1200, 1200)}
CALIB_EVAL_SENTENCES = 256  # held-out sentences per evaluation source in the report
SHARED_KINDS = ("neurons", "linear")  # a shared expert: the most active neurons, or a linear map of that rank
PARTITIONS = ("kmeans", "graph", "random", "weights")  # how neurons are grouped into experts
# dtype names a user may type -> torch dtype names (the CLI maps them without importing torch)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def calib_steps(device: str, distill_steps: int | None = None, e2e_steps: int | None = None) -> tuple[int, int]:
    """The (layer-wise, end-to-end) calibration steps on `device` ("cpu", "cuda", "cuda:1", ...): each one given
    (not None), else its default there."""
    distill, e2e = CALIB_STEPS["cuda" if device.startswith("cuda") else "cpu"]
    return (distill if distill_steps is None else distill_steps, e2e if e2e_steps is None else e2e_steps)


def capacity(capacity_factor: float, tokens: int, top_k: int, experts: int) -> int | None:
    """Assignments an expert keeps of `tokens` tokens (MoEConfig's convention): None when dropless (0), else
    ceil(|cf| * tokens * top_k / experts), at least 1."""
    if capacity_factor == 0:
        return None
    return max(1, math.ceil(abs(capacity_factor) * tokens * top_k / experts))


def never_drops(capacity_factor: float, top_k: int, experts: int) -> bool:
    """True when routing can never drop an assignment: dropless, or a capacity >= the tokens, which every expert's
    queue fits (a token picks an expert at most once, so a queue never exceeds the tokens)."""
    return capacity_factor == 0 or abs(capacity_factor) * top_k >= experts


def _is_int(value) -> bool:
    # __index__: Python and NumPy integers, and torch.SymInt while Dynamo traces a per-call top_k
    return hasattr(type(value), "__index__") and not isinstance(value, bool)


def check_experts(experts, name: str = "experts") -> int:
    """experts per block: an integer >= 1. `name` is how the caller spells it in the message (--experts)."""
    if not _is_int(experts):
        raise MoECompileError(f"{name} must be an integer, got {experts!r}")
    if experts < 1:
        raise MoECompileError(f"{name} must be >= 1, got {experts}")
    return experts


def check_top_k(top_k, experts: int, name: str = "top_k", experts_name: str = "experts", low: int = 1,
                error: type[Exception] = MoECompileError) -> int:
    """experts per token: an integer in [low, experts]; low is 0 where a shared expert may run alone. `error`:
    MoEBlock's per-call override raises ValueError (a bad call, not bad user input)."""
    if not _is_int(top_k) or not low <= top_k <= experts:
        raise error(f"{name} must be between {low} and {experts_name} ({experts}), got {top_k!r}")
    return top_k


def check_method(method: str) -> str:
    if method not in METHODS:
        raise MoECompileError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    return method


def check_split(neurons: int, experts: int, where: str | None = None) -> None:
    """A neuron split gives every expert the same number of an FFN's neurons: experts must divide them."""
    if neurons % experts:
        of = f" of {where}" if where else ""
        raise MoECompileError(f"split needs experts to divide the FFN size: {neurons} neurons{of} into {experts} "
                              "experts")
