"""fuse_projections on Dynamo graphs of tiny HF MoE models: alone on a captured graph, then through the backend, where
the fused parameters become views of the fused buffer and stay in step with the model."""
import pytest
import torch
from hf_moe import FAMILIES, dynamo_graphs, tiny_moe, token_ids

import moecompile  # noqa: F401  (registers the backend)
from moecompile import backend
from moecompile.passes.fuse_projections import fuse_projections
from moecompile.passes.nodes import kind
from moecompile.passes.pipeline import PassContext

# groups of linears reading one tensor in each tiny model: attention q/k/v (DeepSeek-V3's MLA: q and kv_a), dense and
# shared-expert gate/up (Qwen2-MoE's shared expert also with its sigmoid gate)
GROUPS = {"tiny-mixtral": 2, "tiny-qwen2-moe": 4, "tiny-qwen3-moe": 2, "tiny-olmoe": 2, "tiny-deepseek-v3": 4,
          "tiny-gpt-oss": 2}


def _logits(out):
    return out.logits if hasattr(out, "logits") else out[0]


def _linear_inputs(gm) -> list:
    return [n.args[0] for n in gm.graph.nodes if kind(n) == "linear"]


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_graph_computes_what_the_graph_did(family):
    ((gm, inputs),) = dynamo_graphs(tiny_moe(family), token_ids(), use_cache=False)
    with torch.no_grad():
        before = _logits(gm(*inputs))
    linears = len(_linear_inputs(gm))
    ctx = PassContext(example_inputs=inputs)
    report = fuse_projections(gm, ctx)
    gm.recompile()
    assert len(report["fused"]) == GROUPS[family], report
    assert "self_attn" in report["fused"][0], report  # module names, not Dynamo's placeholder names
    readers = _linear_inputs(gm)
    assert len(readers) == len(set(readers)) < linears  # no two linears left on one tensor
    fused_parts = sum(len(line.split(" -> ")[0].split(", ")) for line in report["fused"])
    biases = 6 if family in ("tiny-qwen2-moe", "tiny-gpt-oss") else 0  # their q/k/v (two layers) carry biases
    assert len(ctx.input_aliases) == fused_parts + biases
    with torch.no_grad():
        torch.testing.assert_close(_logits(gm(*inputs)), before, rtol=1e-5, atol=1e-6)


def test_training_graph_is_left_alone():
    ((gm, inputs),) = dynamo_graphs(tiny_moe("tiny-qwen3-moe"), token_ids(), use_cache=False)
    assert fuse_projections(gm, PassContext(example_inputs=inputs, training=True)) == {"skipped": "training graph"}


def test_without_real_inputs_nothing_is_fused():
    ((gm, _),) = dynamo_graphs(tiny_moe("tiny-qwen3-moe"), token_ids(), use_cache=False)
    assert fuse_projections(gm, PassContext()) == {"fused": []}


def test_backend_keeps_fused_weights_in_step_with_the_model(tmp_path):
    """Through the backend: the parameters become views of the fused buffer; in-place updates and replaced tensors
    are both seen; a second graph (another shape) shares the buffer; the model still saves and reloads."""
    torch._dynamo.reset()
    model = tiny_moe("tiny-qwen2-moe")
    q = model.model.layers[0].self_attn.q_proj
    k = model.model.layers[0].self_attn.k_proj
    compiled = torch.compile(model, backend="moecompile", options={"inductor": False}, dynamic=False)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(_logits(compiled(ids)), _logits(model(ids)), rtol=1e-5, atol=1e-6)
        assert q.weight.untyped_storage().data_ptr() == k.weight.untyped_storage().data_ptr()
        assert k.weight.storage_offset() == q.weight.numel()
        shared = q.weight.data_ptr()
        compiled(token_ids(length=5))  # a second graph: same buffer
        assert q.weight.data_ptr() == shared
        assert sum(1 for r in backend.records()[-2:] for name, rep in r.reports if name == "fuse_projections"
                   and rep["fused"]) == 2

        k.weight.mul_(1.5)  # in place: into the fused buffer
        torch.testing.assert_close(_logits(compiled(ids)), _logits(model(ids)), rtol=1e-5, atol=1e-6)
        q.weight.data = q.weight.detach().clone() * 0.5  # replaced: copied back into the buffer at the next call
        q.bias.data = torch.randn_like(q.bias)
        expected = _logits(model(ids))
        torch.testing.assert_close(_logits(compiled(ids)), expected, rtol=1e-5, atol=1e-6)
        assert q.weight.data_ptr() == shared

    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(_logits(reloaded(ids)), expected, rtol=0, atol=0)
    torch._dynamo.reset()


def test_option_turns_it_off():
    torch._dynamo.reset()
    model = tiny_moe("tiny-mixtral")
    compiled = torch.compile(model, backend="moecompile", options={"inductor": False, "fuse_projections": False})
    with torch.no_grad():
        compiled(token_ids())
    (report,) = [rep for name, rep in backend.records()[-1].reports if name == "fuse_projections"]
    assert report == {"skipped": "off (option fuse_projections=False)"}
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.storage_offset() == 0 and q.untyped_storage().nbytes() == q.numel() * q.element_size()
    torch._dynamo.reset()


class _Projections(torch.nn.Module):
    """Five linears of one input: a and b fuse; c shares its weight with a second use (tied), d has a bias the others
    lack, e is in another dtype."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, n, bias=False) for n in (4, 6, 5))
        self.d = torch.nn.Linear(8, 3)
        self.e = torch.nn.Linear(8, 2, bias=False).double()

    def forward(self, x):
        tied = torch.nn.functional.linear(x.flip(0), self.c.weight)
        return self.a(x), self.b(x), self.c(x) + tied, self.d(x), self.e(x.double())


def test_only_untied_weights_of_one_dtype_and_bias_kind_are_fused():
    torch.manual_seed(0)
    model, x = _Projections(), torch.randn(3, 8)
    ((gm, inputs),) = dynamo_graphs(model, x)
    with torch.no_grad():
        before = gm(*inputs)
    report = fuse_projections(gm, PassContext(example_inputs=inputs))
    gm.recompile()
    assert report == {"fused": ["a, b -> (10, 8)"]}, report
    with torch.no_grad():
        for got, want in zip(gm(*inputs), before, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_empty_shared_expert_loaded_from_disk_is_left_alone(tmp_path):
    """Qwen2-MoE with shared_expert_intermediate_size 0 (what `convert` writes for Qwen2): loaded from safetensors, the
    empty gate/up weights sit at the address of the next tensor; fusing them once made a view out of bounds."""
    config = tiny_moe("tiny-qwen2-moe").config
    model = type(tiny_moe("tiny-qwen2-moe"))(type(config)(**{**config.to_dict(), "shared_expert_intermediate_size": 0}))
    model.save_pretrained(tmp_path)
    model = type(model).from_pretrained(tmp_path).eval()
    ((gm, inputs),) = dynamo_graphs(model, token_ids(), use_cache=False)
    with torch.no_grad():
        before = _logits(gm(*inputs))
    report = fuse_projections(gm, PassContext(example_inputs=inputs))
    gm.recompile()
    assert not any("shared_expert." in line for line in report["fused"]), report  # q/k/v still fused
    assert len(report["fused"]) == 2, report
    with torch.no_grad():
        torch.testing.assert_close(_logits(gm(*inputs)), before, rtol=1e-5, atol=1e-6)
