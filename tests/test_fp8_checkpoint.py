"""FP8 checkpoints: moecompile's own (save / load / CLI), their size, and HF FineGrainedFP8 folders of Mixtral and
Qwen3-MoE models that transformers' loader reads."""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model, tiny_token_ids
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import moecompile
from moecompile import MoECompileError, report
from moecompile.cli import main
from moecompile.core import fp8_format as K
from moecompile.ir import fp8
from moecompile.ir.fp8 import MoEExpertsFP8
from moecompile.ir.layout import moe_blocks

F8 = torch.float8_e4m3fn


def bits(t):
    return t.view(torch.uint8)


def cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def fp8_llama(experts=16, dtype=torch.float32):
    model = make_tiny_model("llama", random_bias=False)
    moecompile.moeize(model, experts=experts, top_k=2, capacity_factor=0.0, progress=False)
    return fp8.quantize(model).to(dtype)


def dtypes(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


# ---------------------------------------------------------------------------------------- moecompile checkpoints

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_checkpoint_round_trip(tmp_path, dtype):
    model = fp8_llama(dtype=dtype)
    ids = tiny_token_ids()
    with torch.no_grad():
        want = model(ids).logits
    moecompile.save(model, tmp_path / "ckpt", progress=False)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [128, 128]
    assert "model.layers.0.self_attn.q_proj" in q["modules_to_not_convert"]  # only the experts are FP8
    assert all(b["fp8"] == fp8.FORMAT for b in config["moe"]["blocks"])
    stored = dtypes(tmp_path / "ckpt" / "model.safetensors")
    assert stored["model.layers.0.mlp.experts.w_in"] == stored["model.layers.1.mlp.experts.w_out"] == "F8_E4M3"
    assert stored["model.layers.0.mlp.experts.w_in_scale_inv"] == "F32"
    assert stored["model.layers.0.mlp.router.weight"] == ("F32" if dtype == torch.float32 else "BF16")

    loaded = moecompile.load(tmp_path / "ckpt", progress=False)
    assert loaded.dtype == dtype
    original = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        assert p.dtype == original[name].dtype, name
        assert torch.equal(bits(p) if p.dtype == F8 else p, bits(original[name]) if p.dtype == F8 else original[name])
    assert all(isinstance(b.experts, MoEExpertsFP8) for _, b in moe_blocks(loaded))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)
    summary = report.checkpoint_summary(tmp_path / "ckpt")  # inspect's, from the headers
    assert summary == {"blocks": report.block_rows(loaded), **report.parameter_counts(loaded)}
    assert all(row["fp8"] for row in summary["blocks"])


def test_fp8_checkpoint_is_at_most_055_of_bf16(tmp_path):
    """A converted model whose experts dominate (tiny LLaMA, 16 experts per FFN): FP8 experts + bf16 rest vs bf16."""
    model = make_tiny_model("llama", random_bias=False)
    moecompile.moeize(model, experts=16, top_k=2, capacity_factor=0.0, progress=False)
    moecompile.save(model.to(torch.bfloat16), tmp_path / "bf16", progress=False)
    moecompile.save(fp8.quantize(model), tmp_path / "fp8", progress=False)
    size = {k: (tmp_path / k / "model.safetensors").stat().st_size for k in ("bf16", "fp8")}
    ratio = size["fp8"] / size["bf16"]
    print(f"\nFP8 / bf16 checkpoint: {size['fp8']} / {size['bf16']} bytes = {ratio:.3f}")
    assert ratio <= 0.55


def test_load_refuses_fp8_checkpoints_that_do_not_fit(tmp_path):
    moecompile.save(fp8_llama(experts=2), tmp_path / "ckpt", progress=False)
    path = tmp_path / "ckpt" / "config.json"
    config = json.loads(path.read_text())
    block = config["moe"]["blocks"][0]
    block["fp8"]["weight_block_size"] = [64, 64]
    path.write_text(json.dumps(config))
    with pytest.raises(MoECompileError, match=r"MoE block model.layers.0.mlp: unsupported fp8 format"):
        moecompile.load(tmp_path / "ckpt", progress=False)
    del block["fp8"]  # the layout says bf16/fp32 experts, the file holds FP8 ones
    path.write_text(json.dumps(config))
    with pytest.raises(MoECompileError, match=r"model.layers.0.mlp.experts.w_in is torch.float8_e4m3fn, config "
                                              r"implies torch.float32"):
        moecompile.load(tmp_path / "ckpt", progress=False)


# ---------------------------------------------------------------------------------------------------- the CLI

