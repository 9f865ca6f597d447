"""Expert parallelism on torch.distributed: each rank holds E/W experts and tokens cross ranks by all-to-all.

    import moecompile, moecompile.distributed as ep
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    ep.init()                                  # torchrun's env; gloo on CPU, NCCL on CUDA; clear error on timeout
    mesh = init_device_mesh("cpu", (dp, ep_size), mesh_dim_names=("dp", "ep"))
    moecompile.distribute(model, mesh["ep"])   # in place: every MoEBlock keeps E/W experts, DTensors on mesh["ep"]
    ep.apply_fsdp(model, mesh)                 # experts: fully_shard over "dp"; the rest over dp x ep
    loss.backward()                            # no hand-written gradient sync
    optimizer.step()

Expert gradients: the reverse all-to-all sums every ep rank's tokens into the owner's gradient, and the block scales
it by 1/W_ep, so it is the gradient of the mean of the ep group's losses; averaging it over the replicas of those
experts (FSDP/DDP over "dp") gives the gradient of the mean of every rank's loss, like the dense parameters'.

One block's call on rank r of W (L = E/W local experts, r holds experts r*L .. r*L+L-1, contiguous blocks):
  route -> dispatch: this rank's tokens as expert-contiguous rows, so the rows for rank w are one slice
  counts: all_to_all of the per-expert row counts, then one host sync (split sizes must be Python ints)
  all_to_all_single(rows) -> rows from every rank for the local experts, ordered [source rank][local expert]
  dispatch by local expert -> moecompile::experts on the local weights -> un-permute (combine with weight 1)
  all_to_all_single back (the splits reversed) -> combine with the routing weights, on the tokens' own rank.
With overlap_degree d > 1 each expert's rows are cut into d chunks; all d forward all-to-alls are issued before
the first chunk's experts run, and each chunk's return all-to-all is issued as soon as its experts are done.

`expert_parallel_experts` is that data path, written once: the module view calls it (functional collectives with
autograd), and the graph pass (passes/insert_all_to_all.py) traces it into c10d functional collective nodes.
"""
from __future__ import annotations

import contextlib
import shutil
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from moecompile import settings
from moecompile.errors import MoECompileError
from moecompile.io import checkpoint
from moecompile.ir import layout, ops
from moecompile.ir.block import MoEBlock, MoEExperts
from moecompile.ir.sharding import EXPERT_TENSORS, local_experts  # noqa: F401  (part of this module's API)

DEFAULT_TIMEOUT_S = 300.0


def _first_line(e: BaseException) -> str:
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
                              f"(a peer is unreachable or was never started): {_first_line(e)}") from e
    return dist.group.WORLD


