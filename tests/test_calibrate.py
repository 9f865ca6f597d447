"""Calibrated split: block options, partitions, router fit, distillation, CLI and report (tiny random models)."""
import copy
import json

import pytest
import torch

import moecompile
from moecompile import MoEBlock, MoECompileError, MoEConfig
from moecompile.calibration import calibrate as C
from moecompile.calibration import config as CF
from moecompile.calibration import dense as DN
from moecompile.calibration import e2e as E2E
from moecompile.calibration import evaluate as EV
from moecompile.calibration import masked as M
from moecompile.calibration import partition as P
from moecompile.calibration import router as R
from moecompile.calibration import shared as S
from moecompile.calibration import tokens as T
from moecompile.cli import main
from moecompile.conversion import models
from moecompile.passes.find_ffn import find_dense_ffns


def gen(seed):
    return torch.Generator().manual_seed(seed)


def tiny(name="tiny-bert"):
    torch.manual_seed(0)
    return models.load_source(name, random_init=True, progress=False).model.eval()


def ffn_and_inputs(name="tiny-bert", n=600, seed=0):
    model = tiny(name)
    ffn = find_dense_ffns(model)[0][0]
    x = torch.randn(n, ffn.hidden_size, generator=gen(seed))
    return ffn, x


def option_block(**kw):
    cfg = dict(hidden_size=8, expert_size=5, num_experts=4, top_k=2, bias_in=True, bias_out="shared",
               gate_weighting="unit", capacity_factor=0.0, router_bias=True, compensation=True, shared_expert_size=3)
    cfg.update(kw)
    block = MoEBlock(MoEConfig(**cfg)).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.5, generator=gen(1))
    return block


@pytest.mark.parametrize("kw", [{}, {"shared_linear": True}, {"gated": True}, {"gate_weighting": "router"},
                                {"compensation": False, "shared_expert_size": 0}])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_masked_forward_equals_block_forward(kw, k):
    block = option_block(**kw)
    x = torch.randn(13, 8, generator=gen(2))
    torch.testing.assert_close(M.masked_forward(block, x, k), block(x, top_k=k), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", [{}, {"gated": True, "shared_expert_size": 0}, {"gate_weighting": "router"}])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_sparse_and_dense_routed_experts_agree_with_gradients(kw, k):
    """masked_forward's two ways of running the routed experts: same outputs and same gradients (k = 8 = E too;
    the router biased so that most experts get no token at k = 1)."""
    block = option_block(num_experts=8, **kw)
    with torch.no_grad():
        block.router.bias[0] += 20.0
    x = torch.randn(13, 8, generator=gen(2))
    results = []
    for routed in (M.routed_sparse, M.routed_dense):
        block.zero_grad()
        out = M.masked_forward(block, x, k, routed)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}))
    (sparse, sparse_grads), (dense, dense_grads) = results
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)
    assert sparse_grads.keys() == dense_grads.keys() and "experts.w_in" in sparse_grads
    for name, g in dense_grads.items():
        torch.testing.assert_close(sparse_grads[name], g, atol=1e-4, rtol=1e-4, msg=name)


