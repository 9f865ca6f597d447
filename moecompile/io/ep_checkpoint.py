"""Expert-parallel checkpoints: one folder, the experts split into one safetensors file per rank.

    config.json                              the model's config + "moe": {..., "expert_parallel": {"world_size": W}}
    dense.safetensors                        every replicated tensor (router, attention, embeddings, ...)
    experts-00000-of-00002.safetensors       rank 0's experts: <block>.experts.w_in [E/W, F, H], ... (full names)
    experts-00001-of-00002.safetensors
    tokenizer files

`moecompile checkpoint scatter` turns a checkpoint that `moecompile.save` wrote into this layout for W ranks,
`gather` turns it back (gather(scatter(c)) has c's tensors and config); moecompile.distributed.save / load write
and read it from a running group, each rank touching only its own experts file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from moecompile.core.errors import MoECompileError
from moecompile.io import checkpoint
from moecompile.ir.sharding import EXPERT_TENSORS, local_experts

EP_KEY = "expert_parallel"
DENSE = "dense.safetensors"
SAFETENSORS_METADATA = {"format": "pt"}


def shard_name(rank: int, world_size: int) -> str:
    return f"experts-{rank:05d}-of-{world_size:05d}.safetensors"


def expert_names(blocks: list[dict]) -> dict[str, int]:
    """Name of every expert tensor a layout can hold -> its block's number of experts."""
    return {f"{b['path']}.experts.{n}": b["config"]["num_experts"] for b in blocks for n in EXPERT_TENSORS}


def split(tensors: dict[str, torch.Tensor], blocks: list[dict]) -> tuple[dict, dict]:
    """(replicated tensors, expert tensors) of a state."""
    experts = expert_names(blocks)
    return ({k: v for k, v in tensors.items() if k not in experts},
            {k: v for k, v in tensors.items() if k in experts})


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors, each stored once (a tied weight keeps its first name, as save_pretrained does)."""
    from torch.distributed.tensor import DTensor

    seen, out = set(), {}
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):  # an expert-parallel model's experts: this rank's shard
            t = t.to_local()
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() == 0 or key not in seen:
            seen.add(key)
            out[name] = t.detach().cpu().contiguous()
    return out


def model_config(model: nn.Module) -> dict:
    """config.json of a Hugging Face model (what save_pretrained writes), or {} for other models."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return {}
    out = json.loads(config.to_json_string(use_diff=True))
    cls = type(model)
    if cls.__name__.startswith("FSDP") and len(cls.__mro__) > 2:  # fully_shard's subclass FSDP<Name>(FSDPModule, Name)
        cls = next(c for c in cls.__mro__[1:] if c.__name__ == cls.__name__[4:])
    out["architectures"] = [cls.__name__]
    return out


def write_common(directory: Path, config: dict, blocks: list[dict], world_size: int, dense: dict,
                 tokenizer_dir=None) -> None:
    """Everything but the expert shards: config.json, dense.safetensors, tokenizer files."""
    checkpoint.write_moe_config(directory, config, {"blocks": blocks, EP_KEY: {"world_size": world_size}})
    save_file(dense, str(directory / DENSE), metadata=SAFETENSORS_METADATA)
    checkpoint.copy_tokenizer(tokenizer_dir, directory)


def write_shard(directory: Path, rank: int, world_size: int, experts: dict) -> None:
    save_file({k: v.contiguous() for k, v in experts.items()}, str(directory / shard_name(rank, world_size)),
              metadata=SAFETENSORS_METADATA)


def read_sharded_config(directory: Path) -> tuple[dict, dict, int]:
    """(config, moe section, world size) of an expert-parallel checkpoint."""
    config, moe = checkpoint.read_moe_config(directory)
    world = (moe.get(EP_KEY) or {}).get("world_size")
    if not isinstance(world, int) or world < 1:
        raise MoECompileError(f"{directory} is not an expert-parallel checkpoint (config.json has no "
                              f"moe.{EP_KEY}.world_size): it was saved whole; `moecompile checkpoint scatter` "
                              f"shards it")
    return config, moe, world


