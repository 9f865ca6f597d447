"""moecompile.io.checkpoint save/load through the Python API (moeize -> save -> load), CPU, float32, tiny models."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from moecompile import MoEBlock, MoECompileError, report
from moecompile.conversion.in_memory import moeize
from moecompile.io import checkpoint
from moecompile.ir.layout import moe_blocks

VOCAB = 100


# ----------------------------------------------------------------------------------------------- tiny models

def tiny_model(family: str, seed: int = 0) -> nn.Module:
    """Tiny random HF models (float32, eval), with a larger init than HF's so the FFNs matter in the outputs."""
    import transformers as tf

    if family == "gpt2":
        config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                               eos_token_id=0, initializer_range=0.2)
        cls = tf.GPT2LMHeadModel
    elif family == "bert":
        config = tf.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                               vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.2)
        cls = tf.BertModel
    elif family == "llama":
        config = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                                eos_token_id=0, initializer_range=0.2)
        cls = tf.LlamaForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    return cls(config).float().eval()


IDS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


def outputs(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids)
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def converted(family: str, method: str = "upcycle") -> nn.Module:
    model = tiny_model(family)
    top_k = 4 if method == "split" else 2
    return moeize(model, experts=4, top_k=top_k, capacity_factor=0, method=method, progress=False)


def block_configs(model: nn.Module) -> list:
    return [(path, block.config) for path, block in moe_blocks(model)]


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


@pytest.fixture(scope="module")
def gpt2_moe() -> nn.Module:
    """A tiny GPT-2 with its two MLPs upcycled into 4 experts (shared by the tests that only read it)."""
    return converted("gpt2")


@pytest.fixture(scope="module")
def gpt2_ckpt(gpt2_moe, tmp_path_factory) -> Path:
    """gpt2_moe saved once; tests that corrupt it work on copies."""
    return checkpoint.save(gpt2_moe, tmp_path_factory.mktemp("ckpt") / "gpt2-moe", progress=False)


def copy_ckpt(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("method", ["upcycle", "split"])
@pytest.mark.parametrize("family", ["gpt2", "bert", "llama"])
def test_roundtrip_identical(family, method, tmp_path):
    model = converted(family, method)
    assert len(moe_blocks(model)) == 2
    expected = outputs(model)
    out = checkpoint.save(model, tmp_path / "ckpt", progress=False)
    assert out == tmp_path / "ckpt"
    assert (out / "model.safetensors").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["moe"]["format_version"] == 2 and config["model_type"] == checkpoint.MODEL_TYPE
    assert [b["path"] for b in config["moe"]["blocks"]] == [p for p, _ in moe_blocks(model)]

    loaded = checkpoint.load(out, progress=False)
    assert type(loaded) is type(model)
    assert not loaded.training
    assert block_configs(loaded) == block_configs(model)
    assert all(isinstance(loaded.get_submodule(p), MoEBlock) for p, _ in moe_blocks(model))
    assert loaded.moe_layout == model.moe_layout
    if family == "bert":  # the block absorbed output.dense, which is an Identity again after load
        for entry in model.moe_layout:
            assert entry["identity"]
            for p in entry["identity"]:
                assert isinstance(loaded.get_submodule(p), nn.Identity)
    assert_same_state(loaded, model)
    got = outputs(loaded)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected), (got - expected).abs().max()
    # inspect's summary from the config and the safetensors headers alone equals the loaded model's
    assert report.checkpoint_summary(out) == {"blocks": report.block_rows(loaded), **report.parameter_counts(loaded)}


# run by a fresh interpreter that never imports moecompile: what plain transformers makes of the folder
PLAIN_LOAD = r"""
import json, sys, transformers
try:
    transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
    result = {"loaded": True}
except Exception as e:
    result = {"loaded": False, "error": type(e).__name__, "message": str(e).splitlines()[0]}
result["moecompile_imported"] = any(m.split(".")[0] == "moecompile" for m in sys.modules)
print(json.dumps(result))
"""


