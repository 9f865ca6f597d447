"""Greedy token-by-token generation of Hugging Face causal LMs with the whole decode step in one CUDA graph.

    tokens = moecompile.generate(model, input_ids, max_new_tokens=64)

The prompt runs once through the model compiled with the moecompile backend (one graph per prompt length); each
decode step - every layer, the logits, the greedy choice and the update of the token, position and output buffers -
is one compiled function, captured once as a CUDA graph and replayed with no host synchronisation per token: the
host reads the tokens once, at the end. On CPU the same compiled step runs in a Python loop. The key/value cache is
HF's StaticCache; sliding-window layers get full-length cache layers (the model's own masks keep the window), so
every step is the same graph.

`Generator` keeps the compiled functions, the cache and the captured graph for one batch size and cache length;
`generate` keeps one Generator per model and shape.
"""
from __future__ import annotations

import copy
import inspect
import weakref

import torch

from moecompile.errors import MoECompileError
from moecompile.runtime import graphs

WARMUP_STEPS = 2  # uncaptured runs of the step before capture: autotuning and allocations happen outside it
# Dynamo keeps the compiled prefill and step of every Generator (one per model, batch size, length; prefill also per
# prompt length) on the same two functions: room for that many, where its default limit is meant for one model.
RECOMPILE_LIMIT = 256
GREEDY_CHUNK = 1024  # vocabulary columns per first-stage program of the greedy choice


def static_cache(model, max_length: int):
    """HF's StaticCache for model, every layer full length: HF's sliding-window layers count tokens in a Python int,
    a new graph per step under torch.compile (GPT-OSS hits the recompile limit), while the model's own masks keep
    the window on a full-length layer. Also for HF's generate: `model.generate(ids, past_key_values=cache, ...)`."""
    from transformers import StaticCache

    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "sliding_window", None) is not None or "sliding_attention" in layer_types:
        config = copy.copy(config)
        config.sliding_window = None
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    return StaticCache(config=config, max_cache_len=max_length)


def greedy_token(logits: torch.Tensor, chunk: int = GREEDY_CHUNK) -> torch.Tensor:
    """logits.argmax(-1, keepdim=True) in two reductions, each row's vocabulary split into chunks: one reduction over
    a whole large vocabulary runs on one GPU program per row. The first maximum wins, as in argmax."""
    batch, vocab = logits.shape
    if vocab <= chunk:
        return logits.argmax(-1, keepdim=True)
    padded = torch.nn.functional.pad(logits, (0, -vocab % chunk), value=float("-inf")).view(batch, -1, chunk)
    best, where = padded.max(-1)
    which = best.argmax(-1, keepdim=True)
    return which * chunk + where.gather(-1, which)