def read_rank(directory: Path, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """The tensors one rank loads: the replicated ones and its own experts."""
    return checkpoint.read_tensors([directory / DENSE, directory / shard_name(rank, world_size)], progress=False)


def _check_experts(tensors: dict, blocks: list[dict], world_size: int, where: Path) -> None:
    names = expert_names(blocks)
    for block in blocks:
        local_experts(block["config"]["num_experts"], world_size)
    for name, t in tensors.items():
        if name in names and (t.dim() == 0 or t.shape[0] != names[name]):
            raise MoECompileError(f"{where}: {name} has shape {tuple(t.shape)}, expected {names[name]} experts "
                                  f"on its first dimension")


def scatter(source: str | os.PathLike, out: str | os.PathLike, world_size: int, progress: bool = True) -> Path:
    """Split a whole checkpoint (moecompile.save's) into the expert-parallel layout for world_size ranks."""
    source = Path(source)
    if not isinstance(world_size, int) or world_size < 1:
        raise MoECompileError(f"world size must be a positive integer, got {world_size!r}")
    config, moe = checkpoint.read_moe_config(source)
    if EP_KEY in moe:
        raise MoECompileError(f"{source} is already sharded over {moe[EP_KEY].get('world_size')} ranks: "
                              f"gather it first")
    checkpoint.check_output_dir(out)
    tensors = checkpoint.read_tensors(checkpoint.weight_files(source), progress)
    blocks = moe["blocks"]
    _check_experts(tensors, blocks, world_size, source)
    dense, experts = split(tensors, blocks)
    config = {k: v for k, v in config.items() if k != "moe"}
    with checkpoint.atomic_directory(out) as tmp:
        write_common(tmp, config, blocks, world_size, dense, tokenizer_dir=source)
        for rank in tqdm(range(world_size), desc="scatter", unit="rank", disable=not progress):
            shard = {}
            for name, t in experts.items():
                local = t.shape[0] // world_size
                shard[name] = t[rank * local:(rank + 1) * local]
            write_shard(tmp, rank, world_size, shard)
    return Path(out)


def gather(source: str | os.PathLike, out: str | os.PathLike, progress: bool = True) -> Path:
    """Merge an expert-parallel checkpoint into one whole checkpoint (loadable by moecompile.load)."""
    source = Path(source)
    config, moe, world = read_sharded_config(source)
    checkpoint.check_output_dir(out)
    blocks = moe["blocks"]
    for block in blocks:
        local_experts(block["config"]["num_experts"], world)
    tensors = checkpoint.read_tensors([source / DENSE], progress=False)
    if set(tensors) & set(expert_names(blocks)):
        raise MoECompileError(f"{source / DENSE} holds expert tensors: not an expert-parallel checkpoint")
    shards = [checkpoint.read_tensors([source / shard_name(r, world)], progress=False)
              for r in tqdm(range(world), desc="gather", unit="rank", disable=not progress)]
    names = set(shards[0])
    for rank, shard in enumerate(shards):
        if set(shard) != names or not names <= set(expert_names(blocks)):
            raise MoECompileError(f"{source / shard_name(rank, world)} does not hold the same expert tensors as "
                                  f"the other shards")
    for name in sorted(names):
        tensors[name] = torch.cat([shard[name] for shard in shards])
    _check_experts(tensors, blocks, 1, source)
    with checkpoint.atomic_directory(out) as tmp:
        checkpoint.write_moe_config(tmp, config, {k: v for k, v in moe.items() if k != EP_KEY})
        save_file(tensors, str(tmp / checkpoint.WEIGHTS), metadata=SAFETENSORS_METADATA)
        checkpoint.copy_tokenizer(source, tmp)
    return Path(out)
