"""What works with what: every conversion route x every consumer (tiny configs, float32, CPU).

ROUTES says how each route's output is built and what its reference is; CONSUMERS how each consumer is checked;
CELLS every cell that is not a plain "works": refused by design (the reason, one line, which the cell checks is
what happens), not applicable, or the same code path as another cell (trimmed, to keep the file fast). README.md's
section "What works with what" is this table: test_readme_table_matches checks it (readme_table() prints it).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
import transformers
from conftest import make_tiny_model
from hf_moe import MOE_LAYERS, moe_nodes, tiny_moe
from test_native import SOURCES

import moecompile
from moecompile import backend
from moecompile.cli import main as cli
from moecompile.errors import MoECompileError

NO_INDUCTOR = {"inductor": False}
NEW_TOKENS = 3
ATOL = RTOL = 1e-4


@dataclass
class Built:
    path: Path
    format: str  # "moecompile" or "hf" (the family's native Hugging Face class)
    reference: Callable[[torch.Tensor], torch.Tensor]  # the eager output the route must reproduce
    blocks: int  # MoE blocks in the output
    causal: bool = True
    fp8: bool = False


def _out(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids)
    return (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).float()


def _ids(seq=8, batch=2, seed=1):
    return torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _dense_folder(root: Path, family: str) -> Path:
    """A tiny dense LLaMA / Mistral / Qwen2 / Qwen3 folder (test_native's configs)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(SOURCES[family]())
    model.save_pretrained(root / family)
    return root / family


def _in_memory(family: str, **kw):
    def build(root: Path) -> Built:
        model = make_tiny_model(family)
        r = moecompile.convert(model, root / "out", experts=4, top_k=2, progress=False, **kw)
        return Built(r.path, r.format, lambda ids: _out(r.model, ids), 2, causal=family != "bert",
                     fp8=kw.get("fp8", False))
    return build


def _calibrated(root: Path) -> Built:
    """The calibrated blocks convert(calib=...) builds, on a short byte-level text (the cheap way: the convert path
    assembles the full calibration text first)."""
    from moecompile.calibration import calibrate, config, tokens

    model = make_tiny_model("gpt2")
    batches = tokens.token_batches(tokens.ByteTokenizer(model.config.vocab_size),
                                   ["a few words of calibration text"] * 40, 500)
    calibrate.calibrate_model(model, batches, config.CalibConfig(experts=4, top_k=2, shared_experts=1,
                                                                 distill_steps=2, batch_tokens=64), progress=False)
    moecompile.save(model, root / "out", progress=False)
    return Built(root / "out", "moecompile", lambda ids: _out(model, ids), 2)


def _native(family: str, **kw):
    def build(root: Path) -> Built:
        src = _dense_folder(root, family)
        r = moecompile.convert(str(src), root / "out", experts=4, top_k=2, progress=False, **kw)
        assert r.format == "hf"
        dense = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
        return Built(r.path, r.format, lambda ids: _out(dense, ids), 2, fp8=kw.get("fp8", False))
    return build


def _split_stream(root: Path) -> Built:
    src = _dense_folder(root, "llama")
    r = moecompile.convert(str(src), root / "out", experts=4, top_k=2, method="split", progress=False)
    assert r.engine == "split-stream"
    dense = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    ref = moecompile.convert(dense, None, experts=4, top_k=2, method="split", progress=False).model
    return Built(r.path, r.format, lambda ids: _out(ref, ids), 2)


def _hf_moe(name: str):
    def build(root: Path) -> Built:
        model = tiny_moe(name)
        model.save_pretrained(root / "out")
        return Built(root / "out", "hf", lambda ids: _out(model, ids), MOE_LAYERS[name])
    return build


# route -> (what it is, how to build it)
ROUTES: dict[str, tuple[str, Callable[[Path], Built]]] = {
    "gpt2-upcycle": ("GPT-2 upcycled in memory", _in_memory("gpt2")),
    "gpt2-split": ("GPT-2 split in memory", _in_memory("gpt2", method="split")),
    "bert-upcycle": ("BERT upcycled in memory", _in_memory("bert")),
    "bert-split": ("BERT split in memory", _in_memory("bert", method="split")),
    "gpt2-calibrated": ("GPT-2 calibrated split (its blocks; `convert(calib=...)` itself: test_calibrate.py)",
                        _calibrated),
    "gpt2-fp8": ("GPT-2 upcycled, `fp8=True`", _in_memory("gpt2", fp8=True)),
    "llama-native": ("LLaMA folder -> Mixtral", _native("llama")),
    "mistral-native": ("Mistral folder -> Mixtral", _native("mistral")),
    "qwen2-native": ("Qwen2 folder -> Qwen2-MoE", _native("qwen2")),
    "qwen3-native": ("Qwen3 folder -> Qwen3-MoE", _native("qwen3")),
    "llama-native-fp8": ("LLaMA folder -> Mixtral, `fp8=True`", _native("llama", fp8=True)),
    "llama-split-stream": ("LLaMA folder, streamed split", _split_stream),
    **{f"hf-{n.removeprefix('tiny-')}": (f"HF {n.removeprefix('tiny-')} model", _hf_moe(n))
       for n in MOE_LAYERS},
}


# ---------------------------------------------------------------- consumers

def _load(b: Built):
    """The output as a user loads it: transformers for the native format, moecompile.load for its own."""
    if b.format == "hf":
        return transformers.AutoModelForCausalLM.from_pretrained(b.path).eval()
    return moecompile.load(b.path, progress=False).eval()


def _close(got, want, atol=ATOL, rtol=RTOL):
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def _fp8_close(got, want):
    """FP8 experts against float32: one 128x128 scale per tiny weight is coarser than any real model's FP8."""
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)  # a token whose top-k flips scores lower
    assert cosine.mean() > 0.97 and cosine.min() > 0.85 and not torch.equal(got, want)


