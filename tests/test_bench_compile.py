"""Smoke test of bench/compile.py (the GPU benchmark of the torch.compile backend) on CPU, tiny sizes."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_compile_tiny(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_compile", ROOT / "bench" / "compile.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "table.md"
    assert bench.main(["--tiny", "--models", "qwen3-moe-like", "--tokens", "64", "--layers", "1",
                       "--no-hf-inductor", "--no-inductor", "--out", str(out)]) == 0
    text = out.read_text()
    header, rule, row = text.splitlines()[:3]
    assert "HF eager tok/s" in header and "moecompile / best peer" in header
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "qwen3-moe-like" and cells[1] == "64 (2x32)"
    assert float(cells[2].replace(",", "")) > 0 and float(cells[3].replace(",", "")) > 0
    assert cells[5] == "1"  # the one MoE layer was recognised
    assert "smoke test, not a measurement" in text
