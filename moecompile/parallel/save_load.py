"""Expert-parallel checkpoints: every rank writes its own experts into one folder (the layout:
moecompile/io/ep_checkpoint.py), and reads them back on as many ranks."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moecompile.core.errors import MoECompileError
from moecompile.io import checkpoint, ep_checkpoint
from moecompile.ir import layout
from moecompile.parallel.groups import collectively, process_group
from moecompile.parallel.sharded import distribute, is_distributed


def save(model: nn.Module, directory, group: dist.ProcessGroup | None = None, tokenizer_dir=None):
    """Write an expert-parallel model from every rank of group into one folder: rank 0 writes config.json and the
    replicated tensors, each rank its own experts file. Collective and all-or-nothing: the folder appears once every
    rank has written; on any failure every rank raises MoECompileError and nothing is left behind."""
    group = process_group(group)
    if not is_distributed(model):
        raise MoECompileError("the model's experts are not sharded: save it with moecompile.save")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    directory = Path(directory)
    tmp = directory.parent / f".{directory.name}.ep.partial"  # a name every rank computes alike
    blocks = layout.get_layout(model)
    dense, experts = ep_checkpoint.split(ep_checkpoint.model_state(model), blocks)

    def start():
        checkpoint.check_output_dir(directory)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
        tmp.mkdir(parents=True)
        ep_checkpoint.write_common(tmp, ep_checkpoint.model_config(model), blocks, world, dense, tokenizer_dir)

    collectively(start if rank == 0 else None, group, f"saving {directory}")
    try:
        collectively(lambda: ep_checkpoint.write_shard(tmp, rank, world, experts), group, f"saving {directory}")
        collectively((lambda: checkpoint.publish(tmp, directory)) if rank == 0 else None, group,
                      f"saving {directory}")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def load(directory, model: nn.Module | None = None, group: dist.ProcessGroup | None = None,
         overlap_degree: int = 1) -> nn.Module:
    """Load a checkpoint onto every rank of group, experts sharded: an expert-parallel folder saved by as many
    ranks (each reads the replicated tensors and its own experts file), or a whole checkpoint (each keeps its
    slice). Pass `model` (a dense skeleton) for non-HF models, as for moecompile.load."""
    group = process_group(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    directory = Path(directory)
    config, moe = checkpoint.read_moe_config(directory)
    if ep_checkpoint.EP_KEY not in moe:
        return distribute(checkpoint.load(directory, model, progress=False), group, overlap_degree)
    saved = moe[ep_checkpoint.EP_KEY].get("world_size")
    if saved != world:
        raise MoECompileError(f"{directory} was saved by {saved} ranks but this group has {world}: reshard it with "
                              f"`moecompile checkpoint gather {directory} WHOLE` then `moecompile checkpoint "
                              f"scatter WHOLE OUT --world-size {world}`")
    loaded = {}

    def read():
        skeleton = model if model is not None else checkpoint.build_skeleton(config, directory)
        checkpoint.apply_layout(skeleton, moe["blocks"])
        distribute(skeleton, group, overlap_degree)
        tensors = ep_checkpoint.read_rank(directory, rank, world)
        params = dict(skeleton.named_parameters())
        for name, t in tensors.items():  # this rank's experts file holds the local shards of the DTensors
            p = params.get(name)
            if isinstance(p, DTensor):
                tensors[name] = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False)
        checkpoint.load_state(skeleton, tensors, directory)
        if hasattr(skeleton, "tie_weights"):
            skeleton.tie_weights()
        loaded["model"] = skeleton.eval()

    collectively(read, group, f"loading {directory}")
    return loaded["model"]