def test_cli_convert_fp8_then_inspect(tmp_path, capsys):
    out = tmp_path / "llama-fp8"
    rc, stdout, err = cli(capsys, "convert", "tiny-llama", "--random-init", "--experts", "4", "--capacity-factor",
                          "0", "--fp8", "--dtype", "bfloat16", "--out", out, "--no-progress")
    assert rc == 0, err
    m = re.search(r"FP8 experts \(float8_e4m3fn, 128x128 block scales\): output vs unquantised, relative error "
                  r"([0-9.e-]+)", stdout)
    assert m and float(m.group(1)) < 0.05
    stored = dtypes(out / "model.safetensors")
    assert stored["model.layers.1.mlp.experts.w_out"] == "F8_E4M3" and stored["model.embed_tokens.weight"] == "BF16"
    rc, stdout, _ = cli(capsys, "inspect", out, "--no-progress")
    assert rc == 0 and stdout.count("(silu, gated, fp8)") == 2


def test_cli_quantize_moecompile_checkpoint(tmp_path, capsys):
    src, out = tmp_path / "moe", tmp_path / "moe-fp8"
    model = make_tiny_model("llama", random_bias=False)
    moecompile.moeize(model, experts=8, top_k=2, capacity_factor=0.0, progress=False)
    moecompile.save(model, src, progress=False)
    rc, stdout, err = cli(capsys, "quantize", src, "--fp8", "--out", out, "--no-progress")
    assert rc == 0, err
    assert "quantised the experts of 2 MoE blocks" in stdout and re.search(r"MB \(0\.[0-9]+x\)", stdout)
    want = fp8.quantize(moecompile.load(src, progress=False))  # the same as quantising the loaded model in memory
    moecompile.save(want, tmp_path / "in-memory", tokenizer_dir=src, progress=False)
    streamed, in_memory = (load_file(d / "model.safetensors") for d in (out, tmp_path / "in-memory"))
    assert streamed.keys() == in_memory.keys()
    assert [k for k, t in streamed.items() if t.dtype != in_memory[k].dtype or not torch.equal(
        bits(t) if t.dtype == F8 else t, bits(in_memory[k]) if t.dtype == F8 else in_memory[k])] == []
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "in-memory" / "config.json")
                                                                       .read_text())
    got = moecompile.load(out, progress=False)
    ids = tiny_token_ids()
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)
    rc, _, err = cli(capsys, "quantize", out, "--fp8", "--out", tmp_path / "twice", "--no-progress")
    assert rc == 2 and "experts already in FP8: model.layers.0.mlp" in err
    assert not (tmp_path / "twice").exists()


def test_cli_quantize_bad_input(tmp_path, capsys):
    dense = tmp_path / "dense"
    make_tiny_model("llama", random_bias=False).save_pretrained(dense)
    capsys.readouterr()  # transformers' "Writing model shards" bar
    before = sorted(p.name for p in tmp_path.iterdir())
    rc, _, err = cli(capsys, "quantize", dense, "--fp8", "--out", tmp_path / "o", "--no-progress")
    assert rc == 2 and re.fullmatch(r"moecompile: error: no per-expert weights .* not a Hugging Face MoE "
                                    r"checkpoint\n", err)
    rc, _, err = cli(capsys, "quantize", tmp_path / "missing", "--fp8", "--out", tmp_path / "o", "--no-progress")
    assert rc == 2 and "no such folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no .partial left
    with pytest.raises(SystemExit) as e:  # the format is required (argparse: usage + one error line, exit 2)
        main(["quantize", str(dense), "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "--fp8" in capsys.readouterr().err


# ------------------------------------------------------------------------- Hugging Face FineGrainedFP8 layout

def hf_moe(family: str):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                  num_experts_per_tok=2, vocab_size=100, max_position_embeddings=64)
    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=256, num_local_experts=4, **common)).eval()
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=128, num_experts=4,
                                                    head_dim=64, **common)).eval()


# the per-expert tensors transformers writes, in the order it fuses them into gate_up_proj: (gate, up), down
PER_EXPERT = {"mixtral": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                          "block_sparse_moe.experts.{e}.w2"),
              "qwen3_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")}


@pytest.fixture(params=["mixtral", "qwen3_moe"])
def hf_fp8_folder(request, tmp_path, capsys):
    model = hf_moe(request.param)
    src, out = tmp_path / "src", tmp_path / "fp8"
    model.save_pretrained(src, max_shard_size="300KB")  # sharded: the index gets the scales too
    capsys.readouterr()
    rc, stdout, err = cli(capsys, "quantize", src, "--fp8", "--out", out, "--no-progress")
    assert rc == 0, err
    assert "quantised 24 expert weights (Hugging Face FineGrainedFP8 layout)" in stdout
    return request.param, model, src, out


def test_hf_fp8_folder_layout(hf_fp8_folder):
    family, model, src, out = hf_fp8_folder
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [128, 128] and q["activation_scheme"] == "dynamic"
    from transformers import FineGrainedFP8Config

    parsed = FineGrainedFP8Config.from_dict(q)
    assert list(parsed.weight_block_size) == [128, 128] and "lm_head" in parsed.modules_to_not_convert
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len({Path(f).name for f in index.values()}) > 1
    stored = {}
    for f in set(index.values()):
        stored.update(dtypes(out / f))
    assert set(stored) == set(index)
    name = f"model.layers.1.{PER_EXPERT[family][0].format(e=3)}"
    assert stored[f"{name}.weight"] == "F8_E4M3" and stored[f"{name}.weight_scale_inv"] == "F32"
    assert stored["model.layers.0.self_attn.q_proj.weight"] == "F32"  # everything else as it was
    assert sum(1 for k in stored if k.endswith("weight_scale_inv")) == 2 * 4 * 3


