"""Streaming upcycle of a dense Hugging Face checkpoint folder into its family's native HF MoE architecture.

    LlamaForCausalLM, MistralForCausalLM -> MixtralForCausalLM      (every layer MoE)
    Qwen2ForCausalLM                     -> Qwen2MoeForCausalLM     (layers left dense go to mlp_only_layers)
    Qwen3ForCausalLM                     -> Qwen3MoeForCausalLM     (layers left dense go to mlp_only_layers)

The model is never materialised: the source safetensors headers give every output tensor's name, shape and dtype
up front, so the shards, the index and the progress total are planned before any data is read; then each output
tensor is read (one source tensor at a time, through safe_open), cast and streamed straight into its shard file.
Peak memory is about one source tensor, whatever the model or shard size.

Tensors use the layout Hugging Face publishes and `save_pretrained` writes (Mixtral:
`block_sparse_moe.experts.{e}.w1/w2/w3` and `block_sparse_moe.gate`; Qwen3-MoE: `mlp.experts.{e}.gate_proj/...`
and `mlp.gate`), which transformers 5 fuses on load and transformers 4, vLLM and llama.cpp read as they are.

Upcycle: every expert is a copy of the dense FFN and the router a small random matrix. The native blocks renormalise
the top-k weights to sum to one (Mixtral always, Qwen2/3-MoE with norm_topk_prob=True) and drop no token, so the
converted model computes the dense model's function exactly (up to rounding) until it is trained. Qwen2-MoE adds a
shared expert scaled by sigmoid(shared_expert_gate(x)) > 0: it is written empty (shared_expert_intermediate_size 0,
zero-size tensors), so it adds exactly 0 and costs nothing; a zero shared expert of any size would cost a dense FFN.

    moecompile.convert(SOURCE, OUT, experts=8, top_k=2)   # or `moecompile convert SOURCE --experts 8 --out OUT`
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moecompile.conversion import validate
from moecompile.core.errors import MoECompileError
from moecompile.ffn.build import ROUTER_STD, upcycle_copy, upcycle_router
from moecompile.ffn.layers import parse_layers
from moecompile.io.checkpoint import (
    DEFAULT_SHARD_SIZE,
    NATIVE_RECORD,
    atomic_directory,
    check_output_dir,
    copy_generation_config,
    copy_tokenizer,
    read_config,
    write_config,
)
from moecompile.io.stream import ST_DTYPES, TORCH_TO_ST, Entry, parse_size, shard, write_weights
from moecompile.ir import knobs

FFN_PROJS = ("gate_proj", "up_proj", "down_proj")
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Family:
    target: str  # native transformers class
    config_class: str
    moe_prefix: str  # the MoE block's name inside a decoder layer
    expert_names: dict  # dense projection -> the expert's projection name
    experts_key: str  # config key of the expert count
    per_layer_dense: bool  # can some layers keep their dense FFN?
    shared_expert: bool = False  # Qwen2-MoE's sigmoid-gated shared expert, written empty


MIXTRAL = Family("MixtralForCausalLM", "MixtralConfig", "block_sparse_moe",
                 {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}, "num_local_experts", False)
QWEN2_MOE = Family("Qwen2MoeForCausalLM", "Qwen2MoeConfig", "mlp",
                   {p: p for p in FFN_PROJS}, "num_experts", True, shared_expert=True)
QWEN3_MOE = Family("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "mlp",
                   {p: p for p in FFN_PROJS}, "num_experts", True)
FAMILIES = {"LlamaForCausalLM": MIXTRAL, "MistralForCausalLM": MIXTRAL, "Qwen2ForCausalLM": QWEN2_MOE,
            "Qwen3ForCausalLM": QWEN3_MOE}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
# config keys never copied from the source: identity of the source model, or set by the conversion
NOT_COPIED = {"architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
              "auto_map", "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "router_jitter_noise",
              "output_router_logits", "layer_types", "max_window_layers"}
ALWAYS_COPIED = ("head_dim",)  # read with getattr by the native attention although not a declared config field


@dataclass
class NativeResult:
    out: Path
    target: str
    source_params: int
    output_params: int
    output_bytes: int
    shards: int
    moe_layers: list[int]
    seconds: float


@dataclass
class _Tensor(Entry):  # one output tensor of the plan
    source: str | None = None  # source tensor copied (and cast) into it
    router_layer: int | None = None  # or: the router of this layer, generated
    zeros: bool = False  # or: zeros (Qwen2-MoE's empty shared expert and its gate)
    noise_key: tuple | None = None  # (layer, projection, expert) of an expert copy that gets its own noise


# --------------------------------------------------------------------------------------------------- support check

def _config_dict(config) -> dict:
    if isinstance(config, (str, os.PathLike)):
        return read_config(Path(config))
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):  # a transformers PretrainedConfig
        return config.to_dict()
    raise TypeError(f"config must be a dict, a transformers config or a folder, got {type(config).__name__}")


def _architecture(cfg: dict) -> str | None:
    """The config's class; a config without `architectures` (built in code) is the causal LM of its model_type."""
    archs = cfg.get("architectures")
    return archs[0] if archs else MODEL_TYPES.get(cfg.get("model_type"))