class Generator:
    """Greedy generation for one model, batch size and maximum length (prompt + new tokens).

    compile: run prefill and the decode step through the moecompile backend (False: the model as it is, eagerly).
    cuda_graph: capture the decode step as one CUDA graph (default: when the model is on a CUDA device).
    options: moecompile backend options (see moecompile.backend.OPTIONS).
    """

    def __init__(self, model, batch_size: int, max_length: int, *, compile: bool = True,
                 cuda_graph: bool | None = None, options: dict | None = None):
        from moecompile.backend import moecompile_backend, resolve_options

        if batch_size < 1 or max_length < 2:
            raise MoECompileError(f"generation needs batch_size >= 1 and max_length >= 2, got {batch_size}, "
                                  f"{max_length}")
        self.model, self.batch_size, self.max_length = model, batch_size, max_length
        self.device = next(model.parameters()).device
        self.cuda_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        if self.cuda_graph and self.device.type != "cuda":
            raise MoECompileError("cuda_graph=True needs the model on a CUDA device")
        self.cache = static_cache(model, max_length)
        accepted = inspect.signature(model.forward).parameters
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
        self._cache_arg = "cache" if "cache" in accepted else "past_key_values"  # transformers renamed it
        long = dict(dtype=torch.long, device=self.device)
        self.tokens = torch.zeros(batch_size, 1, **long)  # the token each step reads
        self.positions = torch.zeros(batch_size, 1, **long)  # its position in each row
        self.column = torch.zeros(1, **long)  # the output column it writes
        self.out = torch.zeros(batch_size, max_length, **long)
        self.mask = None  # [batch, max_length] when the prompt is padded
        self.prefill_logits = None  # the prompt's last logits, [batch, vocab]
        self._graph = None
        self._compiled = compile
        self._initialise_cache()
        if compile:
            resolve_options(options)  # a mistake fails here, not at the first step

            def backend(gm, example_inputs):
                return moecompile_backend(gm, example_inputs, options=options)

            self._prefill = torch.compile(self._forward, backend=backend, fullgraph=True, dynamic=False)
            self._step = torch.compile(self._decode_step, backend=backend, fullgraph=True, dynamic=False)
        else:
            self._prefill, self._step = self._forward, self._decode_step

    @torch.no_grad()
    def _initialise_cache(self):
        """HF's cache allocates its tensors on first use: do that eagerly, not inside a compiled function."""
        self._forward(self.tokens, self.positions, None)
        self.cache.reset()

    def _run(self, fn, *args):
        if not self._compiled:
            return fn(*args)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return fn(*args)

    def _forward(self, input_ids, position_ids, attention_mask):
        """(greedy next token [batch, 1], the last position's logits)"""
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         use_cache=True, **{self._cache_arg: self.cache}, **self._extra)
        logits = out.logits[:, -1]
        return greedy_token(logits), logits

    def _decode_step(self, tokens, positions, column, out, mask):
        nxt, _ = self._forward(tokens, positions, mask)
        out.index_copy_(1, column, nxt)
        tokens.copy_(nxt)
        positions.add_(1)
        column.add_(1)

    def _advance(self):
        self._run(self._step, self.tokens, self.positions, self.column, self.out, self.mask)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Reset the cache, run the prompt, write it and the first new token into the output buffer."""
        batch, length = input_ids.shape
        if batch != self.batch_size or length >= self.max_length:
            raise MoECompileError(f"this Generator takes {self.batch_size} prompts shorter than {self.max_length} "
                                  f"tokens, got {batch} x {length}")
        input_ids = input_ids.to(self.device)
        self.cache.reset()
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None
        if attention_mask is None:
            positions = torch.arange(length, device=self.device).expand(batch, length)
            if self.mask is not None:  # a padded call before: back to the unmasked graph
                self.mask, self._graph = None, None
        else:  # left padding: positions count real tokens; the mask covers the whole cache, later columns real
            attention_mask = attention_mask.to(self.device, torch.long)
            positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
            if self.mask is None:
                self.mask, self._graph = torch.ones(batch, self.max_length, dtype=torch.long,
                                                    device=self.device), None
            self.mask.fill_(1)
            self.mask[:, :length] = attention_mask
        prompt_mask = self.mask[:, :length] if self.mask is not None else None
        first, self.prefill_logits = self._run(self._prefill, input_ids, positions, prompt_mask)
        self.out[:, :length] = input_ids
        self.out[:, length:length + 1] = first
        self.tokens.copy_(first)
        self.positions.copy_(positions[:, -1:] + 1)
        self.column.fill_(length + 1)

    @torch.no_grad()
    def decode(self, steps: int) -> None:
        """Run `steps` decode steps after prefill (the graph is captured on the first call)."""
        if not self.cuda_graph:
            return self._uncaptured(steps)
        done = 0
        if self._graph is None:
            if steps <= WARMUP_STEPS:
                return self._uncaptured(steps)
            self._graph, _ = graphs.capture(self._advance, warmup=WARMUP_STEPS)  # the warm-up runs are real steps
            done = WARMUP_STEPS
        for _ in range(steps - done):
            self._graph.replay()

    def _uncaptured(self, steps: int) -> None:
        for _ in range(steps):
            self._advance()

    def __call__(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> torch.Tensor:
        """Prompt + up to max_new_tokens greedy tokens, [batch, length + new]; as HF's generate, rows that reached
        an end-of-sequence token are padded after it and the output ends when every row has."""
        length = input_ids.shape[1]
        if max_new_tokens < 1 or length + max_new_tokens > self.max_length:
            raise MoECompileError(f"max_new_tokens must be in 1..{self.max_length - length} for this Generator, "
                                  f"got {max_new_tokens}")
        self.prefill(input_ids, attention_mask)
        self.decode(max_new_tokens - 1)
        return _stop_at_eos(self.out[:, :length + max_new_tokens].clone(), length, eos_token_id, pad_token_id)


def _stop_at_eos(tokens: torch.Tensor, length: int, eos_token_id, pad_token_id) -> torch.Tensor:
    if eos_token_id is None:
        return tokens
    eos = torch.as_tensor(eos_token_id, device=tokens.device).reshape(-1)
    new = tokens[:, length:]
    is_eos = torch.isin(new, eos)
    after = (is_eos.cumsum(-1) - is_eos.long()) > 0  # strictly after a row's first end-of-sequence token
    new = new.masked_fill(after, eos[0] if pad_token_id is None else pad_token_id)
    finished = is_eos.cumsum(-1).clamp_max(1).min(0).values  # every row has ended by this step
    end = int(finished.argmax()) + 1 if bool(finished.any()) else new.shape[1]
    return torch.cat([tokens[:, :length], new[:, :end]], 1)


_generators: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def generate(model, input_ids: torch.Tensor, max_new_tokens: int = 32, *, attention_mask=None, compile: bool = True,
             cuda_graph: bool | None = None, options: dict | None = None) -> torch.Tensor:
    """Greedy generation, [batch, prompt + new tokens] as HF's `model.generate(..., do_sample=False)` returns it.

    The compiled functions and the captured graph are kept per model, batch size, length and options, so later
    calls with the same shapes start decoding at once. End-of-sequence and padding tokens come from the model's
    generation_config."""
    batch, length = input_ids.shape
    key = (batch, length + max_new_tokens, compile, cuda_graph, repr(sorted((options or {}).items())))
    per_model = _generators.setdefault(model, {})
    if key not in per_model:
        per_model[key] = Generator(model, batch, length + max_new_tokens, compile=compile, cuda_graph=cuda_graph,
                                   options=options)
    config = getattr(model, "generation_config", None)
    return per_model[key](input_ids, max_new_tokens, attention_mask,
                          eos_token_id=getattr(config, "eos_token_id", None),
                          pad_token_id=getattr(config, "pad_token_id", None))