def _group(group: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise MoECompileError("torch.distributed is not initialized: launch with torchrun and call "
                              "moecompile.distributed.init() (or torch.distributed.init_process_group) first")
    if isinstance(group, DeviceMesh):
        return _mesh(group).get_group()
    return group if group is not None else dist.group.WORLD


def _mesh(group: dist.ProcessGroup | DeviceMesh | None) -> DeviceMesh:
    """The 1-D mesh the experts are sharded over: the one given, or one over the process group's ranks."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise MoECompileError(f"expert parallelism takes one dimension of a DeviceMesh (e.g. mesh['ep']), got "
                                  f"a {group.ndim}-D mesh {group.mesh_dim_names}")
        return group
    group = _group(group)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    return DeviceMesh.from_group(group, device)


# ---- the data path ----------------------------------------------------------------------------------------------

class Exchange(NamedTuple):
    """Host-side split sizes of one call (per chunk c) and the small index tensors derived from them."""
    send: list  # send[c][w]: rows this rank sends to rank w in chunk c
    recv: list  # recv[c][w]: rows this rank receives from rank w in chunk c
    sent: int  # rows that go anywhere (the rest are dropped assignments)
    pad: int  # dropped rows, appended as zeros to the result
    chunk_ids: torch.Tensor | None  # [sent, 1] chunk of each sent row (overlap_degree > 1)
    chunk_start: list  # first row of chunk c among the chunk-major sent rows
    chunk_rows: list
    local_ids: list  # local_ids[c]: [rows, 1] local expert of each received row (more than one local expert)
    local_offsets: list  # local_offsets[c]: [1] int32 group end (one local expert)


def _piece(n: int, chunk: int, degree: int) -> int:
    """Rows of chunk `chunk` when n rows are cut into `degree` near-equal chunks."""
    return n * (chunk + 1) // degree - n * chunk // degree


@fx.wrap  # one graph node in the traced graph view: it synchronises the host, which no graph can express
def exchange_counts(offsets: torch.Tensor, rows: int, world_size: int, local: int, degree: int,
                    group_name: str) -> Exchange:
    """All-to-all of the per-expert row counts, then the one host sync of the call: every split size."""
    group = dist.distributed_c10d._resolve_process_group(group_name)
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1, dtype=torch.long))
    received = torch.empty_like(counts)  # [source rank, local expert]
    try:
        dist.all_to_all_single(received, counts, group=group)
        host = torch.cat([counts, received]).tolist()
    except RuntimeError as e:  # gloo: a peer that exited or hangs past the group's timeout
        raise MoECompileError(f"expert-parallel all-to-all failed (a peer is unreachable, exited, or timed out): "
                              f"{_first_line(e)}") from e
    experts = len(counts)
    sends, recvs = host[:experts], host[experts:]
    chunks = range(degree)

    def per_rank(n, c):
        return [sum(_piece(n[w * local + j], c, degree) for j in range(local)) for w in range(world_size)]

    send = [per_rank(sends, c) for c in chunks]
    recv = [per_rank(recvs, c) for c in chunks]
    sent = sum(sends)
    device = offsets.device
    chunk_ids, chunk_start, chunk_rows = None, [0], [sum(s) for s in send]
    if degree > 1:  # chunk of row p of a group of n rows: the c with n*c//d <= p < n*(c+1)//d
        expert = torch.repeat_interleave(torch.arange(experts, device=device), counts, output_size=sent)
        n = counts[expert]
        pos = torch.arange(sent, device=device) - (offsets.long() - counts)[expert]
        chunk_ids = (((pos + 1) * degree + n - 1) // n - 1).unsqueeze(1)
        for rows_c in chunk_rows[:-1]:
            chunk_start.append(chunk_start[-1] + rows_c)
    local_ids, local_offsets = [], []
    for c in chunks:
        if local > 1:
            sizes = torch.tensor([_piece(n, c, degree) for n in recvs], device=device)
            ids = torch.arange(local, device=device).repeat(world_size)
            local_ids.append(torch.repeat_interleave(ids, sizes, output_size=sum(recv[c])).unsqueeze(1))
        else:
            local_offsets.append(torch.tensor([sum(recv[c])], dtype=torch.int32, device=device))
    return Exchange(send, recv, sent, rows - sent, chunk_ids, chunk_start, chunk_rows, local_ids, local_offsets)


def _all_to_all_module(x, output_splits, input_splits, group_name):
    # autograd (the backward is the reverse all-to-all); returns an AsyncCollectiveTensor that waits on first use
    return funcol.all_to_all_single_autograd(x, output_splits, input_splits, group_name)


def _all_to_all_graph(x, output_splits, input_splits, group_name):
    return torch.ops._c10d_functional.all_to_all_single.default(x, output_splits, input_splits, group_name)


def _wait_graph(x):
    return torch.ops._c10d_functional.wait_tensor.default(x)


def expert_parallel_experts(rows, offsets, w_in, b_in, w_out, b_out, activation: str, gated: bool,
                            group_name: str, world_size: int, local: int, degree: int = 1, traced: bool = False):
    """moecompile::experts with the experts sharded over the ranks of the group: rows/offsets as dispatch made them
    for all E experts, weights the L = E / W local experts'. Returns [rows, H] like experts (zeros past the kept
    rows). traced=True emits plain c10d functional ops and explicit waits (the graph view)."""
    all_to_all = _all_to_all_graph if traced else _all_to_all_module
    wait = _wait_graph if traced else (lambda t: t)
    run_experts = ops.experts if traced else ops.expert_ffn  # the module view trains: keep the first projection
    ex = exchange_counts(offsets, rows.shape[0], world_size, local, degree, group_name)
    sent = rows.narrow(0, 0, ex.sent)
    if degree > 1:  # chunk-major order, expert-contiguous inside each chunk
        chunked = ops.dispatch(sent, ex.chunk_ids, degree)
        pieces = [chunked[0].narrow(0, ex.chunk_start[c], ex.chunk_rows[c]) for c in range(degree)]
    else:
        pieces = [sent]
    received = [all_to_all(pieces[c], ex.recv[c], ex.send[c], group_name) for c in range(degree)]
    returned = []
    for c in range(degree):
        x = wait(received[c])
        if local > 1:
            grouped = ops.dispatch(x, ex.local_ids[c], local)
            y = run_experts(grouped[0], grouped[2], w_in, b_in, w_out, b_out, activation, gated)
            y = ops.combine(y, grouped[1], torch.ones_like(ex.local_ids[c], dtype=torch.float32))
        else:
            y = run_experts(x, ex.local_offsets[c], w_in, b_in, w_out, b_out, activation, gated)
        returned.append(all_to_all(y, ex.send[c], ex.recv[c], group_name))
    back = torch.cat([wait(t) for t in returned]) if degree > 1 else wait(returned[0])
    if degree > 1:
        back = ops.combine(back, chunked[1], torch.ones_like(ex.chunk_ids, dtype=torch.float32))
    return torch.cat([back, rows.new_zeros(ex.pad, rows.shape[1])])


@torch.library.custom_op("moecompile::expert_parallel_experts", mutates_args=(), schema=(
    "(Tensor rows, Tensor offsets, Tensor w_in, Tensor? b_in, Tensor w_out, Tensor? b_out, str activation, "
    "bool gated, str group_name, int world_size, int local, int degree) -> Tensor"))
def expert_parallel_experts_op(rows, offsets, w_in, b_in, w_out, b_out, activation, gated, group_name, world_size,
                               local, degree):
    """expert_parallel_experts as one opaque op, the torch.compile backend's form: the counts exchange (a host sync
    with data-dependent split sizes) and the collectives stay inside it, out of AOT autograd's and inductor's
    tracing. Inference only."""
    return expert_parallel_experts(rows, offsets, w_in, b_in, w_out, b_out, activation, gated, group_name,
                                   world_size, local, degree)


@expert_parallel_experts_op.register_fake
def _(rows, offsets, w_in, b_in, w_out, b_out, activation, gated, group_name, world_size, local, degree):
    return torch.empty_like(rows)


def _no_backward(ctx, grad):
    raise MoECompileError("expert_parallel under torch.compile is inference-only; train with "
                          "moecompile.distribute(model) (the module view)")


expert_parallel_experts_op.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


def trace_expert_parallel(activation: str, gated: bool, group_name: str, world_size: int, local: int,
                          degree: int = 1) -> fx.GraphModule:
    """The data path as a graph over (rows, offsets, w_in, b_in, w_out, b_out): c10d functional all_to_all_single
    and wait_tensor nodes around the moecompile ops, the counts exchange one node (exchange_counts)."""
    def expert_parallel(rows, offsets, w_in, b_in, w_out, b_out):
        return expert_parallel_experts(rows, offsets, w_in, b_in, w_out, b_out, activation, gated, group_name,
                                       world_size, local, degree, traced=True)

    return fx.GraphModule(nn.Module(), fx.Tracer().trace(expert_parallel), "expert_parallel")


# ---- the module view --------------------------------------------------------------------------------------------

PARALLEL_MODES = ("ep", "dp")


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a tensor: the local shard of a DTensor (an expert weight: [E/W, ...]), else t."""
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertParallelMoEBlock(MoEBlock):
    """An MoEBlock whose experts are sharded over a process group or 1-D DeviceMesh: this rank holds experts
    [rank * L, (rank + 1) * L). Their parameters keep MoEBlock's names and are DTensors of the global shape [E, ...]
    placed Shard(0) on that mesh (so FSDP2 composes with them as with tensor parallelism, and DCP reshards them);
    router, shared bias and everything else are plain replicated tensors. Outputs equal the unsharded block run on
    each rank's tokens; an expert's gradient is the mean over the W ep ranks of their tokens' contributions.

    forward(x, top_k=None, capacity_factor=None, parallel=None): parallel="ep" (default: self.parallel) sends the
    tokens to the experts (all-to-all); "dp" brings the experts to the tokens (all-gather of the expert weights,
    reduce-scatter of their gradients) and runs all E experts locally. Same outputs and gradients either way; every
    rank of the group must pick the same mode for a call."""

    experts_sharded = True  # checkpoint.save refuses such a model without importing this module

    def __init__(self, config, group: dist.ProcessGroup | DeviceMesh | None = None, overlap_degree: int = 1):
        super().__init__(config)
        self._shard(group, overlap_degree)

    @classmethod
    def from_block(cls, block: MoEBlock, group: dist.ProcessGroup | DeviceMesh | None = None,
                   overlap_degree: int = 1) -> "ExpertParallelMoEBlock":
        """Shard an MoEBlock in place (it becomes this class, keeping its router and local expert weights)."""
        block.__class__ = cls
        block._shard(group, overlap_degree)
        return block

    def _shard(self, group, overlap_degree: int) -> None:
        mesh = _mesh(group)
        group = mesh.get_group()
        if not isinstance(overlap_degree, int) or overlap_degree < 1:
            raise MoECompileError(f"overlap_degree must be a positive integer, got {overlap_degree!r}")
        self.group_name = group.group_name
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.local_experts = local_experts(self.config.num_experts, self.world_size)
        self.overlap_degree = overlap_degree
        self.parallel = "ep"
        self._call_parallel = None
        first = self.rank * self.local_experts
        for name in EXPERT_TENSORS:
            p = getattr(self.experts, name)
            if p is not None:
                local = p.detach()[first:first + self.local_experts].clone()
                sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
                setattr(self.experts, name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        if type(self.experts) is MoEExperts:
            self.experts.__class__ = ExpertParallelExperts

    def extra_repr(self) -> str:
        first = self.rank * self.local_experts
        return (f"{super().extra_repr()}, rank={self.rank}/{self.world_size}, "
                f"local_experts={first}..{first + self.local_experts - 1}, overlap_degree={self.overlap_degree}, "
                f"parallel={self.parallel}")

    def forward(self, hidden_states: torch.Tensor, top_k: int | None = None, capacity_factor: float | None = None,
                parallel: str | None = None) -> torch.Tensor:
        mode = self.parallel if parallel is None else parallel
        if mode not in PARALLEL_MODES:
            raise MoECompileError(f"parallel must be one of {PARALLEL_MODES}, got {mode!r}")
        self._call_parallel = mode
        try:
            return super().forward(hidden_states, top_k, capacity_factor)
        finally:
            self._call_parallel = None

    def run_experts(self, x, weights, expert_ids):
        # through the experts module's call, so that FSDP2's hooks on it gather and reduce its parameters
        return self.experts(x, weights, expert_ids, self, self._call_parallel or self.parallel)


class ExpertParallelExperts(MoEExperts):
    """The local experts of an ExpertParallelMoEBlock (MoEExperts' parameters, as DTensors); called as a module
    with the block's routing, it runs the block's expert-parallel (or data-parallel) data path."""

    def local_weights(self, world_size: int) -> list[torch.Tensor | None]:
        """w_in, b_in, w_out, b_out of the local experts as plain tensors, gradient scaled by 1/W (the mean)."""
        scale = 1.0 / world_size
        return [None if p is None else _ScaleGrad.apply(local_tensor(p), scale)
                for p in (getattr(self, n) for n in EXPERT_TENSORS)]

    def forward(self, x, weights, expert_ids, block: "ExpertParallelMoEBlock", mode: str = "ep"):
        c = block.config
        w_in, b_in, w_out, b_out = self.local_weights(block.world_size)
        rows, order, offsets = ops.dispatch(x, expert_ids, c.num_experts)
        if mode == "dp" and block.world_size > 1:
            # the backward of the all-gather is a reduce-scatter (sum): each shard's gradient sums every rank's
            full = [None if w is None else funcol.all_gather_single_autograd(w.contiguous(), 0, block.group_name)
                    for w in (w_in, b_in, w_out, b_out)]
            out = ops.expert_ffn(rows, offsets, *full, c.activation, c.gated)
        else:
            out = expert_parallel_experts(rows, offsets, w_in, b_in, w_out, b_out, c.activation, c.gated,
                                          block.group_name, block.world_size, block.local_experts,
                                          block.overlap_degree)
        return ops.combine(out, order, weights)


@contextlib.contextmanager
def parallel_mode(model: nn.Module, mode: str):
    """Run every expert-parallel block of model in `mode` ("ep" or "dp") inside the with-block (for models that
    call their blocks themselves, such as Hugging Face ones); the previous modes come back on exit."""
    if mode not in PARALLEL_MODES:
        raise MoECompileError(f"parallel must be one of {PARALLEL_MODES}, got {mode!r}")
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoEBlock)]
    before = [b.parallel for b in blocks]
    for b in blocks:
        b.parallel = mode
    try:
        yield model
    finally:
        for b, m in zip(blocks, before):
            b.parallel = m


