"""The module view of expert parallelism: MoEBlocks whose experts are DTensors sharded over a mesh, FSDP2 over
the rest, and the gradient all-reduce for plain data parallelism.

Expert gradients: the reverse all-to-all sums every ep rank's tokens into the owner's gradient, and the block scales
it by 1/W_ep, so it is the gradient of the mean of the ep group's losses; averaging it over the replicas of those
experts (FSDP/DDP over "dp") gives the gradient of the mean of every rank's loss, like the dense parameters'.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from moecompile.core.errors import MoECompileError
from moecompile.ir import ops
from moecompile.ir.block import MoEBlock, MoEExperts
from moecompile.ir.sharding import EXPERT_TENSORS, local_experts
from moecompile.parallel.all_to_all import expert_parallel_experts
from moecompile.parallel.groups import device_mesh, process_group

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
        mesh = device_mesh(group)
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
            return ops.expert_ffn_combine(rows, offsets, order, weights, *full, c.activation, c.gated)
        out = expert_parallel_experts(rows, offsets, w_in, b_in, w_out, b_out, c.activation, c.gated,
                                      block.group_name, block.world_size, block.local_experts, block.overlap_degree)
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
    mesh = device_mesh(group)
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
    group = process_group(group)
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
