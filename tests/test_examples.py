"""The examples run end to end: examples/helloworld.py trains one MoE layer and its loss goes down."""
from __future__ import annotations

import math
import re
import subprocess
import sys

from moecompile.examples import helloworld

TINY = ["--steps", "3", "--batch-size", "4", "--seq-len", "8", "--hidden", "32", "--ffn", "64"]
STEP = re.compile(r"^step\s+(\d+)\s+loss\s+(\S+)\s.*time\s+([\d.]+) ms$", re.M)


def _losses(out: str) -> list[float]:
    steps = STEP.findall(out)
    assert [int(s) for s, _, _ in steps] == list(range(1, len(steps) + 1))
    return [float(loss) for _, loss, _ in steps]


def test_helloworld_in_process(capsys):
    assert helloworld.main(TINY + ["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for key, value in [("device", "cpu"), ("dtype", "float32"), ("batch_size", "4"), ("seq_len", "8"),
                       ("hidden", "32"), ("ffn", "64"), ("experts", "4"), ("top_k", "2"),
                       ("capacity_factor", "0.0"), ("activation", "gelu"), ("gated", "False"), ("steps", "3")]:
        assert re.search(rf"^{key}\s*: {re.escape(value)}$", out, re.M), (key, out)
    losses = _losses(out)
    assert len(losses) == 3, out
    assert math.isfinite(losses[-1]) and losses[-1] < losses[0], losses
    assert re.search(r"^median step time: [\d.]+ ms$", out, re.M), out
    assert re.search(r"^throughput: [\d,]+ tokens/s$", out, re.M), out


def test_helloworld_gated_sgd_with_capacity(capsys):
    argv = TINY + ["--device", "cpu", "--gated", "--activation", "silu", "--optimizer", "sgd",
                   "--capacity-factor", "1.0", "--experts", "2", "--top-k", "1"]
    assert helloworld.main(argv) == 0
    losses = _losses(capsys.readouterr().out)
    assert len(losses) == 3 and math.isfinite(losses[-1]) and losses[-1] < losses[0], losses


def test_helloworld_as_module(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moecompile.examples.helloworld", *TINY, "--device", "cpu",
                           "--steps", "2"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)  # (not the repository root: tests/conftest.py says why)
    assert proc.returncode == 0, proc.stderr
    assert len(_losses(proc.stdout)) == 2, proc.stdout
