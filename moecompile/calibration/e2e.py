"""End-to-end distillation: every converted block at once against the dense model's last hidden state."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from moecompile.calibration.distill import ADAM_OPTIONS, one_cycle
from moecompile.calibration.masked import masked_forward
from moecompile.calibration.tokens import last_hidden, pooled
from moecompile.ir.block import MoEBlock


def embedding_loss(h: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(1 - cosine of mean-pooled states) + (1 - mean per-token cosine) over the real tokens."""
    m = mask.unsqueeze(-1).float()
    pooled = F.cosine_similarity((h * m).sum(1), (target * m).sum(1), dim=-1).mean()
    tokens = F.cosine_similarity(h[mask], target[mask], dim=-1).mean()
    return 2.0 - pooled - tokens


@dataclass
class Judge:
    """Text the end-to-end stage is scored on every `every` steps (and after the last): {name: (batches, the dense
    model's pooled embeddings per batch)}. The parameters that scored best on `select` are the ones kept (None:
    the last ones); `history` receives {"step", name: mean cosine, ...} rows."""
    sets: dict[str, tuple[list[dict], list[torch.Tensor]]]
    every: int
    select: str | None = None
    history: list[dict] = field(default_factory=list)

    @classmethod
    @torch.no_grad()
    def of(cls, dense: nn.Module, sets: dict[str, list[dict]], every: int, select: str | None = None) -> Judge:
        """Judge on batches of the dense `model` (before it is converted)."""
        return cls({name: (batches, [pooled(last_hidden(dense, b), b["attention_mask"]) for b in batches])
                    for name, batches in sets.items()}, every, select)

    @torch.no_grad()
    def score(self, model: nn.Module, prefix: _FrozenPrefix | None) -> dict[str, float]:
        out = {}
        for name, (batches, targets) in self.sets.items():
            cos = []
            for j, (enc, target) in enumerate(zip(batches, targets)):
                if prefix is not None:
                    prefix.batch = (name, j)
                cos.append(F.cosine_similarity(pooled(last_hidden(model, enc), enc["attention_mask"]), target, dim=-1))
            out[name] = torch.cat(cos).mean().item()
        return out


def frozen_layers(model: nn.Module, trained: MoEBlock, frozen: list[MoEBlock]) -> list[nn.Module]:
    """The layers (items of the model's layer list) in front of the one holding `trained`, if they hold all the
    `frozen` blocks: nothing in them changes while the blocks after them train; [] if there is no such list."""
    path = next(n for n, m in model.named_modules() if m is trained)
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and path.startswith(n + ".")]
    if not lists:
        return []
    name, layer_list = max(lists, key=lambda nm: len(nm[0]))
    index = int(path[len(name) + 1:].split(".")[0])
    layers = list(layer_list)[:index]
    inside = {id(m) for layer in layers for m in layer.modules()}
    return layers if layers and all(id(b) in inside for b in frozen) else []


class _FrozenPrefix:
    """Skips the frozen first layers in end-to-end distillation: the first step on a batch runs them (without
    autograd) and keeps the last one's output, later steps on that batch return it from every frozen layer (the
    next layer only sees the last one's). Same numbers as running them, in less time."""

    def __init__(self, layers: list[nn.Module]):
        self.layers, self.cache, self.batch = layers, {}, None
        self.saved = [layer.__dict__.get("forward") for layer in layers]
        for layer in layers:
            layer.forward = functools.partial(self._forward, layer, layer.forward)

    def _forward(self, layer, forward, *args, **kwargs):
        if self.batch in self.cache:
            return self.cache[self.batch]
        with torch.no_grad():
            out = forward(*args, **kwargs)
        if layer is self.layers[-1]:
            self.cache[self.batch] = torch.utils._pytree.tree_map(
                lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
        return out

    def restore(self):
        for layer, forward in zip(self.layers, self.saved):
            del layer.forward
            if forward is not None:
                layer.forward = forward


def distill_end_to_end(model: nn.Module, batches: list[dict], targets: list[torch.Tensor], steps: int, lr: float,
                       seed: int, progress: bool = True, bf16: bool = False, frozen_fraction: float = 0.0,
                       cache_frozen: bool = True, judge: Judge | None = None) -> float:
    """Adam on the parameters of the MoEBlocks at once (the rest of the model frozen, and the first
    `frozen_fraction` of the blocks in model order) so the converted model's last hidden state matches the dense
    model's (`targets`, one per batch); one random batch per step. `cache_frozen`: the layers in front of the
    first trained block run once per batch (_FrozenPrefix). `judge`: scores held-out text along the way and, with
    its `select`, keeps the parameters that scored best on it (early stopping without stopping: the schedule runs
    to its end)."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if steps <= 0 or not blocks or not batches:
        return float("nan")
    frozen = {p: p.requires_grad for p in model.parameters()}
    # the first blocks keep their layer-wise result, so the backward pass stops above them
    first = int(len(blocks) * frozen_fraction)
    params = [p for b in blocks[first:] for p in b.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)

    def forward(b, x, top_k=None, capacity_factor=None):
        # masked_forward trains faster on CPU; bfloat16 autocast on the blocks only, where it pays
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            return masked_forward(b, x.reshape(-1, x.shape[-1]), b.config.top_k).reshape(x.shape).to(x.dtype)

    for b in blocks:
        b.forward = functools.partial(forward, b)
    layers = frozen_layers(model, blocks[first], blocks[:first]) if cache_frozen and 0 < first < len(blocks) else []
    prefix = _FrozenPrefix(layers) if layers else None
    opt = torch.optim.Adam(params, lr=lr, **ADAM_OPTIONS)
    sched = one_cycle(opt, lr, steps)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    best = (-float("inf"), None)  # (score on judge.select, parameters)

    def judge_now(step):
        nonlocal best
        scores = judge.score(model, prefix)
        judge.history.append({"step": step, **scores})
        if judge.select is not None and scores[judge.select] > best[0]:
            best = (scores[judge.select], [p.detach().clone() for p in params])

    try:
        for step in tqdm(range(steps), desc="end-to-end distill", unit="step", disable=not progress):
            if judge is not None and judge.every > 0 and step % judge.every == 0:
                judge_now(step)
            i = int(torch.randint(len(batches), (1,), generator=gen))
            if prefix is not None:
                prefix.batch = i
            loss = embedding_loss(last_hidden(model, batches[i]), targets[i], batches[i]["attention_mask"].bool())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        if judge is not None:
            judge_now(steps)
            if best[1] is not None:
                with torch.no_grad():
                    for p, q in zip(params, best[1]):
                        p.copy_(q)
    finally:
        if prefix is not None:
            prefix.restore()
        for b in blocks:
            del b.forward
        for p, flag in frozen.items():
            p.requires_grad_(flag)
    return float(loss.detach())
