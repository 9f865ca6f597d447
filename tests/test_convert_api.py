"""moecompile.convert, the Python API the CLI's convert is argparse over: each engine against the dense model in
plain transformers, and the CLI and the API writing byte-identical folders for the same arguments."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from conftest import make_tiny_model, tiny_token_ids

import moecompile
from moecompile.cli import main as cli
from moecompile.core.errors import MoECompileError


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense")
    out = {}
    for family in ("llama", "gpt2"):
        make_tiny_model(family).save_pretrained(root / family)
        out[family] = root / family
    return out


def _dense_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(ids).logits


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits


def test_upcycle_in_memory_equals_dense_and_keeps_the_callers_rng(folders):
    ids = tiny_token_ids()
    state = torch.get_rng_state()
    r = moecompile.convert(str(folders["gpt2"]), experts=4, top_k=2, progress=False)
    assert torch.equal(torch.get_rng_state(), state)  # the conversion's seed does not leak into the caller's RNG
    assert (r.path, r.format, r.engine) == (None, "moecompile", "in-memory")
    blocks = [m for m in r.model.modules() if isinstance(m, moecompile.MoEBlock)]
    assert len(blocks) == 2 and all(b.config.num_experts == 4 and b.config.top_k == 2 for b in blocks)
    torch.testing.assert_close(_logits(r.model, ids), _dense_logits(folders["gpt2"], ids), atol=1e-4, rtol=1e-4)
    assert r.metrics["max_abs_diff_dropless"] < 1e-4 and "nothing written" in str(r)


def test_native_upcycle_writes_mixtral_equal_to_dense(folders, tmp_path):
    ids = tiny_token_ids()
    r = moecompile.convert(str(folders["llama"]), tmp_path / "moe", experts=4, top_k=2, progress=False)
    assert (r.path, r.format, r.engine, r.model) == (tmp_path / "moe", "hf", "native", None)
    moe = transformers.AutoModelForCausalLM.from_pretrained(r.path)
    assert type(moe).__name__ == "MixtralForCausalLM"
    torch.testing.assert_close(_logits(moe, ids), _dense_logits(folders["llama"], ids), atol=1e-4, rtol=1e-4)
    assert "MixtralForCausalLM" in r.lines[0]


def test_split_streams_and_equals_dense_at_top_k_all(folders, tmp_path):
    ids = tiny_token_ids()
    options = moecompile.ConvertOptions(experts=4, top_k=4, method="split", format="moecompile", progress=False)
    r = moecompile.convert(str(folders["llama"]), tmp_path / "split", options)
    assert (r.format, r.engine) == ("moecompile", "split-stream")
    model = moecompile.load(r.path, progress=False)
    assert {b.config.method for b in model.modules() if isinstance(b, moecompile.MoEBlock)} == {"split"}
    torch.testing.assert_close(_logits(model, ids), _dense_logits(folders["llama"], ids), atol=1e-4, rtol=1e-4)


def test_fp8_experts_close_to_dense(folders, tmp_path):
    ids = tiny_token_ids()
    r = moecompile.convert(str(folders["gpt2"]), tmp_path / "fp8", experts=4, top_k=2, fp8=True, progress=False)
    assert r.engine == "in-memory" and 0 < r.metrics["fp8_relative_error"] < 0.15  # e4m3: 3 mantissa bits
    model = moecompile.load(r.path, progress=False)
    assert any(isinstance(m, moecompile.MoEExpertsFP8) for m in model.modules())
    got, want = _logits(model, ids), _dense_logits(folders["gpt2"], ids)
    assert 0 < ((got - want).norm() / want.norm()).item() < 0.15
    torch.testing.assert_close(got, _logits(r.model, ids), atol=0, rtol=0)  # the folder holds the model returned


def test_bad_options_raise_before_any_work(folders, tmp_path):
    for kw, message in [({"experts": 0}, "experts must be >= 1"), ({"experts": 4, "top_k": 5}, "top_k must be"),
                        ({"experts": 4, "method": "x"}, "unknown method"), ({"experts": 4, "format": "onnx"},
                                                                              "unknown format"),
                        ({"experts": 4, "calib": "stdlib"}, "calib needs method 'split'")]:
        with pytest.raises(MoECompileError, match=message):
            moecompile.convert(str(folders["gpt2"]), tmp_path / "never", **kw)
    with pytest.raises(MoECompileError, match="format hf writes a folder"):
        moecompile.convert(str(folders["llama"]), experts=4, format="hf")
    with pytest.raises(MoECompileError, match="either as a ConvertOptions or as keywords"):
        moecompile.convert(str(folders["llama"]), None, moecompile.ConvertOptions(experts=4), top_k=1)
    assert not (tmp_path / "never").exists()
    assert moecompile.ConvertOptions(experts=2, dtype=torch.bfloat16).dtype == "bfloat16"


CASES = {  # CLI flags -> the same conversion as keywords; one per engine, and FP8 both native and in memory
    "native": (["--experts", "4", "--seed", "3"], dict(experts=4, seed=3)),
    "native-fp8": (["--experts", "4", "--fp8", "--capacity-factor", "1.5"], dict(experts=4, fp8=True,
                                                                                 capacity_factor=1.5)),
    "split-stream": (["--experts", "4", "--method", "split", "--dtype", "bf16"],
                     dict(experts=4, method="split", dtype="bf16")),
    "in-memory": (["--experts", "2", "--top-k", "1", "--noise", "0.1", "--capacity-factor", "1.0"],
                  dict(experts=2, top_k=1, noise=0.1, capacity_factor=1.0)),
    "in-memory-fp8": (["--experts", "4", "--fp8", "--format", "moecompile"], dict(experts=4, fp8=True,
                                                                                 format="moecompile")),
}


@pytest.mark.parametrize("case", CASES)
def test_cli_and_api_write_byte_identical_folders(folders, tmp_path, capsys, case):
    flags, kw = CASES[case]
    source = str(folders["gpt2" if case == "in-memory" else "llama"])
    assert cli(["convert", source, *flags, "--out", str(tmp_path / "cli"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    r = moecompile.convert(source, tmp_path / "api", **kw, progress=False)
    assert r.engine == case.removesuffix("-fp8")
    files = sorted(f.relative_to(tmp_path / "cli") for f in (tmp_path / "cli").rglob("*") if f.is_file())
    assert files == sorted(f.relative_to(tmp_path / "api") for f in (tmp_path / "api").rglob("*") if f.is_file())
    for f in files:
        assert (tmp_path / "cli" / f).read_bytes() == (tmp_path / "api" / f).read_bytes(), f
    # the summary is the same but for the output path and the time taken
    assert printed.splitlines()[0] == r.lines[0] and len(printed.splitlines()) == len(r.lines)


@pytest.mark.parametrize("capacity_factor, top_k", [(0.0, 2), (0.5, 2), (-0.75, 1), (1.0, 3), (4.0, 2)])
def test_knobs_capacity_is_what_route_keeps(capacity_factor, top_k):
    from moecompile.ir import knobs, ops

    experts, tokens = 4, 37
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(0))
    _, ids = ops.route(logits, top_k, capacity_factor, True)
    _, all_ids = ops.route(logits, top_k, 0.0, True)
    kept = torch.bincount(ids[ids < experts].flatten(), minlength=experts)
    wanted = torch.bincount(all_ids.flatten(), minlength=experts)
    cap = knobs.capacity(capacity_factor, tokens, top_k, experts)
    assert torch.equal(kept, wanted if cap is None else wanted.clamp(max=cap))
    assert knobs.never_drops(capacity_factor, top_k, experts) == (cap is None or cap >= tokens)


def test_cli_flags_map_one_to_one_and_defaults_are_the_apis():
    from moecompile.cli import _convert_options, _parser

    def options(*flags):
        return _convert_options(_parser().parse_args(["convert", "m", *flags]))

    assert options("--experts", "4") == moecompile.ConvertOptions(experts=4)  # every default is ConvertOptions'
    given = options("--experts", "8", "--top-k", "3", "--method", "split", "--capacity-factor", "1.5", "--layers",
                    "odd", "--dtype", "bf16", "--seed", "7", "--calib", "--shared-experts", "1", "--device", "cuda",
                    "--max-shard-size", "1GB", "--fp8", "--allow-nonfinite", "--no-progress")
    assert given == moecompile.ConvertOptions(experts=8, top_k=3, method="split", capacity_factor=1.5, layers="odd",
                                              dtype="bf16", seed=7, calib="mixed", shared_experts=1, device="cuda",
                                              max_shard_size="1GB", fp8=True, allow_nonfinite=True, progress=False)


def test_a_model_in_memory_converts_in_place(tmp_path):
    ids = tiny_token_ids()
    model = make_tiny_model("bert")
    with torch.no_grad():
        want = model(ids).last_hidden_state
    r = moecompile.convert(model, tmp_path / "bert", experts=4, top_k=4, method="split", progress=False)
    assert r.model is model and (r.engine, r.format) == ("in-memory", "moecompile") and "BertModel" in r.lines[0]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).last_hidden_state, want, atol=1e-4, rtol=1e-4)  # split, k = E: exact
        torch.testing.assert_close(moecompile.load(r.path, progress=False)(ids).last_hidden_state, want,
                                   atol=1e-4, rtol=1e-4)
    with pytest.raises(MoECompileError, match="format hf and random_init need a name or folder"):
        moecompile.convert(make_tiny_model("bert"), experts=4, random_init=True)
