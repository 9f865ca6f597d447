"""Expert parallelism on CPU with gloo, 2 and 4 processes: outputs and gradients against the single-process model.

Every spawned run does many checks in one go, once per test run (the xdist workers share it): each rank computes
the single-process reference itself, records the error of every check (or the message of an expected error) in a
JSON file, and the tests below assert on them. Errors are relative to the reference's largest magnitude (>= 1).
The ranks are forked from the test process, which has imported torch and transformers already.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from filelock import FileLock

import moecompile
from moecompile import MoEBlock, MoECompileError, MoEConfig
from moecompile import distributed as ep
from moecompile.cli import main as cli_main
from moecompile.io import ep_checkpoint

TOL = 1e-5
H, F = 8, 6


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def _expect_error(fn) -> str:
    try:
        fn()
    except MoECompileError as e:
        return str(e)
    return "no error"


@functools.cache
def _warm_up() -> None:
    """Import and build once in this process what every rank would otherwise import and build by itself: the
    ranks are forked from here and start with it."""
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    from hf_moe import tiny_moe  # noqa: F401

    import moecompile.backend  # noqa: F401
    from moecompile.parallel import dcp  # noqa: F401

    _tiny_gpt2()
    _mesh_gpt2()
    _mesh_mixtral()


def _spawn(worker, world: int, tmp: Path, *args) -> list[dict]:
    _warm_up()
    mp.start_processes(worker, args=(world, _port(), str(tmp), *args), nprocs=world, start_method="fork")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def _once(tmp_path_factory, name: str, make) -> tuple[list[dict], Path]:
    """make(folder)'s results, computed once per test run: under xdist the first worker to ask runs it in a folder
    all workers share, the others wait for it and read its results."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        folder = tmp_path_factory.mktemp(name)
        return make(folder), folder
    root = tmp_path_factory.getbasetemp().parent  # the run's folder, above each worker's own
    folder, results = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not results.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker's failed attempt
            folder.mkdir()
            results.write_text(json.dumps(make(folder)))
    return json.loads(results.read_text()), folder


def _init(rank, world, port, timeout=60):
    torch.set_num_threads(1)
    ep.init(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout)


# ---- one MoEBlock: uneven loads, an expert with no tokens, a rank with no tokens, drops, overlap -----------------

def _skewed_block(config: MoEConfig, seed: int) -> MoEBlock:
    """Random weights (biases too). Inputs carry a constant feature 1 (_inputs): through it the last expert's
    router logit is -10, so it is never chosen (top_k < E), and expert 0's is raised by 1: uneven loads."""
    torch.manual_seed(seed)
    block = MoEBlock(config).train()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.5)
        block.router.weight[-1] = 0.0
        block.router.weight[-1, 0] = -10.0
        block.router.weight[0, 0] += 1.0
    return block


def _inputs(tokens: list[int], gen: torch.Generator) -> list[torch.Tensor]:
    xs = [torch.randn(n, H, generator=gen) for n in tokens]
    for x in xs:
        x[:, 0] = 1.0
    return xs


def _block_checks(rank, world, name, config, tokens, degrees, seed, out):
    ref = _skewed_block(config, seed)
    block = ep.distribute(copy.deepcopy(ref))
    gen = torch.Generator().manual_seed(seed + 1)
    xs = _inputs(tokens, gen)
    gs = [torch.randn(n, H, generator=gen) for n in tokens]
    # reference: the unsharded block on each rank's tokens, loss summed over ranks
    ref_x = [x.clone().requires_grad_() for x in xs]
    total = 0.0
    ys = []
    for x, g in zip(ref_x, gs):
        ref.aux_loss = None
        y = ref(x)
        ys.append(y)
        total = total + (y * g).sum() + (ref.aux_loss if ref.aux_loss is not None else 0.0)
    total.backward()
    with torch.no_grad():  # what the routing did: assignments per expert (before capacity), dropped ones
        _, ids = moecompile.ir.ops.route(torch.cat(xs) @ ref.router.weight.t(), config.top_k, 0.0, True)
        out[f"{name}/tokens_per_expert"] = torch.bincount(ids.flatten(), minlength=config.num_experts).tolist()
        out[f"{name}/dropped"] = sum(
            int((moecompile.ir.ops.route(x @ ref.router.weight.t(), config.top_k, config.capacity_factor, True)[1]
                 == config.num_experts).sum()) for x in xs)
    out[f"{name}/tokens_per_rank"] = list(tokens)
    local = config.num_experts // world
    lo, hi = rank * local, (rank + 1) * local
    for degree in degrees:
        block.overlap_degree = degree
        block.zero_grad(set_to_none=True)
        block.aux_loss = None
        x = xs[rank].clone().requires_grad_()
        y = block(x)
        loss = (y * gs[rank]).sum() + (block.aux_loss if block.aux_loss is not None else 0.0)
        loss.backward()
        ep.all_reduce_gradients(block, average=False)
        key = f"{name}/d{degree}"
        out[f"{key}/out"] = _err(y.detach(), ys[rank].detach())
        out[f"{key}/grad_x"] = _err(x.grad, ref_x[rank].grad)
        for pname in ep.EXPERT_TENSORS:
            p = getattr(block.experts, pname)
            if p is not None:
                out[f"{key}/grad_{pname}"] = _err(ep.local_tensor(p.grad), getattr(ref.experts, pname).grad[lo:hi])
        out[f"{key}/grad_router"] = _err(block.router.weight.grad, ref.router.weight.grad)
        if block.bias is not None:
            out[f"{key}/grad_bias"] = _err(block.bias.grad, ref.bias.grad)
        out[f"{key}/local_shape"] = list(ep.local_tensor(block.experts.w_in).shape)
        out[f"{key}/global_shape"] = list(block.experts.w_in.shape)