def distribute(model: nn.Module, group: dist.ProcessGroup | DeviceMesh | None = None,
               overlap_degree: int = 1) -> nn.Module:
    """Shard the experts of every MoEBlock in model over group (a process group, a 1-D DeviceMesh such as
    mesh["ep"], or None: the world), in place; returns model (a bare MoEBlock is returned as its
    ExpertParallelMoEBlock). Every rank of the group must pass the same model (same weights); each keeps E / W
    experts per block, as DTensors on the mesh. overlap_degree > 1 pipelines chunked all-to-alls with expert
    compute."""
    blocks = [model] if isinstance(model, MoEBlock) else [m for m in model.modules() if isinstance(m, MoEBlock)]
    if not blocks:
        raise MoECompileError(f"{type(model).__name__} has no MoEBlock to distribute: run moecompile.moeize first")
    mesh = _mesh(group)
    world = mesh.size()
    for block in blocks:  # check every block before changing any
        local_experts(block.config.num_experts, world)
    for block in blocks:
        if not isinstance(block, ExpertParallelMoEBlock):
            ExpertParallelMoEBlock.from_block(block, mesh, overlap_degree)
    return model


def data_parallel_mesh(mesh: DeviceMesh, dp: str = "dp", ep: str = "ep") -> DeviceMesh:
    """The 1-D mesh over all ranks of a (dp, ep) mesh: the one the replicated (non-expert) parameters are reduced
    over, since every rank has its own tokens."""
    name = f"{dp}_{ep}"
    try:
        return mesh[name]
    except KeyError:
        return mesh[dp, ep]._flatten(name)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, dp: str = "dp", ep: str = "ep", modules=(),
                **fsdp_kwargs) -> nn.Module:
    """FSDP2 for an expert-parallel model (torchtitan's layout): every block's experts sharded over mesh[dp] (the
    ranks that hold the same experts), then each module of `modules` (e.g. the transformer layers) and the model
    over all the ranks of dp x ep. fsdp_kwargs go to torch.distributed.fsdp.fully_shard (mp_policy, ...)."""
    from torch.distributed.fsdp import fully_shard as fsdp

    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoEBlock)]
    if not blocks:
        raise MoECompileError("no expert-parallel block: call moecompile.distribute(model, mesh['ep']) first")
    for block in blocks:
        fsdp(block.experts, mesh=mesh[dp], **fsdp_kwargs)
    everything = data_parallel_mesh(mesh, dp, ep)
    for module in modules:
        fsdp(module, mesh=everything, **fsdp_kwargs)
    fsdp(model, mesh=everything, **fsdp_kwargs)
    return model


