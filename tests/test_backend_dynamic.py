"""The compile backend on dynamic shapes: every recognised HF MoE family and converted models (upcycle, split),
compiled with torch.compile(backend="moecompile") at a first sequence length and then a second one (Dynamo retraces
with symbolic sizes), and with dynamic=True; outputs against eager, the MoE blocks rewritten in the dynamic graph,
and the graphs the backend compiled counted, so that no fallback to eager hides a failure. Also the capacity factor
a converted model records, applied alike by the backend and moecompile.compile."""
import pytest
import torch
from conftest import make_tiny_model, tiny_token_ids
from hf_moe import FAMILIES, moe_nodes, tiny_moe, token_ids

import moecompile
from moecompile import backend

NO_INDUCTOR = {"inductor": False}
FIRST, SECOND = 8, 5


def _lengths(cases, dynamic_in_make_test):
    """Each case at a second length (a static graph, then a dynamic one) and with dynamic=True (one dynamic graph);
    dynamic=True of the other cases, whose symbolic graphs their second length covers, in `make test-slow`."""
    params = []
    for case in cases:
        values = case if isinstance(case, tuple) else (case,)
        name = "-".join(map(str, values))
        slow = () if case == dynamic_in_make_test else pytest.mark.slow
        params += [pytest.param(*values, None, id=f"{name}-second-length"),
                   pytest.param(*values, True, id=f"{name}-dynamic", marks=slow)]
    return params


@pytest.fixture(autouse=True)
def _errors_raise():
    """A failing compile must fail the test, not run eagerly."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend.clear_records()
    with torch._dynamo.config.patch(suppress_errors=False):
        yield
    torch._dynamo.reset()


def _one_moe_layer(model):
    """The model with only its last decoder layer (an MoE layer in every tiny family): half the tracing."""
    model.model.layers = model.model.layers[-1:]
    model.config.num_hidden_layers = 1
    return model


def _symbolic(gm) -> bool:
    return any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.find_nodes(op="placeholder"))


def _compiled_graphs() -> list:
    """The records of the graphs Dynamo installed, each compiled by the backend: the last records (under
    dynamic=True Dynamo may trace a frame twice, turning a float into a graph input the second time, and empty
    the graph it dropped)."""
    installed = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    kept = [r for r in backend.records() if any(n.op == "call_function" for n in r.graph_module.graph.nodes)]
    assert len(kept) == installed, (len(kept), installed)
    return kept


def _check_lengths(model, dynamic, make_ids=token_ids, **options):
    """Compile, run at FIRST then SECOND tokens against eager; the record of the last (dynamic) graph."""
    compiled = torch.compile(model, backend="moecompile", fullgraph=True, dynamic=dynamic,
                             options={**NO_INDUCTOR, **options})
    with torch.no_grad():
        for length in (FIRST, SECOND):
            ids = make_ids(length=length)
            torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                       rtol=1e-5, atol=1e-5)
    graphs = _compiled_graphs()
    # one graph for both lengths with dynamic=True; else a static graph, then a dynamic one for the second length
    assert len(graphs) == (1 if dynamic else 2), [r.reports for r in graphs]
    assert _symbolic(graphs[-1].graph_module) and not (len(graphs) == 2 and _symbolic(graphs[0].graph_module))
    return graphs[-1]


@pytest.mark.parametrize("family, dynamic", _lengths(FAMILIES, "tiny-mixtral"))
def test_hf_moe_families_on_dynamic_shapes(family, dynamic):
    record = _check_lengths(_one_moe_layer(tiny_moe(family)), dynamic)
    reports = dict(record.reports)
    assert record.moe_blocks == 1 and not reports["recognise_moe"]["rejected"], reports["recognise_moe"]
    assert len(moe_nodes(record.graph_module, "route_dispatch")) == 1
    assert reports["direct_experts"] == {"direct": []}  # a symbolic token count keeps the sorted path


def _converted(family, method, capacity_factor):
    layers = {"n_layer": 1} if family == "gpt2" else {"num_hidden_layers": 1}
    model = make_tiny_model(family, **layers)
    return moecompile.moeize(model, experts=4, top_k=2, method=method, capacity_factor=capacity_factor,
                             progress=False)


@pytest.mark.parametrize("family, method, capacity_factor, dynamic",
                         _lengths([("llama", "upcycle", 0.0), ("llama", "split", 1.0), ("gpt2", "split", 0.0)],
                                  ("llama", "split", 1.0)))
def test_converted_models_on_dynamic_shapes(family, method, capacity_factor, dynamic):
    """Split blocks weight each kept expert 1 (read off the expert ids before the dispatch); a capacity factor
    bounds each expert by the token count of each call, symbolic in the dynamic graph."""
    record = _check_lengths(_converted(family, method, capacity_factor), dynamic,
                            make_ids=lambda length: tiny_token_ids(seq=length))
    assert dict(record.reports)["fuse_route_dispatch"]["fused"]
    assert len(moe_nodes(record.graph_module, "route_dispatch")) == 1
    assert len(moe_nodes(record.graph_module, "experts_gathered")) == 1


def test_recorded_capacity_factor_applies_alike():
    """A converted model's config records a capacity factor (config.json's "moecompile" entry): torch.compile with
    the backend and moecompile.compile both apply it, and give the same outputs; the caller's option overrides it."""
    model = _one_moe_layer(tiny_moe("tiny-mixtral"))
    model.config.moecompile = {"capacity_factor": 0.5}  # few enough rows per expert that assignments drop
    ids = token_ids()

    def logits(compiled):
        torch._dynamo.reset()
        with torch.no_grad():
            return compiled(ids, use_cache=False).logits

    with torch.no_grad():
        dropless = model(ids, use_cache=False).logits
    by_backend = logits(torch.compile(model, backend="moecompile", options=NO_INDUCTOR))
    by_compile = logits(moecompile.compile(model, **NO_INDUCTOR))
    overridden = logits(torch.compile(model, backend="moecompile", options={**NO_INDUCTOR, "capacity_factor": 0.0}))
    assert torch.equal(by_backend, by_compile)
    assert (by_backend - dropless).abs().max() > 1e-3  # the recorded capacity dropped assignments
    torch.testing.assert_close(overridden, dropless, rtol=1e-5, atol=1e-5)
    assert [dict(r.reports)["set_capacity"].get("capacity_factor") for r in backend.records()] == [0.5, 0.5, 0.0]


