"""torch.compile(model, backend="moecompile"): tiny HF MoE models of every family against eager, options, the entry
point, the HF experts implementation, `moecompile inspect --graph`. One test goes through inductor (slow to compile
on CPU); the others use options={"inductor": False} (AOT autograd without code generation)."""
import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from hf_moe import FAMILIES, MOE_LAYERS, moe_nodes, tiny_moe, token_ids

import moecompile
from moecompile import MoECompileError, backend
from moecompile.cli import main
from moecompile.passes.nodes import value

NO_INDUCTOR = {"inductor": False}


def _logits(model, ids):
    return model(ids, use_cache=False).logits


def _assert_rel_close(got, expected, rel=1e-5):
    err = (got - expected).abs().max().item() / expected.abs().max().item()
    assert err <= rel, f"relative error {err:.2e} > {rel:.0e}"


def _compiled(model, **options):
    torch._dynamo.reset()
    backend.clear_records()
    return torch.compile(model, backend="moecompile", fullgraph=True, options=options)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_matches_eager(family):
    model, ids = tiny_moe(family), token_ids()
    with torch.no_grad():  # with the router logits out too (the aux loss): the fused router must keep them
        expected = model(ids, use_cache=False, output_router_logits=True)
        got = _compiled(model, **NO_INDUCTOR)(ids, use_cache=False, output_router_logits=True)
    _assert_rel_close(got.logits, expected.logits)
    if getattr(expected, "aux_loss", None) is not None:
        _assert_rel_close(got.aux_loss, expected.aux_loss)
    # fullgraph=True: one graph, so no break inside an MoE block; one MoE op group per MoE layer
    (record,) = backend.records()
    assert record.moe_blocks == MOE_LAYERS[family]
    for op in ("route_dispatch", "experts", "combine"):
        assert len(moe_nodes(record.graph_module, op)) == MOE_LAYERS[family]


def test_dense_model_passes_through_and_matches():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=64, vocab_size=128)).eval()
    ids = token_ids()
    with torch.no_grad():
        _assert_rel_close(_logits(_compiled(model, **NO_INDUCTOR), ids), _logits(model, ids))
    (record,) = backend.records()
    assert record.moe_blocks == 0 and not moe_nodes(record.graph_module, "experts")


def test_inductor_end_to_end():
    # the one test through compile_fx: GPT-OSS (router bias, transposed interleaved experts with biases), one layer
    model = tiny_moe("tiny-gpt-oss")
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    ids = token_ids()
    with torch.no_grad():
        expected = _logits(model, ids)
        got = _logits(_compiled(model), ids)
    _assert_rel_close(got, expected)
    (record,) = backend.records()
    assert record.moe_blocks == 1 and len(moe_nodes(record.graph_module, "route_dispatch")) == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["tiny-gpt-oss", "tiny-deepseek-v3"])
def test_training_gradients_match_eager(family):
    model = tiny_moe(family).train()
    twin = copy.deepcopy(model)
    ids = token_ids()
    params = [p for p in model.parameters()]
    expected = torch.autograd.grad(_logits(model, ids).square().mean(), params, allow_unused=True)
    torch._dynamo.reset()
    backend.clear_records()
    compiled = moecompile.compile(twin, fullgraph=True, **NO_INDUCTOR)
    got = torch.autograd.grad(_logits(compiled, ids).square().mean(), list(twin.parameters()), allow_unused=True)
    (record,) = backend.records()  # a training graph: the first projections are kept for the backward
    kept = "experts_train" if family == "tiny-gpt-oss" else "experts_combine_train"  # (GPT-OSS: its own activation)
    assert len(moe_nodes(record.graph_module, kept)) == MOE_LAYERS[family]
    assert not moe_nodes(record.graph_module, "experts")
    assert dict(record.reports)["keep_first_projection"][kept]
    router_grads = 0
    for (name, _), g, e in zip(model.named_parameters(), got, expected):
        assert (g is None) == (e is None), name
        if e is not None:
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6 * max(1.0, e.abs().max().item()))
            router_grads += ("gate.weight" in name or "router." in name) and bool(e.abs().sum() > 0)
    assert router_grads >= 1  # the routing weights' gradient reaches the router through the fused op
    torch._dynamo.reset()


