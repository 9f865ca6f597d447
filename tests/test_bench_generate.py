"""bench/generate.py (the GPU decode benchmark) on CPU: its floor and fit arithmetic against hand counts from the
published configs, and one tiny run of the FP8 comparison and the attention probe; a tiny run of bench/fp8_drift.py."""
import gc
import importlib.util
import sys
from pathlib import Path

import pytest

import moecompile.backend

ROOT = Path(__file__).resolve().parents[1]


def load_bench(script: str):
    """bench/<script>.py as a module, with bench/ importable while it loads (its scripts import one another)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{script}", ROOT / "bench" / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


@pytest.fixture(scope="module")
def bench():
    return load_bench("generate")


@pytest.fixture(autouse=True)
def _frozen_heap():
    """The benches collect garbage between modes: with what the test process held before frozen, each collection
    walks only what the run made, not every object the earlier tests left."""
    gc.freeze()
    yield
    gc.unfreeze()


def rows_of(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]


def test_full_sizes_and_cache_floor(bench):
    config = bench.make_config("qwen3-30b-a3b", tiny=False, full=True)
    shapes = bench.parameter_shapes("qwen3-30b-a3b", config)
    assert config.num_hidden_layers == 48
    assert 60e9 < bench.resident_bytes(shapes, 2) < 62e9  # the 61 GB in bf16
    # keys and values: layers x 2 x kv heads x head_dim x positions x batch x bytes
    assert bench.cache_bytes(config, 64, 4096, 2) == 48 * 2 * 4 * 128 * 4096 * 64 * 2
    deepseek = bench.make_config("deepseek-v3", tiny=False, full=True)
    assert (deepseek.num_hidden_layers, deepseek.first_k_dense_replace) == (61, 3)
    # MLA's cache (transformers' and moecompile's alike): the latent of kv_lora_rank and the rope key per token
    assert bench.cache_bytes(deepseek, 2, 100, 2) == 61 * (512 + 64) * 100 * 2 * 2
    # what HF's attention expands it into at each step: every head's keys and values
    assert bench.kv_widths(deepseek) == (128, 128, 128 + 64, 128)
    oss = bench.make_config("gpt-oss-20b", tiny=False, full=True)  # half its layers see a 128-token window
    assert bench.cache_bytes(oss, 1, 4096, 2) == 12 * (4096 + 128) * 2 * 8 * 64 * 2
    assert bench.cache_bytes(oss, 1, 4096, 2, windows=False) == 24 * 4096 * 2 * 8 * 64 * 2


def test_fp8_floor_counts_fp8_bytes_of_the_quantised_tensors(bench):
    config = bench.make_config("qwen3-30b-a3b", tiny=True, layers=1)
    shapes = bench.parameter_shapes("qwen3-30b-a3b", config)
    experts = bench.fp8_parameters(shapes, config, linears=False)
    linears = bench.fp8_parameters(shapes, config, linears=True)
    assert bench.fp8_parameters(shapes, config, head=True) == linears | {"lm_head.weight"}  # moecompile-fp8-head
    assert experts == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    assert "model.layers.0.self_attn.q_proj.weight" in linears and "model.layers.0.mlp.gate.weight" not in linears
    assert "lm_head.weight" not in linears
    assert bench.fp8_bytes((2, 256, 130)) == 2 * 256 * 130 + 4 * 2 * 2 * 2  # float32 scale per 128 x 128 block
    hit = 1 - (1 - 8 / 128) ** 4  # batch 4: the expected fraction of experts read
    delta = sum((2 * s.numel() - bench.fp8_bytes(s)) * hit for name, s in shapes.items() if name in experts)
    full = bench.weight_bytes(shapes, config, 4, 2)
    assert bench.weight_bytes(shapes, config, 4, 2, experts) == pytest.approx(full - delta)
    # the FP8 mode's model (transformers' FineGrainedFP8 layout) holds its FP8 tensors and no bf16 copy of them
    assert bench.resident_bytes(shapes, 2, linears) == bench.resident_bytes(shapes, 2) - sum(
        2 * shapes[name].numel() - bench.fp8_bytes(shapes[name]) for name in linears)
    full = bench.make_config("mixtral-8x7b", tiny=False, full=True)
    shapes = bench.parameter_shapes("mixtral-8x7b", full)
    assert 93e9 < bench.resident_bytes(shapes, 2) < 94e9 and 46e9 < bench.resident_bytes(
        shapes, 2, bench.fp8_parameters(shapes, full)) < 47e9  # the 93 GB in bf16, about 47 GB in FP8


def test_model_that_does_not_fit_is_a_row(bench, tmp_path):
    out = tmp_path / "table.md"
    assert bench.main(["--tiny", "--full", "--models", "mixtral-8x7b", "--batches", "1,64", "--modes", "moecompile",
                       "--memory-gb", "0.01", "--out", str(out)]) == 0
    rows = rows_of(out.read_text())[1:]
    assert [r[:2] for r in rows] == [["mixtral-8x7b (32)", "1"], ["mixtral-8x7b (32)", "64"]]
    assert all(r[3].startswith("does not fit: ") for r in rows)


def test_direct_mode_raises_the_threshold_for_its_run_only(bench, tmp_path):
    """moecompile-direct: a batch of two Mixtral tokens (4 assignments over 8 experts), sorted by default, goes direct
    in that mode, and the pass's threshold is back afterwards."""
    from moecompile.passes import direct_experts

    threshold = direct_experts.MAX_ASSIGNMENTS_PER_EXPERT
    direct = {}
    for mode in ("moecompile", "moecompile-direct"):
        assert bench.main(["--tiny", "--models", "mixtral-8x7b", "--layers", "1", "--batches", "2", "--context", "4",
                           "--new", "2", "--reps", "1", "--modes", mode, "--no-profile",
                           "--out", str(tmp_path / f"{mode}.md")]) == 0
        step = moecompile.backend.records()[-1]  # the decode step's graph
        direct[mode] = dict(step.reports)["direct_experts"]["direct"]
    assert direct["moecompile"] == [] and len(direct["moecompile-direct"]) == 1  # the one layer's block
    assert direct_experts.MAX_ASSIGNMENTS_PER_EXPERT == threshold


