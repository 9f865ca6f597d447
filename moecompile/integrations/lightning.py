"""PyTorch Lightning: a callback that trains the MoE blocks' aux loss and logs their routing every step.

    from moecompile.integrations.lightning import MoECallback
    trainer = lightning.Trainer(callbacks=[MoECallback()], ...)

Works with `lightning` (lightning.pytorch) or the standalone `pytorch_lightning`, whichever is installed
(`lightning` first). Any Lightning logger receives the metrics (`moe/<block>/load_max`, ...; see
moecompile.routing_metrics), including MLFlowLogger.
"""
from __future__ import annotations

import logging

from moecompile.core.errors import MoECompileError
from moecompile.ir.block import aux_loss
from moecompile.ir.layout import moe_blocks
from moecompile.stats import routing_metrics, track_routing

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError:
        raise MoECompileError("the Lightning callback needs PyTorch Lightning: "
                              "pip install 'moecompile[lightning]'") from None

log = logging.getLogger("moecompile")


def _with_aux(output, aux):
    """training_step's output (a loss tensor, a dict with "loss", or None to skip the batch) plus aux."""
    if output is None:
        return None
    if isinstance(output, dict):
        return {**output, "loss": output["loss"] + aux}
    return output + aux


class MoECallback(pl.Callback):
    """add_aux_loss: add `moecompile.aux_loss(module)` to what training_step returns (automatic optimization;
    with manual optimization add it yourself before manual_backward). Leave it off when training_step already
    adds the aux loss.
    log_stats: turn routing statistics on and log them after every training batch (on_step, not on_epoch).
    Values are logged as device tensors: Lightning moves them to the host only when its logger writes.
    per_expert: also log each expert's share of the assignments, `<prefix>/<block>/load/<e>`."""

    def __init__(self, add_aux_loss: bool = True, log_stats: bool = True, per_expert: bool = True,
                 prefix: str = "moe"):
        self.add_aux_loss, self.log_stats, self.per_expert, self.prefix = add_aux_loss, log_stats, per_expert, prefix
        self._tracking = None
        self._wrapped = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not moe_blocks(pl_module):
            raise MoECompileError(f"MoECallback: no MoE blocks in {type(pl_module).__name__}; "
                                  "convert the model with moecompile.moeize first")
        if self.log_stats and self._tracking is None:
            self._tracking = track_routing(pl_module)
        if self.add_aux_loss and stage == "fit" and self._wrapped is None:
            if not pl_module.automatic_optimization:
                log.warning("MoECallback: manual optimization; add moecompile.aux_loss(self) to your loss yourself")
                return
            step = pl_module.training_step  # the bound method (or an earlier instance override)

            def training_step(*args, **kwargs):
                return _with_aux(step(*args, **kwargs), aux_loss(pl_module))

            # an instance attribute shadows the class's method for every strategy's call path
            pl_module.training_step = training_step
            self._wrapped = (pl_module, step)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._wrapped is not None:
            module, step = self._wrapped
            if getattr(step, "__self__", None) is module and step.__func__ is type(module).training_step:
                del module.training_step  # back to the class's method
            else:
                module.training_step = step
            self._wrapped = None
        if self._tracking is not None:
            self._tracking.__exit__(None, None, None)
            self._tracking = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.log_stats:
            metrics = routing_metrics(pl_module, self.prefix, self.per_expert)
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)
