"""Process groups: joining one (torchrun's environment, a clear error on timeout), the group or 1-D mesh the
experts are sharded over, and a collective step that fails on every rank when it fails on one."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from moecompile.core import settings
from moecompile.core.errors import MoECompileError

DEFAULT_TIMEOUT_S = 300.0


def first_line(e: BaseException) -> str:
    """The first line of an error's message (its type name when it has none): one-line MoECompileErrors."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def init(backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S, init_method: str | None = None,
         rank: int | None = None, world_size: int | None = None) -> dist.ProcessGroup:
    """Join the process group (torchrun's environment unless rank/world_size/init_method are given): gloo on CPU,
    NCCL when CUDA is available. Peers that do not all arrive within `timeout` seconds raise MoECompileError
    (instead of waiting forever); the same timeout bounds every later collective (gloo raises, NCCL aborts)."""
    if dist.is_initialized():
        return dist.group.WORLD
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and settings.local_rank() is not None:
        torch.cuda.set_device(settings.local_rank())
    kwargs = {k: v for k, v in (("rank", rank), ("world_size", world_size)) if v is not None}
    try:
        dist.init_process_group(backend, init_method=init_method, timeout=timedelta(seconds=timeout), **kwargs)
    except (RuntimeError, ValueError, TimeoutError) as e:  # DistStoreError, DistNetworkError: RuntimeErrors
        size = world_size or settings.world_size("?")
        raise MoECompileError(f"could not form the process group of {size} ranks within {timeout:g} s "
                              f"(a peer is unreachable or was never started): {first_line(e)}") from e
    return dist.group.WORLD


def process_group(group: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise MoECompileError("torch.distributed is not initialized: launch with torchrun and call "
                              "moecompile.distributed.init() (or torch.distributed.init_process_group) first")
    if isinstance(group, DeviceMesh):
        return device_mesh(group).get_group()
    return group if group is not None else dist.group.WORLD


def device_mesh(group: dist.ProcessGroup | DeviceMesh | None) -> DeviceMesh:
    """The 1-D mesh the experts are sharded over: the one given, or one over the process group's ranks."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise MoECompileError(f"expert parallelism takes one dimension of a DeviceMesh (e.g. mesh['ep']), got "
                                  f"a {group.ndim}-D mesh {group.mesh_dim_names}")
        return group
    group = process_group(group)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    return DeviceMesh.from_group(group, device)


def collectively(step, group: dist.ProcessGroup, what: str) -> None:
    """Run step (on this rank; None: nothing to do here), then agree across the group: if it failed anywhere,
    every rank raises, instead of the others waiting in their next collective until the timeout."""
    error = None
    if step is not None:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - whatever failed here, the other ranks must hear of it
            error = e
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=device)
    flags[dist.get_rank(group)] = int(error is not None)
    dist.all_reduce(flags, group=group)
    failed = flags.nonzero().flatten().tolist()
    if error is not None:
        raise MoECompileError(f"{what} failed: {error}") from error
    if failed:
        raise MoECompileError(f"{what} failed on rank(s) {', '.join(map(str, failed))}")
