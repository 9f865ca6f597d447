"""Conversion outputs and the CLI can be trusted: dropless defaults that equal the dense model, one input
validation for every engine, `inspect` of native MoE outputs, messages that point the right way, and signals."""
from __future__ import annotations

import inspect as pyinspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import moecompile
from moecompile.cli import main
from moecompile.io import checkpoint

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
            intermediate_size=48, max_position_embeddings=64, initializer_range=0.2)
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if not line.startswith("moecompile: WARNING")]
    assert len(lines) == 1 and lines[0].startswith("moecompile: error: "), err
    return lines[0]


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return (out.logits if hasattr(out, "logits") else out[0]).float()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Dense HF folders with fixed random weights: GPT-2 (in-memory path), LLaMA and Qwen3 (native paths)."""
    root = tmp_path_factory.mktemp("dense")
    configs = {"gpt2": transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=128,
                                               bos_token_id=0, eos_token_id=0),
               "llama": transformers.LlamaConfig(**TINY),
               "qwen3": transformers.Qwen3Config(head_dim=8, tie_word_embeddings=True, **TINY),
               "bert": transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                               intermediate_size=64, vocab_size=128, max_position_embeddings=64)}
    out = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        auto = transformers.AutoModel if name == "bert" else transformers.AutoModelForCausalLM
        auto.from_config(config).save_pretrained(root / name)
        out[name] = root / name
    return out


def _copy(src: Path, dst: Path, config_edit=None, edit=None) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config_edit(config) if config_edit else config))
    tensors = load_file(src / "model.safetensors")
    if edit:
        edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _compiled(model):
    """moecompile.compile without inductor, whichever way its options are passed."""
    named = pyinspect.signature(moecompile.compile).parameters.get("options")
    if named is not None and named.kind is not pyinspect.Parameter.VAR_KEYWORD:
        return moecompile.compile(model, options={"inductor": False})
    return moecompile.compile(model, inductor=False)


# ------------------------------------------------------------------------------------------- dropless by default

def test_one_capacity_default_and_help(capsys):
    from moecompile.calibration.config import CalibConfig
    from moecompile.ir import knobs
    from moecompile.ir.config import MoEConfig

    assert knobs.CAPACITY_FACTOR == 0.0
    assert MoEConfig(hidden_size=4, expert_size=4, num_experts=2).capacity_factor == knobs.CAPACITY_FACTOR
    assert CalibConfig(experts=4, top_k=2).capacity_factor == knobs.CAPACITY_FACTOR
    assert pyinspect.signature(moecompile.moeize).parameters["capacity_factor"].default == knobs.CAPACITY_FACTOR
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    assert "a training knob" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_default_upcycle_equals_dense_through_load_and_compile(folders, tmp_path, capsys, name):
    """Default flags: the in-memory (GPT-2) and native (LLaMA -> Mixtral) upcycles compute the dense model, through
    moecompile.load and moecompile.compile, as the summary says."""
    torch._dynamo.reset()
    rc, out, err = cli(capsys, "convert", folders[name], "--experts", "4", "--out", tmp_path / "moe", "--no-progress")
    assert rc == 0, err
    assert "dropless" in out and "drops" not in out
    if name == "llama":
        assert "run it dropless: exactly the dense model at init" in out
        assert "capacity_factor" not in json.loads((tmp_path / "moe" / "config.json").read_text())["moecompile"]
    dense = transformers.AutoModelForCausalLM.from_pretrained(folders[name]).eval()
    want = logits(dense)
    model = moecompile.load(tmp_path / "moe", progress=False)
    assert (logits(model) - want).abs().max() <= 1e-5
    assert (logits(_compiled(model)) - want).abs().max() <= 1e-5


def test_capacity_given_is_recorded_and_its_drops_reported(folders, tmp_path, capsys):
    rc, out, err = cli(capsys, "convert", folders["gpt2"], "--experts", "4", "--capacity-factor", "0.5", "--out",
                       tmp_path / "moe", "--no-progress")
    assert rc == 0, err
    assert "(upcycle, 4 experts, top-2, capacity factor 0.5)" in out
    line = next(t for t in out.splitlines() if "capacity 0.5: drops" in t)
    assert float(line.split("drops ")[1].split("%")[0]) > 0  # half the even share cannot hold a random routing
    blocks = json.loads((tmp_path / "moe" / "config.json").read_text())["moe"]["blocks"]
    assert {b["config"]["capacity_factor"] for b in blocks} == {0.5}
    rc, out, err = cli(capsys, "convert", folders["qwen3"], "--experts", "4", "--capacity-factor", "1.25", "--out",
                       tmp_path / "native", "--no-progress")
    assert rc == 0, err
    assert json.loads((tmp_path / "native" / "config.json").read_text())["moecompile"]["capacity_factor"] == 1.25
    assert "capacity factor 1.25 is recorded" in out and "inspect --routing" in out


# ------------------------------------------------------------------------------------ inspect of native MoE models

@pytest.mark.parametrize("name, cls", [("llama", "MixtralSparseMoeBlock"), ("qwen3", "Qwen3MoeSparseMoeBlock")])
def test_inspect_native_output(folders, tmp_path, capsys, name, cls):
    h, i, e, k, vocab, layers = 32, 48, 4, 2, 128, 2
    out = tmp_path / "moe"
    assert cli(capsys, "convert", folders[name], "--experts", e, "--out", out, "--no-progress")[0] == 0
    rc, text, err = cli(capsys, "inspect", out, "--json", "--routing", "--probe-tokens", 64, "--no-progress")
    assert rc == 0, err
    info = json.loads(text)
    expert = 3 * h * i  # gate, up, down of one expert
    kv = h // 2 if name == "llama" else 8  # one key/value head of head_dim 16 (LLaMA) or 8 (Qwen3)
    heads = 32 if name == "llama" else 16  # two query heads
    attn = h * heads + 2 * h * kv + heads * h + (2 * 8 if name == "qwen3" else 0)  # Qwen3: q_norm, k_norm
    block = h * e + e * expert
    embeddings = vocab * h * (1 if name == "qwen3" else 2)  # Qwen3 ties the LM head
    total = embeddings + layers * (attn + 2 * h + block) + h
    assert info["kind"] == "moe" and [b["class"] for b in info["blocks"]] == [cls] * layers
    assert all(b["experts"] == e and b["top_k"] == k and b["expert_size"] == i and b["params"] == block
               for b in info["blocks"])
    assert info["total"] == total
    assert info["active_per_token"] == total - layers * (e - k) * expert
    for stats in info["routing"]["blocks"].values():
        assert sum(stats["counts"]) == 64 * k and stats["dropped"] == 0 and len(stats["counts"]) == e


def test_inspect_tiny_mixtral_random_init(capsys):
    rc, text, err = cli(capsys, "inspect", "tiny-mixtral", "--random-init", "--no-progress")
    assert rc == 0, err
    h, i, e, k, vocab, kv, layers = 32, 48, 4, 2, 128, 16, 2
    expert = 3 * h * i
    total = 2 * vocab * h + layers * (2 * h * h + 2 * h * kv + 2 * h + h * e + e * expert) + h
    assert "tiny-mixtral: 2 MoE blocks" in text and "4 experts x 48 (silu, gated), top-2, dropless" in text
    assert f"total parameters: {total:,} (" in text
    assert f"active parameters per token: {total - layers * (e - k) * expert:,} (" in text
    rc, text, err = cli(capsys, "inspect", "tiny-mixtral", "--random-init", "--routing", "--probe-tokens", 32,
                        "--no-progress")
    assert rc == 0 and "routing on 32 probe tokens" in text and "dropped 0.0%" in text, err


# ------------------------------------------------------------------------------------------------ input validation

@pytest.mark.parametrize("name, edit, message", [
    ("gpt2", lambda c: {**c, "n_layer": 1}, "n_layer=1 but the weights hold layers 0-1"),
    ("gpt2", lambda c: {**c, "n_layer": 3}, "n_layer=3 but the weights hold layers 0-1"),
    ("gpt2", lambda c: {**c, "n_inner": 64}, "has shape"),
    ("bert", lambda c: {**c, "num_hidden_layers": 3}, "num_hidden_layers=3 but the weights hold layers 0-1"),
])
def test_in_memory_config_weights_mismatch_refused(folders, tmp_path, capsys, name, edit, message):
    src = _copy(folders[name], tmp_path / "src", edit)
    (tmp_path / "outs").mkdir()
    rc, _, err = cli(capsys, "convert", src, "--experts", "4", "--out", tmp_path / "outs" / "moe", "--no-progress")
    assert rc == 2 and message in one_error(err)
    assert list((tmp_path / "outs").iterdir()) == []


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("transformer.h.1.ln_2.weight"), "1 tensors missing from the weights, e.g. transformer.h.1.ln_2"),
    (lambda t: t.update({"transformer.h.0.extra": torch.ones(2)}), "unexpected tensor transformer.h.0.extra"),
])
def test_gpt2_missing_or_unexpected_tensor_refused(folders, tmp_path, capsys, edit, message):
    src = _copy(folders["gpt2"], tmp_path / "src", edit=edit)
    rc, _, err = cli(capsys, "convert", src, "--experts", "4", "--out", tmp_path / "moe", "--no-progress")
    assert rc == 2 and message in one_error(err) and not (tmp_path / "moe").exists()


def _nan(name):
    def edit(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][0, 0] = float("nan")
    return edit


@pytest.mark.parametrize("name, extra, tensor", [
    ("gpt2", [], "transformer.h.1.mlp.c_fc.weight"),  # in memory
    ("llama", [], "model.layers.1.mlp.up_proj.weight"),  # native streaming
    ("llama", ["--method", "split"], "model.layers.0.self_attn.q_proj.weight"),  # split streaming, a copied tensor
])
def test_nonfinite_weights_refused_on_every_engine(folders, tmp_path, capsys, name, extra, tensor):
    src = _copy(folders[name], tmp_path / "src", edit=_nan(tensor))
    (tmp_path / "outs").mkdir()
    args = ["convert", src, "--experts", "4", "--out", tmp_path / "outs" / "moe", "--no-progress", *extra]
    rc, _, err = cli(capsys, *args)
    assert rc == 2 and f"{tensor} holds 1 NaN or infinite values" in one_error(err) and "--allow-nonfinite" in err
    assert list((tmp_path / "outs").iterdir()) == []
    rc, _, err = cli(capsys, *args, "--allow-nonfinite")
    assert rc == 0, err


# -------------------------------------------------------------------------------------------------------- messages

def test_every_moecompile_format_folder_has_a_model_card(folders, tmp_path, capsys):
    for name, extra in [("gpt2", []), ("llama", ["--method", "split"]), ("llama", ["--format", "moecompile"])]:
        out = tmp_path / f"{name}{len(extra)}{''.join(extra)}"
        rc, text, err = cli(capsys, "convert", folders[name], "--experts", "4", "--out", out, "--no-progress", *extra)
        assert rc == 0, err
        assert "load it with moecompile.load" in text
        card = (out / "README.md").read_text()
        assert "moecompile.load(" in card and "Why plain transformers refuses it" in card
        config = json.loads((out / "config.json").read_text())
        assert "moecompile.load" in config["moecompile_note"] and "moecompile.load" in config["model_type"]


def test_out_naming_a_file(folders, tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    rc, _, err = cli(capsys, "convert", folders["gpt2"], "--experts", "4", "--out", tmp_path / "a-file")
    assert rc == 2 and "a-file is an existing file" in one_error(err)


def test_layers_on_llama_does_not_advise_the_flag_given(folders, tmp_path, capsys):
    rc, out, err = cli(capsys, "convert", folders["llama"], "--experts", "4", "--layers", "0", "--out",
                       tmp_path / "moe", "--no-progress")
    assert rc == 0, err
    assert "MixtralForCausalLM has no dense layers" in out and "--format moecompile" not in out
    rc, _, err = cli(capsys, "convert", folders["llama"], "--experts", "4", "--layers", "0", "--format", "hf",
                     "--out", tmp_path / "hf", "--no-progress")
    assert rc == 2 and "format auto writes moecompile's format" in one_error(err)


# --------------------------------------------------------------------------------------------------------- signals

# the CLI as a program (argv from sys.argv), its output's last step replaced by a long C call (no Python handler
# would run before it returns), announced on stdout
SLOW_SAVE = r"""
import ctypes, sys
from moecompile.conversion import native
from moecompile.io import checkpoint