def test_plain_transformers_refuses_a_moecompile_folder(gpt2_ckpt):
    """Never the dense source class with freshly initialised FFN weights: AutoModelForCausalLM raises."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(gpt2_ckpt)], capture_output=True, text=True,
                          env=env, cwd="/", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] is False and result["moecompile_imported"] is False
    assert result["error"] == "ValueError"
    assert "model type `moecompile-checkpoint: load it with moecompile.load`" in result["message"]
    assert "moecompile.load" in json.loads((gpt2_ckpt / "config.json").read_text())["moecompile_note"]
    card = (gpt2_ckpt / "README.md").read_text()
    assert "moecompile.load(" in card and "transformers refuses" in card


def test_loads_folders_written_in_the_old_layout(gpt2_moe, gpt2_ckpt, tmp_path):
    """format_version 1 kept the source's model_type and architectures at the top of config.json."""
    d = copy_ckpt(gpt2_ckpt, tmp_path)
    config = json.loads((d / "config.json").read_text())
    moe = config.pop("moe")
    config.update(moe.pop("source"))
    config["moe"] = {**moe, "format_version": 1}
    (d / "config.json").write_text(json.dumps(config))
    loaded = checkpoint.load(d, progress=False)
    assert type(loaded) is type(gpt2_moe) and block_configs(loaded) == block_configs(gpt2_moe)
    assert_same_state(loaded, gpt2_moe)
    assert torch.equal(outputs(loaded), outputs(gpt2_moe))