def _moe_graphs(b: Built, graphs: int) -> None:
    """No fallback to eager: the backend compiled `graphs` graphs, each running every MoE block as moecompile ops
    (a recognised HF block or a moecompile block traced: one combine each)."""
    done = [len(moe_nodes(r.graph_module, "combine")) for r in backend.records()]
    assert [n for n in done if n] == [b.blocks] * graphs, done  # dynamic=True: a graph break before the first


def check_load(b: Built, tmp: Path, capsys):
    ids = _ids()
    got, want = _out(moecompile.load(b.path, progress=False).eval(), ids), b.reference(ids)
    _fp8_close(got, want) if b.format == "hf" and b.fp8 else _close(got, want)


def check_transformers(b: Built, tmp: Path, capsys):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(b.path, output_loading_info=True)
    assert not any(info.values()), info
    ids = _ids()
    got, want = _out(model.eval(), ids), b.reference(ids)
    _fp8_close(got, want) if b.fp8 else _close(got, want)


def _compiled(b: Built, lengths: list[int], graphs: int, compile_model=None):
    """The compiled model against its eager self at each sequence length, and the graphs the backend compiled."""
    model = _load(b)
    torch._dynamo.reset()
    backend.clear_records()
    compiled = (compile_model or (lambda m: torch.compile(m, backend="moecompile", options=NO_INDUCTOR)))(model)
    try:
        for seq in lengths:
            ids = _ids(seq)
            _close(_out(compiled, ids), _out(model, ids))
        _moe_graphs(b, graphs)
    finally:
        torch._dynamo.reset()


def check_compile(b: Built, tmp: Path, capsys):
    _compiled(b, [8], 1)


def check_compile_second_length(b: Built, tmp: Path, capsys):
    _compiled(b, [8, 11], 2)  # the second length: Dynamo's automatic dynamic shapes retrace with symbolic sizes


def check_compile_dynamic(b: Built, tmp: Path, capsys):
    _compiled(b, [8, 11], 1, lambda m: torch.compile(m, backend="moecompile", dynamic=True, options=NO_INDUCTOR))


def check_moecompile_compile(b: Built, tmp: Path, capsys):
    _compiled(b, [8], 1, lambda m: moecompile.compile(m, inductor=False))


def check_generate(b: Built, tmp: Path, capsys):
    model = _load(b)
    ids = _ids(6)
    want = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    torch._dynamo.reset()
    try:
        got = moecompile.generate(model, ids, NEW_TOKENS, eos_token_id=None, pad_token_id=0, options=NO_INDUCTOR)
    finally:
        torch._dynamo.reset()
    assert want.shape == (2, 6 + NEW_TOKENS) and torch.equal(got, want)


