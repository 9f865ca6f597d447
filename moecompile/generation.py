"""Token-by-token generation of Hugging Face causal LMs with the whole decode step in one CUDA graph.

    tokens = moecompile.generate(model, input_ids, max_new_tokens=64)
    tokens = moecompile.generate(model, input_ids, generation_config=GenerationConfig(do_sample=True, top_p=0.9))

The prompt runs once through the model compiled with the moecompile backend (one graph per prompt length); each
decode step - every layer, the logits, the token choice (greedy, or sampled with temperature / top-k / top-p / min-p
from a seeded device generator), the padding of rows that ended and the update of the token, position and output
buffers - is one compiled function, captured once as a CUDA graph and replayed with no host synchronisation per
token. The host reads tokens once at the end, or once per chunk of tokens when it streams them or watches for the
end of sequence. On CPU the same compiled step runs in a Python loop. The key/value cache is HF's StaticCache;
sliding-window layers get full-length cache layers (the model's own masks keep the window), so every step is the
same graph. DeepSeek-V3's latent attention runs absorbed (moecompile.integrations.mla): the step attends over the
cached latents without expanding them into per-head keys and values.

`Generator` keeps the compiled functions, the cache and the captured graphs for one batch size and cache length;
`generate` keeps one Generator per model and shape and takes HF's GenerationConfig.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import weakref

import torch

from moecompile.core.errors import MoECompileError
from moecompile.integrations import finegrained_fp8, mla
from moecompile.runtime import graphs

WARMUP_STEPS = 2  # uncaptured runs of the step before capture: autotuning and allocations happen outside it
# Dynamo keeps the compiled prefill and step of every Generator (one per model, batch size, length; prefill also per
# prompt length) on the same two functions: room for that many, where its default limit is meant for one model.
RECOMPILE_LIMIT = 256
GREEDY_CHUNK = 1024  # vocabulary columns per first-stage program of the greedy choice
READ_EVERY = 16  # new tokens per host read when streaming or stopping at end of sequence

# GenerationConfig fields that would change the tokens and that the compiled step does not implement: each with the
# value (None aside) that leaves the tokens as they are.
UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "penalty_alpha": None, "num_return_sequences": 1,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
    "min_length": 0, "min_new_tokens": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "remove_invalid_values": False,
    "exponential_decay_length_penalty": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "sequence_bias": None, "guidance_scale": 1.0, "watermarking_config": None, "stop_strings": None, "max_time": None,
    "token_healing": False, "prompt_lookup_num_tokens": None, "return_dict_in_generate": False,
    "output_scores": False, "output_logits": False, "output_attentions": False, "output_hidden_states": False,
}


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


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling as HF's warpers do it, in HF's order: temperature, top-k, top-p, min-p. top_k None (or 0), top_p 1
    and min_p None switch that filter off; seed None draws one from torch's global generator."""
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature > 0:
            raise MoECompileError(f"sampling needs temperature > 0 (0 is greedy decoding), got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise MoECompileError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise MoECompileError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise MoECompileError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def structure(self) -> tuple:
        """What the compiled step specialises on; the values of temperature, top_p and min_p live in device
        tensors, so that changing them reuses the compiled step and its CUDA graph."""
        return self.top_k or None, self.top_p < 1, self.min_p is not None


def sample_token(logits: torch.Tensor, noise: torch.Tensor, temperature: torch.Tensor | float,
                 top_k: int | None = None, top_p: torch.Tensor | float | None = None,
                 min_p: torch.Tensor | float | None = None) -> torch.Tensor:
    """[batch, 1] tokens drawn from softmax(logits / temperature) restricted as HF's top-k, top-p and min-p warpers
    restrict it, with fixed shapes and no host synchronisation (safe to capture in a CUDA graph).

    noise: Exp(1) draws shaped like logits; the token is argmax(log p - log noise) (the exponential race: index i
    wins with probability p_i / sum p), so a seeded generator filling noise makes the choice reproducible. Each filter
    becomes a floor on the scaled logits (tokens below it are dropped): tokens tied with the last kept one are kept,
    where HF drops some of them by their sort position."""
    scores = logits.float() / temperature
    floor = None
    ranked = None  # the candidates' scores in ascending order, when top-p needs them
    if top_k is not None:
        top = scores.topk(min(top_k, scores.shape[-1]), -1).values
        floor = top[:, -1:]
        ranked = top.flip(-1)
    if top_p is not None:
        if ranked is None:
            ranked = scores.sort(-1).values
        cumulative = ranked.softmax(-1).cumsum(-1)
        # HF drops the tokens whose ascending cumulative probability is <= 1 - top_p, and keeps the most likely one
        dropped = (cumulative <= 1 - top_p).sum(-1, keepdim=True).clamp_max(ranked.shape[-1] - 1)
        kept = ranked.gather(-1, dropped)
        floor = kept if floor is None else torch.maximum(floor, kept)
    if min_p is not None:  # p >= min_p * max p, in logits
        kept = scores.amax(-1, keepdim=True) + torch.log(torch.as_tensor(min_p, dtype=scores.dtype))
        floor = kept if floor is None else torch.maximum(floor, kept)
    if floor is not None:
        scores = scores.masked_fill(scores < floor, float("-inf"))
    return greedy_token(scores - noise.clamp_min(torch.finfo(noise.dtype).tiny).log())


def next_token(logits: torch.Tensor, choice: dict) -> torch.Tensor:
    """The next token of each row, [batch, 1], as `choice` (Generator._configure) says: greedy or sampled, and rows
    that ended give the pad token."""
    if "noise" in choice:
        token = sample_token(logits, choice["noise"], choice["temperature"], choice.get("top_k"),
                             choice.get("top_p"), choice.get("min_p"))
    else:
        token = greedy_token(logits)
    if "eos" in choice:
        finished = choice["finished"]
        token = torch.where(finished, choice["pad"], token)
        finished.copy_(finished | (token == choice["eos"]).any(-1, keepdim=True))
    return token


class Generator:
    """Generation for one model, batch size and maximum length (prompt + new tokens).

    compile: run prefill and the decode step through the moecompile backend (False: the model as it is, eagerly).
    cuda_graph: capture the decode step as one CUDA graph (default: when the model is on a CUDA device); one graph
    per kind of call (padded prompts or not, greedy or the sampling filters used, stopping at end of sequence or not).
    options: moecompile backend options (see moecompile.backend.OPTIONS).
    absorb_mla: DeepSeek-V3 latent attention with kv_b_proj folded into the query and output (None: where the model
    has it; False: HF's attention, which expands the cached latents into every head's keys and values per step).
    """

    def __init__(self, model, batch_size: int, max_length: int, *, compile: bool = True,
                 cuda_graph: bool | None = None, options: dict | None = None, absorb_mla: bool | None = None):
        from moecompile.backend import moecompile_backend, resolve_options

        if batch_size < 1 or max_length < 2:
            raise MoECompileError(f"generation needs batch_size >= 1 and max_length >= 2, got {batch_size}, "
                                  f"{max_length}")
        self.model, self.batch_size, self.max_length = model, batch_size, max_length
        self.device = next(model.parameters()).device
        self.cuda_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        if self.cuda_graph and self.device.type != "cuda":
            raise MoECompileError("cuda_graph=True needs the model on a CUDA device")
        finegrained_fp8.enable(model)  # a FineGrainedFP8 model's FP8 modules on moecompile's ops (no Hub kernel)
        self.cache = static_cache(model, max_length)
        self.absorbed = mla.resolve(model, absorb_mla)  # the attention modules whose forward runs absorbed
        accepted = inspect.signature(model.forward).parameters
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
        self._cache_arg = "cache" if "cache" in accepted else "past_key_values"  # transformers renamed it
        long = dict(dtype=torch.long, device=self.device)
        self.tokens = torch.zeros(batch_size, 1, **long)  # the token each step reads
        self.positions = torch.zeros(batch_size, 1, **long)  # its position in each row
        self.column = torch.zeros(1, **long)  # the output column it writes
        self.out = torch.zeros(batch_size, max_length, **long)
        self.mask = None  # [batch, max_length] when the prompt is padded
        self._mask = torch.ones(batch_size, max_length, **long)  # self.mask's storage, kept for the captured graphs
        self.prefill_logits = None  # the prompt's last logits, [batch, vocab]
        # the token choice's device state: the compiled step reads it, the captured graphs keep its addresses
        self.rng = torch.Generator(device=self.device)
        scalar = dict(dtype=torch.float32, device=self.device)
        self._temperature, self._top_p, self._min_p = (torch.ones((), **scalar) for _ in range(3))
        self._noise = None  # [batch, vocab] Exp(1) draws, made on the first sampled call
        self._finished = torch.zeros(batch_size, 1, dtype=torch.bool, device=self.device)
        self._pad = torch.zeros((), **long)
        self._eos = {}  # [1, n] end-of-sequence ids, per n
        self._choice, self._choice_key = {}, ()
        self._graphs = {}
        self._compiled = compile
        self.vocab = self._initialise_cache()
        if compile:
            resolve_options(options)  # a mistake fails here, not at the first step

            def backend(gm, example_inputs):
                return moecompile_backend(gm, example_inputs, options=options)

            self._prefill = torch.compile(self._first, backend=backend, fullgraph=True, dynamic=False)
            self._step = torch.compile(self._decode_step, backend=backend, fullgraph=True, dynamic=False)
        else:
            self._prefill, self._step = self._first, self._decode_step

    @torch.no_grad()
    def _initialise_cache(self) -> int:
        """HF's cache allocates its tensors on first use: do that eagerly, not inside a compiled function. Returns
        the vocabulary size of the logits."""
        with mla.absorbed(self.absorbed):
            vocab = self._forward(self.tokens, self.positions, None).shape[-1]
        self.cache.reset()
        return vocab

    def _run(self, fn, *args):
        with mla.absorbed(self.absorbed), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return fn(*args)

    def _forward(self, input_ids, position_ids, attention_mask):
        """The last position's logits, [batch, vocab]."""
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         use_cache=True, **{self._cache_arg: self.cache}, **self._extra)
        return out.logits[:, -1]

    def _first(self, input_ids, position_ids, attention_mask, choice):
        logits = self._forward(input_ids, position_ids, attention_mask)
        return next_token(logits, choice), logits

    def _decode_step(self, tokens, positions, column, out, mask, choice):
        nxt = next_token(self._forward(tokens, positions, mask), choice)
        out.index_copy_(1, column, nxt)
        tokens.copy_(nxt)
        positions.add_(1)
        column.add_(1)

    def _draw_noise(self):
        if "noise" in self._choice:
            self._noise.exponential_(generator=self.rng)

    def _advance(self):
        self._draw_noise()  # inside the captured graph: the generator's registered state advances per replay
        self._run(self._step, self.tokens, self.positions, self.column, self.out, self.mask, self._choice)

    def _configure(self, sampling: Sampling | None, eos_token_id, pad_token_id) -> None:
        """Fill the token choice's device state for the next prefill and decode; seed the generator."""
        choice, key = {}, ()
        if sampling is not None:
            if self._noise is None:
                self._noise = torch.empty(self.batch_size, self.vocab, dtype=torch.float32, device=self.device)
            top_k, use_top_p, use_min_p = key = sampling.structure
            self._temperature.fill_(sampling.temperature)
            choice.update(noise=self._noise, temperature=self._temperature)
            if top_k is not None:
                choice["top_k"] = top_k
            if use_top_p:
                choice["top_p"] = self._top_p.fill_(sampling.top_p)
            if use_min_p:
                choice["min_p"] = self._min_p.fill_(sampling.min_p)
            self.rng.manual_seed(torch.randint(2 ** 62, ()).item() if sampling.seed is None else sampling.seed)
        eos = _token_list(eos_token_id)
        if eos:
            if len(eos) not in self._eos:
                self._eos[len(eos)] = torch.empty(1, len(eos), dtype=torch.long, device=self.device)
            self._eos[len(eos)].copy_(torch.tensor([eos]))
            self._pad.fill_(eos[0] if pad_token_id is None else pad_token_id)
            choice.update(eos=self._eos[len(eos)], pad=self._pad, finished=self._finished)
            key += ("eos", len(eos))
        self._choice, self._choice_key = choice, key

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                sampling: Sampling | None = None, eos_token_id: int | list[int] | None = None,
                pad_token_id: int | None = None) -> None:
        """Reset the cache, run the prompt, write it and the first new token into the output buffer. sampling None
        is greedy; with eos_token_id, rows give pad_token_id (default: the first end-of-sequence id) after ending."""
        batch, length = input_ids.shape
        if batch != self.batch_size or length >= self.max_length:
            raise MoECompileError(f"this Generator takes {self.batch_size} prompts shorter than {self.max_length} "
                                  f"tokens, got {batch} x {length}")
        self._configure(sampling, eos_token_id, pad_token_id)
        input_ids = input_ids.to(self.device)
        self.cache.reset()
        self._finished.zero_()
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None
        if attention_mask is None:
            positions = torch.arange(length, device=self.device).expand(batch, length)
            self.mask = None
        else:  # left padding: positions count real tokens; the mask covers the whole cache, later columns real
            attention_mask = attention_mask.to(self.device, torch.long)
            positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
            self.mask = self._mask
            self.mask.fill_(1)
            self.mask[:, :length] = attention_mask
        prompt_mask = self.mask[:, :length] if self.mask is not None else None
        self._draw_noise()
        first, self.prefill_logits = self._run(self._prefill, input_ids, positions, prompt_mask, self._choice)
        self.out[:, :length] = input_ids
        self.out[:, length:length + 1] = first
        self.tokens.copy_(first)
        self.positions.copy_(positions[:, -1:] + 1)
        self.column.fill_(length + 1)

    @torch.no_grad()
    def decode(self, steps: int) -> None:
        """Run `steps` decode steps after prefill (the graph of this kind of call is captured on its first use)."""
        if not self.cuda_graph:
            return self._uncaptured(steps)
        key = self._graph_key()
        done = 0
        if key not in self._graphs:
            if steps <= WARMUP_STEPS:
                return self._uncaptured(steps)
            # the warm-up runs are real steps; the graph advances the generator's state on every replay
            self._graphs[key], _ = graphs.capture(self._advance, warmup=WARMUP_STEPS, generators=(self.rng,))
            done = WARMUP_STEPS
        for _ in range(steps - done):
            self._graphs[key].replay()

    def _graph_key(self) -> tuple:
        return self.mask is not None, self._choice_key

    def _uncaptured(self, steps: int) -> None:
        for _ in range(steps):
            self._advance()

    def __call__(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None, *,
                 sampling: Sampling | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, streamer=None, read_every: int = READ_EVERY) -> torch.Tensor:
        """Prompt + up to max_new_tokens tokens, [batch, length + new], as HF's generate: rows that gave an
        end-of-sequence token give the pad token after it and the output ends when every row has ended. The host
        reads the tokens once at the end, or every `read_every` tokens with a streamer or end-of-sequence ids."""
        length = input_ids.shape[1]
        if max_new_tokens < 1 or length + max_new_tokens > self.max_length:
            raise MoECompileError(f"max_new_tokens must be in 1..{self.max_length - length} for this Generator, "
                                  f"got {max_new_tokens}")
        if read_every < 1:
            raise MoECompileError(f"read_every must be >= 1, got {read_every}")
        self.prefill(input_ids, attention_mask, sampling=sampling, eos_token_id=eos_token_id,
                     pad_token_id=pad_token_id)
        if streamer is not None:
            streamer.put(input_ids.cpu())  # as HF's generate: the prompt first (TextStreamer's skip_prompt)
        eos = _token_list(eos_token_id)
        if streamer is None and not eos:
            self.decode(max_new_tokens - 1)
            new = max_new_tokens
        else:
            new = self._decode_reading(length, max_new_tokens, eos, streamer, read_every)
        if streamer is not None:
            streamer.end()
        return self.out[:, :length + new].clone()

    def _decode_reading(self, length: int, max_new_tokens: int, eos: list[int], streamer, read_every: int) -> int:
        """Decode, reading the new tokens once per `read_every`: to the streamer, and to stop once every row has
        given an end-of-sequence token. Returns the number of new tokens the output keeps."""
        eos_ids = torch.tensor(eos, dtype=torch.long)
        ended = torch.zeros(self.batch_size, dtype=torch.bool)
        read, decoded = 0, 1  # the prefill gave the first new token
        # a first read before the capture waits for it: the warm-up steps and one replay
        first = read_every if not self.cuda_graph or self._graph_key() in self._graphs else \
            max(read_every, WARMUP_STEPS + 2)
        while read < max_new_tokens and not ended.all():
            upto = min(max_new_tokens, read + (read_every if read else first))
            self.decode(upto - decoded)
            decoded = upto
            block = self.out[:, length + read:length + upto].cpu()
            keep = block.shape[1]
            if eos:
                ended_at = ended[:, None] | (torch.isin(block, eos_ids).cumsum(-1) > 0)
                all_ended = ended_at.all(0)
                if bool(all_ended.any()):
                    keep = int(all_ended.int().argmax()) + 1
                ended = ended_at[:, -1]
            if streamer is not None:
                streamer.put(block[:, :keep])
            read += keep
        return read


