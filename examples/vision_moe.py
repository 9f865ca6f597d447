"""Vision MoE: a small ViT image classifier, dense and with its MLP blocks converted to experts, side by side.

A ViT (patch embedding, pre-norm transformer blocks, mean pooling) is built once; a copy is converted with
`moecompile.moeize`, which finds every MLP (Linear -> GELU -> Linear) in the exported graph and upcycles it
into an MoE block whose experts are noisy copies of the dense MLP. Both models then train from the same
initial weights on the same batches (AdamW, the MoE model adds its aux loss), and the script prints test
accuracy per epoch, median step time and parameter counts for both.

Data: CIFAR-10 when its binary version (cifar-10-batches-bin: data_batch_*.bin, test_batch.bin; read as raw
bytes, nothing unpickled) is found locally (--data, $CIFAR10_DIR, ./data, ~/data, ~/.cache); otherwise a
synthetic 10-class task of 32x32 colour textures, and the output says so.

    python -m moecompile.examples.vision_moe                    # defaults: about a minute or two on 2 CPU cores
    python -m moecompile.examples.vision_moe --data ~/cifar-10-batches-bin --train-size 0 --epochs 10
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import moecompile
from moecompile.core import settings
from moecompile.examples.common import add_moe_args, apply_threads
from moecompile.report import human, parameter_counts

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR_DIRNAME = "cifar-10-batches-bin"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moecompile.examples.vision_moe", description=__doc__.split("\n")[0])
    p.add_argument("--data", default=None, help=f"CIFAR-10 binary folder ({CIFAR_DIRNAME}) or its parent")
    p.add_argument("--synthetic", action="store_true", help="use the synthetic task even if CIFAR-10 is found")
    p.add_argument("--train-size", type=int, default=3000, help="training images (0: all)")
    p.add_argument("--test-size", type=int, default=1000, help="test images (0: all)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--dim", type=int, default=64, help="ViT width")
    p.add_argument("--depth", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mlp-ratio", type=int, default=2, help="MLP hidden size = ratio * dim")
    p.add_argument("--patch", type=int, default=4, help="patch size (32x32 images)")
    add_moe_args(p, noise=0.5)
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        p.error("--epochs and --batch-size must be >= 1")
    if 32 % args.patch:
        p.error("--patch must divide 32")
    if args.dim % args.heads:
        p.error("--heads must divide --dim")
    return args


# ------------------------------------------------------------------------------------------------------ model

class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), MLP(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int, mlp_ratio: int, patch: int, classes: int = 10):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, (32 // patch) ** 2, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio * dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.embed(images).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


# ------------------------------------------------------------------------------------------------------- data

def find_cifar(explicit: str | None) -> Path | None:
    candidates = [explicit] if explicit else [settings.cifar10_dir(), "data", "~/data", "~/.cache", "."]
    for c in filter(None, candidates):
        for d in (Path(c).expanduser(), Path(c).expanduser() / CIFAR_DIRNAME):
            if (d / "test_batch.bin").is_file() and (d / "data_batch_1.bin").is_file():
                return d
    if explicit:
        raise SystemExit("vision_moe: error: no CIFAR-10 binary batches (data_batch_1.bin, test_batch.bin) in "
                         f"{explicit}")
    return None


def read_cifar(folder: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CIFAR-10 binary format: records of 1 label byte + 3072 pixel bytes (3 x 32 x 32, channel-major)."""
    def load(names):
        raw = np.concatenate([np.fromfile(folder / n, dtype=np.uint8) for n in names if (folder / n).is_file()])
        raw = raw.reshape(-1, 3073)
        images = torch.from_numpy(raw[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32) / 255.0)
        mean, std = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
        return (images - mean) / std, torch.from_numpy(raw[:, 0].astype(np.int64))

    x_train, y_train = load([f"data_batch_{i}.bin" for i in range(1, 6)])
    x_test, y_test = load(["test_batch.bin"])
    return x_train, y_train, x_test, y_test


