"""Expert parallelism on torch.distributed: each rank holds E/W experts and tokens cross ranks by all-to-all.

    import moecompile, moecompile.distributed as ep
    ep.init()                                  # torchrun's env; gloo on CPU, NCCL on CUDA; clear error on timeout
    model = moecompile.distribute(model)       # in place: every MoEBlock keeps only its local experts
    loss.backward()
    ep.all_reduce_gradients(model)             # dense grads averaged over ranks; expert grads are not all-reduced
    optimizer.step()

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

import shutil
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import fx, nn

from moecompile import settings
from moecompile.errors import MoECompileError
from moecompile.io import checkpoint
from moecompile.ir import layout, ops
from moecompile.ir.block import MoEBlock
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


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise MoECompileError("torch.distributed is not initialized: launch with torchrun and call "
                              "moecompile.distributed.init() (or torch.distributed.init_process_group) first")
    return group if group is not None else dist.group.WORLD


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

class ExpertParallelMoEBlock(MoEBlock):
    """An MoEBlock whose experts are sharded over a process group: this rank holds experts
    [rank * L, (rank + 1) * L) (their parameters keep MoEBlock's names, with L rows instead of E); router, shared
    bias and everything else are replicated. Outputs and gradients equal the unsharded block run on each rank's
    tokens; an expert's gradient sums the contributions of every rank's tokens."""

    experts_sharded = True  # checkpoint.save refuses such a model without importing this module

    def __init__(self, config, group: dist.ProcessGroup | None = None, overlap_degree: int = 1):
        super().__init__(config)
        self._shard(group, overlap_degree)

    @classmethod
    def from_block(cls, block: MoEBlock, group: dist.ProcessGroup | None = None,
                   overlap_degree: int = 1) -> "ExpertParallelMoEBlock":
        """Shard an MoEBlock in place (it becomes this class, keeping its router and local expert weights)."""
        block.__class__ = cls
        block._shard(group, overlap_degree)
        return block

    def _shard(self, group, overlap_degree: int) -> None:
        group = _group(group)
        if not isinstance(overlap_degree, int) or overlap_degree < 1:
            raise MoECompileError(f"overlap_degree must be a positive integer, got {overlap_degree!r}")
        self.group_name = group.group_name
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.local_experts = local_experts(self.config.num_experts, self.world_size)
        self.overlap_degree = overlap_degree
        first = self.rank * self.local_experts
        for name in EXPERT_TENSORS:
            p = getattr(self.experts, name)
            if p is not None:
                local = p.detach()[first:first + self.local_experts].clone()
                setattr(self.experts, name, nn.Parameter(local, requires_grad=p.requires_grad))

    def extra_repr(self) -> str:
        first = self.rank * self.local_experts
        return (f"{super().extra_repr()}, rank={self.rank}/{self.world_size}, "
                f"local_experts={first}..{first + self.local_experts - 1}, overlap_degree={self.overlap_degree}")

    def run_experts(self, x, weights, expert_ids):
        c, e = self.config, self.experts
        rows, order, offsets = ops.dispatch(x, expert_ids, c.num_experts)
        out = expert_parallel_experts(rows, offsets, e.w_in, e.b_in, e.w_out, e.b_out, c.activation, c.gated,
                                      self.group_name, self.world_size, self.local_experts, self.overlap_degree)
        return ops.combine(out, order, weights)


def distribute(model: nn.Module, group: dist.ProcessGroup | None = None, overlap_degree: int = 1) -> nn.Module:
    """Shard the experts of every MoEBlock in model over group (default: the world), in place; returns model (a
    bare MoEBlock is returned as its ExpertParallelMoEBlock). Every rank must pass the same model (same weights);
    each keeps E / W experts per block. overlap_degree > 1 pipelines chunked all-to-alls with expert compute."""
    blocks = [model] if isinstance(model, MoEBlock) else [m for m in model.modules() if isinstance(m, MoEBlock)]
    if not blocks:
        raise MoECompileError(f"{type(model).__name__} has no MoEBlock to distribute: run moecompile.moeize first")
    world = dist.get_world_size(_group(group))
    for block in blocks:  # check every block before changing any
        local_experts(block.config.num_experts, world)
    for block in blocks:
        if not isinstance(block, ExpertParallelMoEBlock):
            ExpertParallelMoEBlock.from_block(block, group, overlap_degree)
    return model


def is_distributed(model: nn.Module) -> bool:
    return any(getattr(m, "experts_sharded", False) for m in model.modules())


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The sharded expert weights: never all-reduced (each rank owns different experts)."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelMoEBlock) for p in m.experts.parameters()]


def data_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter (replicated on all ranks): the ones a data-parallel all-reduce covers."""
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def all_reduce_gradients(model: nn.Module, group: dist.ProcessGroup | None = None, average: bool = True) -> None:
    """Data-parallel gradient sync for an expert-parallel model, after backward: one all-reduce of the replicated
    parameters' gradients, none of the experts'. An expert's gradient already sums every rank's tokens (the reverse
    all-to-all brought them), so with average=True it is divided by W: the result on every rank is the gradient of
    the mean of the ranks' losses, DDP's convention; with average=False, of their sum."""
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
    if average:
        for p in expert_parameters(model):
            if p.grad is not None:
                p.grad /= world


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
        checkpoint.load_state(skeleton, ep_checkpoint.read_rank(directory, rank, world), directory)
        if hasattr(skeleton, "tie_weights"):
            skeleton.tie_weights()
        loaded["model"] = skeleton.eval()

    _collectively(read, group, f"loading {directory}")
    return loaded["model"]
