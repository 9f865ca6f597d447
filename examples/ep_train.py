"""Expert-parallel training on a (dp, ep) DeviceMesh with FSDP2: convert a model to MoE, train a few steps.

    torchrun --nproc-per-node 2 -m moecompile.examples.ep_train --steps 5
    torchrun --nproc-per-node 8 -m moecompile.examples.ep_train --model gpt2 --experts 16 --ep 4 --batch-size 8

Every rank builds the same model (same seed; --random-init configs, or a local/packaged model) and converts its FFNs
with `moecompile.moeize`; then the torchtitan recipe: a ("dp", "ep") mesh of W / ep x ep ranks,
`moecompile.distribute(model, mesh["ep"])` keeps E/ep experts of every block on each rank, and
`ep.apply_fsdp(model, mesh)` shards the experts over "dp" and everything else over all ranks with FSDP2's
fully_shard, which also reduces every gradient (no hand-written all-reduce). Each rank trains on its own random
token batch (causal LM loss + the blocks' aux loss). Rank 0 prints the mean loss over ranks and the step time. gloo
on CPU, NCCL on GPUs (one per rank). --save writes a torch.distributed.checkpoint (DCP) checkpoint, model and
optimizer, loadable on any other mesh (`moecompile checkpoint export-dcp` makes one folder of it).

--lightning runs the same recipe under PyTorch Lightning's ModelParallelStrategy: its ("data_parallel",
"tensor_parallel") mesh is the (dp, ep) mesh, configure_model() distributes and shards, and MoECallback adds the aux
loss. Lightning's sampler splits the data over "data_parallel" only, so the ep ranks of a dp group train on the same
batch.
"""
from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import moecompile
from moecompile import distributed as ep
from moecompile.core import settings


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node W -m moecompile.examples.ep_train",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-gpt2", help="anything `moecompile convert` takes (default tiny-gpt2, "
                                                        "built from its config with random weights)")
    p.add_argument("--experts", type=int, default=4, help="experts per block (a multiple of the world size)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=0.0)
    p.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: the world size); the "
                                                         "world size over it is the data-parallel degree")
    p.add_argument("--parallel", choices=("ep", "dp"), default="ep",
                   help="run the blocks expert-parallel (tokens all-to-all) or data-parallel (expert weights "
                        "all-gathered)")
    p.add_argument("--overlap-degree", type=int, default=1, help="all-to-all chunks pipelined with expert compute")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for peers (then a clear error)")
    p.add_argument("--save", default=None, help="write a DCP checkpoint (model + optimizer) to this folder at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lightning", action="store_true", help="train with Lightning's ModelParallelStrategy")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return train_lightning(args) if args.lightning else train(args)
    except moecompile.MoECompileError as e:
        print(f"ep_train: error: {e}", flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def build_model(args) -> torch.nn.Module:
    from moecompile.conversion import models

    torch.manual_seed(args.seed)  # the same model on every rank
    model = models.load_source(args.model, random_init=True, progress=False).model
    return moecompile.moeize(model, experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity_factor,
                             noise=0.1, progress=False)


def train(args) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    from moecompile.parallel import dcp

    group = ep.init(timeout=args.timeout)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ep_size = args.ep or world
    if world % ep_size:
        raise moecompile.MoECompileError(f"--ep {ep_size} does not divide the world size {world}")
    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world // ep_size, ep_size), mesh_dim_names=("dp", "ep"))
    model = build_model(args).to(device).train()
    moecompile.distribute(model, mesh["ep"], overlap_degree=args.overlap_degree)
    ep.apply_fsdp(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own data
    ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=gen).to(device)
    if rank == 0:
        print(f"ranks: {world} ({dist.get_backend(group)}), mesh: dp {world // ep_size} x ep {ep_size}, model: "
              f"{args.model}, experts: {args.experts} ({args.experts // ep_size} per rank), top_k: {args.top_k}, "
              f"tokens per rank: {ids.numel()}, overlap degree: {args.overlap_degree}, parallel: {args.parallel}",
              flush=True)
    times = []
    with ep.parallel_mode(model, args.parallel):
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            lm_loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss = lm_loss + moecompile.aux_loss(model).to(device)
            loss.backward()  # FSDP2 reduce-scatters every gradient over the ranks that hold the same weights
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=group)
            mean /= world
            times.append(time.perf_counter() - start)
            if rank == 0:
                print(f"step {step:4d}  loss {mean.item():.6f}  time {times[-1] * 1e3:9.3f} ms", flush=True)
    if rank == 0:
        print(f"median step time: {statistics.median(times) * 1e3:.3f} ms", flush=True)
    if args.save:
        dcp.save(model, args.save, optimizer)
        if rank == 0:
            print(f"saved DCP checkpoint to {args.save}", flush=True)
    return 0


def train_lightning(args) -> int:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from moecompile.integrations.lightning import MoECallback

    world = int(settings.world_size("1"))  # torchrun's; Lightning forms the group itself
    ep_size = args.ep or world
    if world % ep_size:
        raise moecompile.MoECompileError(f"--ep {ep_size} does not divide the world size {world}")

    class MoELM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model(args)

        def configure_model(self):
            if ep.is_distributed(self.model):  # (called again by a later fit/validate)
                return
            mesh = self.device_mesh
            moecompile.distribute(self.model, mesh["tensor_parallel"], overlap_degree=args.overlap_degree)
            ep.apply_fsdp(self.model, mesh, dp="data_parallel", ep="tensor_parallel")

        def training_step(self, batch, batch_idx):
            with ep.parallel_mode(self.model, args.parallel):
                return self.model(input_ids=batch[0], labels=batch[0], use_cache=False).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=args.lr)

    class Report(pl.Callback):
        def on_train_start(self, trainer, module):
            if trainer.global_rank == 0:
                print(f"ranks: {world} ({dist.get_backend()}, lightning {pl.__version__}), mesh: dp {dp_size} x ep "
                      f"{ep_size}, model: {args.model}, experts: {args.experts} ({args.experts // ep_size} per rank)",
                      flush=True)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            loss = outputs["loss"].detach().clone()
            dist.all_reduce(loss)
            if trainer.global_rank == 0:
                print(f"step {trainer.global_step:4d}  loss {loss.item() / world:.6f}", flush=True)

    dp_size = world // ep_size
    gen = torch.Generator().manual_seed(args.seed + 1)
    vocab = build_model(args).config.vocab_size
    data = torch.randint(0, vocab, (dp_size * args.batch_size, args.seq_len), generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=args.batch_size)
    strategy = ModelParallelStrategy(data_parallel_size=dp_size, tensor_parallel_size=ep_size,
                                     timeout=timedelta(seconds=args.timeout))
    trainer = pl.Trainer(accelerator="auto", devices=world, strategy=strategy, max_steps=args.steps,
                         max_epochs=args.steps, callbacks=[MoECallback(log_stats=False), Report()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(MoELM(), loader)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
