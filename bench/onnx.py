"""onnxruntime (CPU provider) vs torch eager (CPU): forward time of GPT-2 upcycled into MoE blocks.

    python bench/onnx.py --out bench/results/onnx.md

Builds GPT-2 (124M) from its config with RANDOM weights (no GPT-2 weights on this machine; timing does not
depend on the values), times the dense model, then upcycles every FFN into `--experts` experts (top-k, dropless:
the com.microsoft::MoE path) and times torch eager, the onnxruntime export with com.microsoft::MoE, and the
export with every block lowered to standard ONNX ops (`contrib=False`). torch and the onnxruntime sessions run in
turn, `--repeat` rounds after two warm-ups each, so that all see the same load on a shared machine; the best and
the median time are reported, on `--threads` threads in both runtimes, with the max abs difference of the logits
(onnxruntime vs torch).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

# `python bench/onnx.py` puts bench/ first on sys.path, where this file would shadow the onnx package
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

import moecompile  # noqa: E402
from moecompile.conversion import models  # noqa: E402
from moecompile.io.onnx_export import export_onnx, token_ids  # noqa: E402


def _interleaved_ms(fns: dict, repeat: int) -> dict:
    """Best and median wall time (ms) of each fn, run in turn so that all of them see the same machine load."""
    for fn in fns.values():
        for _ in range(2):  # warm-up
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def _session(path: Path, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _time(model, sessions: dict, batches: list[int], seq: int, repeat: int) -> list[dict]:
    rows = []
    for batch in batches:
        ids = token_ids(model, batch, seq, seed=batch)
        feed = {"input_ids": ids.numpy()}
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits.numpy()
            fns = {"eager": lambda: model(ids, use_cache=False)}
            fns.update({name: (lambda s=s: s.run(None, feed)) for name, s in sessions.items()})
            ms = _interleaved_ms(fns, repeat)
        for name, session in sessions.items():
            diff = float(np.abs(session.run(None, feed)[0] - logits).max())
            rows.append({"variant": name, "batch": batch, "eager": ms["eager"], "ort": ms[name], "diff": diff})
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--out", default=None, help="write the markdown table here")
    a = p.parse_args(argv)
    a.argv = sys.argv[1:] if argv is None else list(argv)
    a.load_before = os.getloadavg()[0]
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = models.load_source("gpt2", random_init=True, progress=False).model.eval()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        export_onnx(model, tmp / "dense.onnx", progress=False)
        print(f"dense export {time.perf_counter() - start:.1f} s", flush=True)
        rows += _time(model, {"dense": _session(tmp / "dense.onnx", a.threads)}, a.batches, a.seq, a.repeat)
        (tmp / "dense.onnx").unlink()
        moecompile.moeize(model, experts=a.experts, top_k=a.top_k, capacity_factor=0.0, noise=0.01, progress=False)
        sessions = {}
        for name, contrib in (("MoE, com.microsoft::MoE", True), ("MoE, standard ops", False)):
            start = time.perf_counter()
            report = export_onnx(model, tmp / f"{contrib}.onnx", contrib=contrib, progress=False)
            assert bool(report.contrib_blocks) == contrib, report.blocks
            print(f"{name} export {time.perf_counter() - start:.1f} s", flush=True)
            sessions[name] = _session(tmp / f"{contrib}.onnx", a.threads)
        rows += _time(model, sessions, a.batches, a.seq, a.repeat)
    a.load_after = os.getloadavg()[0]
    table = _markdown(rows, a)
    print(table)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(table)
    return 0


def _markdown(rows: list[dict], a) -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    lines = [
        "# ONNX Runtime vs torch eager on CPU: GPT-2 forward",
        "",
        f"GPT-2 (124M config, RANDOM weights), float32, sequence {a.seq}; MoE = every FFN upcycled into "
        f"{a.experts} experts, top-{a.top_k}, dropless (capacity factor 0). {a.repeat} rounds after 2 warm-ups, "
        f"torch and onnxruntime in turn; {a.threads} threads in both runtimes. Machine: {cpu}, "
        f"{os.cpu_count()} cores (shared with other jobs: 1-minute load average {a.load_before:.1f} at the start, "
        f"{a.load_after:.1f} at the end, so compare rows of one run, not absolute times), torch {torch.__version__}, "
        f"onnxruntime {ort.__version__}.",
        "",
        f"Command: `{' '.join(['python bench/onnx.py', *a.argv])}`",
        "",
        "| model | batch | torch eager, best / median (ms) | onnxruntime, best / median (ms) | torch / ort (best) "
        "| max abs diff of logits |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        (e_best, e_med), (o_best, o_med) = r["eager"], r["ort"]
        lines.append(f"| {r['variant']} | {r['batch']} | {e_best:.0f} / {e_med:.0f} | {o_best:.0f} / {o_med:.0f} | "
                     f"{e_best / o_best:.2f}x | {r['diff']:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
