"""Streaming neuron split of a dense Hugging Face checkpoint folder into moecompile's format: `convert --method
split` without --calib, for the families whose FFNs native.py finds by name (LLaMA, Mistral, Qwen2, Qwen3:
model.layers.N.mlp.gate_proj / up_proj / down_proj).

The model is never built. config.json and the safetensors headers give every FFN, and a block of meta tensors gives
every output tensor's name, shape and dtype, so the shards are planned before any weight is read. Then each FFN's
weights are read and handed to moeize.build_block, the function the in-memory moeize calls (same k-means partition,
experts and router); the block's tensors are written and dropped, and every other tensor is copied through. Peak
memory: a small constant plus one FFN and its block, whatever the model size.

The folder holds bit for bit the tensors, config.json (layout included) and generation config that
`moeize(model, method="split")` and `checkpoint.save` write for the model as transformers loads it, for the same seed.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moecompile.conversion import validate
from moecompile.conversion.native import LAYER_RE, check_source, family_support, natural_key, parse_dtype
from moecompile.core.errors import MoECompileError
from moecompile.ffn.build import block_config, build_block, check_ffns, check_options
from moecompile.ffn.layers import parse_layers
from moecompile.ffn.match import FFNMatch, LinearRef, dense_ffn
from moecompile.io.checkpoint import (
    CONFIG,
    DEFAULT_SHARD_SIZE,
    atomic_directory,
    check_output_dir,
    copy_tokenizer,
    read_config,
    weight_files,
    write_moe_config,
)
from moecompile.io.stream import ST_DTYPES, TORCH_TO_ST, Entry, parse_size, shard, write_weights
from moecompile.ir import layout
from moecompile.ir.block import MoEBlock
from moecompile.ir.config import identify_activation
from moecompile.ir.knobs import CAPACITY_FACTOR, TOP_K

METHOD = "split"


@dataclass
class SplitResult:
    out: Path
    blocks: list[str]  # the paths of the MoE blocks written
    source_params: int
    output_bytes: int
    shards: int
    dtype: torch.dtype
    seconds: float


@dataclass
class _Tensor(Entry):  # one output tensor of the plan
    source: str | None = None  # a source tensor copied through (cast as the in-memory path casts it)
    layer: int | None = None  # or: a tensor of this layer's MoE block


def _ffn_path(layer: int) -> str:
    return f"model.layers.{layer}.mlp"  # the FFN module the block replaces whole (as moeize's _plan finds)


def _support(directory: Path, layers) -> tuple[dict | None, str | None, str]:
    """(config as transformers reads it, the FFN activation, "") when the streaming split applies, else
    (None, None, why)."""
    cfg, reason = family_support(directory, layers)
    if cfg is None:
        return None, None, reason
    if not read_config(directory).get("architectures"):  # the in-memory path would build the headless AutoModel
        return None, None, "config.json names no architectures"
    from transformers.activations import ACT2FN

    act = cfg.get("hidden_act")
    activation = identify_activation(ACT2FN[act]) if act in ACT2FN else None
    if activation is None:
        return None, None, f"activation {act!r} is none moecompile's blocks compute"
    return cfg, activation, ""


def split_support(directory: str | os.PathLike, layers=None) -> tuple[bool, str]:
    """(True, "") when the streaming split applies to this checkpoint folder and layer selection, else (False, the
    reason in one line)."""
    cfg, _, reason = _support(Path(directory), layers)
    return cfg is not None, reason


def _match(layer: int, tensors: dict, activation: str) -> FFNMatch:
    """The gated FFN of a decoder layer, as find_ffns would match it, named by its parameters (no graph)."""
    def ref(proj: str) -> LinearRef:
        bias = f"{_ffn_path(layer)}.{proj}.bias"
        return LinearRef(None, f"{_ffn_path(layer)}.{proj}.weight", bias if bias in tensors else None, True)

    return FFNMatch(up=ref("up_proj"), down=ref("down_proj"), gate=ref("gate_proj"), activation=activation)


def _parameters(match: FFNMatch) -> list[str]:
    """The names of an FFN's weights and biases."""
    return [n for r in match.linears for n in (r.weight, r.bias) if n is not None]


def _load_dtype(hf_config, tensors: dict, first_file: Path) -> torch.dtype:
    """The dtype transformers loads the dense model in (from_pretrained's dtype "auto"): config.json's, else that of
    the first floating tensor of the first weight file."""
    dtype = getattr(hf_config, "dtype", None)
    if dtype is not None:
        return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."))
    stored = [ST_DTYPES[st] for path, _, st in tensors.values() if path == first_file]
    return next((d for d in stored if d.is_floating_point), torch.get_default_dtype())


class _Reader:
    """Produces the plan's tensors: a copied tensor on its own; a block's tensors by building the whole block once
    and handing them out until none is left, so at most one FFN and its block are held."""

    def __init__(self, tensors: dict, matches: dict, knobs: dict, load: torch.dtype, out: torch.dtype,
                 allow_nonfinite: bool = False):
        self.tensors, self.matches, self.knobs, self.load, self.out = tensors, matches, knobs, load, out
        self.allow_nonfinite = allow_nonfinite
        self.block: dict[str, torch.Tensor] = {}

    def _cast(self, value: torch.Tensor) -> torch.Tensor:
        # as the in-memory path: loaded in the load dtype, then model.to(--dtype)
        return value.to(self.load).to(self.out) if value.is_floating_point() else value

    def __call__(self, t: _Tensor) -> torch.Tensor:
        if t.layer is None:
            return self._cast(self._read(t.source))
        if t.name not in self.block:
            self.block = {}  # free the previous block before building the next
            self.block = self._build(t.layer)
        return self.block.pop(t.name)

    def _read(self, name: str) -> torch.Tensor:
        return validate.read_checked(self.tensors[name][0], name, self.allow_nonfinite)

    def _build(self, layer: int) -> dict[str, torch.Tensor]:
        match = self.matches[layer]
        # the read tensors die with this dict once dense_ffn has concatenated gate and up
        ffn = dense_ffn({n: self._read(n).to(self.load) for n in _parameters(match)}, match, _ffn_path(layer))
        block = build_block(ffn, method=METHOD, index=layer, **self.knobs)
        return {f"{_ffn_path(layer)}.{k}": self._cast(v) for k, v in block.state_dict().items()}