def _token_list(ids) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, torch.Tensor):
        return ids.reshape(-1).tolist()
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def generation_settings(model, generation_config=None, **overrides):
    """HF's GenerationConfig as HF's generate resolves it: the given one (or an empty one), its unset fields from
    model.generation_config, then HF's defaults, then the keyword overrides; fields moecompile.generate does not
    implement and that would change the tokens are refused."""
    from transformers import GenerationConfig

    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    try:
        own = getattr(model, "generation_config", None)
        if own is not None:
            config.update(**own.to_dict(), defaults_only=True)
        defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
        if defaults is not None:
            config.update(**defaults(), defaults_only=True)
        unknown = config.update(**overrides)
    except ValueError as error:
        raise MoECompileError(f"generation config: {error}") from None
    if unknown:
        raise MoECompileError(f"generate got unknown arguments {sorted(unknown)} (neither its own nor "
                              "GenerationConfig fields)")
    unsupported = [f"{field}={getattr(config, field)!r}" for field, neutral in UNSUPPORTED.items()
                   if getattr(config, field, None) not in (None, neutral)]
    if unsupported:
        raise MoECompileError(f"moecompile.generate does not implement {', '.join(unsupported)}: it decodes greedily "
                              "or samples with temperature / top_k / top_p / min_p (use HF's generate for the rest)")
    return config


