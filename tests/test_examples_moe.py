"""examples/vision_moe.py and examples/gpt2_finetune.py run end to end with tiny flags and print their summary."""
import re

import numpy as np
import pytest
import torch

import moecompile
from moecompile.examples import gpt2_finetune, vision_moe

pytest.importorskip("matplotlib")  # gpt2_finetune writes its loss curve with it


@pytest.fixture(autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


VISION_TINY = ["--train-size", "200", "--test-size", "100", "--epochs", "2", "--batch-size", "50", "--dim", "32",
               "--depth", "2", "--heads", "2", "--experts", "4", "--device", "cpu", "--threads", "1"]
ROW = re.compile(r"^  (.+?)\s{2,}(\S+)\s+(\S+)$", re.M)


def summary_rows(out: str) -> dict[str, tuple[str, str]]:
    tail = out[out.index("\nsummary"):]
    return {name.strip(): (dense, moe) for name, dense, moe in ROW.findall(tail)}


def test_vision_moe_synthetic(capsys):
    assert vision_moe.main(VISION_TINY + ["--synthetic"]) == 0
    out = capsys.readouterr().out
    assert "data: SYNTHETIC 10-class texture task (--synthetic): 200 training, 100 test images" in out
    assert "MoE copy: 2 MLPs -> 4 experts, top-2" in out
    rows = summary_rows(out)
    for epoch in (1, 2):
        dense, moe = rows[f"test accuracy, epoch {epoch}"]
        assert 0 <= float(dense.rstrip("%")) <= 100 and 0 <= float(moe.rstrip("%")) <= 100
    dense_ms, moe_ms = map(float, rows["median train step (ms)"])
    assert dense_ms > 0 and moe_ms > 0
    dense_p, moe_p = rows["parameters"]
    assert dense_p != moe_p  # the MoE copy holds 4 experts per MLP
    assert re.search(r"moe expert load on 500 test images: busiest expert [\d.]+x an even share, dropped [\d.]+%", out)
    assert re.search(r"final test accuracy: dense [\d.]+%, moe [\d.]+%; total time \d+ s", out)


def test_vision_moe_reads_cifar10_binary(tmp_path, capsys):
    """A stand-in CIFAR-10 binary folder (the real format: label byte + 3072 pixel bytes per record)."""
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, n in [("data_batch_1.bin", 150), ("data_batch_2.bin", 100), ("test_batch.bin", 120)]:
        records = rng.integers(0, 256, size=(n, 3073), dtype=np.uint8)
        records[:, 0] = np.arange(n) % 10
        records.tofile(folder / name)
    x_train, y_train, x_test, y_test = vision_moe.read_cifar(folder)
    assert x_train.shape == (250, 3, 32, 32) and x_test.shape == (120, 3, 32, 32)
    assert y_train[:12].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1] and y_test.max() == 9
    raw = np.fromfile(folder / "test_batch.bin", dtype=np.uint8).reshape(-1, 3073)
    pixel = raw[5, 1 + 2 * 1024 + 3 * 32 + 7] / 255.0  # record 5, blue channel, row 3, column 7
    expected = (pixel - vision_moe.CIFAR_MEAN[2]) / vision_moe.CIFAR_STD[2]
    assert x_test[5, 2, 3, 7].item() == pytest.approx(expected, rel=1e-5)
    argv = VISION_TINY + ["--data", str(tmp_path)]
    argv[argv.index("--epochs") + 1] = "1"
    assert vision_moe.main(argv) == 0
    out = capsys.readouterr().out
    assert f"data: CIFAR-10 from {folder}: 200 training, 100 test images" in out
    assert "summary (CIFAR-10 from" in out
    with pytest.raises(SystemExit, match="no CIFAR-10 binary batches"):
        vision_moe.main(VISION_TINY + ["--data", str(tmp_path / "nowhere")])


GPT2_TINY = ["--steps", "4", "--eval-every", "2", "--layers", "1", "--width", "32", "--heads", "2", "--seq-len",
             "32", "--batch-size", "2", "--device", "cpu", "--threads", "1"]


def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("Experts route tokens; the router learns which expert fits which token. " * 40)
    return path


def test_gpt2_finetune_random_reduced(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert gpt2_finetune.main(GPT2_TINY + ["--text", str(text_file(tmp_path)), "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "model: reduced GPT-2 (1 layers x 32), RANDOM weights" in out
    assert "(UTF-8 bytes), 90% train / 10% validation" in out
    assert "converted: 1 MLPs -> 4 experts, top-2" in out
    steps = re.findall(r"^step\s+(\d+): (?:train loss [\d.]+, )?validation loss ([\d.]+)", out, re.M)
    assert [int(s) for s, _ in steps] == [0, 2, 4]
    m = re.search(r"validation loss ([\d.]+) -> ([\d.]+)", out)
    assert m and float(m.group(1)) == float(steps[0][1]) and float(m.group(2)) == float(steps[-1][1])
    assert (out_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = moecompile.load(out_dir / "checkpoint", progress=False)
    assert [p for p, _ in moecompile.ir.layout.moe_blocks(model)] == ["transformer.h.0.mlp"]
    assert model.config.vocab_size == 256
    logits = model(torch.tensor([list(b"Experts route")]), use_cache=False).logits
    assert logits.shape == (1, 13, 256) and torch.isfinite(logits).all()
    # a second run into the same folder is refused before any work
    assert gpt2_finetune.main(GPT2_TINY + ["--text", str(text_file(tmp_path)), "--out", str(out_dir)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_gpt2_finetune_local_weights(tmp_path, capsys):
    """A local GPT-2 folder (safetensors, no tokenizer) is loaded with its weights, not rebuilt at random."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=300)).save_pretrained(
        tmp_path / "local-gpt2")
    argv = GPT2_TINY + ["--model", str(tmp_path / "local-gpt2"), "--text", str(text_file(tmp_path)),
                        "--out", str(tmp_path / "run"), "--steps", "2"]
    assert gpt2_finetune.main(argv) == 0
    out = capsys.readouterr().out
    assert f"model: {tmp_path / 'local-gpt2'} (real weights from {tmp_path / 'local-gpt2'})" in out
    assert "RANDOM" not in out
    assert moecompile.load(tmp_path / "run" / "checkpoint", progress=False).config.vocab_size == 300
    assert gpt2_finetune.main(GPT2_TINY + ["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert "unknown model" in capsys.readouterr().err