def _tiny_gpt2_dense(seed=0):
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0,
                           eos_token_id=0, initializer_range=0.2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return tf.GPT2LMHeadModel(config).float().eval()


def _built_once(build):
    """build() runs once per process and each call returns a copy: ranks forked after _warm_up copy the model it
    built instead of converting their own."""
    built = functools.cache(build)
    return functools.wraps(build)(lambda: copy.deepcopy(built()))


@_built_once
def _tiny_gpt2():
    return moecompile.moeize(_tiny_gpt2_dense(), experts=4, top_k=2, capacity_factor=0.0, noise=0.5, progress=False)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _model_checks(rank, world, tmp: Path, out):
    """A converted GPT-2: training gradients after all_reduce_gradients, checkpoints, wrong world size."""
    ref = _tiny_gpt2().train()
    model = moecompile.distribute(copy.deepcopy(ref))
    ids = [torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    losses = []
    for r in range(world):
        losses.append(ref(input_ids=ids[r], labels=ids[r], use_cache=False).loss + moecompile.aux_loss(ref))
    (torch.stack(losses).mean()).backward()
    loss = model(input_ids=ids[rank], labels=ids[rank], use_cache=False).loss + moecompile.aux_loss(model)
    out["model/loss"] = _err(loss.detach(), losses[rank].detach())
    loss.backward()
    ep.all_reduce_gradients(model)  # averaged: the gradient of the mean of the ranks' losses
    experts = {id(p) for p in ep.expert_parameters(model)}
    ref_params = dict(ref.named_parameters())
    worst_dense, worst_expert = 0.0, 0.0
    for name, p in model.named_parameters():
        g = ref_params[name].grad
        if id(p) in experts:
            local = ep.local_tensor(p).shape[0]
            worst_expert = max(worst_expert, _err(ep.local_tensor(p.grad), g[rank * local:(rank + 1) * local]))
        else:
            worst_dense = max(worst_dense, _err(p.grad, g))
    out["model/grad_dense"] = worst_dense
    out["model/grad_expert"] = worst_expert
    out["model/expert_params"] = len(experts)
    ref.eval()
    model.eval()
    # checkpoints: save from every rank, load back; gather into one folder, which moecompile.load reads
    ck, whole, ck4 = tmp / "ck", tmp / "whole", tmp / "ck4"
    ep.save(model, ck)
    out["ckpt/files"] = sorted(p.name for p in ck.iterdir())
    loaded = ep.load(ck)
    out["ckpt/load_out"] = _err(_logits(loaded, ids[rank]), _logits(ref, ids[rank]))
    out["ckpt/save_twice"] = _expect_error(lambda: ep.save(model, ck))
    out["ckpt/whole_save"] = _expect_error(lambda: moecompile.save(model, tmp / "never"))
    if rank == 0:
        ep_checkpoint.gather(ck, whole, progress=False)
        ep_checkpoint.scatter(whole, ck4, 4, progress=False)
    dist.barrier()
    out["ckpt/gathered_out"] = _err(_logits(moecompile.load(whole, progress=False), ids[rank]),
                                    _logits(ref, ids[rank]))
    out["ckpt/whole_into_ep"] = _err(_logits(ep.load(whole), ids[rank]), _logits(ref, ids[rank]))
    out["ckpt/world_mismatch"] = _expect_error(lambda: ep.load(ck4))
    out["ckpt/leftovers"] = sorted(p.name for p in tmp.iterdir() if p.name.startswith("."))


def _graph_checks(rank, world, out, degree):
    """The graph view: insert_all_to_all on a captured, moeized GPT-2 against the single-process graph."""
    from moecompile.passes.capture import capture
    from moecompile.passes.pipeline import run_pipeline

    model = _tiny_gpt2_dense()
    options = {"experts": 4, "top_k": 2, "capacity_factor": 0.0, "noise": 0.5}
    single, _ = run_pipeline(capture(model), options)
    gm, ctx = run_pipeline(capture(model), {**options, "expert_parallel": {"overlap_degree": degree}})
    ids = [torch.randint(0, 50, (1, 8), generator=torch.Generator().manual_seed(20 + r)) for r in range(world)]
    with torch.no_grad():
        out[f"graph/d{degree}/out"] = _err(gm(ids[rank], use_cache=False)[0], single(ids[rank], use_cache=False)[0])
    # autograd through the graph's collectives: an expert's gradient sums every rank's tokens
    sum(single(i, use_cache=False)[0].square().sum() for i in ids).backward()
    gm(ids[rank], use_cache=False)[0].square().sum().backward()
    local = 4 // world
    out[f"graph/d{degree}/grad_w_in"] = _err(gm.get_parameter("moe0.experts.w_in").grad,
                                             single.get_parameter("moe0.experts.w_in").grad[rank * local:][:local])
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    out[f"graph/d{degree}/collectives"] = [targets.count("_c10d_functional.all_to_all_single.default"),
                                           targets.count("_c10d_functional.wait_tensor.default")]
    out[f"graph/d{degree}/report"] = dict(ctx.reports)["insert_all_to_all"]["rewritten"]
    out[f"graph/d{degree}/w_in"] = list(gm.get_parameter("moe0.experts.w_in").shape)


def _backend_checks(rank, world, out):
    """torch.compile(backend="moecompile", options={"expert_parallel": ...}) on a tiny HF Mixtral against eager."""
    from hf_moe import tiny_moe, token_ids

    import moecompile

    model, ids = tiny_moe("tiny-mixtral"), token_ids(seed=30 + rank)
    compiled = moecompile.compile(model, fullgraph=True, inductor=False, expert_parallel={"overlap_degree": 2})
    with torch.no_grad():
        out["backend/out"] = _err(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
    report = dict(moecompile.backend.records()[-1].reports)["insert_all_to_all"]
    out["backend/rewritten"] = report["rewritten"]
    training = moecompile.compile(model.train(), fullgraph=True, inductor=False, expert_parallel={})
    try:  # Dynamo wraps a backend's error in its own (BackendCompilerFailed), with the message kept
        training(ids, use_cache=False).logits.sum().backward()
        out["backend/train_error"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["backend/train_error"] = str(e)


# ---- a (dp, ep) DeviceMesh under FSDP2: the torchtitan recipe, DCP checkpoints, the dp/ep switch ----------------

NOMINAL = 10  # the loss of a rank: its tokens' summed cross-entropy / NOMINAL (+ aux), so an empty rank adds 0
SEQ = 6
DCP_IDS = torch.randint(0, 50, (2, SEQ), generator=torch.Generator().manual_seed(99))


def _starve(model, first: int, capacity_factor: float):
    """Every MoEBlock: a router bias of -30 on experts >= first (never chosen: an ep rank that holds only those
    receives no tokens) and capacity_factor (drops); the layout records it, so checkpoints rebuild the same."""
    import dataclasses

    from moecompile.ir import layout

    identity = {e["path"]: e.get("identity", []) for e in layout.get_layout(model)}
    for path, block in layout.moe_blocks(model):
        block.config = dataclasses.replace(block.config, router_bias=True, capacity_factor=capacity_factor)
        block.router.bias = torch.nn.Parameter(torch.zeros(block.config.num_experts))
        with torch.no_grad():
            block.router.bias[first:] = -30.0
        layout.record(model, path, block.config, identity.get(path, []))
    return model


@_built_once
def _mesh_gpt2():
    model = moecompile.moeize(_tiny_gpt2_dense(), experts=8, top_k=2, capacity_factor=0.0, noise=0.5, progress=False)
    return _starve(model, 4, 1.0)


@_built_once
def _mesh_mixtral():
    """A tiny Mixtral whose sparse blocks are MoEBlocks with its router and SwiGLU experts (gate|up, down)."""
    import transformers as tf

    from moecompile.ir import layout

    torch.manual_seed(1)
    config = tf.MixtralConfig(hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, vocab_size=50, max_position_embeddings=32, num_local_experts=8,
                              num_experts_per_tok=2, initializer_range=0.2)
    model = tf.MixtralForCausalLM(config).float()
    for i, layer in enumerate(model.model.layers):
        block = MoEBlock(MoEConfig(hidden_size=16, expert_size=12, num_experts=8, top_k=2, activation="silu",
                                   gated=True, renormalize=True))
        with torch.no_grad():
            block.router.weight.normal_(0.0, 0.5)
            block.experts.w_in.copy_(layer.mlp.experts.gate_up_proj)
            block.experts.w_out.copy_(layer.mlp.experts.down_proj)
        layer.mlp = block
        layout.record(model, f"model.layers.{i}.mlp", block.config, [])
    return _starve(model, 4, 1.0)


def _lm_loss(model, ids):
    from moecompile.ir import layout

    for _, block in layout.moe_blocks(model):
        block.aux_loss = None  # (a block keeps its last training forward's)
    logits = model(input_ids=ids, use_cache=False).logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                           reduction="sum")
    return ce / NOMINAL + moecompile.aux_loss(model)


def _full(t):
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def _mesh_model_checks(rank, world, mesh, name, build, out, dcp_dir=None, load_dir=None):
    """The recipe on one mesh: distribute over mesh["ep"], FSDP2 over the rest; loss, every gradient and the
    parameters after an SGD step against the single-process model run on every rank's share (losses averaged)."""
    from moecompile.ir import layout
    from moecompile.parallel import dcp as dcp_io

    key = f"{'x'.join(map(str, mesh.shape))}/{name}"
    ref = build().train()
    model = copy.deepcopy(ref)
    moecompile.distribute(model, mesh["ep"])
    ep.apply_fsdp(model, mesh, modules=[layout.moe_blocks(model)[0][1]])  # one inner FSDP unit, as per layer
    ids = [torch.randint(0, 50, (2, SEQ), generator=torch.Generator().manual_seed(40 + r)) for r in range(world)]
    blocks = [b for _, b in layout.moe_blocks(ref)]
    counts = torch.zeros(blocks[0].config.num_experts, dtype=torch.long)
    dropped = 0
    for b in blocks:
        b.track_routing = True
    losses = []
    for i in ids:
        losses.append(_lm_loss(ref, i))
        counts += sum(b.routing["counts"] for b in blocks)
        dropped += sum(int(b.routing["dropped"]) for b in blocks)
    torch.stack(losses).mean().backward()
    out[f"{key}/tokens_per_expert"] = counts.tolist()
    out[f"{key}/dropped"] = dropped
    loss = _lm_loss(model, ids[rank])
    loss.backward()
    out[f"{key}/loss"] = _err(loss.detach(), losses[rank].detach())
    ref_params = dict(ref.named_parameters())
    grads = {n: _err(_full(p.grad), ref_params[n].grad) for n, p in model.named_parameters()}
    out[f"{key}/grad"] = max(grads.values())
    out[f"{key}/grads_checked"] = sorted(grads)
    out[f"{key}/expert_placements"] = str(model.get_parameter(f"{layout.moe_blocks(model)[0][0]}.experts.w_in")
                                          .placements)
    for params in (ref.parameters(), model.parameters()):
        torch.optim.SGD(params, lr=0.5, momentum=0.9).step()
    out[f"{key}/param_after_step"] = max(_err(_full(p.detach()), ref_params[n].detach())
                                         for n, p in model.named_parameters())
    model.eval()
    ref.eval()
    want = _logits(ref, DCP_IDS)
    out[f"{key}/eval_out"] = _err(_logits(model, DCP_IDS), want)
    if dcp_dir is not None:  # save here, for the other meshes and world sizes to load
        dcp_io.save(model, dcp_dir)
        if rank == 0:
            torch.save(want, Path(dcp_dir).parent / "dcp_logits.pt")
    if load_dir is not None:  # this mesh's model, loaded from another mesh's checkpoint
        dcp_io.load(load_dir, model)
        out[f"{key}/dcp_loaded_out"] = _err(_logits(model, DCP_IDS),
                                            torch.load(Path(load_dir).parent / "dcp_logits.pt", weights_only=True))


def _switch_checks(rank, world, mesh, out):
    """One MoEBlock between two Linears under the recipe, rank 1 without tokens: parallel="ep" and "dp" against
    the single-process model, outputs and every gradient."""
    config = MoEConfig(hidden_size=H, expert_size=F, num_experts=4, top_k=2, capacity_factor=0.75, bias_in=True,
                       bias_out="expert", gated=True, activation="silu")
    torch.manual_seed(7)
    ref = torch.nn.Sequential(torch.nn.Linear(H, H), _skewed_block(config, 7), torch.nn.Linear(H, H))
    model = copy.deepcopy(ref)
    block = moecompile.distribute(copy.deepcopy(ref[1]), mesh["ep"])  # the per-call argument, without FSDP
    moecompile.distribute(model, mesh["ep"])
    ep.apply_fsdp(model, mesh)
    tokens = [7, 0, 12, 5][:world]
    gen = torch.Generator().manual_seed(8)
    xs = _inputs(tokens, gen)
    ref_params = dict(ref.named_parameters())
    outs = []
    for x in xs:
        ref[1].aux_loss = None
        outs.append(ref(x))
    torch.stack([(y * y).sum() / NOMINAL for y in outs]).mean().backward()
    for mode in ("ep", "dp"):
        model.zero_grad(set_to_none=True)
        with ep.parallel_mode(model, mode):
            y = model(xs[rank])
        ((y * y).sum() / NOMINAL).backward()
        out[f"switch/{mode}/out"] = _err(y.detach(), outs[rank].detach())
        out[f"switch/{mode}/grad"] = max(_err(_full(p.grad), ref_params[n].grad) for n, p in model.named_parameters())
    with torch.no_grad():
        out["switch/kwarg"] = _err(block(xs[rank], parallel="dp"), block(xs[rank], parallel="ep"))
    out["switch/bad_mode"] = _expect_error(lambda: block(xs[rank], parallel="tp"))


def _mesh_worker_checks(rank, world, tmp: Path, out):
    from torch.distributed.device_mesh import init_device_mesh

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # full_tensor's notice
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    flat = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "ep"))
    _switch_checks(rank, world, square, out)
    _mesh_model_checks(rank, world, square, "gpt2", _mesh_gpt2, out, dcp_dir=tmp / "dcp")
    _mesh_model_checks(rank, world, flat, "gpt2", _mesh_gpt2, out, load_dir=tmp / "dcp")
    _mesh_model_checks(rank, world, square, "mixtral", _mesh_mixtral, out)
    _mesh_model_checks(rank, world, flat, "mixtral", _mesh_mixtral, out)