def _normalised(cfg: dict) -> dict:
    """The config as transformers reads it: legacy keys (rope_theta/rope_scaling, torch_dtype, Qwen3's
    max_window_layers) turned into the current ones, so none is lost when copied into the native config."""
    import transformers

    try:
        out = transformers.CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg).to_dict()
    except Exception as e:  # noqa: BLE001 - transformers' validation: the user's config.json is at fault
        raise MoECompileError(f"config.json is not a valid {cfg.get('model_type')} config: {e}") from None
    out["architectures"] = [_architecture(cfg)]
    return out


def family_support(config, layers=None) -> tuple[dict | None, str]:
    """(the config as transformers reads it, "") when this dense config (dict, transformers config or checkpoint
    folder) is of a family in FAMILIES, whose FFNs are found by name (model.layers.N.mlp.gate_proj/up_proj/down_proj),
    and `layers` selects some of them; else (None, the reason in one line). The streaming split needs no more."""
    cfg = _config_dict(config)
    arch = _architecture(cfg)
    family = FAMILIES.get(arch)
    if family is None:
        known = ", ".join(f"{a} -> {f.target}" for a, f in FAMILIES.items())
        return None, f"no native MoE architecture for {arch or 'a config without architectures'} (supported: {known})"
    if cfg.get("model_type") != {v: k for k, v in MODEL_TYPES.items()}[arch]:
        return None, f"{arch} with model_type {cfg.get('model_type')!r}: not the model this name says"
    try:
        cfg = _normalised(cfg)
    except MoECompileError as e:
        return None, str(e)
    n = cfg.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        return None, f"{arch} config has no valid num_hidden_layers ({n!r})"
    try:
        _select_layers(layers, n)
    except MoECompileError as e:
        return None, str(e)
    return cfg, ""


def native_support(config, layers=None) -> tuple[str | None, str]:
    """(native class name, "") when the native upcycle applies to this dense config (dict, transformers config or
    checkpoint folder) and this layer selection, else (None, the reason in one line)."""
    cfg, reason = family_support(config, layers)
    if cfg is None:
        return None, reason
    arch = cfg["architectures"][0]
    family = FAMILIES[arch]
    if cfg.get("attention_bias") and family is MIXTRAL:
        return None, f"{arch} with attention_bias=True: {family.target} attention has no biases"
    if cfg.get("mlp_bias"):
        return None, f"{arch} with mlp_bias=True: {family.target} experts have no biases"
    types = set(cfg.get("layer_types") or [])
    if family is QWEN3_MOE and len(types) > 1:  # Qwen3-MoE applies one sliding window to all layers or none
        return None, f"{arch} mixes {' and '.join(sorted(types))} layers: {family.target} cannot"
    n = cfg["num_hidden_layers"]
    selected = _select_layers(layers, n)
    if not family.per_layer_dense and len(selected) != n:
        return None, (f"{family.target} has no dense layers: the native format makes all {n} FFNs MoE (asked for "
                      f"{len(selected)})")
    return family.target, ""


def native_target(config, layers=None) -> str | None:
    """The native HF MoE class this dense config upcycles into (e.g. "MixtralForCausalLM"), or None; see
    native_support for the reason."""
    return native_support(config, layers)[0]


