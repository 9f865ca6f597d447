"""GPT-2 MoE fine-tune: convert GPT-2's MLPs to experts, train on local text with the aux loss, save the result.

The model is a local GPT-2 (a folder with config.json + safetensors, or the HF cache) with its real weights and
tokenizer when one exists (--model PATH). Otherwise GPT-2 is built with RANDOM weights, said loudly, and by
default in a reduced configuration (--layers/--width/--heads, byte-level vocabulary of 256) so that the
default run trains in a couple of minutes on a CPU; --full-size keeps the published 124M configuration.
Without a GPT-2 tokenizer the text is tokenized as UTF-8 bytes.

The text is a file (--text) or, by default, the docstrings of a fixed list of Python standard-library modules.
Each MLP is upcycled into an MoE block (moecompile.moeize); training adds moecompile.aux_loss to the language-
model loss. The script writes OUT/loss.png (training loss per step and validation loss) and OUT/checkpoint
(moecompile.save; reload with moecompile.load), and prints a summary with step time and expert load.

    python -m moecompile.examples.gpt2_finetune                           # random reduced GPT-2, stdlib docs
    python -m moecompile.examples.gpt2_finetune --model ./gpt2 --text notes.txt --steps 200 --out gpt2-notes
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import moecompile
from moecompile.conversion import models
from moecompile.core.errors import MoECompileError
from moecompile.examples.common import add_moe_args, apply_threads
from moecompile.io import checkpoint
from moecompile.plot import curve_figure, require_matplotlib, save_png
from moecompile.report import human, parameter_counts

STDLIB_MODULES = ("argparse", "collections", "contextlib", "dataclasses", "datetime", "functools", "heapq",
                  "inspect", "itertools", "json", "logging", "os", "pathlib", "random", "re", "shutil",
                  "statistics", "string", "subprocess", "textwrap", "threading", "typing", "unittest", "zipfile")
BYTE_VOCAB = 256


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moecompile.examples.gpt2_finetune",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2", help="a local GPT-2 folder or HF-cache name (default gpt2: "
                   "real weights if cached here, otherwise RANDOM weights)")
    p.add_argument("--full-size", action="store_true", help="random weights: keep the published configuration")
    p.add_argument("--layers", type=int, default=4, help="random reduced config: transformer blocks (default 4)")
    p.add_argument("--width", type=int, default=128, help="random reduced config: hidden size (default 128)")
    p.add_argument("--heads", type=int, default=4, help="random reduced config: attention heads (default 4)")
    p.add_argument("--text", default=None, help="UTF-8 text file to train on (default: stdlib docstrings)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-4 for real weights, "
                   "3e-3 for random ones); linear warmup over 10%% of the steps, then cosine decay")
    p.add_argument("--eval-every", type=int, default=25, help="validation loss every N steps")
    p.add_argument("--out", default="gpt2-moe-finetune", help="output folder (must not exist or be empty)")
    add_moe_args(p, noise=0.0)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "eval_every", "layers", "width", "heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.width % args.heads:
        p.error("--heads must divide --width")
    return args


def stdlib_docs() -> str:
    """Docstrings of STDLIB_MODULES and their public classes and functions, in a fixed order."""
    parts = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if getattr(obj, "__module__", None) == name and inspect.getdoc(obj):
                parts.append(f"{attr}: {inspect.getdoc(obj)}")
    return "\n\n".join(p for p in parts if p)


def load_model(args):
    """(model, tokenizer or None, description). Real weights when a local GPT-2 exists, else random."""
    import transformers

    try:
        source = models.load_source(args.model, random_init=False, progress=False)
    except MoECompileError as e:
        if "no weights for" not in str(e):  # a real problem with the given path or name
            raise
        source = None
    if source is not None:
        tokenizer = None
        if source.directory is not None and any((source.directory / f).is_file() for f in checkpoint.TOKENIZER_FILES):
            tokenizer = transformers.AutoTokenizer.from_pretrained(source.directory, local_files_only=True)
        return source.model, tokenizer, f"{args.model} (real weights from {source.directory})", source.directory
    if args.full_size:
        source = models.load_source(args.model, random_init=True, progress=False)  # warns: RANDOM weights
        return source.model, None, f"{args.model} published config, RANDOM weights", None
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                                     n_positions=max(args.seq_len, 128), vocab_size=BYTE_VOCAB,
                                     bos_token_id=None, eos_token_id=None)
    logging.getLogger("moecompile").warning(
        "no local %s weights: building a reduced GPT-2 (%d layers x %d wide, byte vocabulary) with RANDOM weights; "
        "pass --model PATH for real weights or --full-size for the published configuration", args.model,
        args.layers, args.width)
    return (transformers.GPT2LMHeadModel(config), None,
            f"reduced GPT-2 ({args.layers} layers x {args.width}), RANDOM weights", None)


def tokenize(text: str, tokenizer, vocab_size: int) -> torch.Tensor:
    if tokenizer is not None:
        return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    if vocab_size < BYTE_VOCAB:
        raise MoECompileError(f"byte-level tokens need a vocabulary of at least {BYTE_VOCAB}, the model has "
                              f"{vocab_size}")
    return ids


def batches(ids: torch.Tensor, count: int, batch_size: int, seq_len: int, gen: torch.Generator) -> list[torch.Tensor]:
    starts = torch.randint(0, len(ids) - seq_len - 1, (count, batch_size), generator=gen)
    return [torch.stack([ids[s:s + seq_len + 1] for s in row.tolist()]) for row in starts]


def unigram_entropy(ids: torch.Tensor) -> float:
    """Nats per token of the best context-free predictor: below it, the model uses context."""
    p = torch.bincount(ids).float()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def evaluate(model, val: list[torch.Tensor]) -> float:
    model.eval()
    with torch.no_grad():
        loss = statistics.mean(lm_loss(model, b).item() for b in val)
    model.train()
    return loss


def loss_plot(train_losses: list[float], evals: list[tuple[int, float]], unigram: float, title: str,
              path: Path) -> None:
    steps = len(train_losses)
    fig = curve_figure({"train (LM loss)": (list(range(1, steps + 1)), train_losses),
                        "validation": ([s for s, _ in evals], [v for _, v in evals])},
                       title, "step", "cross-entropy (nats / token)",
                       levels={"unigram entropy of the training text": unigram})
    save_png(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except MoECompileError as e:
        print(f"gpt2_finetune: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    start = time.perf_counter()
    out = checkpoint.check_output_dir(args.out)
    require_matplotlib()  # fail now, not after training
    apply_threads(args)
    torch.manual_seed(args.seed)
    model, tokenizer, what, tokenizer_dir = load_model(args)
    if args.lr is None:
        args.lr = 3e-3 if "RANDOM" in what else 1e-4
    n_positions = model.config.n_positions
    if args.seq_len > n_positions:
        raise MoECompileError(f"--seq-len {args.seq_len} exceeds the model's {n_positions} positions")

    if args.text:
        try:
            text, source = Path(args.text).read_text(encoding="utf-8"), args.text
        except (OSError, UnicodeDecodeError) as e:
            raise MoECompileError(f"cannot read --text {args.text}: {e}") from None
    else:
        text, source = stdlib_docs(), f"docstrings of {len(STDLIB_MODULES)} Python standard-library modules"
    ids = tokenize(text, tokenizer, model.config.vocab_size)
    split = int(len(ids) * 0.9)
    if split < args.seq_len + 2 or len(ids) - split < args.seq_len + 2:
        raise MoECompileError(f"not enough text: {len(ids)} tokens for --seq-len {args.seq_len}")
    train_ids, val_ids = ids[:split], ids[split:]
    print(f"model: {what}")
    print(f"text: {source}: {len(ids):,} tokens ({'model tokenizer' if tokenizer is not None else 'UTF-8 bytes'}), "
          f"90% train / 10% validation")

    dense_params = parameter_counts(model)["total"]
    moecompile.moeize(model, experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity_factor,
                      method="upcycle", noise=args.noise, seed=args.seed, progress=False)
    counts = parameter_counts(model)
    print(f"converted: {len(moecompile.ir.layout.moe_blocks(model))} MLPs -> {args.experts} experts, top-{args.top_k}, "
          f"capacity factor {args.capacity_factor}; parameters {human(dense_params)} dense -> {human(counts['total'])} "
          f"total, {human(counts['active_per_token'])} active per token")

    device = torch.device(args.device)
    model.to(device).train()
    gen = torch.Generator().manual_seed(args.seed)
    val = [b.to(device) for b in batches(val_ids, 4, args.batch_size, args.seq_len, gen)]
    train_batches = batches(train_ids, args.steps, args.batch_size, args.seq_len, gen)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    moecompile.track_routing(model)

    evals = [(0, evaluate(model, val))]
    print(f"step    0: validation loss {evals[0][1]:.3f}")
    losses, aux_losses, times = [], [], []
    for step, batch in enumerate(train_batches, 1):
        t0 = time.perf_counter()
        loss = lm_loss(model, batch.to(device))
        aux = moecompile.aux_loss(model)
        opt.zero_grad(set_to_none=True)
        (loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())  # the one host sync per step, for the curve
        times.append(time.perf_counter() - t0)
        aux_losses.append(aux.item())
        if step % args.eval_every == 0 or step == args.steps:
            evals.append((step, evaluate(model, val)))
            load = [s.summary() for s in moecompile.routing_stats(model).values()]
            print(f"step {step:4d}: train loss {statistics.mean(losses[-args.eval_every:]):.3f}, validation loss "
                  f"{evals[-1][1]:.3f}, aux {aux_losses[-1]:.4f}, busiest expert "
                  f"{max(s['load_max'] for s in load):.2f}x even, step {statistics.median(times) * 1e3:.0f} ms",
                  flush=True)

    out.mkdir(parents=True, exist_ok=True)
    png = out / "loss.png"
    unigram = unigram_entropy(train_ids)
    loss_plot(losses, evals, unigram, f"{what}: MoE fine-tune ({args.experts} experts, top-{args.top_k})", png)
    model.eval()
    saved = moecompile.save(model, out / "checkpoint", tokenizer_dir=tokenizer_dir, progress=False)
    median = statistics.median(times)
    tokens = args.batch_size * args.seq_len
    print(f"\nsummary: {args.steps} steps of {tokens} tokens; validation loss {evals[0][1]:.3f} -> {evals[-1][1]:.3f} "
          f"(for scale: uniform over the vocabulary {math.log(model.config.vocab_size):.3f}, unigram entropy of "
          f"the training text {unigram:.3f})")
    print(f"  median step {median * 1e3:.0f} ms ({tokens / median:,.0f} tokens/s on {device}"
          f"{f', {torch.get_num_threads()} threads' if device.type == 'cpu' else ''}); total time "
          f"{time.perf_counter() - start:.0f} s")
    load = [s.summary() for s in moecompile.routing_stats(model).values()]
    print(f"  routing at the last step: busiest expert {max(s['load_max'] for s in load):.2f}x an even share, "
          f"{statistics.mean(s['dropped_frac'] for s in load):.1%} of assignments dropped, aux loss "
          f"{aux_losses[-1]:.4f}")
    print(f"  loss curve: {png}")
    print(f"  checkpoint: {saved} (moecompile.load to reload)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
