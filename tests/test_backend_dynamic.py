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
DYNAMIC = pytest.mark.parametrize("dynamic", [None, True], ids=["second-length", "dynamic"])


@pytest.fixture(autouse=True)
def _errors_raise():
    """A failing compile must fail the test, not run eagerly."""
    torch._dynamo.reset()
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
    """The graphs the backend compiled that compute something (Dynamo may also hand over an empty one)."""
    return [r for r in backend.records() if any(n.op == "call_function" for n in r.graph_module.graph.nodes)]


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


@DYNAMIC
@pytest.mark.parametrize("family", FAMILIES)
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


@DYNAMIC
@pytest.mark.parametrize("family, method, capacity_factor", [("llama", "upcycle", 0.0), ("llama", "split", 1.0),
                                                             ("gpt2", "split", 0.0)])
def test_converted_models_on_dynamic_shapes(family, method, capacity_factor, dynamic):
    """Split blocks weight each kept expert 1 (read off the expert ids before the dispatch); a capacity factor
    bounds each expert by the token count of each call, symbolic in the dynamic graph."""
    record = _check_lengths(_converted(family, method, capacity_factor), dynamic,
                            make_ids=lambda length: tiny_token_ids(seq=length))
    assert dict(record.reports)["fuse_route_dispatch"]["fused"]
    assert len(moe_nodes(record.graph_module, "route_dispatch")) == 1
    assert len(moe_nodes(record.graph_module, "experts")) == 1