def _plan(tensors: dict, configs: dict, tied: bool, out: torch.dtype) -> list[_Tensor]:
    """Every output tensor in writing order (the source's, natural order), a block's tensors where its FFN was."""
    def dtype_of(st: str) -> str:
        return TORCH_TO_ST[out] if ST_DTYPES[st].is_floating_point else st

    plan, placed = [], set()
    for name in sorted(tensors, key=natural_key):
        _, shape, st = tensors[name]
        if tied and name == "lm_head.weight":
            continue  # save_pretrained stores tied weights once, as the embeddings
        m = LAYER_RE.match(name)
        layer = int(m.group(1)) if m else None
        if layer not in configs or not name.startswith(_ffn_path(layer) + "."):
            plan.append(_Tensor(name, shape, dtype_of(st), source=name))
        elif layer not in placed:
            placed.add(layer)
            with torch.device("meta"):
                state = MoEBlock(configs[layer]).state_dict()
            plan += [_Tensor(f"{_ffn_path(layer)}.{k}", tuple(v.shape), TORCH_TO_ST[out], layer=layer)
                     for k, v in state.items()]
    return plan


def _write_configs(tmp: Path, source: Path, hf_config, out: torch.dtype, blocks: list[dict]) -> None:
    """config.json and generation_config.json as save_pretrained writes them for the loaded model, then checkpoint's
    moe section."""
    from transformers import GenerationConfig

    hf_config.dtype = str(out).removeprefix("torch.")  # save_pretrained records the model's dtype
    hf_config.save_pretrained(tmp)
    write_moe_config(tmp, read_config(tmp), {"blocks": blocks})
    try:  # as from_pretrained finds it: the folder's generation_config.json, else one made from config.json
        generation = GenerationConfig.from_pretrained(source, local_files_only=True)
    except OSError:
        generation = GenerationConfig.from_pretrained(source, config_file_name=CONFIG, _from_model_config=True,
                                                      local_files_only=True)
    generation.save_pretrained(tmp)


def split_checkpoint(source: str | os.PathLike, out: str | os.PathLike, experts: int, top_k: int = TOP_K,
                     capacity_factor: float = CAPACITY_FACTOR, layers=None, seed: int = 0,
                     dtype: str | torch.dtype | None = None, max_shard_size: str | int = DEFAULT_SHARD_SIZE,
                     progress: bool = True, allow_nonfinite: bool = False) -> SplitResult:
    """Split every selected FFN of the dense checkpoint folder `source` into `experts` experts and write the
    moecompile checkpoint `out`, streaming (see the module docstring); source weights holding NaN or infinity are
    refused unless `allow_nonfinite`; `out` appears complete or not at all."""
    start = time.perf_counter()
    source = Path(source)
    if not source.is_dir():
        raise MoECompileError(f"no such checkpoint folder: {source}")
    check_output_dir(out)  # before reading any weight
    check_options(experts, top_k, METHOD)
    out_dtype = parse_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    cfg, activation, reason = _support(source, layers)
    if cfg is None:
        raise MoECompileError(f"cannot stream a split of {source}: {reason}")
    tensors = check_source(cfg, source)
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(source)  # checked buildable by check_source
    load = _load_dtype(hf_config, tensors, weight_files(source)[0])
    out_dtype = out_dtype or load
    selected = parse_layers(layers, cfg["num_hidden_layers"])
    matches = {i: _match(i, tensors, activation) for i in selected}
    # the FFNs as meta tensors: their block configs (and the split's divisibility check) before any weight is read
    meta = {i: dense_ffn({n: torch.empty(tensors[n][1], dtype=load, device="meta") for n in _parameters(matches[i])},
                         matches[i], _ffn_path(i)) for i in selected}
    check_ffns(list(meta.values()), experts, METHOD)
    configs = {i: block_config(meta[i], experts, top_k, capacity_factor, METHOD) for i in selected}
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    plan = _plan(tensors, configs, tied, out_dtype)
    knobs = dict(experts=experts, top_k=top_k, capacity_factor=capacity_factor, seed=seed)
    files = shard(plan, max_bytes)
    with atomic_directory(out) as tmp:
        read = _Reader(tensors, matches, knobs, load, out_dtype, allow_nonfinite)
        total = write_weights(tmp, files, read, "split", progress)
        _write_configs(tmp, source, hf_config, out_dtype,
                       [layout.entry(_ffn_path(i), configs[i], []) for i in selected])
        copy_tokenizer(source, tmp)
    source_params = sum(Entry(k, shape, st).numel for k, (_, shape, st) in tensors.items()
                        if not (tied and k == "lm_head.weight"))
    return SplitResult(Path(out), [_ffn_path(i) for i in selected], source_params, total, len(files), out_dtype,
                       time.perf_counter() - start)