def test_fp8_against_bf16_and_attention_probe_tiny(bench, tmp_path):
    out = tmp_path / "table.md"
    assert bench.main(["--tiny", "--models", "qwen3-30b-a3b", "--layers", "1", "--batches", "2", "--context", "8",
                       "--new", "3", "--reps", "1", "--modes", "moecompile-fp8-head,moecompile", "--fp8",
                       "--attention-probe", "--no-profile", "--commit", "abc1234", "--out", str(out)]) == 0
    text = out.read_text()
    assert "triton " in text and "(commit abc1234)" in text and "--context 8" in text
    rows = {r[2]: r for r in rows_of(text) if r[0] == "qwen3-30b-a3b (1)"}
    assert list(rows) == ["moecompile", "moecompile-fp8", "moecompile-fp8-head"]  # bf16 first, then on one FP8 model
    for mode, bound in (("moecompile-fp8", 0.995), ("moecompile-fp8-head", 0.99)):  # the head quantised too
        cosine, speed = rows[mode][12].split(", ")
        assert float(cosine) > bound and float(speed.rstrip("x")) > 0
    assert rows["moecompile"][12] == ""
    probe = [r for r in rows_of(text) if r[0] == "qwen3-30b-a3b" and len(r) == 7]
    assert sum("(the compiled step)" in r[2] and r[3].startswith("default: ") for r in probe) == 1
    assert any(r[3] == "forced MATH" and float(r[4]) > 0 for r in probe)
    ours = [r for r in probe if r[3].startswith("moecompile split-KV kernel")]  # against float32 SDPA, tiny widths
    assert ours and all(float(r[3].split("err ")[1]) < 1e-5 and float(r[4]) > 0 for r in ours)