def is_distributed(model: nn.Module) -> bool:
    return any(getattr(m, "experts_sharded", False) for m in model.modules())


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The sharded expert weights (DTensors on the ep mesh): never reduced over the ep ranks (each owns different
    experts), only over the ranks that hold the same experts."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelMoEBlock) for p in m.experts.parameters()]


def data_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter (replicated on all ranks): the ones a data-parallel all-reduce covers."""
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def all_reduce_gradients(model: nn.Module, group: dist.ProcessGroup | None = None, average: bool = True) -> None:
    """Gradient sync for plain expert parallelism (the experts sharded over the whole group, no FSDP or DDP), after
    backward: one all-reduce of the replicated parameters' gradients, none of the experts' (they already are the
    mean over the ep ranks). average=True: every gradient is that of the mean of the ranks' losses (DDP's
    convention); average=False: of their sum. With a (dp, ep) mesh use apply_fsdp instead."""
    group = _group(group)
    world = dist.get_world_size(group)
    dense = [p for p in data_parallel_parameters(model) if p.requires_grad]
    for p in dense:
        if p.grad is None:  # every rank must contribute the same flat buffer
            p.grad = torch.zeros_like(p)
    if dense:
        flat = torch._utils._flatten_dense_tensors([p.grad for p in dense])
        dist.all_reduce(flat, group=group)
        if average:
            flat /= world
        for p, g in zip(dense, torch._utils._unflatten_dense_tensors(flat, [p.grad for p in dense])):
            p.grad.copy_(g)
    if not average:
        for block in (m for m in model.modules() if isinstance(m, ExpertParallelMoEBlock)):
            for p in block.experts.parameters():
                if p.grad is not None:
                    p.grad *= block.world_size


# ---- checkpoints (the layout: moecompile/ep_checkpoint.py) -----------------------------------------------------

def _collectively(step, group: dist.ProcessGroup, what: str) -> None:
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


def save(model: nn.Module, directory, group: dist.ProcessGroup | None = None, tokenizer_dir=None):
    """Write an expert-parallel model from every rank of group into one folder: rank 0 writes config.json and the
    replicated tensors, each rank its own experts file. Collective and all-or-nothing: the folder appears once every
    rank has written; on any failure every rank raises MoECompileError and nothing is left behind."""
    from moecompile.io import ep_checkpoint  # (it imports this module)

    group = _group(group)
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

    _collectively(start if rank == 0 else None, group, f"saving {directory}")
    try:
        _collectively(lambda: ep_checkpoint.write_shard(tmp, rank, world, experts), group, f"saving {directory}")
        _collectively((lambda: checkpoint.publish(tmp, directory)) if rank == 0 else None, group,
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
    from moecompile.io import ep_checkpoint

    group = _group(group)
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

    _collectively(read, group, f"loading {directory}")
    return loaded["model"]