def _select_layers(layers, n: int) -> list[int]:
    selected = parse_layers(layers, n)
    if not selected:
        raise MoECompileError(f"no layers selected by {layers!r}: nothing to upcycle")
    return selected


def native_config(config, experts: int, top_k: int, layers=None, dtype: str | None = None) -> dict:
    """config.json of the native MoE model: every field the source shares with the native config class, plus the
    MoE fields. Raises MoECompileError when the native format does not apply."""
    import transformers

    cfg = _config_dict(config)
    target, reason = native_support(cfg, layers)
    if target is None:
        raise MoECompileError(f"cannot upcycle into a native MoE architecture: {reason}; moecompile's format "
                              "(moeize + save, or convert --format moecompile) takes any layer selection")
    knobs.check_top_k(top_k, knobs.check_experts(experts))
    dtype = dtype or cfg.get("dtype") or cfg.get("torch_dtype")
    cfg = _normalised(cfg)
    family = FAMILIES[cfg["architectures"][0]]
    n = cfg["num_hidden_layers"]
    selected = _select_layers(layers, n)
    cls = getattr(transformers, family.config_class)
    fields = set(cls().to_dict())
    kwargs = {k: v for k, v in cfg.items() if (k in fields or k in ALWAYS_COPIED) and k not in NOT_COPIED}
    kwargs.update({family.experts_key: experts, "num_experts_per_tok": top_k, "output_router_logits": False})
    if family is MIXTRAL:
        kwargs["router_jitter_noise"] = 0.0  # the upcycled model must compute the dense function
    else:
        kwargs.update(moe_intermediate_size=cfg["intermediate_size"], decoder_sparse_step=1, norm_topk_prob=True,
                      mlp_only_layers=[i for i in range(n) if i not in selected])
    if family is QWEN3_MOE:
        sliding = "sliding_attention" in (cfg.get("layer_types") or [])
        kwargs.update(use_sliding_window=sliding, sliding_window=cfg.get("sliding_window") if sliding else None)
    if family is QWEN2_MOE:  # same attention as Qwen2 (q/k/v biases, per-layer sliding windows); empty shared expert
        kwargs.update(qkv_bias=True, shared_expert_intermediate_size=0, layer_types=cfg["layer_types"],
                      max_window_layers=cfg["max_window_layers"])
    try:
        out = cls(**kwargs).to_dict()
    except Exception as e:  # noqa: BLE001 - transformers' validation of a field: the user's config is at fault
        raise MoECompileError(f"cannot build {family.config_class} from the source config: {e}") from None
    out["architectures"] = [family.target]
    out[family.experts_key] = experts  # transformers 5 writes an alias (num_local_experts): keep the published key
    if dtype:
        out["dtype"] = out["torch_dtype"] = str(dtype).removeprefix("torch.")  # transformers 5 / 4 spellings
    return out


# ------------------------------------------------------------------------------------------------- source reading

def check_source(cfg: dict, directory: Path) -> dict:
    """The source's tensors (from the headers), checked against config.json by the one validation (validate.py)."""
    import transformers

    return validate.check_folder(directory, getattr(transformers, _architecture(cfg)))


# ----------------------------------------------------------------------------------------------- plan and writing

def _plan(tensors: dict, family: Family, selected: list[int], experts: int, out_dtype: torch.dtype | None,
          tied: bool) -> list[_Tensor]:
    """Every output tensor in writing order: a layer's E copies of one projection follow each other, so each source
    tensor is read once."""
    def dtype_of(st: str) -> str:
        return TORCH_TO_ST[out_dtype] if out_dtype is not None and ST_DTYPES[st].is_floating_point else st

    moe = set(selected)
    plan = []
    for name in sorted(tensors, key=natural_key):
        _, shape, st = tensors[name]
        if tied and name == "lm_head.weight":
            continue  # tied to the embeddings: the native model ties it again on load
        m = LAYER_RE.match(name)
        proj = name[m.end():].removeprefix("mlp.").removesuffix(".weight") if m else None
        if m and int(m.group(1)) in moe and name == f"{m.group(0)}mlp.{proj}.weight" and proj in FFN_PROJS:
            block = f"{m.group(0)}{family.moe_prefix}"
            if proj == FFN_PROJS[0]:  # the router (and an empty shared expert), before the experts of its layer
                hidden = shape[1]
                plan.append(_Tensor(f"{block}.gate.weight", (experts, hidden), dtype_of(st),
                                    router_layer=int(m.group(1))))
                if family.shared_expert:
                    plan += [_Tensor(f"{block}.shared_expert.{p}.weight", (hidden, 0) if p == "down_proj" else
                                     (0, hidden), dtype_of(st), zeros=True) for p in FFN_PROJS]
                    plan.append(_Tensor(f"{block}.shared_expert_gate.weight", (1, hidden), dtype_of(st), zeros=True))
            for e in range(experts):
                plan.append(_Tensor(f"{block}.experts.{e}.{family.expert_names[proj]}.weight", shape, dtype_of(st),
                                    source=name, noise_key=(int(m.group(1)), FFN_PROJS.index(proj), e)))
        else:
            plan.append(_Tensor(name, shape, dtype_of(st), source=name))
    return plan


