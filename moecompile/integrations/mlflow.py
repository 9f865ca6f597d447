"""MLflow: log the MoE blocks' routing statistics (and optionally an expert-load figure) to an MLflow run.

    from moecompile.integrations.mlflow import log_routing_stats
    moecompile.track_routing(model)
    with mlflow.start_run():
        for step, batch in enumerate(loader):
            ...
            log_routing_stats(model, step=step)

`mlflow-skinny` suffices. With PyTorch Lightning, MoECallback plus Lightning's MLFlowLogger logs the same metrics.
"""
from __future__ import annotations

import time

from torch import nn

from moecompile.core.errors import MoECompileError
from moecompile.stats import as_floats, routing_metrics, routing_stats


def _mlflow():
    try:
        import mlflow
    except ImportError:
        raise MoECompileError("MLflow logging needs mlflow: pip install 'moecompile[mlflow]'") from None
    return mlflow


def log_routing_stats(model: nn.Module, step: int | None = None, run_id: str | None = None, prefix: str = "moe",
                      per_expert: bool = True) -> dict[str, float]:
    """Log moecompile.routing_metrics(model) (each block's last forward) to run_id, or to the active run
    (MLflow starts one if none is active). Reads the values to the host once. Returns what it logged."""
    mlflow = _mlflow()
    metrics = as_floats(routing_metrics(model, prefix, per_expert))
    if not metrics:
        raise MoECompileError("no routing statistics recorded yet: run a forward pass after "
                              "moecompile.track_routing(model)")
    if run_id is None:
        mlflow.log_metrics(metrics, step=step)
    else:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        mlflow.MlflowClient().log_batch(run_id, metrics=[Metric(k, v, now, step or 0) for k, v in metrics.items()])
    return metrics


def log_expert_load_figure(model: nn.Module, artifact_file: str = "expert_load.png", title: str | None = None,
                           run_id: str | None = None) -> None:
    """Log the expert-load bar charts of every block's last forward as a PNG artifact (needs matplotlib)."""
    from moecompile.plot import expert_load_figure

    mlflow = _mlflow()
    figure = expert_load_figure(routing_stats(model), title or f"{type(model).__name__}: expert load per block")
    if run_id is None:
        mlflow.log_figure(figure, artifact_file)
    else:
        mlflow.MlflowClient().log_figure(run_id, figure, artifact_file)