def test_options_select_passes():
    model, ids = tiny_moe("tiny-mixtral"), token_ids()
    with torch.no_grad():
        expected = _logits(model, ids)
        unfused = _logits(_compiled(model, inductor=False, fuse=False), ids)
    _assert_rel_close(unfused, expected)
    (record,) = backend.records()
    gm = record.graph_module
    assert not moe_nodes(gm, "route_dispatch") and len(moe_nodes(gm, "route")) == len(moe_nodes(gm, "dispatch")) == 2
    assert dict(record.reports)["fuse_route_dispatch"] == {"skipped": "off (option fuse=False)"}
    with torch.no_grad():
        capped = _logits(_compiled(model, inductor=False, capacity_factor=0.5), ids)
    (record,) = backend.records()
    assert dict(record.reports)["set_capacity"]["capacity_factor"] == 0.5
    assert all(n.args[4] == 0.5 for n in moe_nodes(record.graph_module, "route_dispatch"))
    assert not torch.allclose(capped, expected)  # capacity 0.5 drops assignments
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_fp8_option_quantises_the_experts_in_the_graph(family):
    """options fp8: every recognised experts node runs FP8 (weights quantised by graph nodes: Dynamo hands the
    parameters over as inputs); the logits stay close to the unquantised model's."""
    model, ids = tiny_moe(family), token_ids()
    with torch.no_grad():
        expected = _logits(model, ids)
        got = _logits(_compiled(model, fp8=True, **NO_INDUCTOR), ids)
    (record,) = backend.records()
    report = dict(record.reports)["insert_fp8"]
    assert len(report["rewritten"]) == MOE_LAYERS[family] and not report["skipped"]
    assert all("(constants)" in r for r in report["rewritten"])  # quantised once, at compile time
    assert len(moe_nodes(record.graph_module, "experts_fp8")) == MOE_LAYERS[family]
    assert not moe_nodes(record.graph_module, "experts")
    cosine = torch.nn.functional.cosine_similarity(got.flatten(1), expected.flatten(1)).min().item()
    assert cosine >= 0.999, cosine
    assert not torch.equal(got, expected)  # the FP8 path ran
    with pytest.raises(Exception, match="'fp8' is inference-only"):  # Dynamo wraps the backend's error
        _logits(_compiled(model, fp8=True, **NO_INDUCTOR), ids)
    torch._dynamo.reset()


def test_fp8_option_without_fusion_dispatches_fp8_tokens():
    """fuse=False leaves plain dispatch nodes: insert_fp8 quantises the tokens before them (FP8 dispatch), with the
    Dynamo graph's example values updated to FP8 rows."""
    model, ids = tiny_moe("tiny-mixtral"), token_ids()
    with torch.no_grad():
        expected = _logits(model, ids)
        got = _logits(_compiled(model, fp8=True, fuse=False, **NO_INDUCTOR), ids)
    (record,) = backend.records()
    report = dict(record.reports)["insert_fp8"]
    assert len(report["rewritten"]) == 2 and all(r.endswith("activations: FP8 dispatch") for r in report["rewritten"])
    for dispatch in moe_nodes(record.graph_module, "dispatch"):
        assert value(dispatch)[0].dtype == torch.float8_e4m3fn
    cosine = torch.nn.functional.cosine_similarity(got.flatten(1), expected.flatten(1)).min().item()
    assert cosine >= 0.999, cosine
    torch._dynamo.reset()


@pytest.mark.parametrize("options", [{}, {"fp8": True}])
def test_parameters_and_constants_are_static_inputs_for_cuda_graphs(monkeypatch, options):
    """What AOT autograd is told stays in place between calls (CUDA graphs then read it there instead of copying it
    at every replay): every parameter and every tensor a pass made (fused projections, FP8 weights); only the
    token ids are not."""
    from torch._functorch import aot_autograd

    seen = []  # (inputs, static input indices) of each call
    real = aot_autograd._try_get_metadata_from_dynamo

    def spy(*args):
        sources, static = real(*args)
        seen.append((args[2], static))
        return sources, static  # what AOT autograd would have had anyway

    monkeypatch.setattr(aot_autograd, "_try_get_metadata_from_dynamo", spy)
    model, ids = tiny_moe("tiny-qwen3-moe"), token_ids()
    with torch.no_grad():
        _logits(_compiled(model, **options, **NO_INDUCTOR), ids)
    (record,) = backend.records()
    constants = sum(1 for n in record.graph_module.graph.nodes if n.op == "get_attr"
                    and n.meta.get("moecompile_constant"))
    assert constants >= 2 + 4 * bool(options)  # two fused q/k/v, FP8 weights and scales of two layers
    ((inputs, static),) = seen
    assert static == list(range(1, inputs))
    torch._dynamo.reset()


@pytest.mark.parametrize("options,message", [
    ({"fp8": True, "expert_parallel": {"overlap_degree": 1}}, "cannot be combined"),
    ({"expert_parallel": 2}, "option 'expert_parallel' must be dict"),
    ({"expert_parallel": {"degree": 2}}, "takes 'group' and 'overlap_degree'"),
    ({"fusion": False}, "unknown moecompile option 'fusion'"),
    ({"inductor": "no"}, "option 'inductor' must be bool"),
    ({"capacity_factor": True}, "option 'capacity_factor' must be"),
])
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(MoECompileError, match=message):
        moecompile.compile(torch.nn.Linear(2, 2), **options)


