"""Calibration text -> token batches -> the dense model's activations on them."""
from __future__ import annotations

import logging
import random

import torch
from torch import nn
from tqdm.auto import tqdm

log = logging.getLogger("moecompile")


class ByteTokenizer:
    """Fallback for models without tokenizer files (--random-init configs): UTF-8 bytes modulo the vocabulary."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, texts: list[str], max_length: int) -> dict:
        rows = [[b % self.vocab_size for b in t.encode()[:max_length]] or [0] for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return {"input_ids": ids, "attention_mask": mask}

    def words(self) -> list[str]:
        return []


class HFTokenizer:
    """A Hugging Face tokenizer as token_batches calls it."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, texts: list[str], max_length: int) -> dict:
        return dict(self.tok(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"))

    def words(self) -> list[str]:
        """The vocabulary's whole words (no word pieces, special tokens or byte markers) of 3+ letters, sorted."""
        return sorted(w for w in self.tok.get_vocab() if len(w) >= 3 and w.isascii() and w.isalpha())


def load_tokenizer(directory, model: nn.Module):
    if directory is not None:
        try:
            from transformers import AutoTokenizer

            return HFTokenizer(AutoTokenizer.from_pretrained(directory))
        except Exception:  # noqa: BLE001 - no tokenizer files: fall back below
            pass
    log.warning("no tokenizer for this model: calibrating on UTF-8 bytes as token ids")
    return ByteTokenizer(model.config.vocab_size)


def token_batches(tokenize, texts: list[str], tokens: int, max_length: int = 128, batch: int = 32,
                  seed: int = 0, shuffle: bool = True, device: torch.device | str = "cpu") -> list[dict]:
    """Batches on device holding about `tokens` real tokens from texts (shuffled with seed, else taken in their
    order), grouped by length so that little compute goes to padding."""
    order = list(texts)
    if shuffle:
        random.Random(seed).shuffle(order)
    chosen, count = [], 0
    for start in range(0, len(order), 256):
        part = order[start:start + 256]
        lengths = tokenize(part, max_length)["attention_mask"].sum(1).tolist()
        for text, n in zip(part, lengths):
            chosen.append((n, text))
            count += n
            if count >= tokens:
                break
        if count >= tokens:
            break
    chosen.sort(key=lambda p: p[0])
    texts = [t for _, t in chosen]
    return [{k: v.to(device) for k, v in tokenize(texts[i:i + batch], max_length).items()}
            for i in range(0, len(texts), batch)]


def model_kwargs(model: nn.Module, enc: dict) -> dict:
    """The model's keyword arguments for a token batch (no KV cache where the model takes `use_cache`)."""
    kwargs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    if "use_cache" in getattr(model.forward, "__code__", type("", (), {"co_varnames": ()})).co_varnames:
        kwargs["use_cache"] = False
    return kwargs


def last_hidden(model: nn.Module, enc: dict) -> torch.Tensor:
    """The model's last hidden state [B, T, H] (after a decoder's final norm)."""
    return model(**model_kwargs(model, enc), output_hidden_states=True).hidden_states[-1].float()


def pooled(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean-pooled sentence embeddings [B, H] of hidden states [B, T, H] over the real tokens."""
    m = mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp_min(1)


@torch.no_grad()
def collect_ffn_inputs(model: nn.Module, owners: list[str], batches: list[dict], progress: bool = True,
                       final: list | None = None, outputs: tuple[str, ...] = ()):
    """The input of each FFN module (real tokens only, padding dropped) over the batches: {owner: [N, H]}; the
    model's last hidden state per batch is appended to `final` if given. With `outputs` (module paths), also the
    tensor output of those modules: ({owner: [N, H]}, {path: [N, H]}) (a path missing from the second dict gave
    no tensor). Each is written into one preallocated float32 buffer (no concatenation: half the peak memory)."""
    total = sum(int(enc["attention_mask"].sum()) for enc in batches)
    store: dict[tuple[str, str], torch.Tensor] = {}
    at = {"row": 0, "mask": None}

    def keep(key, t):
        if not isinstance(t, torch.Tensor):
            return
        t = t[at["mask"]]
        if key not in store:
            store[key] = torch.empty(total, t.shape[-1], device=t.device)
        store[key][at["row"]:at["row"] + t.shape[0]] = t

    hooks = [model.get_submodule(o).register_forward_pre_hook(lambda m, args, o=o: keep((o, "in"), args[0]))
             for o in owners]
    hooks += [model.get_submodule(p).register_forward_hook(lambda m, args, out, p=p: keep((p, "out"), out))
              for p in outputs]
    try:
        for enc in tqdm(batches, desc="calibration forward", unit="batch", disable=not progress):
            at["mask"] = enc["attention_mask"].bool()
            if final is None:
                model(**model_kwargs(model, enc))
            else:
                final.append(last_hidden(model, enc))
            at["row"] += int(at["mask"].sum())
    finally:
        for h in hooks:
            h.remove()
    inputs = {o: store[(o, "in")] for o in owners}
    return (inputs, {p: store[(p, "out")] for p in outputs if (p, "out") in store}) if outputs else inputs