def synthetic_images(n: int, seed: int, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """A 10-class texture task: each class is a sum of three oriented colour gratings (fixed per class, the
    same for every seed); an image is its class's texture, randomly shifted, rescaled in contrast, mixed with
    a weaker texture of another class and Gaussian noise. Solvable, but not from any single pixel."""
    proto_gen = torch.Generator().manual_seed(1234)
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    protos = torch.zeros(classes, 3, 32, 32)
    for c in range(classes):
        for _ in range(3):
            angle, freq = torch.rand(2, generator=proto_gen)
            phase = float(torch.rand(1, generator=proto_gen)) * 2 * math.pi
            wave = torch.sin(2 * math.pi * (0.05 + 0.2 * freq) * (xx * torch.cos(angle * math.pi)
                                                                   + yy * torch.sin(angle * math.pi)) + phase)
            protos[c] += torch.randn(3, 1, 1, generator=proto_gen) * wave
    protos /= protos.std(dim=(1, 2, 3), keepdim=True)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    others = (labels + torch.randint(1, classes, (n,), generator=g)) % classes
    shifts = torch.randint(-6, 7, (n, 2), generator=g)
    images = torch.empty(n, 3, 32, 32)
    for i in range(n):
        mix = protos[labels[i]] * (0.5 + 0.7 * torch.rand(1, generator=g)) + 0.8 * protos[others[i]]
        images[i] = torch.roll(mix, shifts=tuple(shifts[i].tolist()), dims=(1, 2))
    images += torch.randn(images.shape, generator=g) * 1.5
    return images, labels


def dataset(args) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    folder = None if args.synthetic else find_cifar(args.data)
    if folder is not None:
        x_train, y_train, x_test, y_test = read_cifar(folder)
        name = f"CIFAR-10 from {folder}"
        g = torch.Generator().manual_seed(args.seed)  # a fixed random subset when --train-size is smaller
        if args.train_size:
            keep = torch.randperm(len(y_train), generator=g)[:args.train_size]
            x_train, y_train = x_train[keep], y_train[keep]
        if args.test_size:
            x_test, y_test = x_test[:args.test_size], y_test[:args.test_size]
    else:
        name = ("SYNTHETIC 10-class texture task (CIFAR-10 not found locally: pass --data DIR with the binary "
                "version to train on it)" if not args.synthetic else "SYNTHETIC 10-class texture task (--synthetic)")
        x_train, y_train = synthetic_images(args.train_size or 10000, seed=args.seed + 1)
        x_test, y_test = synthetic_images(args.test_size or 2000, seed=args.seed + 2)
    return name, x_train, y_train, x_test, y_test


# -------------------------------------------------------------------------------------------------- training

def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> float:
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x[i:i + batch_size]).argmax(-1) == y[i:i + batch_size]).sum())
                      for i in range(0, len(y), batch_size))
    model.train()
    return correct / len(y)


def train(model: nn.Module, data, args, label: str) -> dict:
    _, x_train, y_train, x_test, y_test = data
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps_per_epoch = math.ceil(len(y_train) / args.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.epochs * steps_per_epoch,
                                                pct_start=0.15)
    order_gen = torch.Generator().manual_seed(args.seed)  # the same batches for both models
    times, accs, losses = [], [], []
    model.train()
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(len(y_train), generator=order_gen)
        for i in range(0, len(y_train), args.batch_size):
            idx = perm[i:i + args.batch_size]
            start = time.perf_counter()
            logits = model(x_train[idx])
            loss = F.cross_entropy(logits, y_train[idx]) + moecompile.aux_loss(model)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        accs.append(accuracy(model, x_test, y_test, 250))
        print(f"  {label:<5} epoch {epoch}: train loss {statistics.mean(losses[-steps_per_epoch:]):.3f}, "
              f"test accuracy {accs[-1]:.1%}, median step {statistics.median(times) * 1e3:.1f} ms", flush=True)
    return {"accuracy": accs, "step_ms": statistics.median(times) * 1e3, "steps": len(times)}


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    apply_threads(args)
    torch.manual_seed(args.seed)
    data = dataset(args)
    print(f"data: {data[0]}: {len(data[2])} training, {len(data[4])} test images")

    dense = ViT(args.dim, args.depth, args.heads, args.mlp_ratio, args.patch)
    moe = copy.deepcopy(dense)  # the same initial weights
    moecompile.moeize(moe, experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity_factor,
                      method="upcycle", noise=args.noise, seed=args.seed, example_args=(data[1][:2],),
                      progress=False)
    blocks = len(moecompile.ir.layout.moe_blocks(moe))
    print(f"model: ViT {args.depth} blocks x {args.dim} wide, patch {args.patch}; MoE copy: {blocks} MLPs -> "
          f"{args.experts} experts, top-{args.top_k}, capacity factor {args.capacity_factor} (upcycled, noise "
          f"{args.noise})")

    device = torch.device(args.device)
    data = (data[0], *(t.to(device) for t in data[1:]))
    print(f"device: {device}{'' if device.type != 'cpu' else f', {torch.get_num_threads()} threads'}")
    results = {}
    for label, model in (("dense", dense.to(device)), ("moe", moe.to(device))):
        print(f"training {label} ({args.epochs} epochs, batch {args.batch_size}):")
        results[label] = train(model, data, args, label)
        results[label].update(parameter_counts(model))

    moecompile.track_routing(moe)
    accuracy(moe, data[3][:500], data[4][:500], 500)  # one test batch, to report expert load
    load = [s.summary() for s in moecompile.routing_stats(moe).values()]

    d, m = results["dense"], results["moe"]
    print(f"\nsummary ({data[0].split(' (')[0]}):")
    print(f"  {'':<26}{'dense':>12}{'moe':>12}")
    print(f"  {'parameters':<26}{human(d['total']):>12}{human(m['total']):>12}")
    print(f"  {'active parameters/token':<26}{human(d['active_per_token']):>12}{human(m['active_per_token']):>12}")
    for e in range(args.epochs):
        print(f"  {f'test accuracy, epoch {e + 1}':<26}{d['accuracy'][e]:>12.1%}{m['accuracy'][e]:>12.1%}")
    print(f"  {'median train step (ms)':<26}{d['step_ms']:>12.1f}{m['step_ms']:>12.1f}")
    print(f"  moe expert load on 500 test images: busiest expert {max(s['load_max'] for s in load):.2f}x an even "
          f"share, dropped {statistics.mean(s['dropped_frac'] for s in load):.1%} of assignments")
    print(f"  final test accuracy: dense {d['accuracy'][-1]:.1%}, moe {m['accuracy'][-1]:.1%}; "
          f"total time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
