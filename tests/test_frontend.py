"""Front end + FFN finder: capture (torch.export) and the structural FFN match on tiny models and plain modules."""
from __future__ import annotations

import functools
import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moecompile import MoECompileError
from moecompile.conversion.in_memory import moeize
from moecompile.ir.block import MoEBlock
from moecompile.passes.capture import capture, example_inputs, module_scopes
from moecompile.passes.find_ffn import find_dense_ffns, find_ffns

N_LAYERS = 2

# family -> (activation, gated, gate path, up path, down path) with {i} the layer index
EXPECTED = {
    "gpt2": ("gelu_tanh", False, None, "transformer.h.{i}.mlp.c_fc", "transformer.h.{i}.mlp.c_proj"),
    "bert": ("gelu", False, None, "encoder.layer.{i}.intermediate.dense", "encoder.layer.{i}.output.dense"),
    "llama": ("silu", True, "model.layers.{i}.mlp.gate_proj", "model.layers.{i}.mlp.up_proj",
              "model.layers.{i}.mlp.down_proj"),
    "qwen2": ("silu", True, "model.layers.{i}.mlp.gate_proj", "model.layers.{i}.mlp.up_proj",
              "model.layers.{i}.mlp.down_proj"),
    "mistral": ("silu", True, "model.layers.{i}.mlp.gate_proj", "model.layers.{i}.mlp.up_proj",
                "model.layers.{i}.mlp.down_proj"),
}


# ---------------------------------------------------------------- HF families

@pytest.fixture(scope="module")
def found(make_tiny):
    """found(family, attn) -> (model, matches, rejected): find_ffns on the capture of the tiny model, once per
    module (each capture is a torch.export; the tests only read what it found)."""
    @functools.cache
    def get(family: str, attn: str):
        model = make_tiny(family, attn_implementation=attn)
        return model, *find_ffns(capture(model))

    return get


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_one_ffn_per_layer_with_right_activation_and_paths(tiny_family, found, attn):
    model, matches, rejected = found(tiny_family, attn)
    activation, gated, gate, up, down = EXPECTED[tiny_family]
    assert len(matches) == N_LAYERS, [m.describe() for m in matches]
    assert rejected == []
    for i, m in enumerate(matches):  # graph order is layer order
        assert m.activation == activation
        assert m.gated is gated
        assert m.up.module == up.format(i=i)
        assert m.down.module == down.format(i=i)
        if gated:
            assert m.gate is not None and m.gate.module == gate.format(i=i)
        else:
            assert m.gate is None
        assert m.chain, "an FFN match must carry its activation chain"
        # parameters named by fully qualified names that exist in the model, with consistent shapes
        w_up = model.get_parameter(m.up.weight)
        w_down = model.get_parameter(m.down.weight)
        assert m.up.weight == f"{m.up.module}.weight"
        if tiny_family == "gpt2":  # Conv1D stores [in, out]
            assert not m.up.out_in and not m.down.out_in
            assert w_up.shape == (32, 128) and w_down.shape == (128, 32)
        else:
            assert m.up.out_in and m.down.out_in
            assert w_up.shape == (64, 32) and w_down.shape == (32, 64)
        has_bias = tiny_family in ("gpt2", "bert")
        assert (m.up.bias is not None) is has_bias
        assert (m.down.bias is not None) is has_bias


@pytest.mark.parametrize("family, overrides, activation, gated", [
    ("gpt2", dict(activation_function="relu"), "relu", False),
    ("gpt2", dict(activation_function="gelu"), "gelu", False),
    ("gpt2", dict(activation_function="silu"), "silu", False),
    ("bert", dict(hidden_act="gelu_new"), "gelu_tanh", False),
    ("llama", dict(hidden_act="gelu_pytorch_tanh"), "gelu_tanh", True),
    ("llama", dict(hidden_act="relu"), "relu", True),
    ("llama", dict(mlp_bias=True), "silu", True),
])
def test_activation_variants_of_hf_configs(make_tiny, family, overrides, activation, gated):
    matches, rejected = find_ffns(capture(make_tiny(family, **overrides)))
    assert rejected == []
    assert [(m.activation, m.gated) for m in matches] == [(activation, gated)] * N_LAYERS


