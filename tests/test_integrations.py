"""Integrations: the PyTorch Lightning callback (a tiny Trainer run on CPU) and MLflow logging (local file store)."""
import csv
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moecompile
from moecompile import MoEBlock, MoECompileError, MoEConfig
from moecompile.stats import as_floats

pl = pytest.importorskip("lightning.pytorch")
mlflow = pytest.importorskip("mlflow")

from moecompile.integrations.lightning import MoECallback  # noqa: E402
from moecompile.integrations.mlflow import log_expert_load_figure, log_routing_stats  # noqa: E402


def tiny_data(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(-1, keepdim=True).tanh())


class TinyMoE(pl.LightningModule):
    """Linear -> two MoE blocks -> Linear on sequences of 4 tokens; task_weight 0 leaves only the aux loss."""

    def __init__(self, task_weight=1.0):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.moe = nn.ModuleList(MoEBlock(MoEConfig(hidden_size=16, expert_size=8, num_experts=4, top_k=2,
                                                    capacity_factor=1.0, aux_loss_coef=0.1)) for _ in range(2))
        self.out = nn.Linear(16, 1)
        self.task_weight = task_weight
        self.seen = []

    def forward(self, x):
        h = self.inp(x)
        for block in self.moe:
            h = h + block(h)
        return self.out(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.task_weight * F.mse_loss(self(x), y)
        self.seen.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Outputs(pl.Callback):
    def __init__(self):
        self.losses, self.aux = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach())
        self.aux.append(moecompile.aux_loss(pl_module).detach())


def fit(module, callbacks, tmp_path, steps=4, **kw):
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, **kw)
    trainer.fit(module, torch.utils.data.DataLoader(tiny_data(), batch_size=12))
    return trainer


@pytest.mark.parametrize("add_aux", [True, False])
def test_callback_adds_aux_loss_to_training(add_aux, tmp_path):
    module = TinyMoE(task_weight=0.0)  # the task loss has zero gradient: only the aux loss can move the router
    router = [b.router.weight.detach().clone() for b in module.moe]
    seen = Outputs()
    fit(module, [MoECallback(add_aux_loss=add_aux, log_stats=False), seen], tmp_path)
    moved = [not torch.equal(b.router.weight, r) for b, r in zip(module.moe, router)]
    assert moved == [add_aux, add_aux]
    for loss, aux, task in zip(seen.losses, seen.aux, module.seen):
        assert aux > 0
        torch.testing.assert_close(loss, task + aux if add_aux else task)
    assert "training_step" not in vars(module)  # the callback's wrapper is gone after fit
    assert not any(b.track_routing for b in module.moe)


def test_callback_logs_routing_stats_every_step(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    module = TinyMoE()
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, callbacks=[MoECallback()],
                         logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, torch.utils.data.DataLoader(tiny_data(), batch_size=12))
    with open(next(tmp_path.glob("run/*/metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("moe/aux_loss")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    for r in rows:
        for b in ("moe.0", "moe.1"):
            tokens = float(r[f"moe/{b}/tokens"])
            loads = [float(r[f"moe/{b}/load/{e}"]) for e in range(4)]
            assert tokens == 12 * 4
            assert sum(loads) == pytest.approx(1 - float(r[f"moe/{b}/dropped_frac"]), abs=1e-5)
            assert 0 < float(r[f"moe/{b}/entropy"]) <= math.log(4) + 1e-5
        both = float(r["moe/moe.0/aux_loss"]) + float(r["moe/moe.1/aux_loss"])
        assert float(r["moe/aux_loss"]) == pytest.approx(both, rel=1e-5)
    # the last row is the last training batch, whose statistics the blocks still hold
    last = as_floats(moecompile.routing_metrics(module))
    for key, value in last.items():
        assert float(rows[-1][key]) == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_callback_refuses_a_model_without_moe_blocks(tmp_path):
    class Dense(TinyMoE):
        def __init__(self):
            super().__init__()
            self.moe = nn.ModuleList()

    with pytest.raises(MoECompileError, match="no MoE blocks"):
        fit(Dense(), [MoECallback()], tmp_path, steps=1)


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    uri = (tmp_path / "mlruns").as_uri()
    mlflow.set_tracking_uri(uri)
    yield mlflow.MlflowClient(uri)
    if mlflow.active_run():
        mlflow.end_run()


def trained_block_model(steps):
    module = TinyMoE()
    moecompile.track_routing(module)
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    data = tiny_data()
    for step in range(steps):
        x, y = data[step * 12:(step + 1) * 12]
        loss = F.mse_loss(module(x), y) + moecompile.aux_loss(module)
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield step, module


def test_mlflow_logs_routing_stats_per_step(mlflow_store):
    expected = {}
    with mlflow.start_run() as run:
        for step, module in trained_block_model(3):
            logged = log_routing_stats(module, step=step)
            expected[step] = as_floats(moecompile.routing_metrics(module))
            assert logged == expected[step]
    data = mlflow_store.get_run(run.info.run_id).data
    assert set(data.metrics) == set(expected[0])
    for key in ("moe/moe.0/load/3", "moe/moe.1/entropy", "moe/dropped_frac", "moe/aux_loss", "moe/moe.0/tokens"):
        history = sorted(mlflow_store.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == [0, 1, 2]
        assert [m.value for m in history] == pytest.approx([expected[s][key] for s in range(3)])


def test_mlflow_explicit_run_and_figure(mlflow_store):
    pytest.importorskip("matplotlib")
    run = mlflow_store.create_run(mlflow_store.create_experiment("moe"))
    *_, (step, module) = trained_block_model(2)
    logged = log_routing_stats(module, step=7, run_id=run.info.run_id, prefix="r", per_expert=False)
    assert set(logged) == {f"r/moe.{i}/{k}" for i in (0, 1) for k in ("tokens", "dropped_frac", "aux_loss",
                                                                      "entropy", "load_max", "load_min")} | {
        "r/aux_loss", "r/dropped_frac", "r/entropy"}
    history = mlflow_store.get_metric_history(run.info.run_id, "r/moe.1/load_max")
    assert [(m.step, m.value) for m in history] == [(7, pytest.approx(logged["r/moe.1/load_max"]))]
    log_expert_load_figure(module, "load.png", run_id=run.info.run_id)
    assert [a.path for a in mlflow_store.list_artifacts(run.info.run_id)] == ["load.png"]
    png = mlflow_store.download_artifacts(run.info.run_id, "load.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert mlflow.active_run() is None  # an explicit run_id never starts a run


def test_mlflow_before_any_forward(mlflow_store):
    module = TinyMoE()
    with pytest.raises(MoECompileError, match="track_routing"):
        log_routing_stats(module)
    moecompile.track_routing(module)
    with pytest.raises(MoECompileError, match="no routing statistics recorded yet"):
        log_routing_stats(module)