def _dcp_load_checks(rank, world, dcp_dir: Path, out):
    """The 4-rank (2 x 2) checkpoint on 2 ranks as a 1 x 2 mesh under FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh

    from moecompile.parallel import dcp as dcp_io

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    model = dcp_io.build(dcp_dir)
    moecompile.distribute(model, mesh["ep"])
    ep.apply_fsdp(model, mesh)
    dcp_io.load(dcp_dir, model)
    model.eval()
    out["dcp2/out"] = _err(_logits(model, DCP_IDS), torch.load(dcp_dir.parent / "dcp_logits.pt", weights_only=True))
    out["dcp2/local_experts"] = ep.local_tensor(model.get_parameter("transformer.h.0.mlp.experts.w_in")).shape[0]


def _worker2(rank, world, port, tmp, dcp_dir=None):
    _init(rank, world, port)
    tmp, out = Path(tmp), {}
    gelu = MoEConfig(hidden_size=H, expert_size=F, num_experts=4, top_k=2, capacity_factor=0.0, bias_in=True,
                     bias_out="expert")
    _block_checks(rank, world, "uneven", gelu, [11, 0], (1, 3), 1, out)  # rank 1 has no tokens
    gated = MoEConfig(hidden_size=H, expert_size=F, num_experts=2, top_k=1, capacity_factor=0.5, gated=True,
                      activation="silu", bias_out="shared")
    _block_checks(rank, world, "capacity", gated, [9, 5], (1, 2), 2, out)  # drops, one expert per rank
    _model_checks(rank, world, tmp, out)
    _graph_checks(rank, world, out, degree=2)
    _backend_checks(rank, world, out)
    if dcp_dir is not None:
        _dcp_load_checks(rank, world, Path(dcp_dir), out)
    torch.manual_seed(5)
    built = ep.ExpertParallelMoEBlock(MoEConfig(H, F, 4, top_k=2))  # constructed sharded
    torch.manual_seed(5)
    whole = MoEBlock(MoEConfig(H, F, 4, top_k=2))
    x = torch.randn(5, H)
    with torch.no_grad():
        out["ctor/out"] = _err(built(x), ep.ExpertParallelMoEBlock.from_block(copy.deepcopy(whole))(x))
    out["ctor/shape"] = list(ep.local_tensor(built.experts.w_in).shape)
    out["errors/not_divisible"] = _expect_error(lambda: ep.distribute(MoEBlock(MoEConfig(H, F, 3, top_k=1))))
    out["errors/fewer_experts"] = _expect_error(lambda: ep.distribute(MoEBlock(MoEConfig(H, F, 1, top_k=1))))
    # a peer that does not take part: a group with a 2 s timeout, rank 1 sits out; rank 0 must fail, not hang
    short = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    block = ep.distribute(MoEBlock(MoEConfig(H, F, 2, top_k=1)), group=short)
    if rank == 0:
        start = time.perf_counter()
        out["errors/hung_peer"] = _expect_error(lambda: block(torch.randn(3, H)))
        out["errors/hung_peer_s"] = time.perf_counter() - start
    else:
        time.sleep(4)
    dist.barrier()
    (tmp / f"rank{rank}.json").write_text(json.dumps(out))
    # a peer that exits: rank 1 leaves, rank 0's next all-to-all fails at once
    if rank == 0:
        block = ep.distribute(MoEBlock(MoEConfig(H, F, 2, top_k=1)))
        time.sleep(1)
        start = time.perf_counter()
        out["errors/exited_peer"] = _expect_error(lambda: block(torch.randn(3, H)))
        out["errors/exited_peer_s"] = time.perf_counter() - start
        (tmp / f"rank{rank}.json").write_text(json.dumps(out))


def _worker4(rank, world, port, tmp):
    _init(rank, world, port)
    out = {}
    two_local = MoEConfig(hidden_size=H, expert_size=F, num_experts=8, top_k=3, capacity_factor=0.0, bias_in=True,
                          bias_out="expert")
    _block_checks(rank, world, "e8", two_local, [6, 0, 13, 3], (1, 2), 3, out)
    one_local = MoEConfig(hidden_size=H, expert_size=F, num_experts=4, top_k=2, capacity_factor=0.75, gated=True,
                          activation="gelu")
    _block_checks(rank, world, "e4", one_local, [5, 8, 1, 0], (1, 3), 4, out)
    _mesh_worker_checks(rank, world, Path(tmp), out)
    dist.barrier()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def four_ranks_dir(tmp_path_factory):
    return _once(tmp_path_factory, "ep4", lambda tmp: _spawn(_worker4, 4, tmp))


@pytest.fixture(scope="module")
def four_ranks(four_ranks_dir):
    return four_ranks_dir[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, four_ranks_dir):
    return _once(tmp_path_factory, "ep2", lambda tmp: _spawn(_worker2, 2, tmp, str(four_ranks_dir[1] / "dcp")))[0]


def _errors(results: list[dict], prefix: str) -> dict[str, float]:
    return {f"rank{r}:{k}": v for r, res in enumerate(results) for k, v in res.items()
            if k.startswith(prefix) and isinstance(v, float)}


def _assert_close(results, prefix):
    errors = _errors(results, prefix)
    assert errors, f"no results for {prefix}"
    bad = {k: v for k, v in errors.items() if not v <= TOL}
    assert not bad, bad


# ---- 2 processes

def test_uneven_loads_empty_expert_and_empty_rank(two_ranks):
    res = two_ranks[0]
    assert res["uneven/tokens_per_expert"][-1] == 0  # the last expert receives no tokens
    counts = res["uneven/tokens_per_expert"]
    assert min(counts[:-1]) > 0 and sum(counts[:2]) > 1.5 * sum(counts[2:]), counts  # rank 0's experts: most rows
    assert res["uneven/tokens_per_rank"][1] == 0  # rank 1 has no tokens
    assert res["uneven/d1/local_shape"] == [2, F, H]  # E/W = 2 experts per rank
    _assert_close(two_ranks, "uneven/d1/")


def test_overlap_degree_gives_the_same_result(two_ranks):
    _assert_close(two_ranks, "uneven/d3/")
    _assert_close(two_ranks, "capacity/d2/")


def test_capacity_drops_and_one_expert_per_rank(two_ranks):
    res = two_ranks[0]
    assert res["capacity/dropped"] > 0  # capacity 0.5 drops assignments
    assert res["capacity/d1/local_shape"] == [1, 2 * F, H]  # gated: gate|up rows
    _assert_close(two_ranks, "capacity/d1/")
    assert "capacity/d1/grad_bias" in res and "capacity/d1/grad_b_out" not in res  # shared bias, all-reduced


def test_model_gradients_after_all_reduce(two_ranks):
    assert two_ranks[0]["model/expert_params"] == 8  # w_in, b_in, w_out, b_out of 2 blocks
    _assert_close(two_ranks, "model/")


def test_checkpoint_save_load_gather_and_world_size_mismatch(two_ranks):
    assert "exists and is not empty" in two_ranks[0]["ckpt/save_twice"]  # rank 0 checks the folder
    assert "failed on rank(s) 0" in two_ranks[1]["ckpt/save_twice"]  # and the others learn it failed
    for res in two_ranks:
        assert res["ckpt/files"] == ["config.json", "dense.safetensors", "experts-00000-of-00002.safetensors",
                                     "experts-00001-of-00002.safetensors"]
        assert "moecompile.distributed.save" in res["ckpt/whole_save"]
        assert "saved by 4 ranks but this group has 2" in res["ckpt/world_mismatch"]
        assert "checkpoint gather" in res["ckpt/world_mismatch"]
    assert two_ranks[0]["ckpt/leftovers"] == []  # no temporary folder left
    _assert_close(two_ranks, "ckpt/")


def test_compile_backend_expert_parallel_option(two_ranks):
    _assert_close(two_ranks, "backend/")
    for rank, res in enumerate(two_ranks):
        assert res["backend/rewritten"] == [f"experts_default{s}: experts {2 * rank}..{2 * rank + 1} of 4 on rank "
                                            f"{rank}/2, overlap degree 2" for s in ("", "_1")]
        assert "inference-only" in res["backend/train_error"]


def test_graph_pass_matches_single_process_graph(two_ranks):
    for rank, res in enumerate(two_ranks):
        # 2 blocks x 2 chunks x (there and back)
        assert res["graph/d2/collectives"] == [8, 8]
        assert res["graph/d2/w_in"][0] == 2
        assert len(res["graph/d2/report"]) == 2 and f"rank {rank}/2" in res["graph/d2/report"][0]
    _assert_close(two_ranks, "graph/")


def test_block_constructed_sharded(two_ranks):
    assert two_ranks[0]["ctor/shape"] == [2, F, H]
    _assert_close(two_ranks, "ctor/")


def test_bad_expert_counts_are_clear_errors(two_ranks):
    res = two_ranks[0]
    assert "3 experts over 2 ranks" in res["errors/not_divisible"]
    assert "fewer experts than ranks" in res["errors/fewer_experts"]


def test_unreachable_peer_fails_within_the_timeout(two_ranks):
    res = two_ranks[0]
    assert "peer is unreachable" in res["errors/hung_peer"], res["errors/hung_peer"]
    assert res["errors/hung_peer_s"] < 10
    assert "peer is unreachable" in res["errors/exited_peer"], res["errors/exited_peer"]
    assert res["errors/exited_peer_s"] < 10


# ---- 4 processes

def test_four_ranks(four_ranks):
    res = four_ranks[0]
    assert res["e8/tokens_per_expert"][-1] == 0 and res["e8/tokens_per_rank"][1] == 0
    assert res["e8/d1/local_shape"][0] == 2 and res["e4/d1/local_shape"][0] == 1
    _assert_close(four_ranks, "e8/")
    _assert_close(four_ranks, "e4/")


# ---- single process

def test_init_fails_clearly_when_peers_never_arrive():
    start = time.perf_counter()
    with pytest.raises(MoECompileError, match="could not form the process group of 2 ranks within 2 s"):
        ep.init(init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=2, timeout=2)
    assert time.perf_counter() - start < 15
    assert not dist.is_initialized()


def test_distribute_needs_a_process_group():
    with pytest.raises(MoECompileError, match="not initialized"):
        ep.distribute(MoEBlock(MoEConfig(H, F, 2, top_k=1)))


@pytest.fixture(scope="module")
def whole_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("whole") / "ck"
    moecompile.save(_tiny_gpt2(), path, progress=False)
    return path


def _state(directory: Path) -> dict:
    from moecompile.io import checkpoint

    return checkpoint.read_tensors(checkpoint.weight_files(directory), progress=False)


@pytest.mark.parametrize("world", [2, 4])
def test_gather_of_scatter_is_the_checkpoint(whole_checkpoint, tmp_path, world):
    ep_checkpoint.scatter(whole_checkpoint, tmp_path / "ep", world, progress=False)
    ep_checkpoint.gather(tmp_path / "ep", tmp_path / "back", progress=False)
    shard = ep_checkpoint.read_rank(tmp_path / "ep", world - 1, world)
    assert shard["transformer.h.0.mlp.experts.w_in"].shape[0] == 4 // world
    before, after = _state(whole_checkpoint), _state(tmp_path / "back")
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k
    config = json.loads((whole_checkpoint / "config.json").read_text())
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == config
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_logits(moecompile.load(tmp_path / "back", progress=False), ids),
                               _logits(moecompile.load(whole_checkpoint, progress=False), ids), rtol=0, atol=0)


def test_checkpoint_cli_and_bad_input(whole_checkpoint, tmp_path, capsys):
    ep_dir, back = tmp_path / "ep", tmp_path / "back"
    assert cli_main(["checkpoint", "scatter", str(whole_checkpoint), str(ep_dir), "--world-size", "2",
                     "--no-progress"]) == 0
    assert cli_main(["checkpoint", "gather", str(ep_dir), str(back), "--no-progress"]) == 0
    assert "gathered" in capsys.readouterr().out
    cases = [
        (["scatter", str(whole_checkpoint), str(tmp_path / "x"), "--world-size", "3"], "4 experts over 3 ranks"),
        (["scatter", str(ep_dir), str(tmp_path / "x"), "--world-size", "2"], "already sharded"),
        (["gather", str(whole_checkpoint), str(tmp_path / "x")], "not an expert-parallel checkpoint"),
        (["gather", str(ep_dir), str(back)], "exists and is not empty"),
    ]
    for argv, message in cases:
        assert cli_main(["checkpoint", *argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("moecompile: error: ") and message in err and err.count("\n") == 1, err
        assert not (tmp_path / "x").exists()
    with pytest.raises(MoECompileError, match="sharded over 2 ranks"):
        moecompile.load(ep_dir, progress=False)
    (ep_dir / "experts-00001-of-00002.safetensors").write_bytes(b"garbage")
    with pytest.raises(MoECompileError, match="corrupt"):
        ep_checkpoint.gather(ep_dir, tmp_path / "y", progress=False)
    assert not (tmp_path / "y").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ---- the example: its ranks forked here in torchrun's environment; under torchrun itself in `make test-slow`

def _example_rank(rank, world, port, tmp, argv):
    """One rank of ep_train with the environment torchrun gives it; its exit code and printout in tmp."""
    from moecompile.examples import ep_train

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_RUN_ID="test")
    os.chdir(tmp)
    with open(f"rank{rank}.out", "w") as f, contextlib.redirect_stdout(f):
        code = ep_train.main(argv)
    Path(f"rank{rank}.json").write_text(json.dumps(code))


def _example(tmp: Path, *argv: str) -> str:
    """Rank 0's printout of ep_train on 2 ranks; both must exit 0."""
    assert _spawn(_example_rank, 2, tmp, list(argv)) == [0, 0], (tmp / "rank0.out").read_text()
    return (tmp / "rank0.out").read_text()