def _quantized_experts(model, family, layer):
    """Our FP8 blocks of one layer's experts, fused as transformers fuses them: gate|up rows, down."""
    sd = {k: v for k, v in model.state_dict().items()}
    ex = f"model.layers.{layer}.mlp.experts"
    gate_up, down = sd[f"{ex}.gate_up_proj"], sd[f"{ex}.down_proj"]
    gate, up = gate_up.chunk(2, dim=1)
    parts = [K.quantize_blocks(t) for t in (gate, up, down)]
    return (torch.cat([parts[0][0], parts[1][0]], 1), torch.cat([parts[0][1], parts[1][1]], 1)), parts[2]


def test_transformers_loads_hf_fp8_folder_dequantised_on_cpu(hf_fp8_folder):
    """Without a GPU transformers' FineGrainedFP8 loader dequantises (its documented CPU fallback): every tensor
    name maps, and the expert weights come back as our FP8 blocks times our scales."""
    family, model, src, out = hf_fp8_folder
    cls = type(model)
    loaded, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    original = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        if ".experts." in name:
            continue
        assert torch.equal(p, original[name]), name
    for layer in range(2):
        (gu_q, gu_s), (d_q, d_s) = _quantized_experts(model, family, layer)
        ex = loaded.model.layers[layer].mlp.experts
        torch.testing.assert_close(ex.gate_up_proj, K.dequantize_blocks(gu_q, gu_s), rtol=0, atol=0)
        torch.testing.assert_close(ex.down_proj, K.dequantize_blocks(d_q, d_s), rtol=0, atol=0)
    with torch.no_grad():  # and the dequantised model runs: close to the unquantised one
        ids = tiny_token_ids()
        got, want = loaded(ids).logits, model(ids).logits
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.999


def test_transformers_maps_hf_fp8_folder_onto_its_fp8_experts(hf_fp8_folder, monkeypatch):
    """The GPU path of transformers' loader (FP8Experts with gate_up_proj / gate_up_proj_scale_inv parameters),
    taken on CPU by reporting a Hopper GPU to its environment check. Shown: it parses the config into
    FineGrainedFP8Config, swaps in FP8Experts, and maps every tensor with nothing missing or unexpected, bit for
    bit. Not shown: its FP8 matmul (Triton / DeepGEMM kernels), which needs the GPU."""
    family, model, src, out = hf_fp8_folder
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import FP8Experts
    from transformers.utils.import_utils import is_torch_cuda_available

    is_torch_cuda_available.cache_clear()  # cached by transformers: must not outlive the patch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    try:
        loaded, info = type(model).from_pretrained(out, output_loading_info=True)
    finally:
        is_torch_cuda_available.cache_clear()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert isinstance(loaded.hf_quantizer.quantization_config, FineGrainedFP8Config)
    assert not loaded.hf_quantizer.quantization_config.dequantize
    for layer in range(2):
        ex = loaded.model.layers[layer].mlp.experts
        assert isinstance(ex, FP8Experts)
        (gu_q, gu_s), (d_q, d_s) = _quantized_experts(model, family, layer)
        assert ex.gate_up_proj.dtype == F8 and torch.equal(bits(ex.gate_up_proj.data), bits(gu_q))
        assert torch.equal(ex.gate_up_proj_scale_inv.data, gu_s) and torch.equal(ex.down_proj_scale_inv.data, d_s)
        assert torch.equal(bits(ex.down_proj.data), bits(d_q))
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # not converted, as listed


def test_hf_quantize_refuses_a_quantised_folder(hf_fp8_folder, tmp_path, capsys):
    _, _, _, out = hf_fp8_folder
    rc, _, err = cli(capsys, "quantize", out, "--fp8", "--out", tmp_path / "again", "--no-progress")
    assert rc == 2 and "is quantised already (fp8)" in err
    assert not (tmp_path / "again").exists()
    shutil.rmtree(out)


def test_cli_quantize_refuses_a_checkpoint_that_does_not_fit(tmp_path, capsys):
    """The streaming quantiser checks the headers against the config before writing anything."""
    src = tmp_path / "moe"
    model = make_tiny_model("llama", random_bias=False)
    moecompile.moeize(model, experts=2, top_k=2, capacity_factor=0.0, progress=False)
    moecompile.save(model, src, progress=False)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.w_out"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    before = sorted(p.name for p in tmp_path.iterdir())
    rc, _, err = cli(capsys, "quantize", src, "--fp8", "--out", tmp_path / "o", "--no-progress")
    assert rc == 2 and "1 tensors missing, e.g. model.layers.1.mlp.experts.w_out" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before
