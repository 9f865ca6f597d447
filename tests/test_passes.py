"""The pass pipeline on captured graphs: find_ffn + moeize (graph view) against the dense model."""
import pytest
import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from moecompile.passes.capture import capture, example_inputs
from moecompile.passes.find_ffn import find_ffn
from moecompile.passes.moeize import moeize as moeize_pass
from moecompile.passes.pipeline import PIPELINE, PassContext, run_pipeline

MODELS = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)),
    "bert": lambda: BertModel(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                         intermediate_size=64, vocab_size=100)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                                  num_key_value_heads=1, intermediate_size=64, vocab_size=100)),
}
MOE_OPS = {"moecompile.route.default", "moecompile.dispatch.default", "moecompile.experts.default",
           "moecompile.combine.default"}


def _first(out):
    for key in ("logits", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return getattr(out, key)
    return out[0]


def _moe_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in MOE_OPS]


@pytest.fixture(params=sorted(MODELS))
def model(request):
    torch.manual_seed(0)
    return MODELS[request.param]().eval()


@pytest.mark.parametrize("method,top_k", [("upcycle", 2), ("split", 4)])
def test_pipeline_rewrites_every_ffn_and_matches_dense(model, method, top_k):
    args, kwargs = example_inputs(model)
    dense = _first(model(*args, **kwargs))
    gm, ctx = run_pipeline(capture(model), {"experts": 4, "top_k": top_k, "capacity_factor": 0.0, "method": method})
    got = _first(gm(*args, **kwargs))
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
    layers = model.config.num_hidden_layers
    assert len(_moe_nodes(gm)) == 4 * layers  # route, dispatch, experts, combine per layer
    names = [name for name, _ in ctx.reports]
    assert names == [p.__name__ for p in PIPELINE]
    assert len(dict(ctx.reports)["moeize"]["rewritten"]) == layers


def test_dense_ffn_weights_leave_the_graph(model):
    gm, ctx = run_pipeline(capture(model), {"experts": 2, "top_k": 1, "capacity_factor": 0.0})
    params = dict(gm.named_parameters())
    dense = {p for m in ctx.ffns for r in m.linears for p in (r.weight, r.bias) if p}
    assert dense and not dense & set(params)
    assert any(name.startswith("moe0.experts.") for name in params)


def test_layers_option_rewrites_only_the_selected_ffn():
    torch.manual_seed(0)
    model = MODELS["gpt2"]().eval()
    gm, ctx = run_pipeline(capture(model), {"experts": 2, "layers": "1", "capacity_factor": 0.0})
    experts_nodes = [n for n in _moe_nodes(gm) if str(n.target) == "moecompile.experts.default"]
    assert len(experts_nodes) == 1
    assert dict(ctx.reports)["moeize"]["rewritten"][0].startswith("moe1:")


def test_passes_are_plain_functions_over_a_graph_module():
    torch.manual_seed(0)
    gm = capture(MODELS["llama"]().eval())
    ctx = PassContext(options={"experts": 2, "capacity_factor": 0.0})
    report = find_ffn(gm, ctx)
    assert len(report["matched"]) == 2 and all("gated" in line for line in report["matched"])
    assert len(ctx.ffns) == 2
    report = moeize_pass(gm, ctx)
    gm.graph.lint()
    assert len(report["rewritten"]) == 2


def test_print_graph_env_shows_each_stage(monkeypatch, capsys):
    torch.manual_seed(0)
    monkeypatch.setenv("MOECOMPILE_PRINT_GRAPH", "1")
    run_pipeline(capture(MODELS["gpt2"]().eval()), {"experts": 2, "capacity_factor": 0.0})
    out = capsys.readouterr().out
    assert "=== graph before passes ===" in out
    assert "=== after find_ffn" in out and "=== after moeize" in out
    assert "torch.ops.moecompile.experts" in out.split("=== after moeize")[1]
