"""Streaming upcycle into native HF MoE architectures (moecompile.conversion.native).

The converted folders are loaded by plain transformers in a fresh subprocess that never imports moecompile: the
output must stand on its own, with no missing or unexpected keys, and compute the dense model's logits.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moecompile.conversion import native
from moecompile.conversion.native import native_support, native_target, parse_size, upcycle_native
from moecompile.core.errors import MoECompileError

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
            intermediate_size=48, max_position_embeddings=64, initializer_range=0.2)  # large init: logits ~1
SOURCES = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "mistral": lambda: transformers.MistralConfig(sliding_window=4, **TINY),  # window shorter than the probe
    "qwen3": lambda: transformers.Qwen3Config(head_dim=8, tie_word_embeddings=True, **TINY),  # head_dim != 32/2
    # q/k/v biases; layer 0 full attention, layer 1 a window shorter than the probe
    "qwen2": lambda: transformers.Qwen2Config(tie_word_embeddings=True, use_sliding_window=True, sliding_window=4,
                                              max_window_layers=1, **TINY),
}

# run by a fresh interpreter: plain transformers, no moecompile
CHECK = r"""
import json, sys, torch, transformers
pairs = json.loads(sys.argv[1])
torch.manual_seed(0)
ids = torch.randint(0, 128, (2, 11))
results = {}
for src, out in pairs:
    dense = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    moe, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    with torch.no_grad():
        want, got = dense(ids).logits, moe.eval()(ids).logits
    results[out] = {"class": type(moe).__name__, "dtype": str(moe.dtype),
                    "problems": {k: [str(x) for x in v] for k, v in info.items() if v},
                    "max_diff": (got.float() - want.float()).abs().max().item(), "logit_std": want.std().item()}