def test_unsupported_hf_activation_rejected(make_tiny):
    """quick_gelu (x * sigmoid(1.702 x)) is elementwise but no activation the experts kernel knows."""
    model = make_tiny("gpt2", activation_function="quick_gelu")
    matches, rejected = find_ffns(capture(model))
    assert matches == []
    assert len(rejected) == N_LAYERS
    for i, line in enumerate(rejected):
        assert line.startswith(f"transformer.h.{i}.mlp.c_proj:") and "not a supported activation" in line
    with pytest.raises(MoECompileError, match="no FFN found"):
        moeize(model, experts=2, top_k=1, progress=False)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_no_ffn_found_in_attention(tiny_family, found, attn):
    _, matches, _ = found(tiny_family, attn)
    assert matches
    for m in matches:
        for ref in m.linears:
            parts = ref.module.lower().split(".")
            assert not any("attn" in p or "attention" in p for p in parts), m.describe()
            assert not any(p in ("q_proj", "k_proj", "v_proj", "o_proj", "query", "key", "value") for p in parts)


def test_dense_ffn_weights_match_model_parameters(tiny_family, make_tiny):
    """find_dense_ffns hands back the dense weights as [out, in] (gate rows then up rows when gated)."""
    model = make_tiny(tiny_family)
    found, skipped = find_dense_ffns(model)
    assert len(found) == N_LAYERS and skipped == []
    for ffn in found:
        m = ffn.match
        w = lambda ref: model.get_parameter(ref.weight) if ref.out_in else model.get_parameter(ref.weight).t()  # noqa: E731
        expected_in = torch.cat([w(r) for r in (m.gate, m.up) if r is not None])
        assert torch.equal(ffn.w_in, expected_in)
        assert torch.equal(ffn.w_out, w(m.down))
        assert ffn.hidden_size == 32
        assert ffn.intermediate_size == (128 if tiny_family == "gpt2" else 64)


def test_capture_restores_training_mode(make_tiny):
    model = make_tiny("gpt2").train()
    gm = capture(model)
    assert model.training, "capture must put the model back in the mode it found it in"
    scopes = module_scopes(gm)
    assert any("transformer.h.0.mlp" in paths for paths in scopes.values())


def test_example_inputs_for_hf_model(make_tiny):
    model = make_tiny("llama")
    (ids,), kwargs = example_inputs(model)
    assert ids.dtype == torch.long and ids.shape[0] == 1 and int(ids.max()) < model.config.vocab_size
    assert kwargs.get("use_cache") is False


# ---------------------------------------------------------------- plain modules

H, I = 8, 16


class Wrap(nn.Module):
    """Puts an FFN module under `ffn` (moeize replaces a submodule, never the root)."""

    def __init__(self, ffn: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.ffn = ffn

    def forward(self, x):
        return x + self.ffn(self.norm(x))


class TwoLinear(nn.Module):
    def __init__(self, act, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(H, I, bias=bias)
        self.fc2 = nn.Linear(I, H, bias=bias)
        self.act = act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def hand_silu(h):
    return h * torch.sigmoid(h)


def hand_gelu_tanh(h):
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


def hand_gelu_erf(h):
    return 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))


class GatedFFN(nn.Module):
    def __init__(self, gate_first=True):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False)  # gate
        self.w3 = nn.Linear(H, I, bias=False)  # up
        self.w2 = nn.Linear(I, H, bias=False)  # down
        self.gate_first = gate_first

    def forward(self, x):
        if self.gate_first:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        g = self.w1(x)  # up first, silu written by hand
        return self.w2(self.w3(x) * (g * torch.sigmoid(g)))


def _x(seed=0, shape=(2, 5, H)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _build(ffn: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    model = Wrap(ffn).eval()
    with torch.no_grad():  # make the FFN contribute at a visible scale
        for p in model.ffn.parameters():
            p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("make_act, activation", [
    (lambda: nn.ReLU(), "relu"),
    (lambda: hand_silu, "silu"),
    (lambda: hand_gelu_tanh, "gelu_tanh"),
    (lambda: hand_gelu_erf, "gelu"),
    (lambda: nn.GELU(), "gelu"),
    (lambda: nn.GELU(approximate="tanh"), "gelu_tanh"),
    (lambda: nn.SiLU(), "silu"),
])
def test_plain_module_activation_identified(make_act, activation):
    model = _build(TwoLinear(make_act()))
    matches, rejected = find_ffns(capture(model, (_x(),)))
    assert rejected == []
    assert len(matches) == 1
    m = matches[0]
    assert m.activation == activation
    assert not m.gated
    assert (m.up.module, m.down.module) == ("ffn.fc1", "ffn.fc2")


def test_sequential_relu_mlp_matched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, I), nn.ReLU(), nn.Linear(I, H)).eval()
    matches, rejected = find_ffns(capture(model, (_x(),)))
    assert rejected == []
    assert [(m.activation, m.up.module, m.down.module, m.gated) for m in matches] == [("relu", "0", "2", False)]


