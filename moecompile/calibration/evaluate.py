"""How close a converted block or model is to the dense one, and what its FFNs cost."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from moecompile.calibration.config import CalibConfig
from moecompile.calibration.dense import chunks
from moecompile.calibration.tokens import model_kwargs, pooled
from moecompile.ir.block import MoEBlock
from moecompile.ir.config import MoEConfig


def relative_error(block: MoEBlock, ffn_x: torch.Tensor, y: torch.Tensor, top_k: int) -> float:
    """||block(x) - y|| / ||y|| over all tokens, computed with the block's own forward."""
    with torch.no_grad():
        num = den = 0.0
        for s in chunks(ffn_x.shape[0]):
            out = block(ffn_x[s], top_k=top_k)
            num += (out.float() - y[s]).pow(2).sum().item()
            den += y[s].pow(2).sum().item()
    return math.sqrt(num / max(den, 1e-30))


def set_top_k(model: nn.Module, routed_k: int) -> None:
    """Every MoEBlock of the model routes routed_k experts per token."""
    for m in model.modules():
        if isinstance(m, MoEBlock):
            m.config.top_k = routed_k


@torch.no_grad()
def model_outputs(model: nn.Module, batches: list[dict]) -> list:
    """Per batch, what `quality` compares: ("ppl", summed next-token NLL, token count) for decoders, ("emb",
    mean-pooled sentence embeddings) for encoders."""
    outs = []
    for enc in batches:
        out = model(**model_kwargs(model, enc))
        logits = getattr(out, "logits", None)
        if logits is not None:  # decoder: per-batch summed next-token NLL and token count
            mask = enc["attention_mask"][:, 1:].float()
            nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), enc["input_ids"][:, 1:], reduction="none")
            outs.append(("ppl", (nll * mask).sum().item(), mask.sum().item()))
        else:  # encoder: mean-pooled sentence embeddings
            outs.append(("emb", pooled(out.last_hidden_state.float(), enc["attention_mask"])))
    return outs


def quality(model: nn.Module, dense_outs: list, batches: list[dict]) -> dict:
    """Encoders: mean and 5th-percentile cosine of mean-pooled embeddings vs the dense model's.
    Decoders: perplexity on the held-out text (and the dense model's)."""
    outs = model_outputs(model, batches)
    if outs and outs[0][0] == "ppl":
        nll, n = sum(o[1] for o in outs), sum(o[2] for o in outs)
        dn, dc = sum(o[1] for o in dense_outs), sum(o[2] for o in dense_outs)
        return {"perplexity": math.exp(nll / max(n, 1)), "dense_perplexity": math.exp(dn / max(dc, 1))}
    cos = F.cosine_similarity(torch.cat([o[1] for o in outs]), torch.cat([o[1] for o in dense_outs]), dim=-1)
    return {"mean_cosine": cos.mean().item(), "p5_cosine": torch.quantile(cos, 0.05).item()}


def quality_curve(model: nn.Module, dense_outs: dict[str, list], batches: dict[str, list[dict]], cfg: CalibConfig,
                  dense_ffn_flops: int, progress: bool = True) -> list[dict]:
    """Quality on every evaluation source ({name: batches}, dense_outs alike) at every top_k from the shared
    experts' count (at least 1) to experts: rows {top_k, ffn_flop_fraction, sources: {name: quality}}; restores the
    blocks' k."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    saved = [b.config.top_k for b in blocks]
    rows = []
    try:
        for k in tqdm(range(max(1, cfg.shared_experts), cfg.experts + 1), desc="evaluate top_k", unit="k",
                      disable=not progress):
            set_top_k(model, cfg.routed_k(k))  # 0: the shared expert alone
            flops = sum(ffn_flops(b.config, cfg.routed_k(k)) for b in blocks)
            rows.append({"top_k": k, "ffn_flop_fraction": flops / dense_ffn_flops,
                         "sources": {name: quality(model, dense_outs[name], b) for name, b in batches.items()}})
    finally:
        for b, k in zip(blocks, saved):
            b.config.top_k = k
    return rows


def headline(q: dict) -> tuple[str, float]:
    """A quality dict's main number: (name, value), higher better for cosine, lower for perplexity."""
    return ("mean_cosine", q["mean_cosine"]) if "mean_cosine" in q else ("perplexity", q["perplexity"])


def worst_source(row: dict, skip: tuple[str, ...] = ()) -> tuple[str, float]:
    """(source, headline value) of a curve row's worst source (lowest cosine, highest perplexity over dense's)."""
    def badness(item):
        q = item[1]
        return -q["mean_cosine"] if "mean_cosine" in q else q["perplexity"] / q["dense_perplexity"]
    name, q = max(((n, q) for n, q in row["sources"].items() if n not in skip), key=badness)
    return name, headline(q)[1]


def ffn_flops(c: MoEConfig, routed_k: int) -> int:
    """Multiply-adds per token of the experts a token runs (shared one included; router not counted)."""
    per_expert = c.expert_in_features * c.hidden_size + c.hidden_size * c.expert_size
    shared = 0
    if c.shared_expert_size:
        sc = c.shared_config()
        shared = sc.expert_in_features * c.hidden_size + c.hidden_size * sc.expert_size
    return routed_k * per_expert + shared