def _assert_example_trained(stdout: str, banner: str) -> None:
    assert banner in stdout and "(2 per rank)" in stdout, stdout
    losses = [float(line.split()[3]) for line in stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0], stdout


def _assert_example_saved(save: Path, tmp: Path) -> None:
    from moecompile.parallel import dcp as dcp_io

    dcp_io.export(save, tmp / "whole")
    assert len(moecompile.load(tmp / "whole", progress=False).moe_layout) == 2


EXAMPLE_ARGS = ("--steps", "3", "--batch-size", "2", "--seq-len", "16")


def test_ep_train_example(tmp_path):
    stdout = _example(tmp_path, *EXAMPLE_ARGS, "--overlap-degree", "2", "--save", str(tmp_path / "ep"))
    _assert_example_trained(stdout, "ranks: 2 (gloo)")
    assert "mesh: dp 1 x ep 2" in stdout, stdout
    _assert_example_saved(tmp_path / "ep", tmp_path)


def test_ep_train_example_lightning_model_parallel_strategy(tmp_path):
    stdout = _example(tmp_path, "--lightning", *EXAMPLE_ARGS, "--parallel", "dp")
    _assert_example_trained(stdout, "ranks: 2 (gloo, lightning")


def _torchrun_example(tmp: Path, *argv: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "moecompile.examples.ep_train", *EXAMPLE_ARGS, *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp)  # (conftest.py)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_ep_train_example_under_torchrun(tmp_path):
    stdout = _torchrun_example(tmp_path, "--overlap-degree", "2", "--save", str(tmp_path / "ep"))
    _assert_example_trained(stdout, "ranks: 2 (gloo)")
    assert "mesh: dp 1 x ep 2" in stdout, stdout
    _assert_example_saved(tmp_path / "ep", tmp_path)