def sampling_of(config, seed: int | None = None) -> Sampling | None:
    """The Sampling a resolved GenerationConfig asks for; None for greedy (do_sample off, or temperature 0)."""
    if not config.do_sample or config.temperature == 0:
        return None
    return Sampling(temperature=float(config.temperature), top_k=config.top_k or None,
                    top_p=1.0 if config.top_p is None else float(config.top_p), min_p=config.min_p, seed=seed)


_generators: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def generate(model, input_ids: torch.Tensor, max_new_tokens: int | None = None, *, attention_mask=None,
             generation_config=None, streamer=None, seed: int | None = None, read_every: int = READ_EVERY,
             compile: bool = True, cuda_graph: bool | None = None, options: dict | None = None,
             absorb_mla: bool | None = None, **kwargs) -> torch.Tensor:
    """[batch, prompt + new tokens] as HF's `model.generate(input_ids, generation_config=..., **kwargs)` returns it.

    generation_config and kwargs are HF's (max_new_tokens, do_sample, temperature, top_k, top_p, min_p,
    eos_token_id, pad_token_id), resolved as HF's generate resolves them (model.generation_config fills what is
    unset); fields that would change the tokens and that are not implemented are refused. seed makes sampling
    reproducible (None: drawn from torch's global generator, so torch.manual_seed does too). streamer: HF's
    BaseStreamer (put, end), given the prompt, then the new tokens as [batch, n] blocks every read_every tokens.
    absorb_mla: Generator's (DeepSeek-V3's latent attention absorbed where the model has it). The compiled
    functions and the captured graphs are kept per model, batch size, length and options, so later
    calls with the same shapes start decoding at once."""
    config = generation_settings(model, generation_config, **kwargs)
    batch, length = input_ids.shape
    if max_new_tokens is None:
        max_new_tokens = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - length
    if max_new_tokens < 1:
        raise MoECompileError(f"max_new_tokens must be >= 1, got {max_new_tokens} (max_length {config.max_length} "
                              f"and a {length}-token prompt)")
    key = (batch, length + max_new_tokens, compile, cuda_graph, repr(sorted((options or {}).items())), absorb_mla)
    per_model = _generators.setdefault(model, {})
    if key not in per_model:
        per_model[key] = Generator(model, batch, length + max_new_tokens, compile=compile, cuda_graph=cuda_graph,
                                   options=options, absorb_mla=absorb_mla)
    return per_model[key](input_ids, max_new_tokens, attention_mask, sampling=sampling_of(config, seed),
                          eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, streamer=streamer,
                          read_every=read_every)