def test_resolve_options_fills_defaults_and_takes_mode():
    opts = backend.resolve_options({"fuse": False}, mode="max-autotune-no-cudagraphs")
    assert opts["fuse"] is False and opts["inductor"] is True and opts["mode"] == "max-autotune-no-cudagraphs"
    assert set(opts) == set(backend.OPTIONS)


def test_entry_point_backend_without_importing_moecompile(tmp_path):
    script = textwrap.dedent("""
        import sys, torch, transformers
        from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend
        assert "moecompile" in torch._dynamo.list_backends()
        assert "moecompile" not in sys.modules
        config = transformers.MixtralConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                            vocab_size=64)
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(config).eval()
        ids = torch.arange(6).unsqueeze(0)
        with torch.no_grad():
            out = torch.compile(model, backend="moecompile", options={"inductor": False})(ids, use_cache=False)
            ref = model(ids, use_cache=False)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
        import moecompile.backend
        assert moecompile.backend.records()[-1].moe_blocks == 1
        assert _COMPILER_FNS["moecompile"] is moecompile.backend.moecompile_backend
        try:  # the entry point's name is Dynamo's: registering it again fails, so moecompile never does
            register_backend(moecompile.backend.moecompile_backend, name="moecompile")
        except AssertionError as e:
            assert "duplicate" in str(e)
        else:
            raise SystemExit("registered twice")
        print("ok")
    """)
    # (not from the repository root: `python -c` puts the working directory on sys.path, see tests/conftest.py)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_print_graph_shows_each_pass(capsys, monkeypatch):
    monkeypatch.setenv("MOECOMPILE_PRINT_GRAPH", "1")
    with torch.no_grad():
        _compiled(tiny_moe("tiny-olmoe"), **NO_INDUCTOR)(token_ids(), use_cache=False)
    out = capsys.readouterr().out
    assert "=== graph before passes ===" in out
    for name in ("recognise_moe", "set_capacity", "fuse_route_dispatch"):
        assert f"=== after {name}" in out
    assert "grouped_mm" in out.split("=== after recognise_moe")[0]
    assert "moecompile.route_dispatch" in out.split("=== after fuse_route_dispatch")[1]
    torch._dynamo.reset()


def test_cli_inspect_graph(capsys):
    assert main(["inspect", "tiny-qwen2-moe", "--random-init", "--graph", "--json", "--no-progress"]) == 0
    (graph,) = json.loads(capsys.readouterr().out)["graphs"]
    assert graph["moe_blocks"] == 2 and graph["check"] == "fake"
    assert len(graph["passes"]["fuse_route_dispatch"]["fused"]) == 2
    torch._dynamo.reset()


# ------------------------------------------------------------------------- HF experts implementation "moecompile"

@pytest.mark.parametrize("family", FAMILIES)
def test_hf_experts_implementation(family):
    model, ids = tiny_moe(family), token_ids()
    with torch.no_grad():
        expected = _logits(model, ids)
        model.set_experts_implementation("moecompile")
        assert model.config._experts_implementation == "moecompile"
        got = _logits(model, ids)
    _assert_rel_close(got, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_small_batch_delegate_computes_our_experts(family):
    """Small eager CUDA batches go to HF's own implementation: on the same routing it gives our experts' output."""
    from moecompile.integrations import hf_experts

    model = tiny_moe(family)
    experts = next(m for name, m in model.named_modules() if name.endswith("mlp.experts"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, model.config.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(3)])
    weights = torch.rand(3, 2, generator=g)
    with torch.no_grad():
        _assert_rel_close(hf_experts._hf_small_batch_experts()(experts, x, ids, weights),
                          hf_experts.experts_forward(experts, x, ids, weights))


def test_backend_recognises_blocks_already_on_moecompile_experts():
    model, ids = tiny_moe("tiny-gpt-oss"), token_ids()
    with torch.no_grad():
        expected = _logits(model, ids)
        model.set_experts_implementation("moecompile")
        got = _logits(_compiled(model, **NO_INDUCTOR), ids)
    _assert_rel_close(got, expected)
    (record,) = backend.records()
    assert record.moe_blocks == 2 and len(moe_nodes(record.graph_module, "experts")) == 2
    torch._dynamo.reset()


def test_hf_experts_with_an_unknown_gate_is_an_error():
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from moecompile.integrations.hf_experts import experts_forward

    class OddExperts(MixtralExperts):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.tanh(gate) * up

    model = tiny_moe("tiny-mixtral")
    odd = OddExperts(model.config)
    with pytest.raises(MoECompileError, match="unknown gate function"):
        experts_forward(odd, torch.randn(3, 32), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
