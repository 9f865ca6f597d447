"""The expert-parallel data path: each rank holds E/W experts and tokens cross ranks by all-to-all.

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

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import fx, nn

from moecompile.core.errors import MoECompileError
from moecompile.ir import ops
from moecompile.parallel.groups import first_line


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
                              f"{first_line(e)}") from e
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