def _cli(capsys, *args) -> str:
    """Run the CLI in process; its one-line error raised as MoECompileError, else what it printed."""
    capsys.readouterr()
    rc = cli([*args, "--no-progress"])
    out, err = capsys.readouterr()
    if rc:
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        raise MoECompileError(err.strip())
    return out


def _inspect(b: Built, capsys, *flags) -> dict:
    return json.loads(_cli(capsys, "inspect", str(b.path), "--json", *flags))


def check_inspect(b: Built, tmp: Path, capsys):
    info = _inspect(b, capsys)
    assert info["kind"] == "moe" and len(info["blocks"]) == b.blocks, info
    assert 0 < info["active_per_token"] < info["total"]


def check_inspect_routing(b: Built, tmp: Path, capsys):
    routing = _inspect(b, capsys, "--routing", "--probe-tokens", "32")["routing"]
    assert len(routing["blocks"]) == b.blocks
    assert all(sum(s["counts"]) > 0 for s in routing["blocks"].values())


def check_quantize(b: Built, tmp: Path, capsys):
    out = tmp / "fp8"
    _cli(capsys, "quantize", str(b.path), "--fp8", "--out", str(out))
    ids = _ids()
    got, want = _out(_load(Built(out, b.format, b.reference, b.blocks)), ids), b.reference(ids)
    _fp8_close(got, want)


def check_onnx(b: Built, tmp: Path, capsys):
    from moecompile.io.onnx_export import compare_onnxruntime

    model = _load(b)
    moecompile.export_onnx(model, tmp / "m.onnx", progress=False)
    (diff,) = compare_onnxruntime(model, tmp / "m.onnx", [(_ids(),)])
    assert diff < 1e-3


def check_hf_experts(b: Built, tmp: Path, capsys):
    model = _load(b)
    ids = _ids()
    want = _out(model, ids)
    model.set_experts_implementation("moecompile")
    _close(_out(model, ids), want)


# consumer -> (column title, check)
CONSUMERS: dict[str, tuple[str, Callable]] = {
    "load": ("`moecompile.load`", check_load),
    "transformers": ("plain transformers", check_transformers),
    "compile": ("`torch.compile` static", check_compile),
    "compile-2nd-length": ("2nd length", check_compile_second_length),
    "compile-dynamic": ("`dynamic=True`", check_compile_dynamic),
    "moecompile.compile": ("`moecompile.compile`", check_moecompile_compile),
    "generate": ("`moecompile.generate`", check_generate),
    "inspect": ("`inspect`", check_inspect),
    "inspect-routing": ("`inspect --routing`", check_inspect_routing),
    "quantize": ("`quantize`", check_quantize),
    "export-onnx": ("`export-onnx`", check_onnx),
    "hf-experts": ("HF experts integration", check_hf_experts),
}

# (route, consumer) -> (status, reason). "refused": the cell checks that it fails with an error matching the
# reason's quoted part; "n/a": the consumer does not apply; "same": trimmed, the same code path as the cell or the
# test named (a reason starting "fails" marks a repeat of an xfail cell); "xfail": a known failure, strict.
MOECOMPILE_FORMAT = ["gpt2-upcycle", "gpt2-split", "bert-upcycle", "bert-split", "gpt2-calibrated", "gpt2-fp8",
                     "llama-split-stream"]