def test_masked_forward_under_bf16_autocast():
    block = option_block(num_experts=8)
    x = torch.randn(13, 8, generator=gen(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = M.masked_forward(block, x, 1)  # the sparse way (1 of 8)
    torch.testing.assert_close(got.float(), block(x, top_k=1), atol=0.1, rtol=0.05)


def test_compensation_is_added_for_skipped_experts_only():
    block = option_block(shared_expert_size=0)
    x = torch.randn(9, 8, generator=gen(3))
    with torch.no_grad():
        plain = S.with_config(block, compensation=False)(x, top_k=1)
        ids = block.router_logits(x).topk(1, dim=1).indices.flatten()
        skipped = block.compensation.sum(0) - block.compensation[ids]
    torch.testing.assert_close(block(x, top_k=1), plain + skipped, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(block(x, top_k=4), S.with_config(block, compensation=False)(x, top_k=4))


def test_top_k_zero_only_with_a_shared_expert():
    block = option_block()
    x = torch.randn(5, 8, generator=gen(4))
    expected = block._shared_out(x) + block.compensation.sum(0) + block.bias
    torch.testing.assert_close(block(x, top_k=0), expected)
    with pytest.raises(ValueError):
        option_block(shared_expert_size=0)(x, top_k=0)


def test_checkpoint_round_trip_keeps_new_options(tmp_path):
    model = tiny()
    ffns, _ = find_dense_ffns(model)
    cfg = CF.CalibConfig(experts=4, top_k=2, shared_experts=1, distill_steps=3, batch_tokens=64)
    batches = T.token_batches(T.ByteTokenizer(model.config.vocab_size), ["some calibration text here"] * 40, 500)
    C.calibrate_model(model, batches, cfg, progress=False)
    moecompile.save(model, tmp_path / "ck", progress=False)
    loaded = moecompile.load(tmp_path / "ck", progress=False)
    ids = torch.randint(0, 1000, (2, 7), generator=gen(5))
    for k in (1, 2, 3):
        EV.set_top_k(model, k)
        EV.set_top_k(loaded, k)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).last_hidden_state, model(ids).last_hidden_state)
    blocks = [m for m in loaded.modules() if isinstance(m, MoEBlock)]
    assert blocks and all(b.config.shared_expert_size == 64 and b.config.compensation and b.config.router_bias
                          for b in blocks)


@pytest.mark.parametrize("name", ["tiny-bert", "tiny-gpt2"])
def test_split_exact_at_top_k_equals_experts_without_compensation(name):
    ffn, x = ffn_and_inputs(name)
    groups = P.partition_neurons(P.contribution_features(ffn, x), 4, "kmeans", 0)
    block = P.split_block(ffn, groups, None, 4, 0.0, compensation=False)
    R.fit_router_and_compensation(block, x, 2, 1e-3)
    torch.testing.assert_close(block(x, top_k=4), DN.ffn_output(ffn, x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("groups", [8, 12])  # 12: bisections into unequal halves (1/3 and 2/3)
@pytest.mark.parametrize("method", ["kmeans", "graph", "random", "weights"])
def test_partitions_are_balanced_and_deterministic(method, groups):
    ffn, x = ffn_and_inputs()
    feats = P.contribution_features(ffn, x)[:192]
    a = P.partition_neurons(feats, groups, method, seed=3)
    b = P.partition_neurons(feats, groups, method, seed=3)
    assert [len(g) for g in a] == [192 // groups] * groups
    assert torch.equal(torch.cat(a).sort().values, torch.arange(192))
    assert all(torch.equal(g, h) for g, h in zip(a, b))


def test_partition_rejects_uneven_split():
    with pytest.raises(MoECompileError):
        P.partition_neurons(torch.randn(10, 3), 4, "kmeans")


@pytest.mark.parametrize("name", ["tiny-bert", "tiny-gpt2", "tiny-llama"])
def test_collected_ffn_outputs_are_the_dense_ffn_outputs(name):
    model = tiny(name)
    ffns = find_dense_ffns(model)[0]
    texts = [f"text {i} " * (i % 7 + 1) for i in range(20)]
    batches = T.token_batches(T.ByteTokenizer(model.config.vocab_size), texts, 10**6, batch=8)
    paths = tuple(f.identity[0] if f.identity else f.owner for f in ffns)
    inputs, outputs = T.collect_ffn_inputs(model, [f.owner for f in ffns], batches, progress=False, outputs=paths)
    assert inputs[ffns[0].owner].shape[0] == sum(int(b["attention_mask"].sum()) for b in batches)
    for ffn, path in zip(ffns, paths):  # calibrate_model takes y from this pass instead of computing it again
        torch.testing.assert_close(outputs[path], DN.ffn_output(ffn, inputs[ffn.owner]), rtol=1e-5, atol=1e-5)


def test_least_squares_router_recovers_planted_relation():
    # experts whose deviation norms are an exact linear function of the input: the fit must reproduce it
    h, e, n = 6, 3, 400
    block = MoEBlock(MoEConfig(hidden_size=h, expert_size=2, num_experts=e, router_bias=True, compensation=False,
                               gate_weighting="unit", bias_out="shared"))
    x = torch.rand(n, h, generator=gen(6)) + 0.5
    with torch.no_grad():  # relu-free identity-like experts: out_e = W_out_e (W_in_e x) with positive weights
        block.experts.w_in.copy_(torch.rand(e, 2, h, generator=gen(7)))
        block.experts.w_out.zero_()
        block.experts.w_out[:, 0, 0] = 1.0  # ||out_e|| = gelu(w_in_e[0] . x): ~linear for large positive x
        block.experts.w_in[:, 0] *= 20
    R.fit_router_and_compensation(block, x, 1, ridge=1e-9, rounds=1)
    target = R.expert_outputs(block, x).norm(dim=-1)
    pred = block.router_logits(x)
    assert (pred - target).abs().max() < 1e-2 * target.abs().max()


@pytest.mark.parametrize("bf16", [False, True])
def test_distillation_reduces_ffn_error_and_is_deterministic(bf16, monkeypatch):
    monkeypatch.setattr(C, "FIT_TOKENS", 300)  # least-squares fits and error stats on every 2nd token
    ffn, x = ffn_and_inputs(n=800)
    cfg = CF.CalibConfig(experts=4, top_k=1, distill_steps=60, batch_tokens=256, lr=3e-3, bf16=bf16)
    b1, s1 = C.calibrated_block(ffn, x, cfg, seed=0, progress=False)
    b2, s2 = C.calibrated_block(ffn, x, cfg, seed=0, progress=False)
    assert s1["calib_relative_error"] < 0.9 * s1["calib_relative_error_before_distill"]
    assert s1 == s2
    for p, q in zip(b1.state_dict().values(), b2.state_dict().values()):
        assert torch.equal(p, q)


def _split_with_targets(name: str, sentences: int, tokens: int):
    """(calibration batches, the dense model's last hidden states on them, the layer-wise calibrated split)."""
    dense = tiny(name)
    texts = [f"sentence number {i} says {'abc ' * (i % 5)} and more" for i in range(sentences)]
    batches = T.token_batches(T.ByteTokenizer(dense.config.vocab_size), texts, tokens, batch=8)
    with torch.no_grad():
        targets = [T.last_hidden(dense, b) for b in batches]
    split = copy.deepcopy(dense)
    C.calibrate_model(split, batches, CF.CalibConfig(experts=4, top_k=2, shared_experts=1), progress=False)
    return batches, targets, split


@pytest.mark.parametrize("name,bf16", [("tiny-bert", False), ("tiny-gpt2", False), ("tiny-bert", True)])
def test_end_to_end_distillation_lowers_embedding_loss_and_is_deterministic(name, bf16):
    batches, targets, split = _split_with_targets(name, 48, 2000)

    def loss(model):
        with torch.no_grad():
            return sum(E2E.embedding_loss(T.last_hidden(model, b), t, b["attention_mask"].bool()).item()
                       for b, t in zip(batches, targets))

    runs = []
    for _ in range(2):
        model = copy.deepcopy(split)
        E2E.distill_end_to_end(model, batches, targets, steps=40, lr=3e-3, seed=0, progress=False, bf16=bf16)
        runs.append(model)
    assert loss(runs[0]) < 0.7 * loss(split)
    for p, q in zip(runs[0].state_dict().values(), runs[1].state_dict().values()):
        assert torch.equal(p, q)
    blocks = [m for m in runs[0].modules() if isinstance(m, MoEBlock)]
    assert blocks and all("forward" not in vars(b) for b in blocks)  # the block's own forward is back
    assert all(p.requires_grad for p in runs[0].parameters())


def test_end_to_end_judge_keeps_the_best_scoring_parameters_and_only_watches_otherwise():
    batches, targets, split = _split_with_targets("tiny-bert", 48, 2000)
    dense = tiny("tiny-bert")
    held = T.token_batches(T.ByteTokenizer(dense.config.vocab_size),
                           [f"held-out line {i}: {'xyz ' * (i % 7)} or not" for i in range(24)], 10**9, batch=8)
    runs = {}
    for select in ("select", None, "none"):
        model = copy.deepcopy(split)
        judge = E2E.Judge.of(dense, {"select": held[:2], "other": held[2:]}, every=4,
                             select=select) if select != "none" else None
        E2E.distill_end_to_end(model, batches, targets, steps=20, lr=3e-2, seed=0, progress=False, judge=judge)
        runs[select] = (model, judge)
    model, judge = runs["select"]
    assert [h["step"] for h in judge.history] == [0, 4, 8, 12, 16, 20] and "other" in judge.history[0]
    fresh = E2E.Judge.of(dense, {"select": held[:2]}, every=0).score(model, None)["select"]  # the block's forward
    assert fresh == pytest.approx(max(h["select"] for h in judge.history), abs=1e-5)
    # watching alone changes nothing: the same parameters as without a judge, its last score theirs
    watched, plain = runs[None][0], runs["none"][0]
    assert all(torch.equal(p, q) for p, q in zip(watched.state_dict().values(), plain.state_dict().values()))
    last = E2E.Judge.of(dense, {"select": held[:2]}, every=0).score(plain, None)["select"]
    assert last == pytest.approx(runs[None][1].history[-1]["select"], abs=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is missing")
def test_calibration_device_cuda_without_cuda_is_an_error():
    with pytest.raises(MoECompileError, match="CUDA"):
        CF.CalibRun(recipe=CF.CalibConfig(experts=4, top_k=2), device="cuda")


@pytest.mark.parametrize("name", ["tiny-bert", "tiny-gpt2"])
def test_end_to_end_distillation_leaves_the_frozen_first_blocks_alone(name):
    batches, targets, split = _split_with_targets(name, 24, 1000)
    before = [m for m in split.modules() if isinstance(m, MoEBlock)]
    assert len(before) == 2
    layers = E2E.frozen_layers(split, before[1], before[:1])
    assert len(layers) == 1 and any(m is before[0] for m in layers[0].modules())
    runs = []
    for cache in (True, False):  # the frozen first layer run once per batch, or every step: the same numbers
        model = copy.deepcopy(split)
        calls = []
        hook = next(m for m in model.modules() if isinstance(m, MoEBlock)).register_forward_hook(
            lambda *a: calls.append(1))
        # (10 steps: where OneCycleLR used to divide by zero)
        E2E.distill_end_to_end(model, batches, targets, steps=10, lr=3e-3, seed=0, progress=False,
                             frozen_fraction=0.5, cache_frozen=cache)
        hook.remove()
        assert (len(calls) < 10) == cache  # cached: the frozen layer ran once per batch drawn
        assert all("forward" not in vars(m) for m in model.modules())  # every forward is back
        runs.append(model)
    assert all(torch.equal(p, q) for p, q in zip(runs[0].state_dict().values(), runs[1].state_dict().values()))
    after = [m for m in runs[0].modules() if isinstance(m, MoEBlock)]
    assert all(torch.equal(p, q) for p, q in zip(before[0].parameters(), after[0].parameters()))  # frozen
    assert not all(torch.equal(p, q) for p, q in zip(before[1].parameters(), after[1].parameters()))  # trained
    with pytest.raises(MoECompileError, match="e2e_frozen_fraction"):
        CF.CalibConfig(experts=4, top_k=2, e2e_frozen_fraction=1.0)


def test_linear_shared_expert_lowers_error_at_same_cost():
    ffn, x = ffn_and_inputs(n=800)
    base = CF.CalibConfig(experts=4, top_k=2)
    _, plain = C.calibrated_block(ffn, x, base, seed=0, progress=False)
    lin = CF.CalibConfig(experts=4, top_k=2, shared_experts=1, shared_kind="linear")
    block, withlin = C.calibrated_block(ffn, x, lin, seed=0, progress=False)
    assert block.config.shared_linear and block.config.top_k == 1
    per_expert = EV.ffn_flops(block.config, 1) - EV.ffn_flops(block.config, 0)
    assert EV.ffn_flops(block.config, 0) == per_expert  # the linear map costs what one routed expert does
    assert withlin["calib_relative_error"] < plain["calib_relative_error"]


def test_default_shared_experts_is_half_of_top_k_at_most_two_routed_and_valid():
    assert [CF.default_shared_experts(k) for k in (1, 2, 3, 4, 5, 8, 16)] == [0, 1, 1, 2, 3, 6, 14]
    for k in range(1, 17):  # a valid config at every top_k
        CF.CalibConfig(experts=16, top_k=k, shared_experts=CF.default_shared_experts(k))


def test_default_calibration_steps_follow_the_device_and_flags_override_them(monkeypatch):
    from moecompile.cli import _convert_options, _parser
    from moecompile.conversion.api import calib_run
    from moecompile.ir import knobs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # CalibRun checks the device exists
    base = ["convert", "tiny-bert", "--experts", "4", "--method", "split", "--calib"]
    for extra, want in [([], knobs.CALIB_STEPS["cpu"]), (["--device", "cuda:1"], knobs.CALIB_STEPS["cuda"]),
                        (["--distill-steps", "7", "--device", "cuda"], (7, knobs.CALIB_STEPS["cuda"][1]))]:
        a = _parser().parse_args(base + extra)
        recipe = calib_run(a.model, _convert_options(a)).recipe
        assert (recipe.distill_steps, recipe.e2e_steps) == want, extra
    assert knobs.CALIB_STEPS["cpu"] < knobs.CALIB_STEPS["cuda"]  # the CPU's budget is the tighter one


def test_stdlib_calibration_text_draws_on_every_kind_equally():
    from moecompile.calibration import data as calib_data
    from moecompile.calibration.run import calibration_texts

    texts = calibration_texts("stdlib")
    assert len(texts) > 10000 and all(6 <= len(t.split()) <= 40 for t in texts)  # single sentences
    kinds = {k: set(calib_data.sentences(calib_data.corpus("calib", k))) for k in calib_data.STDLIB_KINDS}
    assert set(texts) <= set.union(*kinds.values())
    head = texts[:900]  # any prefix (what a token budget takes) holds every kind about equally
    for sents in kinds.values():
        assert 250 <= sum(t in sents for t in head) <= 350
    assert calibration_texts("stdlib") == texts and calibration_texts("stdlib", seed=1) != texts


def test_mixed_calibration_text_interleaves_the_stdlib_mix_and_the_packaged_text():
    from moecompile.calibration import data as calib_data
    from moecompile.calibration.run import calibration_texts

    stdlib, other = calibration_texts("stdlib"), calib_data.other_sentences()
    texts = calibration_texts("mixed")
    assert len(other) > 5000 and sorted(texts) == sorted(stdlib + list(other))
    head = texts[:1000]  # any prefix (what a token budget takes) draws on both halves equally
    assert sum(t in set(other) for t in head) == 500
    assert calibration_texts("mixed") == texts and calibration_texts("mixed", seed=1) != texts


def test_packaged_text_shares_nothing_with_evaluation_text_and_carries_its_licences(tmp_path, monkeypatch):
    from moecompile.calibration import data as calib_data
    from moecompile.calibration import other_text

    other = set(calib_data.other_sentences())
    assert all(8 <= len(s.split()) <= 40 for s in other)
    pools = calib_data.dependency_sentences(512)
    evaluation = {s for pool in pools.values() for s in pool}
    assert len(evaluation) > 2000 and not other & evaluation
    licences = set(calib_data.distribution_sentences(calib_data._dependencies(), readmes=False))
    assert licences and licences < set(pools["readmes"])  # (the READMEs' and licences' sentences)
    assert not set(calib_data._dependencies()) & set(other_text.DOCSTRINGS.values())
    headers = [line for line in other_text.LICENCES.read_text(encoding="utf-8").splitlines()
               if line.startswith("==== ")]
    for name in other_text.DOCSTRINGS.values():
        assert any(f" {name} " in h or h.startswith(f"==== {name} ") for h in headers), name
    broken = tmp_path / "other_text.txt.gz"
    broken.write_bytes(b"not gzip")
    monkeypatch.setattr(calib_data, "OTHER_TEXT", broken)
    calib_data.other_sentences.cache_clear()
    try:
        with pytest.raises(MoECompileError, match="packaged calibration text"):
            calib_data.other_sentences()
    finally:
        calib_data.other_sentences.cache_clear()


def test_calib_file_comes_first_and_the_mixed_text_fills_the_budget(tmp_path):
    from moecompile.calibration.run import calibration_texts

    own = [f"My own paragraph number {i} about routing tokens to experts." for i in range(20)]
    path = tmp_path / "calib.txt"
    path.write_text("\n\n".join(own) + "\n")
    texts = calibration_texts(str(path))
    assert sorted(texts[:20]) == sorted(own) and texts[20:] == calibration_texts("mixed")
    tok = T.ByteTokenizer(1000)  # ids are the UTF-8 bytes (the first 128): batches decode back to their texts

    def decoded(budget):
        return {bytes(row[m.bool()].tolist()).decode("utf-8", "ignore")
                for b in T.token_batches(tok, texts, budget, shuffle=False)
                for row, m in zip(b["input_ids"], b["attention_mask"])}
    size = sum(len(t.encode()) for t in own)
    assert decoded(size // 2) < set(own)  # a small budget: the file alone
    big = decoded(3 * size)
    mix = {t.encode()[:128].decode("utf-8", "ignore") for t in calibration_texts("mixed")}
    assert set(own) < big and big - set(own) <= mix  # more: the mix joins


def test_vocabulary_substitution_replaces_content_words_at_the_rate():
    from moecompile.calibration import data as calib_data

    texts = calib_data.stdlib_mix("calib")[:400]
    words = ["zebra", "quartz", "violin"]
    out = calib_data.substituted(texts, words, 0.3, seed=3)
    assert out == calib_data.substituted(texts, words, 0.3, seed=3)
    pairs = [(a, b) for t, u in zip(texts, out) for a, b in zip(t.split(), u.split(), strict=True)]
    eligible = [(a, b) for a, b in pairs if len(a) >= 4 and a.isalpha()]
    changed = [b for a, b in eligible if a != b]
    assert 0.25 < len(changed) / len(eligible) < 0.35 and set(changed) <= set(words)
    assert all(a == b for a, b in pairs if not (len(a) >= 4 and a.isalpha()))
    mix = calib_data.stdlib_mix("calib", words=words, rate=0.3)
    assert 0.2 < sum(t not in set(texts) and any(w in t.split() for w in words) for t in mix[:400]) / 400 < 0.3


@pytest.mark.parametrize("kw", [dict(shared_experts=4), dict(top_k=5), dict(partition="spectral"),
                                dict(distill_top_k=(0,)), dict(shared_kind="mlp"), dict(e2e_steps=-1)])
def test_calib_config_validation(kw):
    with pytest.raises(MoECompileError):
        CF.CalibConfig(**{"experts": 4, "top_k": 2, **kw})


@pytest.mark.parametrize("name,metric,calib", [("tiny-bert", "mean_cosine", []),
                                               ("tiny-gpt2", "perplexity", ["stdlib"])])
def test_cli_calibrated_split_writes_report(tmp_path, capsys, name, metric, calib):
    out = tmp_path / "out"
    rc = main(["convert", name, "--random-init", "--experts", "4", "--top-k", "2", "--method", "split",
               "--calib", *calib, "--calib-tokens", "600", "--shared-experts", "1", "--distill-steps", "2",
               "--router-steps", "2", "--e2e-steps", "2", "--eval-sentences", "32", "--capacity-factor", "0",
               "--device", "cpu",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.png").stat().st_size > 0
    assert report["calibration"]["tokens"] >= 600
    assert report["calibration"]["source"] == (calib[0] if calib else "mixed")  # a bare --calib: the mixed text
    assert report["config"]["router_steps"] == 2 and report["config"]["distill_steps"] == 2
    assert report["config"]["e2e_steps"] == 2
    assert [r["top_k"] for r in report["curve"]] == [1, 2, 3, 4]
    assert [r["ffn_flop_fraction"] for r in report["curve"]] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert {"stdlib", "torch", "transformers", "readmes"} <= set(report["eval_sources"]) and report["in_domain"]
    assert all(set(r["sources"]) == set(report["eval_sources"]) for r in report["curve"])
    assert all(metric in q for r in report["curve"] for q in r["sources"].values())
    assert [h["step"] for h in report["e2e_history"]] == [0, 2] and report["calibration"]["device"] == "cpu"
    assert len(report["layers"]) == 2
    for layer in report["layers"]:
        assert layer["flop_fraction"] == pytest.approx(0.5)
        assert len(layer["load"]) == 3 and sum(layer["load"]) == pytest.approx(1.0)
        assert layer["calib_relative_error"] >= 0
    printed = capsys.readouterr().out
    assert "ffn_flop_fraction" in printed and all(name in printed for name in report["eval_sources"])
    assert moecompile.load(out, progress=False) is not None


def test_cli_calib_file_and_errors(tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text("A first paragraph of text.\n\nA second paragraph with more words in it.\n")
    out = tmp_path / "out"
    assert main(["convert", "tiny-bert", "--random-init", "--experts", "4", "--top-k", "2", "--method", "split",
                 "--calib", str(text), "--calib-tokens", "50", "--distill-steps", "2", "--e2e-steps", "2",
                 "--eval-sentences", "0", "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["curve"] == [] and report["config"]["shared_experts"] == 1  # the default at top_k 2
    assert main(["convert", "tiny-bert", "--random-init", "--experts", "4", "--method", "upcycle",
                 "--calib", "stdlib", "--out", str(tmp_path / "x")]) == 2
    assert main(["convert", "tiny-bert", "--random-init", "--experts", "4", "--method", "split",
                 "--calib", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "y")]) == 2
    assert "moecompile: error:" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_stdlib_corpus_splits_are_disjoint_and_deterministic():
    from moecompile.calibration import data as calib_data

    for kind in calib_data.STDLIB_KINDS:
        calib, select, held = (calib_data.corpus(s, kind) for s in calib_data.SPLITS)
        assert len(calib) > 1000 and select and held
        assert not set(calib) & set(held) and not set(calib) & set(select) and not set(select) & set(held)
        assert calib == calib_data.corpus("calib", kind)
    assert all(6 <= len(s.split()) <= 40 for s in calib_data.sentences(calib_data.corpus("heldout")))
    with pytest.raises(MoECompileError):
        calib_data.corpus("calib", "novels")


def test_eval_sources_share_nothing_with_calibration_text():
    from moecompile.calibration import data as calib_data

    sources = calib_data.eval_sources(48, seed=1)
    assert sources == calib_data.eval_sources(48, seed=1)
    assert "stdlib" in sources and {"torch", "transformers", "readmes"} <= set(sources)
    calib = {s for split in ("calib", "select") for k in calib_data.STDLIB_KINDS
             for s in calib_data.sentences(calib_data.corpus(split, k), 1, 10**9)} | set(calib_data.other_sentences())
    for name, texts in sources.items():
        assert len(texts) == 48 and len(set(texts)) == 48, name
        assert all(8 <= len(t.split()) <= 40 for t in texts) and not set(texts) & calib, name
    # out of domain really is another package's text: none of it appears in the standard library's sources
    stdlib = "\n".join(p for s in calib_data.SPLITS for k in calib_data.STDLIB_KINDS for p in calib_data.corpus(s, k))
    assert not [t for n in ("torch", "transformers") for t in sources[n] if t in stdlib]


def test_stdlib_comments_and_docstrings_as_tokenize_and_ast_walk_find_them():
    """The corpus' comment lexer and docstring walk against the standard library's own tokenize and ast.walk, on
    source where a '#' sits inside every kind of string literal and definitions nest in statements."""
    import ast
    import io
    import tokenize

    from moecompile.calibration import data as calib_data

    source = '''"""Module docstring that says enough words to count as prose here."""
import os  # the operating system module gives access to many useful things
x = "a # that is inside a double-quoted string and starts no comment at all"
y = 'an escaped quote \\' then # still inside the string literal itself'
z = r"raw \\" quote # inside" + f"{x!r} # in an f-string"
s = """a triple-quoted string
# whose second line looks like a comment but is not one of them
"""
# A real comment that spans two consecutive lines of this file,
# joined by the lexer into one paragraph of readable prose text.

# Another run of comment lines that stands apart from the first one.
if True:
    class Inner:
        """A class docstring nested in an if block, found by the walk."""
        def method(self):
            """A method docstring two levels down, also found by it."""
            return "# not a comment"  # but this trailing one is a comment here
try:
    pass
except ValueError:
    def handler():
        """A function defined in an except clause, with its own docstring."""
'''
    comments = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT]
    assert len(comments) == 5  # the source holds what the test means it to
    runs, run, last = [], [], -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            if tok.start[0] != last + 1 and run:
                runs.append(" ".join(run))
                run = []
            run.append(tok.string.lstrip("#!").strip())
            last = tok.start[0]
    runs.append(" ".join(run))
    assert calib_data._comments(source) == [r for r in runs if calib_data._is_prose(r)]
    assert len(calib_data._comments(source)) == 4
    walked = [ast.get_docstring(n, clean=True) for n in ast.walk(ast.parse(source))
              if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    assert calib_data._docstrings(source) == [d for d in walked if d] and len(walked) == 4