def natural_key(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


class _Reader:
    """Reads plan tensors one at a time, keeping only the last one (the next expert copies it again)."""

    def __init__(self, tensors: dict, seed: int, router_std: float, noise: float = 0.0, allow_nonfinite: bool = False):
        self.tensors, self.seed, self.router_std, self.noise = tensors, seed, router_std, noise
        self.allow_nonfinite = allow_nonfinite
        self.last: tuple | None = None

    def __call__(self, t: _Tensor) -> torch.Tensor:
        if self.noise > 0 and t.noise_key is not None:
            return upcycle_copy(self._read(t), self.seed, *t.noise_key, self.noise)
        return self._read(t)

    def _read(self, t: _Tensor) -> torch.Tensor:
        key = (t.source, t.router_layer, t.zeros, t.shape, t.dtype)
        if self.last is not None and self.last[0] == key:
            return self.last[1]
        self.last = None  # free the previous tensor before reading the next one
        if t.zeros:
            value = torch.zeros(t.shape, dtype=ST_DTYPES[t.dtype])
        elif t.router_layer is not None:
            value = upcycle_router(self.seed, t.router_layer, *t.shape, self.router_std).to(ST_DTYPES[t.dtype])
        else:
            value = validate.read_checked(self.tensors[t.source][0], t.source, self.allow_nonfinite).to(
                ST_DTYPES[t.dtype])
        self.last = (key, value.contiguous())
        return self.last[1]


# ------------------------------------------------------------------------------------------------------ conversion

def upcycle_native(source: str | os.PathLike, out: str | os.PathLike, experts: int, top_k: int = 2, layers=None,
                   seed: int = 0, dtype: str | torch.dtype | None = None,
                   max_shard_size: str | int = DEFAULT_SHARD_SIZE, router_std: float = ROUTER_STD,
                   noise: float = 0.0, fp8: bool = False, progress: bool = True,
                   record: dict | None = None, allow_nonfinite: bool = False) -> NativeResult:
    """Upcycle the dense HF checkpoint folder `source` into `out` in its native HF MoE architecture (see
    native_support), streaming: every expert a copy of the dense FFN, routers normal(0, router_std) drawn from
    `seed`. `noise` > 0 adds normal noise of noise * std(W) to each expert copy of W (as moeize's upcycle does:
    breaks the symmetry of the copies, no longer exactly the dense model). `dtype` converts floating tensors while
    streaming. `fp8` writes the experts in transformers' FineGrainedFP8 layout (moecompile.io.hf_fp8), quantised from
    the copies (in the source's precision, before any `dtype` cast) as they stream. `record` (how it was made:
    capacity factor, source, ...) goes into config.json's "moecompile" entry, which transformers ignores and
    moecompile reads, and into the model card README.md. Source weights holding NaN or infinity are refused unless
    `allow_nonfinite`. `out` appears complete or not at all."""
    start = time.perf_counter()
    source = Path(source)
    if not source.is_dir():
        raise MoECompileError(f"no such checkpoint folder: {source}")
    check_output_dir(out)  # before reading any weight
    out_dtype = parse_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    if router_std < 0 or noise < 0:
        raise MoECompileError(f"router_std and noise must be >= 0, got {router_std} and {noise}")
    cfg = read_config(source)
    dtype_name = str(out_dtype).removeprefix("torch.") if out_dtype is not None else None
    config = native_config(cfg, experts, top_k, layers, dtype_name)  # validates family, layers, experts, top_k
    config[NATIVE_RECORD] = {"method": "upcycle", **(record or {})}  # also how moecompile.load recognises it
    family = FAMILIES[_architecture(cfg)]
    selected = _select_layers(layers, cfg["num_hidden_layers"])
    tensors = check_source(cfg, source)
    plan = _plan(tensors, family, selected, experts, out_dtype, bool(config.get("tie_word_embeddings")))
    if "dtype" not in config:  # the source config named none: that of the embeddings
        config["dtype"] = config["torch_dtype"] = str(ST_DTYPES[next(
            t.dtype for t in plan if t.name.endswith("embed_tokens.weight"))]).removeprefix("torch.")
    read = _Reader(tensors, seed, router_std, noise, allow_nonfinite)
    written = plan
    if fp8:
        from moecompile.io.hf_fp8 import FP8Reader, fp8_entries, hf_quantization_config

        # experts quantised from the source's precision, as convert --fp8 does before any --dtype rounding
        written = [q for t in plan for q in (fp8_entries(replace(t, dtype=tensors[t.source][2]))
                                             if t.noise_key is not None else [t])]
        read = FP8Reader(read)
        config["quantization_config"] = hf_quantization_config(config, source)
    files = shard(written, max_bytes)
    with atomic_directory(out) as tmp:
        total = write_weights(tmp, files, read, f"upcycle -> {family.target}", progress)
        write_config(tmp, config)
        copy_tokenizer(source, tmp)
        (tmp / "README.md").write_text(_model_card(source, family.target, experts, top_k, selected, seed, noise,
                                                   router_std, fp8, record or {}))
        copy_generation_config(source, tmp)  # generation defaults stay the source's

    source_params = sum(Entry(k, shape, st).numel for k, (_, shape, st) in tensors.items())
    return NativeResult(Path(out), family.target, source_params, sum(t.numel for t in plan), total, len(files),
                        selected, time.perf_counter() - start)


def _model_card(source: Path, target: str, experts: int, top_k: int, selected: list[int], seed: int, noise: float,
                router_std: float, fp8: bool, record: dict) -> str:
    exact = ("every expert a copy of the dense FFN and the top-k weights renormalised, so the model equals the dense "
             "one exactly while no token is dropped (transformers runs it dropless)" if not noise else
             f"every expert a copy of the dense FFN plus normal noise of {noise} x std(W): close to the dense model, "
             "not equal")
    lines = [f"# {target} upcycled from {record.get('source', source.name)}", "",
             f"Made with moecompile: each FFN of layers {_ranges(selected)} became a {target} sparse block of "
             f"{experts} experts, top-{top_k}, softmax routing (routers drawn from normal(0, {router_std}), "
             f"seed {seed}); "
             f"{exact}.", ""]
    if fp8:
        lines += ["The experts are stored in FP8 (float8_e4m3fn, 128x128 block scales, transformers' FineGrainedFP8 "
                  "layout): close to the dense model, not equal.", ""]
    if target == QWEN2_MOE.target:
        lines += ["The shared expert is empty (shared_expert_intermediate_size 0): it adds exactly 0.", ""]
    if "capacity_factor" in record:
        lines += [f"Capacity factor chosen at conversion: {record['capacity_factor']} (config.json `moecompile`; "
                  "`moecompile.compile` applies it, transformers runs dropless).", ""]
    lines += ["Load it with plain transformers: `AutoModelForCausalLM.from_pretrained(folder)`.", ""]
    return "\n".join(lines)


def _ranges(layers: list[int]) -> str:
    runs, start = [], layers[0]
    for prev, cur in zip(layers, layers[1:] + [None]):
        if cur != prev + 1 if cur is not None else True:
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(runs)


def parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and not dtype.is_floating_point:
            raise MoECompileError(f"dtype must be a floating type, got {dtype}")
        return dtype
    name = str(dtype).removeprefix("torch.").lower()
    if name not in knobs.DTYPES:
        raise MoECompileError(f"unknown dtype {dtype!r}; expected one of {', '.join(sorted(knobs.DTYPES))}")
    return getattr(torch, knobs.DTYPES[name])