def test_gpt2_tied_weights_survive(gpt2_moe, gpt2_ckpt):
    assert gpt2_moe.lm_head.weight is gpt2_moe.transformer.wte.weight
    with safe_open(str(gpt2_ckpt / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys  # stored once (the tied lm_head.weight may be dropped)
    loaded = checkpoint.load(gpt2_ckpt, progress=False)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert torch.equal(loaded.transformer.wte.weight, gpt2_moe.transformer.wte.weight)
    assert torch.equal(outputs(loaded), outputs(gpt2_moe))


def test_sharded_save_and_load(gpt2_moe, tmp_path):
    out = checkpoint.save(gpt2_moe, tmp_path / "sharded", max_shard_size="100KB", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 2
    assert not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert all(s.stat().st_size <= 200_000 for s in shards)
    assert "transformer.h.0.mlp.experts.w_in" in index["weight_map"]
    loaded = checkpoint.load(out, progress=False)
    assert block_configs(loaded) == block_configs(gpt2_moe)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert torch.equal(outputs(loaded), outputs(gpt2_moe))


def test_sharded_index_pointing_to_missing_shard(gpt2_moe, tmp_path):
    out = checkpoint.save(gpt2_moe, tmp_path / "sharded", max_shard_size="100KB", progress=False)
    victim = sorted(out.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(MoECompileError, match="missing weight file.*" + victim.name):
        checkpoint.load(out, progress=False)


def test_bfloat16_roundtrip(tmp_path):
    model = converted("gpt2").to(torch.bfloat16)
    expected = outputs(model)
    out = checkpoint.save(model, tmp_path / "bf16", progress=False)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    loaded = checkpoint.load(out, progress=False)
    dtypes = {p.dtype for p in loaded.parameters()}
    assert dtypes == {torch.bfloat16}
    assert_same_state(loaded, model)
    got = outputs(loaded)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_output_permissions_are_not_private(gpt2_ckpt):
    """mkdtemp makes a 0700 folder; the saved checkpoint must get ordinary permissions."""
    umask = os.umask(0)
    os.umask(umask)
    assert gpt2_ckpt.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (gpt2_ckpt / "config.json").stat().st_mode & 0o777 == 0o666 & ~umask


# ----------------------------------------------------------------------------------------------- tokenizer files

def test_tokenizer_files_copied(gpt2_moe, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    (tok / "vocab.txt").write_text("[PAD]\nhello\nworld\n")
    (tok / "notes.md").write_text("not a tokenizer file")
    out = checkpoint.save(gpt2_moe, tmp_path / "with-tok", tokenizer_dir=tok, progress=False)
    assert (out / "tokenizer.json").read_text() == '{"fake": "tokenizer"}'
    assert (out / "vocab.txt").read_text() == "[PAD]\nhello\nworld\n"
    assert not (out / "notes.md").exists()
    assert not (out / "merges.txt").exists()
    assert torch.equal(outputs(checkpoint.load(out, progress=False)), outputs(gpt2_moe))


def test_tokenizer_files_not_copied_without_them(gpt2_moe, tmp_path):
    out = checkpoint.save(gpt2_moe, tmp_path / "no-tok", progress=False)
    empty = tmp_path / "empty-tok"
    empty.mkdir()
    out2 = checkpoint.save(gpt2_moe, tmp_path / "empty-tok-out", tokenizer_dir=empty, progress=False)
    for d in (out, out2):
        names = {p.name for p in d.iterdir()}
        assert not names & set(checkpoint.TOKENIZER_FILES), names
        assert "config.json" in names and "model.safetensors" in names


# ----------------------------------------------------------------------------------------------- atomic writes

def no_partials(parent: Path) -> bool:
    return not list(parent.glob(".*.partial"))


def test_save_refuses_non_empty_dir(gpt2_moe, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    (out / "sub").mkdir()
    with pytest.raises(MoECompileError, match="exists and is not empty"):
        checkpoint.save(gpt2_moe, out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt", "sub"]
    assert (out / "keep.txt").read_text() == "precious"
    assert no_partials(tmp_path)


def test_save_refuses_existing_file(gpt2_moe, tmp_path):
    out = tmp_path / "a-file"
    out.write_text("x")
    with pytest.raises(MoECompileError, match="a-file is an existing file"):
        checkpoint.save(gpt2_moe, out, progress=False)
    assert out.read_text() == "x"


def test_failed_save_leaves_nothing(gpt2_moe, tmp_path, monkeypatch):
    seen = []

    def broken_save_pretrained(directory, **kwargs):
        directory = Path(directory)
        seen.append(directory)
        (directory / "model.safetensors").write_bytes(b"half written")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gpt2_moe, "save_pretrained", broken_save_pretrained)
    parent = tmp_path / "parent"
    parent.mkdir()
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save(gpt2_moe, parent / "out", progress=False)
    assert len(seen) == 1
    assert seen[0].parent == parent and seen[0].name.startswith(".out.") and seen[0].name.endswith(".partial")
    assert not seen[0].exists()
    assert list(parent.iterdir()) == []  # no output directory, no leftover temp dir
    assert no_partials(parent)


def test_failed_save_keeps_existing_empty_dir(gpt2_moe, tmp_path, monkeypatch):
    def broken(directory, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gpt2_moe, "save_pretrained", broken)
    out = tmp_path / "empty"
    out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(gpt2_moe, out, progress=False)
    assert out.is_dir() and list(out.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]


def test_save_into_existing_empty_dir(gpt2_moe, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert checkpoint.save(gpt2_moe, out, progress=False) == out
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert no_partials(tmp_path)
    assert torch.equal(outputs(checkpoint.load(out, progress=False)), outputs(gpt2_moe))


def test_save_creates_missing_parents(gpt2_moe, tmp_path):
    out = checkpoint.save(gpt2_moe, tmp_path / "a" / "b" / "ckpt", progress=False)
    assert checkpoint.is_checkpoint(out)
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["ckpt"]


def test_no_progress_is_quiet(gpt2_moe, tmp_path, capsys):
    checkpoint.save(gpt2_moe, tmp_path / "quiet", max_shard_size="100KB", progress=False)
    checkpoint.load(tmp_path / "quiet", progress=False)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


# ----------------------------------------------------------------------------------------------- bad checkpoints

def _truncate(d: Path):
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def _garbage(d: Path):
    (d / "model.safetensors").write_bytes(os.urandom(4096))


def _garbage_small_header(d: Path):  # a plausible header length followed by non-JSON bytes
    (d / "model.safetensors").write_bytes((64).to_bytes(8, "little") + b"\xff" * 100)


def _tiny_file(d: Path):
    (d / "model.safetensors").write_bytes(b"abc")


def _missing_weights(d: Path):
    (d / "model.safetensors").unlink()


def _bad_json(d: Path):
    (d / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], ')


def _json_not_object(d: Path):
    (d / "config.json").write_text("[1, 2, 3]")


def _edit_config(fn):
    def edit(d: Path):
        config = json.loads((d / "config.json").read_text())
        fn(config)
        (d / "config.json").write_text(json.dumps(config))
    return edit


def _edit_tensors(fn):
    def edit(d: Path):
        tensors = load_file(d / "model.safetensors")
        fn(tensors)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return edit


def _set_experts(config):
    config["moe"]["blocks"][0]["config"]["num_experts"] = 8


def _wrong_version(config):
    config["moe"]["format_version"] = 99


def _bad_block_path(config):
    config["moe"]["blocks"][0]["path"] = "transformer.h.7.mlp"


def _unknown_block_key(config):
    config["moe"]["blocks"][0]["config"]["bogus"] = 1


BAD = {
    "truncated": (_truncate, r"corrupt or truncated safetensors file .*model\.safetensors"),
    "garbage": (_garbage, r"corrupt or truncated safetensors file"),
    "garbage-after-header-size": (_garbage_small_header, r"corrupt or truncated safetensors file"),
    "three-bytes": (_tiny_file, r"corrupt or truncated safetensors file"),
    "missing-weights": (_missing_weights, r"no safetensors weights in .*model\.safetensors or"),
    "invalid-json": (_bad_json, r"config\.json is not valid JSON"),
    "json-not-an-object": (_json_not_object, r"config\.json is not a JSON object"),
    "no-moe-section": (_edit_config(lambda c: c.pop("moe")), r"not a moecompile checkpoint: .*no moe section"),
    "moe-section-not-a-dict": (_edit_config(lambda c: c.update(moe=[1])), r"no moe section"),
    "format-version": (_edit_config(_wrong_version), r"unsupported moe format_version 99"),
    "num-experts-changed": (_edit_config(_set_experts),
                            r"does not match its config: transformer\.h\.0\.mlp\.\S+ has shape \(4, .*config "
                            r"implies \(8, "),
    "bad-block-path": (_edit_config(_bad_block_path), r"MoE layout does not fit this model"),
    "unknown-block-key": (_edit_config(_unknown_block_key), r"unknown MoE config keys: bogus"),
    "no-architecture": (_edit_config(lambda c: c["moe"]["source"].pop("architectures")),
                        r"names no transformers architecture"),
    "no-source": (_edit_config(lambda c: c["moe"].pop("source")),
                  r"model_type 'moecompile-checkpoint: load it with moecompile\.load' but no moe\.source"),
    "extra-tensor": (_edit_tensors(lambda t: t.update({"extra.weight": torch.zeros(3)})),
                     r"unexpected tensor extra\.weight"),
    "missing-tensor": (_edit_tensors(lambda t: t.pop("transformer.h.1.mlp.router.weight")),
                       r"1 tensors missing, e\.g\. transformer\.h\.1\.mlp\.router\.weight"),
    "wrong-shape-tensor": (_edit_tensors(lambda t: t.update({"transformer.ln_f.weight": torch.ones(33)})),
                           r"transformer\.ln_f\.weight has shape \(33,\), config implies \(32,\)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint(case, gpt2_ckpt, tmp_path):
    damage, message = BAD[case]
    d = copy_ckpt(gpt2_ckpt, tmp_path)
    damage(d)
    with pytest.raises(MoECompileError, match=message) as info:
        checkpoint.load(d, progress=False)
    assert "\n" not in str(info.value)  # one line for the CLI


@pytest.mark.parametrize("index", ["{not json", "[]", '{"weight_map": [1]}', '{"metadata": {}}'])
def test_bad_shard_index(index, gpt2_ckpt, tmp_path):
    d = copy_ckpt(gpt2_ckpt, tmp_path)
    (d / "model.safetensors.index.json").write_text(index)  # an index is read before model.safetensors
    with pytest.raises(MoECompileError, match=r"model\.safetensors\.index\.json is not a valid safetensors index"):
        checkpoint.load(d, progress=False)


def test_nonexistent_directory(tmp_path):
    with pytest.raises(MoECompileError, match="no such checkpoint directory"):
        checkpoint.load(tmp_path / "nope", progress=False)


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(MoECompileError, match="is not a checkpoint: no config.json"):
        checkpoint.load(tmp_path, progress=False)


def test_is_checkpoint(gpt2_ckpt, tmp_path):
    assert checkpoint.is_checkpoint(gpt2_ckpt)
    assert not checkpoint.is_checkpoint(tmp_path)
    for text in ("{not json", "5", '"moe"', "[]", '{"model_type": "gpt2"}'):
        (tmp_path / "config.json").write_text(text)
        assert not checkpoint.is_checkpoint(tmp_path), text


# ----------------------------------------------------------------------------------------------- non-HF models

class MLP(nn.Module):
    def __init__(self, h=16, f=64):
        super().__init__()
        self.fc1 = nn.Linear(h, f)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(f, h)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class PlainNet(nn.Module):
    def __init__(self, h=16):
        super().__init__()
        self.inp = nn.Linear(h, h)
        self.ffn = MLP(h)
        self.norm = nn.LayerNorm(h)
        self.out = nn.Linear(h, 4)

    def forward(self, x):
        h = self.inp(x)
        h = self.norm(h + self.ffn(h))
        return self.out(h)


def test_plain_module_roundtrip(tmp_path):
    torch.manual_seed(0)
    net = PlainNet().eval()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dense = net(x)
    moeize(net, experts=4, top_k=2, capacity_factor=0, example_args=(x,), progress=False)
    assert isinstance(net.ffn, MoEBlock)
    with torch.no_grad():
        expected = net(x)
    assert (expected - dense).abs().max() < 1e-5  # upcycling is exact up to rounding

    out = checkpoint.save(net, tmp_path / "plain", progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert set(config) == {"moe", "model_type", "architectures", "moecompile_note"} and config["moe"]["source"] == {}
    assert [b["path"] for b in config["moe"]["blocks"]] == ["ffn"]
    assert config["moe"]["blocks"][0]["config"]["num_experts"] == 4

    torch.manual_seed(123)  # a fresh dense skeleton with other random weights
    skeleton = PlainNet()
    assert isinstance(skeleton.ffn, MLP)
    loaded = checkpoint.load(out, model=skeleton, progress=False)
    assert loaded is skeleton
    assert isinstance(loaded.ffn, MoEBlock) and loaded.ffn.config == net.ffn.config
    assert not loaded.training
    assert_same_state(loaded, net)
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)

    # without a skeleton there is nothing to rebuild a plain module from
    with pytest.raises(MoECompileError, match="names no transformers architecture"):
        checkpoint.load(out, progress=False)
    # skeletons that do not fit are refused: no module at the block's path, or other shapes
    with pytest.raises(MoECompileError, match="MoE layout does not fit this model"):
        checkpoint.load(out, model=nn.Sequential(nn.Linear(16, 16)), progress=False)
    with pytest.raises(MoECompileError, match=r"does not match its config: inp\.\w+ has shape \(16"):
        checkpoint.load(out, model=PlainNet(h=8), progress=False)


def test_moeize_model_without_ffn():
    """A model with no FFN at all (Python API): moeize refuses it with a clear error."""
    net = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    with pytest.raises(MoECompileError, match="no FFN found in Sequential"):
        moeize(net, experts=4, example_args=(torch.randn(2, 8),), progress=False)
    assert not moe_blocks(net)