def stall(source, directory):
    print("WRITING", flush=True)
    ctypes.CDLL(None).sleep(60)

checkpoint.copy_tokenizer = native.copy_tokenizer = stall
from moecompile.cli import main
sys.argv = ["moecompile", *sys.argv[1:]]
raise SystemExit(main())
"""


# a writer killed while writing: the partial folder it leaves
KILLED_WRITER = r"""
import ctypes, sys
from moecompile.io import checkpoint

with checkpoint.atomic_directory(sys.argv[1]) as tmp:
    (tmp / "model.safetensors").write_bytes(b"half")
    print("WRITING", flush=True)
    ctypes.CDLL(None).sleep(60)
"""


def _python(code: str, *args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _stalled(source: Path, out: Path) -> subprocess.Popen:
    return _python(SLOW_SAVE, "convert", source, "--experts", "4", "--out", out, "--no-progress")


def _wait_writing(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    assert line.strip() == "WRITING", (line, proc.stderr.read() if proc.poll() is not None else "")


def test_signals_act_at_once_and_leave_nothing(folders, tmp_path):
    """SIGTERM in the in-memory save exits 143 and SIGINT in the native save 130, within about a second, removing
    their partial folders; a SIGKILLed run's partial is removed by the next run into the same parent folder."""
    runs = [("a", "gpt2", signal.SIGTERM, 143, "terminated"), ("b", "llama", signal.SIGINT, 130, "interrupted"),
            ("c", None, signal.SIGKILL, -9, None)]
    procs = [_stalled(folders[source], tmp_path / parent / "moe") for parent, source, *_ in runs[:2]]
    procs.append(_python(KILLED_WRITER, tmp_path / "c" / "moe"))
    for proc in procs:
        _wait_writing(proc)
    assert [p.name for p in (tmp_path / "a").iterdir()][0].endswith(".partial")  # writing, not yet published
    for proc, (parent, _, signum, code, said) in zip(procs, runs):
        start = time.perf_counter()
        proc.send_signal(signum)
        assert proc.wait(timeout=10) == code, proc.stderr.read()
        assert time.perf_counter() - start < 1.5
        if said:
            assert list((tmp_path / parent).iterdir()) == []
            assert proc.stderr.read().strip().endswith(said)
    left = list((tmp_path / "c").iterdir())
    assert len(left) == 1 and left[0].name.startswith(".moe.") and left[0].name.endswith(".partial")
    # a run writing another folder of that parent removes it; partials of live runs and unmarked folders stay
    live = tmp_path / "c" / f".x.{os.getpid()}.abcd1234.partial"
    unmarked = tmp_path / "c" / ".y.999999999.abcd1234.partial"
    for d in (live, unmarked):
        d.mkdir()
    (live / checkpoint.PARTIAL_MARKER).write_text(json.dumps({"pid": os.getpid()}))
    with checkpoint.atomic_directory(tmp_path / "c" / "other") as tmp:
        (tmp / "f").write_text("done")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted([live.name, unmarked.name, "other"])
    assert [p.name for p in (tmp_path / "c" / "other").iterdir()] == ["f"]