HF_FAMILIES = [r for r in ROUTES if r.startswith("hf-")]
NATIVE = ["llama-native", "mistral-native", "qwen2-native", "qwen3-native", "llama-native-fp8"]
DYNAMIC_TEST = "tests/test_backend_dynamic.py::test_hf_moe_families_on_dynamic_shapes"
CELLS: dict[tuple[str, str], tuple[str, str]] = {
    **{(r, "transformers"): ("refused", "moecompile's format: transformers refuses its model type "
                                        '"moecompile-checkpoint: load it with moecompile.load"')
       for r in MOECOMPILE_FORMAT},
    **{(r, "hf-experts"): ("n/a", "moecompile's format holds moecompile's own MoE blocks, not HF experts modules")
       for r in MOECOMPILE_FORMAT},
    **{(r, "generate"): ("n/a", "an encoder (BertModel): no generation") for r in ("bert-upcycle", "bert-split")},
    **{(r, "load"): ("refused", "a Hugging Face MoE folder: \"not a moecompile checkpoint\" (load it "
                                "with transformers)") for r in HF_FAMILIES},
    # the backend, generate and the experts integration on every HF family: their own tests
    **{(r, c): ("same", f"as {t}") for r in HF_FAMILIES for c, t in [
        ("compile", "tests/test_backend.py::test_compiled_matches_eager"),
        ("compile-2nd-length", DYNAMIC_TEST), ("compile-dynamic", DYNAMIC_TEST),
        ("moecompile.compile", "tests/test_backend_dynamic.py::test_recorded_capacity_factor_applies_alike"),
        ("generate", "tests/test_generation.py::test_compiled_decode_step_matches_hf"),
        ("hf-experts", "tests/test_backend.py::test_hf_experts_implementation")]},
    ("hf-gpt-oss", "quantize"): ("refused", 'GPT-OSS keeps its experts fused: "no per-expert weights"'),
    ("gpt2-fp8", "quantize"): ("refused", '"experts already in FP8"'),
    ("llama-native-fp8", "quantize"): ("refused", '"quantised already"'),
    ("gpt2-fp8", "export-onnx"): ("refused", 'FP8 experts have no ONNX form: "torch.onnx could not export"'),
    # native outputs are HF classes: the consumers of the family's HF model
    # (the HF families' tests above run each class; the native conversions' own weights are checked by load)
    **{(r, c): ("same", f"as {t} (the same class)") for r in ("mistral-native", "llama-native-fp8", "qwen3-native")
       for c, t in [("compile-2nd-length", DYNAMIC_TEST), ("compile-dynamic", DYNAMIC_TEST),
                    ("generate", "tests/test_generation.py::test_compiled_decode_step_matches_hf"),
                    ("hf-experts", "tests/test_backend.py::test_hf_experts_implementation")]},
    # Qwen2-MoE with its empty shared expert: the static compile runs here (fuse_projections leaves the empty weights
    # alone); the rest is the HF class's path
    **{("qwen2-native", c): ("same", f"as {t} (the same class; the empty shared expert: "
                                     "tests/test_fuse_projections.py::test_empty_shared_expert_loaded_from_disk_is_left_alone)")
       for c, t in [("compile-2nd-length", DYNAMIC_TEST), ("compile-dynamic", DYNAMIC_TEST),
                    ("generate", "tests/test_generation.py::test_compiled_decode_step_matches_hf")]},
    # moecompile's format: one model class per family, the same MoEBlock; moecompile.compile is torch.compile
    **{(r, "moecompile.compile"): ("same", "as `torch.compile` static (with the recorded options)")
       for r in MOECOMPILE_FORMAT + NATIVE if r not in ("gpt2-upcycle", "llama-native")},
    **{(r, c): ("same", "as tests/test_backend_dynamic.py::test_converted_models_on_dynamic_shapes (the same MoE "
                        "block)") for r in ("bert-upcycle", "bert-split") for c in ("compile-2nd-length",
                                                                                     "compile-dynamic")},
    ("bert-upcycle", "export-onnx"): ("same", "as tests/test_onnx.py::test_converted_tiny_model_matches_torch"),
    ("bert-split", "export-onnx"): ("same", "as gpt2-split (a split block; BERT's erf gelu: test_onnx's BERT)"),
    ("llama-split-stream", "generate"): ("same", "as tests/test_backend_dynamic.py::"
                                                 "test_generate_on_a_split_checkpoint_matches_hf"),
    **{(r, c): ("same", "as tests/test_backend_dynamic.py::test_converted_models_on_dynamic_shapes")
       for r in ("gpt2-upcycle", "gpt2-split", "llama-split-stream")
       for c in ("compile-2nd-length", "compile-dynamic")},
    **{(r, "compile"): ("same", "as llama-native (the same Mixtral class; transformers dequantises FP8 on the CPU)")
       for r in ("mistral-native", "llama-native-fp8")},
    ("qwen3-native", "compile"): ("same", "as tests/test_backend.py::test_compiled_matches_eager (Qwen3-MoE)"),
    **{("llama-native", c): ("same", f"as {DYNAMIC_TEST}") for c in ("compile-2nd-length", "compile-dynamic")},
    ("llama-native", "generate"): ("same", "as tests/test_generation.py::test_compiled_decode_step_matches_hf"),
    # routers and shared experts export as plain torch ops; every HF experts module exports as moecompile's ops
    **{(r, "export-onnx"): ("same", "as tests/test_onnx.py::test_hf_moe_model_exports_through_moecompiles_experts "
                                    "(HF experts modules as moecompile's ops)") for r in HF_FAMILIES + NATIVE},
    ("gpt2-upcycle", "export-onnx"): ("same", "as tests/test_onnx.py::test_converted_tiny_model_matches_torch"),
    ("llama-split-stream", "export-onnx"): ("same", "as gpt2-split (a split block) and "
                                                    "tests/test_onnx.py::test_converted_tiny_model_matches_torch "
                                                    "(LLaMA's gated experts)"),
    ("gpt2-calibrated", "export-onnx"): ("same", "as gpt2-split (a split block with shared experts takes the same "
                                                 "standard-ops export)"),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[str, Built] = {}

    def get(route: str) -> Built:
        if route not in cache:
            cache[route] = ROUTES[route][1](tmp_path_factory.mktemp(route))
        return cache[route]
    return get


def _status(route: str, consumer: str) -> str:
    return CELLS.get((route, consumer), ("yes", ""))[0]


@pytest.mark.parametrize("route, consumer", [
    pytest.param(r, c, marks=[pytest.mark.xfail(strict=True, reason=CELLS[r, c][1])] if _status(r, c) == "xfail"
                 else []) for r in ROUTES for c in CONSUMERS if _status(r, c) not in ("same", "n/a")])
def test_cell(route, consumer, built, tmp_path, capsys):
    status, reason = CELLS.get((route, consumer), ("yes", ""))
    check = CONSUMERS[consumer][1]
    if status == "refused":
        match = re.escape(re.search(r'"([^"]*)"', reason).group(1))
        with pytest.raises((MoECompileError, ValueError), match=match):
            check(built(route), tmp_path, capsys)
        return
    check(built(route), tmp_path, capsys)


def readme_table() -> str:
    """The README's table: a row per route, a column per consumer; each cell not "yes" points to its note."""
    notes: list[str] = []
    rows = ["| route | " + " | ".join(title for title, _ in CONSUMERS.values()) + " |",
            "|---" * (len(CONSUMERS) + 1) + "|"]
    for route, (what, _) in ROUTES.items():
        cells = []
        for consumer in CONSUMERS:
            status, reason = CELLS.get((route, consumer), ("yes", ""))
            if status == "yes":
                cells.append("yes")
                continue
            fails = status == "xfail" or reason.startswith("fails")
            note = {"refused": "refused: ", "n/a": "", "xfail": "fails: ",
                    "same": "not run, it " if fails else "the same path "}[status] + reason
            if note not in notes:
                notes.append(note)
            label = "**fails**" if fails else {"refused": "no", "same": "yes", "n/a": "n/a"}[status]
            cells.append(f"{label} [{notes.index(note) + 1}]")
        rows.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(rows + [""] + [f"{i}. {n}" for i, n in enumerate(notes, 1)])


def test_trimmed_cells_name_what_covers_them():
    """A "same" cell names a test that exists, or a route whose cell runs."""
    root = Path(__file__).parent.parent
    for (route, consumer), (status, reason) in CELLS.items():
        assert route in ROUTES and consumer in CONSUMERS and status in ("refused", "n/a", "same", "xfail")
        if status != "same":
            continue
        for path, name in re.findall(r"(tests/\w+\.py)::(\w+)", reason):
            assert f"def {name}(" in (root / path).read_text(), (route, consumer, name)
        for other in re.findall(r"\bas ([\w-]+)", reason):
            if other in ROUTES:
                assert _status(other, consumer) not in ("same", "n/a"), (route, consumer, other)


def test_readme_table_matches():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    section = re.search(r"^## What works with what\n(.*?)(?=^## )", text, re.S | re.M)
    assert section and readme_table() in section.group(1), "README.md: paste tests/test_matrix.readme_table()"