@pytest.mark.slow
def test_ep_train_example_lightning_under_torchrun(tmp_path):
    stdout = _torchrun_example(tmp_path, "--lightning", "--parallel", "dp")
    _assert_example_trained(stdout, "ranks: 2 (gloo, lightning")


# ---- a (dp, ep) mesh under FSDP2, DCP, the dp/ep switch (4 processes; the DCP checkpoint also on 2 and 1)

@pytest.mark.parametrize("mesh", ["2x2", "1x4"])
@pytest.mark.parametrize("model", ["gpt2", "mixtral"])
def test_mesh_fsdp_matches_single_process(four_ranks, mesh, model):
    key = f"{mesh}/{model}"
    res = four_ranks[0]
    counts = res[f"{key}/tokens_per_expert"]
    assert counts[4:] == [0, 0, 0, 0] and min(counts[:4]) > 0, counts  # experts 4..7 (an ep rank's) get no tokens
    assert res[f"{key}/dropped"] > 0  # capacity drops
    assert len(res[f"{key}/grads_checked"]) == len(set(res[f"{key}/grads_checked"])) > 20
    assert "experts.w_in" in " ".join(res[f"{key}/grads_checked"])
    assert "Shard(dim=0)" in res[f"{key}/expert_placements"]  # experts: DTensors on (dp, ep), sharded on both
    _assert_close(four_ranks, f"{key}/")


