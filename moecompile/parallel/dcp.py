"""Checkpoints through torch.distributed.checkpoint (DCP): saved from any mesh, loaded on any other.

    config.json         the model's config + "moe": {..., "dcp": {"world_size": W, "tied": [...]}}
    .metadata           DCP's index of every tensor (global shapes) and of the chunks each rank wrote
    __0_0.distcp ...    DCP's per-rank data files
    tokenizer files

Tensors are saved under their global names and shapes (state dict key "model.<name>", and "optim.<...>" with an
optimizer): an expert weight is one [E, ...] tensor whatever the ep degree, a dense one whole whatever the FSDP
sharding. Loading reads into whatever layout the model has now (expert-parallel over another mesh, FSDP-sharded,
or a plain single-process model): DCP reshards. `export` (`moecompile checkpoint export-dcp SRC OUT`) writes the
single-folder safetensors checkpoint that moecompile.load reads.
"""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from moecompile.core.errors import MoECompileError
from moecompile.io import checkpoint
from moecompile.ir import layout
from moecompile.parallel.groups import collectively

DCP_KEY = "dcp"
METADATA = ".metadata"
MODEL, OPTIM = "model", "optim"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _dcp_load(state: dict, directory: Path, no_dist: bool) -> None:
    with warnings.catch_warnings():  # one process on purpose: DCP's "assuming the intent is ..." notice
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=directory, no_dist=no_dist)


def _tied_names(model: nn.Module) -> list[str]:
    """Parameter names that alias an earlier one (tied embeddings): written once by export."""
    seen, tied = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.append(name)
        seen.add(id(p))
    return tied


def is_dcp_checkpoint(directory: str | os.PathLike) -> bool:
    return (Path(directory) / METADATA).is_file() and (Path(directory) / checkpoint.CONFIG).is_file()


def _read(directory: Path) -> tuple[dict, dict]:
    config, moe = checkpoint.read_moe_config(directory)
    if DCP_KEY not in moe or not (directory / METADATA).is_file():
        raise MoECompileError(f"{directory} is not a DCP checkpoint (no {METADATA}, or config.json has no "
                              f"moe.{DCP_KEY}): save it with moecompile.parallel.dcp.save")
    return config, moe


def _check_layout(model: nn.Module, moe: dict, directory: Path) -> None:
    saved = {b["path"]: b["config"] for b in moe["blocks"]}
    here = {b["path"]: b["config"] for b in layout.get_layout(model)}
    if here and saved != here:
        diff = sorted(set(saved) ^ set(here)) or [p for p in saved if saved[p] != here.get(p)]
        raise MoECompileError(f"{directory} was saved from a model with other MoE blocks than this one (first "
                              f"difference: {diff[0]})")


def save(model: nn.Module, directory: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
         tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Save model (expert-parallel, FSDP-sharded, both, or plain) and optionally its optimizer's state with DCP,
    from every rank (collective when torch.distributed is initialized). All-or-nothing: written into a hidden
    sibling folder and renamed into place by rank 0 once every rank has written; on failure every rank raises."""
    from moecompile.io.ep_checkpoint import model_config

    directory = Path(directory)
    distributed = _distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    tmp = directory.parent / f".{directory.name}.dcp.partial"  # a name every rank computes alike
    state = {MODEL: get_model_state_dict(model)}
    if optimizer is not None:
        state[OPTIM] = get_optimizer_state_dict(model, optimizer)

    def start():
        checkpoint.check_output_dir(directory)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
        tmp.mkdir(parents=True)

    def finish():
        checkpoint.write_moe_config(tmp, model_config(model), {
            "blocks": layout.get_layout(model), DCP_KEY: {"world_size": world, "tied": _tied_names(model)}})
        checkpoint.copy_tokenizer(tokenizer_dir, tmp)
        checkpoint.publish(tmp, directory)

    def step(fn, here: bool):
        if distributed:
            collectively(fn if here else None, dist.group.WORLD, f"saving {directory}")
        elif here:
            fn()

    step(start, rank == 0)
    try:
        step(lambda: dcp.save(state, checkpoint_id=tmp, no_dist=not distributed), True)
        step(finish, rank == 0)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def build(directory: str | os.PathLike, model: nn.Module | None = None) -> nn.Module:
    """The model a DCP checkpoint was saved from, unparallelised, with random weights (the MoE blocks where the
    layout says): distribute / shard it as you will, then `load` into it. Pass `model` (a dense skeleton) for
    non-HF models."""
    directory = Path(directory)
    config, moe = _read(directory)
    if model is None:
        model = checkpoint.build_skeleton(config, directory)
    return checkpoint.apply_layout(model, moe["blocks"])


def load(directory: str | os.PathLike, model: nn.Module | None = None,
         optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
    """Load a DCP checkpoint into model as it is laid out now (any mesh, any world size, or one process: DCP
    reshards), and into optimizer's state if given. model None: build(directory) on this process, loaded."""
    directory = Path(directory)
    _, moe = _read(directory)
    if model is None:
        model = build(directory)
    _check_layout(model, moe, directory)
    state = {MODEL: get_model_state_dict(model)}
    if optimizer is not None:
        state[OPTIM] = get_optimizer_state_dict(model, optimizer)
    try:
        _dcp_load(state, directory, no_dist=not _distributed())
    except Exception as e:  # noqa: BLE001 - DCP raises its own CheckpointException with every rank's error
        raise MoECompileError(f"loading {directory} failed: {str(e).strip().splitlines()[0]}") from e
    set_model_state_dict(model, state[MODEL])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state[OPTIM])
    return model


def export(source: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write a DCP checkpoint's model as one single-folder safetensors checkpoint (moecompile.load reads it): every
    tensor whole, tied duplicates once. Runs in one process, whatever world size saved it."""
    source = Path(source)
    config, moe = _read(source)
    checkpoint.check_output_dir(out)
    metadata = dcp.FileSystemReader(str(source)).read_metadata()
    prefix = f"{MODEL}."
    tied = set(moe[DCP_KEY].get("tied", []))
    state = {key: torch.empty(m.size, dtype=m.properties.dtype)
             for key, m in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(m, TensorStorageMetadata) and key[len(prefix):] not in tied}
    if not state:
        raise MoECompileError(f"{source} holds no model tensors")
    _dcp_load(state, source, no_dist=True)
    tensors = {key[len(prefix):]: t.contiguous() for key, t in state.items()}
    with checkpoint.atomic_directory(out) as tmp:
        checkpoint.write_moe_config(tmp, config, {k: v for k, v in moe.items() if k != DCP_KEY})
        save_file(tensors, str(tmp / checkpoint.WEIGHTS), metadata={"format": "pt"})
        checkpoint.copy_tokenizer(source, tmp)
    return Path(out)