results["moecompile_imported"] = any(m.split(".")[0] == "moecompile" for m in sys.modules)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense")
    out = {}
    for name, make in SOURCES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(make())
        with torch.no_grad():  # HF initialises biases to zero: random ones show a bias lost on the way
            for p_name, p in model.named_parameters():
                if p_name.endswith(".bias"):
                    p.normal_(0, 0.5)
        model.save_pretrained(root / name)
        (root / name / "tokenizer_config.json").write_text("{}")  # copied along
        out[name] = root / name
    # a config.json as transformers 4 wrote it (rope_theta, rope_scaling, torch_dtype), and a stored rotary buffer
    legacy = {"rope_theta": 500000.0, "torch_dtype": "float32", "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}
    out["llama-v4"] = _copy(out["llama"], root / "llama-v4", lambda c: {
        **{k: v for k, v in c.items() if k not in ("rope_parameters", "dtype")}, **legacy},
        add={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    return out


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> dict[str, tuple[Path, Path, native.NativeResult]]:
    """name -> (source, output, result) for every conversion the load check covers."""
    root = tmp_path_factory.mktemp("moe")
    runs = {name: (name, {}) for name in SOURCES}
    runs["llama-sharded"] = ("llama", {"max_shard_size": "40KB"})
    runs["qwen3-layer1"] = ("qwen3", {"layers": "1"})
    runs["mistral-bf16"] = ("mistral", {"dtype": "bf16"})
    runs["llama-v4"] = ("llama-v4", {})
    runs["qwen2-layer0"] = ("qwen2", {"layers": "0"})
    done = {}
    for name, (src, kw) in runs.items():
        result = upcycle_native(sources[src], root / name, experts=4, top_k=2, seed=1, progress=False, **kw)
        done[name] = (sources[src], root / name, result)
    return done


@pytest.fixture(scope="module")
def loaded(converted) -> dict:
    pairs = [[str(src), str(out)] for src, out, _ in converted.values()]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", CHECK, json.dumps(pairs)], capture_output=True, text=True,
                          env=env, cwd="/", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fresh_transformers_never_imports_moecompile(loaded):
    assert loaded["moecompile_imported"] is False


@pytest.mark.parametrize("name, cls", [("llama", "MixtralForCausalLM"), ("mistral", "MixtralForCausalLM"),
                                       ("qwen3", "Qwen3MoeForCausalLM"), ("llama-sharded", "MixtralForCausalLM"),
                                       ("qwen3-layer1", "Qwen3MoeForCausalLM"),
                                       ("llama-v4", "MixtralForCausalLM"), ("qwen2", "Qwen2MoeForCausalLM"),
                                       ("qwen2-layer0", "Qwen2MoeForCausalLM")])
def test_native_model_loads_and_equals_dense(converted, loaded, name, cls):
    r = loaded[str(converted[name][1])]
    assert r["class"] == cls
    assert r["problems"] == {}  # no missing, unexpected or mismatched keys
    assert r["logit_std"] > 0.1  # a real comparison, not of near-zero logits
    assert r["max_diff"] < 1e-5


def test_dtype_converted_while_streaming(converted, loaded):
    _, out, _ = converted["mistral-bf16"]
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    r = loaded[str(out)]
    assert r["problems"] == {} and r["dtype"] == "torch.bfloat16"
    assert r["max_diff"] < 0.1 * r["logit_std"]  # bf16 rounding only


def test_native_configs(converted):
    mixtral = json.loads((converted["mistral"][1] / "config.json").read_text())
    assert mixtral["architectures"] == ["MixtralForCausalLM"] and mixtral["model_type"] == "mixtral"
    assert (mixtral["num_local_experts"], mixtral["num_experts_per_tok"]) == (4, 2)
    assert mixtral["sliding_window"] == 4 and mixtral["router_jitter_noise"] == 0.0
    assert mixtral["output_router_logits"] is False and mixtral["intermediate_size"] == 48
    assert mixtral["initializer_range"] == 0.2 and mixtral["dtype"] == "float32"
    qwen = json.loads((converted["qwen3-layer1"][1] / "config.json").read_text())
    assert qwen["architectures"] == ["Qwen3MoeForCausalLM"] and qwen["head_dim"] == 8
    assert qwen["num_experts"] == 4 and qwen["moe_intermediate_size"] == 48 and qwen["norm_topk_prob"] is True
    assert qwen["mlp_only_layers"] == [0] and qwen["decoder_sparse_step"] == 1 and qwen["tie_word_embeddings"]
    legacy = json.loads((converted["llama-v4"][1] / "config.json").read_text())
    assert legacy["rope_parameters"]["rope_theta"] == 500000.0 and legacy["rope_parameters"]["rope_type"] == "llama3"
    assert legacy["dtype"] == "float32" and "rope_theta" not in legacy
    assert not any("inv_freq" in k for k in load_file(converted["llama-v4"][1] / "model.safetensors"))
    assert (converted["qwen3"][1] / "tokenizer_config.json").is_file()
    assert (converted["qwen3"][1] / "generation_config.json").is_file()


def test_published_tensor_layout(converted):
    """The names HF publishes and save_pretrained writes; a tied lm_head is not stored."""
    mixtral = load_file(converted["llama"][1] / "model.safetensors")
    dense = load_file(converted["llama"][0] / "model.safetensors")
    for e in range(4):
        for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            assert torch.equal(mixtral[f"model.layers.1.block_sparse_moe.experts.{e}.{mine}.weight"],
                               dense[f"model.layers.1.mlp.{theirs}.weight"])
    router = mixtral["model.layers.0.block_sparse_moe.gate.weight"]
    assert router.shape == (4, 32) and 0.01 < router.std() < 0.03
    assert not any(".mlp." in k for k in mixtral)
    qwen = load_file(converted["qwen3-layer1"][1] / "model.safetensors")
    assert "lm_head.weight" not in qwen and "model.layers.0.mlp.gate_proj.weight" in qwen
    assert qwen["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (32, 48)


def test_sharded_output_has_an_index(converted):
    src, out, result = converted["llama-sharded"]
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) == result.shards > 2 and not (out / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards
    assert all(p.stat().st_size <= 40_000 + 4096 for p in out.glob("*.safetensors"))  # + header
    whole = {k: v for s in shards for k, v in load_file(out / s).items()}
    assert set(whole) == set(index["weight_map"]) and index["metadata"]["total_size"] == result.output_bytes
    single = load_file(converted["llama"][1] / "model.safetensors")
    assert set(single) == set(whole)
    assert [k for k in single if not torch.equal(single[k], whole[k])] == []  # routers too: same seed


def test_same_seed_gives_identical_bytes(sources, converted, tmp_path):
    again = upcycle_native(sources["llama"], tmp_path / "again", experts=4, top_k=2, seed=1, progress=False)
    first = converted["llama"][1]
    assert (first / "model.safetensors").read_bytes() == (again.out / "model.safetensors").read_bytes()
    other = upcycle_native(sources["llama"], tmp_path / "other", experts=4, top_k=2, seed=2, progress=False)
    a, b = load_file(first / "model.safetensors"), load_file(other.out / "model.safetensors")
    assert not torch.equal(a["model.layers.0.block_sparse_moe.gate.weight"],
                           b["model.layers.0.block_sparse_moe.gate.weight"])
    assert torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_noise_makes_experts_differ_reproducibly(sources, tmp_path):
    runs = [upcycle_native(sources["llama"], tmp_path / f"n{i}", experts=3, noise=0.01, seed=4, progress=False)
            for i in range(2)]
    a, b = (load_file(r.out / "model.safetensors") for r in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    dense = load_file(sources["llama"] / "model.safetensors")["model.layers.1.mlp.up_proj.weight"]
    copies = [a[f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight"] for e in range(3)]
    assert not torch.equal(copies[0], copies[1])
    for c in copies:
        assert 0.005 < ((c - dense).std() / dense.std()).item() < 0.02


def test_parameter_counts(converted):
    r = converted["llama"][2]
    ffn = 3 * 32 * 48
    assert r.output_params == r.source_params + 2 * (3 * ffn + 4 * 32)  # per layer: 3 more experts and a router
    assert r.output_bytes == 4 * r.output_params and r.target == "MixtralForCausalLM" and r.moe_layers == [0, 1]


def _copy(src: Path, dst: Path, config_edit=None, drop: str | None = None, add: dict | None = None) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config_edit(config) if config_edit else config))
    tensors = load_file(src / "model.safetensors")
    tensors.pop(drop, None)
    tensors.update(add or {})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _nothing_left(parent: Path, before: set[str]) -> bool:
    return {p.name for p in parent.iterdir()} == before


@pytest.mark.parametrize("layers, message", [(3, "num_hidden_layers=3 but the weights hold layers 0-1"),
                                             (1, "num_hidden_layers=1 but the weights hold layers 0-1")])
def test_layer_count_mismatch(sources, tmp_path, layers, message):
    src = _copy(sources["llama"], tmp_path / "src", lambda c: {**c, "num_hidden_layers": layers})
    (tmp_path / "outs").mkdir()
    with pytest.raises(MoECompileError, match=message):
        upcycle_native(src, tmp_path / "outs" / "moe", experts=4, progress=False)
    assert _nothing_left(tmp_path / "outs", set())


def test_missing_tensor(sources, tmp_path):
    src = _copy(sources["qwen3"], tmp_path / "src", drop="model.layers.1.self_attn.k_norm.weight")
    with pytest.raises(MoECompileError, match="1 tensors missing.*layers.1.self_attn.k_norm"):
        upcycle_native(src, tmp_path / "moe", experts=4, progress=False)


def test_unexpected_tensor_and_bad_shape(sources, tmp_path):
    src = _copy(sources["llama"], tmp_path / "src", lambda c: {**c, "intermediate_size": 40})
    with pytest.raises(MoECompileError, match="has shape .*config.json implies"):
        upcycle_native(src, tmp_path / "moe", experts=4, progress=False)


def test_unsupported_architecture(tmp_path):
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128)
    config.architectures = ["GPT2LMHeadModel"]
    target, reason = native_support(config)
    assert target is None and "GPT2LMHeadModel" in reason and "LlamaForCausalLM -> MixtralForCausalLM" in reason
    assert native_target(config) is None
    config.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(MoECompileError, match="no native MoE architecture for GPT2LMHeadModel"):
        upcycle_native(tmp_path / "gpt2", tmp_path / "moe", experts=4, progress=False)
    assert _nothing_left(tmp_path, {"gpt2"})


def test_native_target(sources):
    assert native_target(sources["llama"]) == "MixtralForCausalLM"
    assert native_target(transformers.MistralConfig(architectures=["MistralForCausalLM"])) == "MixtralForCausalLM"
    assert native_target(sources["qwen3"], layers="even") == "Qwen3MoeForCausalLM"  # mlp_only_layers
    assert native_target(transformers.Qwen3Config()) == "Qwen3MoeForCausalLM"  # no architectures: its model_type
    target, reason = native_support(sources["llama"], layers="0")
    assert target is None and "all 2 FFNs" in reason and "--format" not in reason  # auto falls back: no advice
    biased = transformers.LlamaConfig(architectures=["LlamaForCausalLM"], attention_bias=True)
    assert native_target(biased) is None and "bias" in native_support(biased)[1]


def test_llama_needs_all_layers(sources, tmp_path):
    with pytest.raises(MoECompileError, match="MixtralForCausalLM has no dense layers.*--format moecompile"):
        upcycle_native(sources["llama"], tmp_path / "moe", experts=4, layers="0", progress=False)


@pytest.mark.parametrize("experts, top_k, message", [(0, 1, "experts must be"), (4, 5, "top_k must be"),
                                                      (4, 0, "top_k must be"), (2.5, 1, "experts must be")])
def test_bad_experts_or_top_k(sources, tmp_path, experts, top_k, message):
    with pytest.raises(MoECompileError, match=message):
        upcycle_native(sources["llama"], tmp_path / "moe", experts=experts, top_k=top_k, progress=False)
    assert _nothing_left(tmp_path, set())


def test_failure_while_writing_leaves_nothing(sources, tmp_path, monkeypatch):
    calls = []

    def failing(self, t):
        calls.append(t.name)
        if len(calls) > 5:
            raise MoECompileError("disk full")
        return real(self, t)

    real = native._Reader.__call__
    monkeypatch.setattr(native._Reader, "__call__", failing)
    (tmp_path / "outs").mkdir()
    with pytest.raises(MoECompileError, match="disk full"):
        upcycle_native(sources["llama"], tmp_path / "outs" / "moe", experts=4, max_shard_size="10KB",
                       progress=False)
    assert _nothing_left(tmp_path / "outs", set())


def test_existing_output_refused(sources, tmp_path):
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "x").write_text("keep")
    with pytest.raises(MoECompileError, match="not empty"):
        upcycle_native(sources["llama"], tmp_path / "moe", experts=4, progress=False)
    assert (tmp_path / "moe" / "x").read_text() == "keep"


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("10kb") == 10_000 and parse_size(1234) == 1234
    for bad in ("5 parsecs", "0", "-1GB", ""):
        with pytest.raises(MoECompileError):
            parse_size(bad)


def test_cli_writes_the_native_format_by_default(sources, tmp_path, capsys):
    import moecompile
    from moecompile import cli

    out = tmp_path / "moe"
    assert cli.main(["convert", str(sources["llama"]), "--experts", "4", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "-> MixtralForCausalLM" in text and "run it dropless: exactly the dense model at init" in text
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and "moe" not in config
    assert config["moecompile"] == {"method": "upcycle", "source": str(sources["llama"])}  # no capacity asked for
    assert (out / "README.md").read_text().startswith("# MixtralForCausalLM upcycled from")
    model = moecompile.load(out)  # transformers' own class, the dense model's logits
    dense = transformers.AutoModelForCausalLM.from_pretrained(sources["llama"]).eval()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    assert type(model).__name__ == "MixtralForCausalLM" and not model.training
    with torch.no_grad():
        assert (model(ids).logits - dense(ids).logits).abs().max() < 1e-5


def test_compile_applies_the_recorded_capacity_factor(sources, tmp_path, monkeypatch):
    import moecompile

    upcycle_native(sources["qwen3"], tmp_path / "moe", experts=4, top_k=2, progress=False,
                   record={"capacity_factor": 1.25})
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.update(kw))
    moecompile.compile(moecompile.load(tmp_path / "moe"))
    assert seen["options"] == {"capacity_factor": 1.25}


def test_cli_format_choices(sources, tmp_path, capsys):
    from moecompile import cli

    kept = tmp_path / "kept"
    args = ["convert", str(sources["llama"]), "--experts", "4", "--no-progress", "--capacity-factor", "0"]
    assert cli.main([*args, "--format", "moecompile", "--out", str(kept)]) == 0
    assert "moe" in json.loads((kept / "config.json").read_text())
    assert cli.main([*args, "--layers", "0", "--out", str(tmp_path / "partial")]) == 0  # Mixtral: all layers or none
    assert "in moecompile's format (" in capsys.readouterr().out
    bad = tmp_path / "gpt2"
    assert cli.main(["convert", "tiny-gpt2", "--random-init", "--experts", "4", "--format", "hf", "--out", str(bad),
                     "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moecompile: error: format hf: ") and "\n" not in err
    assert not bad.exists()


@pytest.mark.parametrize("noise", [0.0, 0.01])
def test_streaming_equals_in_memory_upcycle(sources, tmp_path, noise):
    """The streaming native path writes bit for bit the tensors that moeize builds in memory from the same model and
    seed: expert copies (and their noise), routers, everything else."""
    from moecompile.conversion.in_memory import moeize

    src = sources["llama"]
    upcycle_native(src, tmp_path / "moe", experts=4, top_k=2, seed=3, noise=noise, progress=False)
    streamed = load_file(tmp_path / "moe" / "model.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    moeize(model, experts=4, top_k=2, capacity_factor=0, seed=3, noise=noise, progress=False)
    state = model.state_dict()
    expected = {}
    for layer in range(2):
        mine, ours = f"model.layers.{layer}.block_sparse_moe", f"model.layers.{layer}.mlp"
        w_in, w_out = state[f"{ours}.experts.w_in"], state[f"{ours}.experts.w_out"]
        expected[f"{mine}.gate.weight"] = state[f"{ours}.router.weight"]
        for e in range(4):
            gate, up = w_in[e].chunk(2)
            expected.update({f"{mine}.experts.{e}.w1.weight": gate, f"{mine}.experts.{e}.w3.weight": up,
                             f"{mine}.experts.{e}.w2.weight": w_out[e]})
    expected.update({k: v for k, v in state.items() if ".mlp." not in k})
    assert set(streamed) == set(expected)
    assert [k for k in streamed if not torch.equal(streamed[k], expected[k])] == []
    if noise:  # the noise is there, and the same in both
        assert not torch.equal(streamed["model.layers.0.block_sparse_moe.experts.0.w1.weight"],
                               streamed["model.layers.0.block_sparse_moe.experts.1.w1.weight"])
    native_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = native_model(ids).logits, model(ids).logits
    assert want.std() > 0.1 and (got - want).abs().max() < 1e-5  # other kernels, same function


def test_qwen2_moe_config_and_empty_shared_expert(sources, converted):
    src, out, _ = converted["qwen2-layer0"]
    config = json.loads((out / "config.json").read_text())
    dense = json.loads((src / "config.json").read_text())
    assert config["architectures"] == ["Qwen2MoeForCausalLM"] and config["model_type"] == "qwen2_moe"
    assert config["shared_expert_intermediate_size"] == 0 and config["norm_topk_prob"] is True
    assert config["mlp_only_layers"] == [1] and config["moe_intermediate_size"] == 48 and config["qkv_bias"]
    assert config["layer_types"] == dense["layer_types"] == ["full_attention", "sliding_attention"]
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.0.mlp.shared_expert.gate_proj.weight"].shape == (0, 32)
    assert tensors["model.layers.0.mlp.shared_expert.down_proj.weight"].shape == (32, 0)
    assert not tensors["model.layers.0.mlp.shared_expert_gate.weight"].any()
    assert "model.layers.1.mlp.gate_proj.weight" in tensors and "README.md" in {p.name for p in out.iterdir()}
    assert "shared expert is empty" in (out / "README.md").read_text()


def test_moecompile_load_reads_qwen2_moe(converted):
    import moecompile

    src, out, _ = converted["qwen2"]
    model = moecompile.load(out)
    dense = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = dense(ids).logits
        assert type(model).__name__ == "Qwen2MoeForCausalLM" and want.std() > 0.1
        assert (model(ids).logits - want).abs().max() < 1e-5


@pytest.fixture(scope="module")
def native_fp8(sources, converted, tmp_path_factory) -> Path:
    """The tiny LLaMA upcycled straight into FP8 experts (the same seed as converted["llama"])."""
    out = tmp_path_factory.mktemp("fp8") / "llama-fp8"
    upcycle_native(sources["llama"], out, experts=4, top_k=2, seed=1, fp8=True, progress=False)
    return out


def test_native_fp8_layout(converted, native_fp8):
    """transformers' FineGrainedFP8 layout: each expert weight float8_e4m3fn with a float32 weight_scale_inv per
    128 x 128 block, everything else as the unquantised conversion wrote it, and the quantization_config."""
    from moecompile.core.fp8_format import dequantize_blocks, quantize_blocks

    config = json.loads((native_fp8 / "config.json").read_text())
    q = config.pop("quantization_config")
    plain = json.loads((converted["llama"][1] / "config.json").read_text())
    assert config == plain
    parsed = transformers.FineGrainedFP8Config.from_dict(q)
    assert q["quant_method"] == "fp8" and list(parsed.weight_block_size) == [128, 128]
    assert {"lm_head", "model.layers.0.self_attn.q_proj"} <= set(parsed.modules_to_not_convert)
    assert not any(".experts" in m for m in parsed.modules_to_not_convert)
    got, want = load_file(native_fp8 / "model.safetensors"), load_file(converted["llama"][1] / "model.safetensors")
    experts = [k for k in want if ".experts." in k]
    assert len(experts) == 2 * 4 * 3 and set(got) == set(want) | {f"{k}_scale_inv" for k in experts}
    for k, w in want.items():
        if k not in experts:
            assert torch.equal(got[k], w), k
            continue
        qw, s = got[k], got[f"{k}_scale_inv"]
        assert qw.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (1, 1)  # one partial block
        ref_q, ref_s = quantize_blocks(w)
        assert torch.equal(qw.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
        assert (dequantize_blocks(qw, s) - w).abs().max() <= w.abs().max() / 16  # e4m3: 3 mantissa bits


def test_native_fp8_loads_in_transformers_on_cpu(sources, native_fp8):
    """Without a GPU transformers dequantises FineGrainedFP8 on load: every key maps, the experts come back as the
    FP8 blocks times their scales, and the model stays close to the dense one."""
    from moecompile.core.fp8_format import dequantize_blocks

    model, info = transformers.AutoModelForCausalLM.from_pretrained(native_fp8, output_loading_info=True)
    assert not any(info.values()) and type(model).__name__ == "MixtralForCausalLM"
    stored = load_file(native_fp8 / "model.safetensors")
    gate = dequantize_blocks(stored["model.layers.1.block_sparse_moe.experts.2.w1.weight"],
                             stored["model.layers.1.block_sparse_moe.experts.2.w1.weight_scale_inv"])
    assert torch.equal(model.model.layers[1].mlp.experts.gate_up_proj[2, :48], gate)
    dense = transformers.AutoModelForCausalLM.from_pretrained(sources["llama"]).eval()
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, want = model.eval()(ids).logits, dense(ids).logits
    # one 128 x 128 scale per tiny 48 x 32 weight and init range 0.2: coarser than any real model's FP8
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99


def test_native_fp8_maps_onto_transformers_fp8_experts(native_fp8, monkeypatch):
    """transformers' GPU path (FP8Experts holding gate_up_proj and its scale_inv), taken on the CPU by reporting a
    Hopper GPU to its environment check: every tensor maps, bit for bit. Its FP8 matmul needs the GPU
    (tests/test_gpu_native_fp8.py)."""
    from transformers.integrations.finegrained_fp8 import FP8Experts
    from transformers.utils.import_utils import is_torch_cuda_available

    is_torch_cuda_available.cache_clear()  # cached by transformers: must not outlive the patch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(native_fp8, output_loading_info=True)
    finally:
        is_torch_cuda_available.cache_clear()
    assert not any(info.values())
    stored = load_file(native_fp8 / "model.safetensors")
    ex = model.model.layers[0].mlp.experts
    assert isinstance(ex, FP8Experts) and ex.gate_up_proj.dtype == torch.float8_e4m3fn
    w3 = stored["model.layers.0.block_sparse_moe.experts.3.w3.weight"]
    assert torch.equal(ex.gate_up_proj.data[3, 48:].view(torch.uint8), w3.view(torch.uint8))
    assert torch.equal(ex.down_proj_scale_inv.data[1],
                       stored["model.layers.0.block_sparse_moe.experts.1.w2.weight_scale_inv"])


def test_cli_convert_fp8_writes_the_native_fp8_layout(sources, native_fp8, tmp_path, capsys):
    from moecompile import cli

    out = tmp_path / "moe"
    assert cli.main(["convert", str(sources["llama"]), "--experts", "4", "--seed", "1", "--fp8", "--out", str(out),
                     "--no-progress"]) == 0
    assert "-> MixtralForCausalLM" in capsys.readouterr().out
    assert (out / "model.safetensors").read_bytes() == (native_fp8 / "model.safetensors").read_bytes()
    assert "FP8" in (out / "README.md").read_text()


# ------------------------------------------------------------------------------------ streaming split (moecompile)

def _mlp_biased(sources, tmp_path) -> Path:
    """The tiny LLaMA with mlp_bias=True and random FFN biases: the split's per-expert input bias and shared bias."""
    g = torch.Generator().manual_seed(7)
    biases = {f"model.layers.{i}.mlp.{p}.bias": torch.randn(32 if p == "down_proj" else 48, generator=g)
              for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
    return _copy(sources["llama"], tmp_path / "llama-mlp-bias", lambda c: {**c, "mlp_bias": True}, add=biases)


def _in_memory_split(src: Path, out: Path, dtype=None, **kw) -> None:
    """What `convert --method split` wrote before it streamed: the model loaded, moeize'd and saved."""
    from moecompile.conversion.in_memory import moeize
    from moecompile.conversion.models import load_source
    from moecompile.io import checkpoint

    model = load_source(str(src), progress=False).model.eval()
    moeize(model, experts=4, method="split", seed=3, progress=False, **kw)
    if dtype:
        model.to(dtype)
    checkpoint.save(model, out, tokenizer_dir=src, progress=False)


@pytest.mark.parametrize("name, kw", [("qwen3", {"top_k": 2}),  # tied embeddings
                                      ("qwen2", {"top_k": 4, "layers": "1"}),  # q/k/v biases, a dense layer
                                      ("llama-mlp-bias", {"top_k": 1, "capacity_factor": 0.0}),
                                      ("llama-v4", {"top_k": 2, "dtype": torch.bfloat16}),
                                      ("llama-no-dtype", {"top_k": 2})])  # bf16 weights, no dtype in config.json
def test_streaming_split_equals_in_memory(sources, tmp_path, monkeypatch, name, kw):
    """The streaming split writes bit for bit the tensors, config.json (layout included), generation config and
    tokenizer files of the in-memory moeize + save of the same model and seed, building each block once."""
    from moecompile.conversion import split_stream
    from moecompile.io.checkpoint import read_tensors, weight_files

    if name == "llama-mlp-bias":
        src = _mlp_biased(sources, tmp_path)
    elif name == "llama-no-dtype":
        bf16 = {k: v.bfloat16() for k, v in load_file(sources["llama"] / "model.safetensors").items()}
        src = _copy(sources["llama"], tmp_path / name, lambda c: {k: v for k, v in c.items() if k != "dtype"}, add=bf16)
    else:
        src = sources[name]
    dtype = kw.pop("dtype", None)
    _in_memory_split(src, tmp_path / "memory", dtype, **kw)
    built, build = [], split_stream.build_block
    monkeypatch.setattr(split_stream, "build_block", lambda ffn, **k: built.append(ffn.owner) or build(ffn, **k))
    result = split_stream.split_checkpoint(src, tmp_path / "stream", 4, seed=3, dtype=dtype, max_shard_size="20KB",
                                           progress=False, **kw)
    assert built == result.blocks and result.shards > 1  # one build per block, and blocks across shard files
    want = read_tensors(weight_files(tmp_path / "memory"), progress=False)
    got = read_tensors(weight_files(tmp_path / "stream"), progress=False)
    assert set(got) == set(want) and any(".experts.w_in" in k for k in got)
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []
    def others(folder: Path) -> dict:  # every file but the weights (sharded differently)
        return {f.name: json.loads(f.read_text()) if f.suffix == ".json" else f.read_text() for f in folder.iterdir()
                if not f.name.startswith("model")}

    assert others(tmp_path / "stream") == others(tmp_path / "memory")
    assert {"config.json", "generation_config.json"} <= set(others(tmp_path / "stream"))


def _split_args(src, out, *extra) -> list[str]:
    return ["convert", str(src), "--method", "split", "--experts", "4", "--out", str(out), "--no-progress", *extra]


def test_cli_split_streams_and_top_k_all_equals_dense(sources, tmp_path, capsys):
    import moecompile
    from moecompile import cli

    out = tmp_path / "split"
    assert cli.main(_split_args(sources["llama"], out, "--top-k", "4")) == 0
    text = capsys.readouterr().out
    assert "streamed one FFN at a time" in text and "equals the dense one" in text and "probe tokens" not in text
    model = moecompile.load(out)
    dense = transformers.AutoModelForCausalLM.from_pretrained(sources["llama"]).eval()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = dense(ids).logits
        assert want.std() > 0.1 and (model(ids).logits - want).abs().max() < 1e-5
    assert cli.main(_split_args(sources["qwen3"], tmp_path / "top2", "--top-k", "2", "--format", "moecompile")) == 0
    text = capsys.readouterr().out
    assert "top-2 of 4 experts" in text and "is not the dense model's" in text and "calib" in text


def test_cli_split_routing(sources, tmp_path):
    from moecompile import cli
    from moecompile.conversion import api, models

    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(gpt2)
    streamed = {
        (sources["llama"], ()): True,
        (sources["qwen2"], ("--format", "moecompile", "--layers", "odd")): True,
        (sources["llama"], ("--calib", "stdlib")): False,  # calibration runs the model: in memory
        (sources["llama"], ("--fp8",)): False,
        (sources["llama"], ("--random-init",)): False,
        (gpt2, ()): False,  # FFNs found in the captured graph only
    }
    for (src, extra), want in streamed.items():
        a = cli._parser().parse_args(_split_args(src, tmp_path / "x", *extra))
        assert (api._split_stream_source(a.model, cli._convert_options(a), models) is not None) == want, (src, extra)
    a = cli._parser().parse_args(["convert", str(sources["llama"]), "--experts", "4", "--format", "moecompile"])
    assert api._split_stream_source(a.model, cli._convert_options(a), models) is None  # upcycles stay in memory


def test_cli_split_bad_input_leaves_nothing(sources, tmp_path, capsys):
    from moecompile import cli

    (tmp_path / "outs").mkdir()
    bad_layers = _copy(sources["llama"], tmp_path / "layers", lambda c: {**c, "num_hidden_layers": 3})
    truncated = _copy(sources["llama"], tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    for src, message in [(bad_layers, "num_hidden_layers=3 but the weights hold layers 0-1"),
                         (truncated, "corrupt or truncated safetensors file")]:
        assert cli.main(_split_args(src, tmp_path / "outs" / "moe")) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("moecompile: error: ") and message in err and "\n" not in err
        assert _nothing_left(tmp_path / "outs", set())
