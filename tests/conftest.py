"""Shared fixtures: tiny random Hugging Face models (float32, CPU, eval mode, fixed seed) and a runner."""
from __future__ import annotations

import gc
import os

import torch

# tracing and compiling allocate many short-lived objects: fewer collections of the young generations, and so fewer
# full collections of the large heap that torch and transformers leave
gc.set_threshold(100_000, 10, 10)

# Triton kernels run in Triton's interpreter wherever there is no GPU (CI); must be set before triton compiles them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

SEED = 0
VOCAB = 100
BATCH, SEQ = 2, 8  # 16 tokens per forward
TINY_FAMILIES = ("gpt2", "bert", "llama", "qwen2", "mistral")
# a larger init than HF's 0.02 so that the FFNs contribute visibly to the outputs (exactness checks mean more)
INIT_RANGE = 0.2


def _tiny_config(family: str, **overrides):
    import transformers as tf

    if family == "gpt2":
        kw = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0)
        cls, model_cls = tf.GPT2Config, tf.GPT2LMHeadModel
    elif family == "bert":
        kw = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                  vocab_size=VOCAB, max_position_embeddings=64)
        cls, model_cls = tf.BertConfig, tf.BertModel
    elif family in ("llama", "qwen2", "mistral"):
        kw = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                  eos_token_id=0)
        cls, model_cls = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        }[family]
    else:
        raise ValueError(f"unknown tiny family {family!r}")
    kw["initializer_range"] = INIT_RANGE
    kw.update(overrides)
    config = cls(**kw)
    return config, model_cls


def make_tiny_model(family: str, seed: int = SEED, random_bias: bool = True, **overrides) -> torch.nn.Module:
    """A freshly built tiny random model of `family`, in eval mode, float32 on CPU (deterministic for a seed).

    HF initialises every bias to zero; with random_bias the biases are drawn too, so that conversions that
    mishandle a bias (dropped, added per expert instead of once, ...) show in the outputs."""
    config, model_cls = _tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    if random_bias:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, INIT_RANGE)
    return model


def tiny_token_ids(batch: int = BATCH, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=gen)


def run_model(model: torch.nn.Module, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Run on fixed token ids (no grad); logits for LM heads, last_hidden_state otherwise."""
    ids = tiny_token_ids() if ids is None else ids
    with torch.no_grad():
        out = model(input_ids=ids)
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


@pytest.fixture(scope="session")
def make_tiny():
    """Factory fixture: make_tiny(family, seed=0, **config_overrides) -> fresh tiny model in eval mode."""
    return make_tiny_model


@pytest.fixture(scope="session")
def run():
    """run(model, ids=None) -> logits or last_hidden_state on fixed token ids."""
    return run_model


@pytest.fixture
def token_ids() -> torch.Tensor:
    return tiny_token_ids()


@pytest.fixture(params=TINY_FAMILIES)
def tiny_family(request) -> str:
    return request.param


@pytest.fixture
def tiny_model(tiny_family):
    return make_tiny_model(tiny_family)


@pytest.fixture
def gpt2_model():
    return make_tiny_model("gpt2")


@pytest.fixture
def bert_model():
    return make_tiny_model("bert")


@pytest.fixture
def llama_model():
    return make_tiny_model("llama")


@pytest.fixture
def qwen2_model():
    return make_tiny_model("qwen2")


@pytest.fixture
def mistral_model():
    return make_tiny_model("mistral")


class MoEOpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """With it active, `names` collects the moecompile ops dispatched (e.g. "moecompile::experts_train")."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "moecompile":
            self.names.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.fixture
def moe_op_log():
    """Factory fixture: `with moe_op_log() as log: ...` then log.names."""
    return MoEOpLog