def test_dcp_checkpoint_reshards_across_meshes_and_world_sizes(four_ranks, two_ranks, four_ranks_dir, tmp_path):
    from moecompile.parallel import dcp as dcp_io

    _assert_close(four_ranks, "1x4/gpt2/dcp_loaded_out")  # saved on 2 x 2, loaded on 1 x 4
    _assert_close(two_ranks, "dcp2/")  # on 2 ranks
    assert two_ranks[0]["dcp2/local_experts"] == 4
    source = four_ranks_dir[1] / "dcp"
    want = torch.load(source.parent / "dcp_logits.pt", weights_only=True)
    assert json.loads((source / "config.json").read_text())["moe"]["dcp"]["world_size"] == 4
    assert _err(_logits(dcp_io.load(source).eval(), DCP_IDS), want) <= TOL  # on 1 process
    assert cli_main(["checkpoint", "export-dcp", str(source), str(tmp_path / "whole")]) == 0
    whole = moecompile.load(tmp_path / "whole", progress=False)  # the single-folder format
    assert _err(_logits(whole, DCP_IDS), want) <= TOL
    assert "lm_head.weight" not in _state(tmp_path / "whole")  # tied to the embeddings: stored once
    assert cli_main(["checkpoint", "export-dcp", str(source), str(tmp_path / "whole")]) == 2  # not empty
    assert cli_main(["checkpoint", "export-dcp", str(tmp_path / "whole"), str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_parallel_switch_dp_and_ep_agree(four_ranks):
    for mode in ("ep", "dp"):
        _assert_close(four_ranks, f"switch/{mode}/")
    _assert_close(four_ranks, "switch/kwarg")
    assert "parallel must be one of" in four_ranks[0]["switch/bad_mode"]