# what HF's generate hands a custom_generate callable that moecompile's step implements (from the GenerationConfig)
HF_PROCESSORS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                 "MaxLengthCriteria", "EosTokenCriteria")


def custom_generate(model, input_ids: torch.Tensor, logits_processor=None, stopping_criteria=None,
                    generation_config=None, *, seed: int | None = None, read_every: int = READ_EVERY,
                    compile: bool = True, cuda_graph: bool | None = None, options: dict | None = None,
                    absorb_mla: bool | None = None, **model_kwargs) -> torch.Tensor:
    """moecompile.generate's loop behind HF's own generate:

        model.generate(input_ids, custom_generate=moecompile.generation.custom_generate, max_new_tokens=64, ...)

    HF prepares the GenerationConfig, its logits processors and stopping criteria, then calls this in place of its
    decoding loop; seed, read_every, compile, cuda_graph, options and absorb_mla pass through HF's keyword
    arguments. Logits processors or stopping criteria beyond those the GenerationConfig makes, and a cache of the
    caller's, are refused. HF keeps the streamer from custom_generate callables (it gets the prompt only): stream with
    moecompile.generate."""
    others = sorted({type(p).__name__ for p in [*(logits_processor or ()), *(stopping_criteria or ())]}
                    - set(HF_PROCESSORS))
    if others:
        raise MoECompileError(f"custom_generate does not implement the logits processors or stopping criteria "
                              f"{', '.join(others)}")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if getattr(cache, "_is_user_defined", False):
        raise MoECompileError("custom_generate keeps its own cache: generate without past_key_values / cache")
    return generate(model, input_ids, generation_config.max_length - input_ids.shape[1],
                    attention_mask=model_kwargs.get("attention_mask"), generation_config=generation_config,
                    seed=seed, read_every=read_every, compile=compile, cuda_graph=cuda_graph, options=options,
                    absorb_mla=absorb_mla)