@pytest.mark.parametrize("gate_first", [True, False])
def test_plain_gated_module_identifies_gate(gate_first):
    model = _build(GatedFFN(gate_first))
    matches, rejected = find_ffns(capture(model, (_x(),)))
    assert rejected == []
    assert len(matches) == 1
    m = matches[0]
    assert m.gated and m.activation == "silu"
    assert m.gate.module == "ffn.w1" and m.up.module == "ffn.w3" and m.down.module == "ffn.w2"


@pytest.mark.parametrize("method, top_k", [("upcycle", 2), ("split", 4)])
@pytest.mark.parametrize("make_ffn", [
    lambda: TwoLinear(nn.ReLU()),
    lambda: TwoLinear(hand_silu, bias=False),
    lambda: TwoLinear(hand_gelu_tanh),
    lambda: GatedFFN(True),
    lambda: GatedFFN(False),
])
def test_plain_module_moeize_exact(make_ffn, method, top_k):
    model = _build(make_ffn())
    x = _x(1)
    with torch.no_grad():
        dense = model(x)
    moeize(model, experts=4, top_k=top_k, capacity_factor=0, method=method, example_args=(x,), progress=False)
    assert isinstance(model.ffn, MoEBlock)
    with torch.no_grad():
        out = model(x)
    assert dense.abs().max() > 0.1
    assert (out - dense).abs().max().item() <= 1e-5


class SinFFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, I)
        self.fc2 = nn.Linear(I, H)

    def forward(self, x):
        return self.fc2(torch.sin(self.fc1(x)))


def test_unsupported_elementwise_chain_is_rejected():
    model = _build(SinFFN())
    matches, rejected = find_ffns(capture(model, (_x(),)))
    assert matches == []
    assert len(rejected) == 1
    assert "ffn.fc2" in rejected[0] and "not a supported activation" in rejected[0]


def test_unsupported_chain_reported_when_moeize_fails():
    model = _build(SinFFN())
    with pytest.raises(MoECompileError, match="no FFN found") as info:
        moeize(model, experts=2, top_k=1, example_args=(_x(),), progress=False)
    assert "not a supported activation" in str(info.value)
    assert isinstance(model.ffn.fc1, nn.Linear), "a failed moeize must leave the model untouched"


class LinearLinear(nn.Module):
    def __init__(self, with_view=False):
        super().__init__()
        self.fc1 = nn.Linear(H, I)
        self.fc2 = nn.Linear(I, H)
        self.with_view = with_view

    def forward(self, x):
        h = self.fc1(x)
        if self.with_view:
            h = h.reshape(-1, I).reshape(h.shape)
        return self.fc2(h)


@pytest.mark.parametrize("with_view", [False, True])
def test_linear_linear_without_activation_not_matched(with_view):
    model = _build(LinearLinear(with_view))
    matches, rejected = find_ffns(capture(model, (_x(),)))
    assert matches == []
    assert rejected == []


class ScaledRelu(nn.Module):
    """linear -> relu -> linear, but the hidden activation also feeds a second output: not a rewritable FFN."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, I)
        self.fc2 = nn.Linear(I, H)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h), h.sum(-1)


def test_hidden_activation_with_other_users_not_matched():
    torch.manual_seed(0)
    model = ScaledRelu().eval()
    matches, _ = find_ffns(capture(model, (_x(),)))
    assert matches == []


class EmbedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, H)
        self.norm = nn.LayerNorm(H)

    def forward(self, ids):
        return self.norm(self.embed(ids))


def test_model_without_ffn():
    torch.manual_seed(0)
    model = EmbedNorm().eval()
    ids = torch.arange(6).unsqueeze(0)
    matches, rejected = find_ffns(capture(model, (ids,)))
    assert matches == [] and rejected == []
    with pytest.raises(MoECompileError, match="no FFN found"):
        moeize(model, experts=2, top_k=1, example_args=(ids,), progress=False)


def test_capture_without_vocab_and_example_args_raises():
    model = _build(TwoLinear(nn.ReLU()))
    with pytest.raises(MoECompileError, match="example inputs"):
        capture(model)
    model.config = types.SimpleNamespace(hidden_size=H)  # a config, but no vocab_size
    with pytest.raises(MoECompileError, match="example inputs"):
        capture(model)
    with pytest.raises(MoECompileError):
        moeize(model, experts=2, top_k=1, progress=False)


def test_capture_failure_is_a_moecompile_error():
    model = _build(TwoLinear(nn.ReLU()))
    with pytest.raises(MoECompileError, match="torch.export could not capture"):
        capture(model, (torch.randn(2, H + 1),))  # wrong width: the export itself fails