def test_generate_on_a_split_checkpoint_matches_hf(tmp_path):
    """moecompile.generate (prefill and decode step compiled with the backend) on a split checkpoint as
    `moecompile convert --method split` streams it from a LLaMA folder: HF's greedy tokens."""
    from moecompile.conversion.split_stream import split_checkpoint

    make_tiny_model("llama", num_hidden_layers=1).save_pretrained(tmp_path / "dense")
    split_checkpoint(tmp_path / "dense", tmp_path / "split", 4, top_k=2, capacity_factor=0.0, seed=0, progress=False)
    model = moecompile.load(tmp_path / "split").eval()
    ids = tiny_token_ids(seq=6)
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(moecompile.generate(model, ids, 4, options=NO_INDUCTOR), expected)
    assert all(dict(r.reports)["fuse_route_dispatch"]["fused"] for r in _compiled_graphs())


def test_fp8_graphs_on_dynamic_shapes():
    """insert_fp8 (inference) on a dynamic=True graph of an HF family: FP8 logits within FP8's error of eager, at
    two lengths from one graph."""
    model = _one_moe_layer(tiny_moe("tiny-qwen3-moe"))
    compiled = torch.compile(model, backend="moecompile", fullgraph=True, dynamic=True,
                             options={**NO_INDUCTOR, "fp8": True})
    with torch.no_grad():
        for length in (FIRST, SECOND):
            ids = token_ids(length=length)
            got, want = compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits
            assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    (record,) = _compiled_graphs()
    assert _symbolic(record.graph_module) and dict(record.reports)["insert_fp8"]["rewritten"]


def test_training_graphs_on_dynamic_shapes():
    """keep_first_projection (a training graph) on a dynamic=True graph: gradients equal to eager's, at two
    lengths from one graph."""
    model = _one_moe_layer(tiny_moe("tiny-qwen3-moe")).train()
    compiled = torch.compile(model, backend="moecompile", fullgraph=True, dynamic=True, options=NO_INDUCTOR)
    for length in (FIRST, SECOND):
        ids = token_ids(length=length)
        grads = []
        for run in (compiled, model):
            model.zero_grad()
            run(ids, use_cache=False).logits.square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        assert len(grads[0]) == len(grads[1]) > 0
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    (record,) = _compiled_graphs()
    assert record.moe_blocks == 1 and dict(record.reports)["keep_first_projection"]["experts_combine_train"]
