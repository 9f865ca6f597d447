"""Options of a calibrated split: the per-block recipe (CalibConfig) and a whole run's (CalibRun)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moecompile.core.errors import MoECompileError
from moecompile.ir.knobs import (
    CALIB_DEVICE,
    CALIB_EVAL_SENTENCES,
    CALIB_SOURCE,
    CALIB_TOKENS,
    CAPACITY_FACTOR,
    EXPERTS,
    PARTITIONS,
    SHARED_KINDS,
    TOP_K,
)


@dataclass
class CalibConfig:
    """How `calibrate` builds each block. top_k and distill_top_k count the shared experts too."""
    experts: int = EXPERTS  # expert-sized groups of neurons per FFN, shared ones included
    top_k: int = TOP_K  # active experts per token, shared ones included
    shared_experts: int = 0  # always-on expert-equivalents (top_k counts them)
    shared_kind: str = SHARED_KINDS[0]  # "neurons": the most active neurons; "linear": a linear map of that rank
    partition: str = PARTITIONS[0]
    compensation: bool = True
    router_steps: int = 0
    distill_steps: int = 0
    distill_top_k: tuple[int, ...] = ()  # top_k values drawn during distillation (default: (top_k,))
    lr: float = 1e-3
    batch_tokens: int = 1024
    ridge: float = 1e-3  # router least squares: relative ridge on the input covariance
    e2e_steps: int = 0  # end-to-end steps (one calibration batch of sentences each) after the layer-wise stage
    e2e_lr: float = 3e-4
    e2e_frozen_fraction: float = 1 / 3  # the end-to-end stage leaves the first third of the blocks as they are
    e2e_judge_every: int = 100  # score the end-to-end stage on the selection text every this many steps (0: never)
    e2e_keep_best: bool = True  # keep the end-to-end parameters that scored best there, not the last ones
    bf16: bool | None = None  # distillation matmuls in bfloat16 autocast (weights and losses stay float32);
    # None: where bfloat16 is native (native_bf16)
    capacity_factor: float = CAPACITY_FACTOR
    seed: int = 0

    def __post_init__(self):
        if self.partition not in PARTITIONS:
            raise MoECompileError(f"unknown partition {self.partition!r}; expected one of {', '.join(PARTITIONS)}")
        if not 0 <= self.shared_experts < self.experts:
            raise MoECompileError(f"shared experts must be between 0 and experts - 1 ({self.experts - 1}), "
                                  f"got {self.shared_experts}")
        if not self.shared_experts < self.top_k <= self.experts and not (
                self.shared_experts and self.top_k == self.shared_experts):
            raise MoECompileError(f"top_k must be between {max(self.shared_experts, 1)} and experts "
                                  f"({self.experts}) with {self.shared_experts} shared, got {self.top_k}")
        for k in self.distill_top_k:
            if not self.shared_experts < k <= self.experts:
                raise MoECompileError(f"distillation top_k {k} must be between {self.shared_experts + 1} and "
                                      f"{self.experts}")
        if self.shared_kind not in SHARED_KINDS:
            raise MoECompileError(f"shared_kind must be 'neurons' or 'linear', got {self.shared_kind!r}")
        if self.router_steps < 0 or self.distill_steps < 0 or self.e2e_steps < 0 or self.e2e_judge_every < 0:
            raise MoECompileError("router and distillation steps must be >= 0")
        if not 0 <= self.e2e_frozen_fraction < 1:
            raise MoECompileError(f"e2e_frozen_fraction must be in [0, 1), got {self.e2e_frozen_fraction}")

    def use_bf16(self, device: torch.device) -> bool:
        """Whether the distillation stages run under bfloat16 autocast on device (`bf16`, or where it is native)."""
        return native_bf16(device) if self.bf16 is None else self.bf16

    @property
    def routed_experts(self) -> int:  # a linear shared expert takes no neurons away from the routed ones
        return self.experts - (self.shared_experts if self.shared_kind == "neurons" else 0)

    def routed_k(self, top_k: int) -> int:
        return top_k - self.shared_experts


@dataclass
class CalibRun:
    """A whole calibrated conversion (what moecompile.convert(..., calib=...) builds): where the text comes from,
    how much of it, which FFNs, how to report, and the per-block recipe."""
    recipe: CalibConfig
    source: str = CALIB_SOURCE  # "mixed" (the standard library's text and other projects'), "stdlib" or a file
    tokens: int = CALIB_TOKENS  # calibration tokens
    eval_sentences: int = CALIB_EVAL_SENTENCES  # held-out sentences for the quality report (0: none)
    layers: str | None = None  # which FFNs (parse_layers syntax); None: all
    model_name: str = ""  # what the report calls the model
    device: str = CALIB_DEVICE  # where calibration runs (the model comes back to where it was)
    select_sentences: int = 128  # selection sentences the end-to-end stage is judged on
    vocab_rate: float = 0.0  # share of words replaced by vocabulary words in data.stdlib_mix's substituted part

    def __post_init__(self):
        if self.tokens < 1:
            raise MoECompileError(f"calib_tokens must be positive, got {self.tokens}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise MoECompileError(f"device {self.device}: CUDA is not available here")


def default_shared_experts(top_k: int) -> int:
    """The recipe's shared experts for a top_k: half of the active experts always on, at most 2 routed beyond
    top_k 4 (bench/results/calibrated-split.md)."""
    return max(top_k // 2, top_k - 2)


def native_bf16(device: torch.device) -> bool:
    """Whether bfloat16 matmuls are native here (CUDA with bf16, a CPU with AVX512-BF16 or AMX), so faster than
    float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and any(getattr(torch.cpu, name, lambda: False)()
                                        for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