def test_fp8_only_builds_the_model_in_fp8(bench):
    """--fp8-only's model: transformers' FP8 layout materialised module by module from the meta device, every tensor
    filled (HF's initialisation, rotary tables as an ordinary build's), the same model as the bf16 build (which a
    call of its own may run), and it runs on moecompile's FP8 ops."""
    import torch

    from moecompile.core.fp8_format import dequantize_blocks
    from moecompile.integrations import finegrained_fp8

    config = bench.make_config("mixtral-8x7b", tiny=True, layers=1)
    model = bench.build("mixtral-8x7b", config, "cpu", torch.float32, fp8=True)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert not [n for n, t in tensors.items() if t.is_meta or not t.float().isfinite().all()]
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj.float().std() > 0
    assert model.config.quantization_config.quant_method == "fp8"
    plain = bench.build("mixtral-8x7b", config, "cpu", torch.float32)
    assert torch.equal(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    router = model.model.layers[0].mlp.gate.weight
    assert abs(router.std().item() * router.shape[1] ** 0.5 - 1) < 0.1  # unit-variance router logits
    # the same model as the bf16 build: its unquantised tensors equal, its FP8 ones within e4m3's rounding
    ours, theirs = dict(model.named_parameters()), dict(plain.named_parameters())
    for pname, p in ours.items():
        if pname.endswith("_scale_inv"):
            continue
        if p.dtype == torch.float8_e4m3fn:
            back = dequantize_blocks(p, ours[f"{pname}_scale_inv"])
            assert (back - theirs[pname]).norm() <= 0.05 * theirs[pname].norm(), pname
        else:
            assert torch.equal(p, theirs[pname]), pname
    assert len(finegrained_fp8.enable(model)["experts"]) == 1
    with torch.no_grad():
        assert model(torch.arange(6)[None]).logits.isfinite().all()


def test_fp8_rows_compare_with_bf16_logits_of_another_call(bench, tmp_path):
    """Full-depth bf16 and FP8 models do not fit one call: --save-logits keeps the bf16 row's first-step logits and
    --bf16-logits gives a later --fp8-only call its cosine and speed-up, over the same model's weights."""
    logits, out = tmp_path / "logits", tmp_path / "fp8.md"
    common = ["--tiny", "--models", "qwen3-30b-a3b", "--layers", "1", "--batches", "1", "--context", "4", "--new",
              "2", "--reps", "1", "--no-profile"]
    assert bench.main([*common, "--modes", "moecompile", "--save-logits", str(logits)]) == 0
    assert [p.name for p in logits.iterdir()] == ["qwen3-30b-a3b-1-layers-batch-1-moecompile.safetensors"]
    assert bench.main([*common, "--fp8-only", "--bf16-logits", str(logits), "--out", str(out)]) == 0
    (row,) = [r for r in rows_of(out.read_text()) if r[2] == "moecompile-fp8"]
    cosine, speedup = row[-1].split(", ")
    assert float(cosine) >= 0.995 and speedup.endswith("x (bf16: another call)")


def test_fp8_drift_tiny(tmp_path):
    """bench/fp8_drift.py: a row per model, the FP8 round trip moves the logits a little (not at all would mean it
    never touched the weights), and one routed-set share per layer."""
    drift = load_bench("fp8_drift")
    out = tmp_path / "drift.md"
    assert drift.main(["--tiny", "--models", "mixtral-8x7b", "--layers", "2", "--context", "8", "--device", "cpu",
                       "--commit", "abc1234", "--out", str(out)]) == 0
    (row,) = [r for r in rows_of(out.read_text()) if r[0] == "mixtral-8x7b (2)"]
    assert row[1] == "1 x 8" and 0.9 < float(row[2]) < 1 and 0.9 < float(row[3]) < 1
    assert len(row[4].split(", ")) == 2
