"""Calibrated split with --device cuda (marker gpu: deselected in CI, run on the device with `pytest -m gpu`).

The same tiny conversion calibrated on CUDA and on the CPU: the checkpoint comes back on the CPU and its quality
and per-layer errors are close to the CPU run's (bfloat16 distillation on CUDA, float32 here: close, not equal).
"""
import json

import pytest
import torch

import moecompile
from moecompile.cli import main

pytestmark = pytest.mark.gpu


def _convert(tmp_path, device):
    out = tmp_path / device
    assert main(["convert", "tiny-bert", "--random-init", "--experts", "4", "--top-k", "2", "--method", "split",
                 "--calib", "stdlib", "--calib-tokens", "4000", "--distill-steps", "60", "--e2e-steps", "60",
                 "--eval-sentences", "64", "--capacity-factor", "0", "--device", device, "--out", str(out),
                 "--no-progress"]) == 0
    return json.loads((out / "report.json").read_text()), out


def test_calibration_on_cuda_is_close_to_the_cpu_result(tmp_path):
    cuda, path = _convert(tmp_path, "cuda")
    cpu, _ = _convert(tmp_path, "cpu")
    assert cuda["calibration"]["device"].startswith("cuda") and cpu["calibration"]["device"] == "cpu"
    assert cuda["calibration"]["tokens"] == cpu["calibration"]["tokens"]
    for a, b in zip(cuda["curve"], cpu["curve"]):
        assert a["top_k"] == b["top_k"]
        for name, q in b["sources"].items():
            assert a["sources"][name]["mean_cosine"] == pytest.approx(q["mean_cosine"], abs=0.02), (a["top_k"], name)
    for a, b in zip(cuda["layers"], cpu["layers"]):
        assert a["calib_relative_error"] == pytest.approx(b["calib_relative_error"], rel=0.25, abs=0.02)
    model = moecompile.load(path, progress=False)
    assert all(p.device.type == "cpu" for p in model.parameters())
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 1000, (2, 9))).last_hidden_state).all()
