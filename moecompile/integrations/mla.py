"""Absorbed multi-head latent attention (MLA) for decoding DeepSeek-V3-family Hugging Face models.

HF's DeepseekV3Attention caches the latent of each token (c_kv after kv_a_layernorm, kv_lora_rank wide, and the
shared rope key k_pe after RoPE, qk_rope_head_dim wide: HF's StaticCache allocates exactly these, one "head" each),
then at every step expands the whole cache through kv_b_proj into per-head keys and values. Absorbed, kv_b_proj's
key part W_UK folds into the query and its value part W_UV into the output:

    q_latent = q_nope . W_UK                        [batch, heads, tokens, kv_lora_rank]
    scores   = (q_latent . c_kv + q_pe . k_pe) * scaling, masked, softmax in float32
    out      = (probs . c_kv) . W_UV                [batch, heads, tokens, v_head_dim] -> o_proj

so a step reads kv_lora_rank + qk_rope_head_dim values per cached token and layer and computes nothing per cached
token beyond the two score products and one weighted sum. A long query (a prompt) is cheaper expanded, and keeps
HF's own forward (`absorbs`); both write the same cache.

`absorbed(modules)` swaps the forward of each DeepseekV3Attention instance (found by class) for the duration of a
`with` block and puts HF's back after it; `moecompile.generation.Generator` wraps its prefill and decode steps in it.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from moecompile.core.errors import MoECompileError


def _hf_module():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    return modeling_deepseek_v3


def mla_attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every DeepseekV3Attention (or subclass) instance of model, in module order."""
    cls = _hf_module().DeepseekV3Attention
    return [m for m in model.modules() if isinstance(m, cls)]


def absorbable(attention: torch.nn.Module) -> bool:
    """kv_b_proj is a linear over a floating weight of 16 bits or more (an FP8 checkpoint's needs its scales)."""
    linear = attention.kv_b_proj
    return isinstance(linear, torch.nn.Linear) and linear.weight.dtype.is_floating_point and \
        linear.weight.element_size() >= 2


def resolve(model: torch.nn.Module, absorb_mla: bool | None) -> list[torch.nn.Module]:
    """The attention modules to absorb: None (the default) means every MLA module of the model where the model has
    MLA and all of them can be absorbed; True requires that; False absorbs none."""
    if absorb_mla is False:
        return []
    found = mla_attentions(model)
    if absorb_mla is None:
        return found if all(absorbable(m) for m in found) else []
    if not found:
        raise MoECompileError(f"absorb_mla=True needs a model with DeepSeek-V3 latent attention; "
                              f"{type(model).__name__} has none")
    if not all(absorbable(m) for m in found):
        raise MoECompileError("absorb_mla=True needs kv_b_proj as a plain linear over a 16- or 32-bit weight "
                              f"(got {type(found[0].kv_b_proj).__name__}, {found[0].kv_b_proj.weight.dtype})")
    return found


def absorbs(attention: torch.nn.Module, tokens: int) -> bool:
    """Whether a query of `tokens` tokens per row takes the absorbed path: when it costs fewer multiply-adds per
    head and cached token (scores over kv_lora_rank + rope, sum over kv_lora_rank) than expanding the cache through
    kv_b_proj once and attending per head."""
    rank, nope, rope, value = (attention.kv_lora_rank, attention.qk_nope_head_dim, attention.qk_rope_head_dim,
                               attention.v_head_dim)
    return tokens * (2 * rank + rope) < rank * (nope + value) + tokens * (nope + rope + value)


def _rotary(attention: torch.nn.Module):
    """HF's RoPE function for attention's config, looked up outside any traced code: Dynamo cannot trace an import of
    transformers' lazy modules."""
    hf = _hf_module()
    return hf.apply_rotary_pos_emb_interleave if attention.config.rope_interleave else hf.apply_rotary_pos_emb


def absorbed_forward(attention, rotate, hidden_states: torch.Tensor, position_embeddings, attention_mask=None,
                     cache=None, past_key_values=None, **kwargs):
    """DeepseekV3Attention.forward's result (output, None) computed in the latent space, `rotate` applying RoPE
    (`_rotary`); HF's own forward where the query is long (`absorbs`)."""
    batch, tokens = hidden_states.shape[:-1]
    cache = cache if cache is not None else past_key_values  # transformers renamed it
    if not absorbs(attention, tokens):
        return type(attention).forward(attention, hidden_states, position_embeddings, attention_mask, cache=cache,
                                       **kwargs)
    heads, rank, nope, rope = (attention.num_heads, attention.kv_lora_rank, attention.qk_nope_head_dim,
                               attention.qk_rope_head_dim)
    if attention.q_lora_rank is None:
        q = attention.q_proj(hidden_states)
    else:
        q = attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(hidden_states)))
    q = q.view(batch, tokens, heads, attention.qk_head_dim).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    c_kv, k_pe = torch.split(attention.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    c_kv = attention.kv_a_layernorm(c_kv).view(batch, 1, tokens, rank)
    k_pe = k_pe.view(batch, 1, tokens, rope)
    cos, sin = position_embeddings
    q_pe, k_pe = rotate(q_pe, k_pe, cos, sin)
    if cache is not None:  # HF's call: the cache layer keeps [batch, 1, positions, width] and writes in place
        c_kv, k_pe = cache.update(c_kv, k_pe, attention.layer_idx, kwargs=kwargs)
    length = c_kv.shape[-2]
    # views of kv_b_proj's weight, per head: its key rows then its value rows
    w_uk, w_uv = attention.kv_b_proj.weight.view(heads, nope + attention.v_head_dim, rank).split(
        [nope, attention.v_head_dim], dim=1)
    q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)
    # heads fold into the query rows, so the cache is read once per row, not once per head
    c_kv = c_kv.reshape(batch, length, rank)
    scores = torch.bmm(q_latent.reshape(batch, heads * tokens, rank), c_kv.transpose(1, 2)).float() + torch.bmm(
        q_pe.reshape(batch, heads * tokens, rope), k_pe.reshape(batch, length, rope).transpose(1, 2)).float()
    scores = scores.view(batch, heads, tokens, length) * attention.scaling
    scores = _masked(scores, attention_mask, tokens, length)
    probs = scores.softmax(-1).to(c_kv.dtype)
    out_latent = torch.bmm(probs.view(batch, heads * tokens, length), c_kv).view(batch, heads, tokens, rank)
    out = torch.einsum("bhtr,hvr->bthv", out_latent, w_uv).reshape(batch, tokens, heads * attention.v_head_dim)
    return attention.o_proj(out), None


def _masked(scores: torch.Tensor, mask, tokens: int, length: int) -> torch.Tensor:
    """scores [batch, heads, tokens, length] under the mask HF hands the attention: boolean (True attends) or
    additive, [batch, 1, tokens, length]; None is causal from the first position when the query has several tokens,
    as HF's SDPA path reads it (is_causal), and no mask for one token."""
    if mask is None:
        if tokens == 1:
            return scores
        mask = torch.ones(tokens, length, dtype=torch.bool, device=scores.device).tril()[None, None]
    if mask.dim() != 4:
        raise MoECompileError(f"absorbed MLA takes HF's 4-d attention mask, got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        # the lowest finite score, not -inf: a padded query row that attends nowhere stays finite, as in HF's eager
        return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores + mask


_ABSORBED = "_moecompile_absorbed_forward"


@contextlib.contextmanager
def absorbed(modules: list[torch.nn.Module]):
    """HF's decoder layers call the absorbed forward of `modules` inside the block; HF's own forward after it. Each
    module gets the same forward object every time: Dynamo guards on its identity, so a new one would recompile
    every graph that calls it at every entry."""
    for module in modules:
        if _ABSORBED not in module.__dict__:
            module.__dict__[_ABSORBED] = functools.partial(absorbed_forward, module, _rotary(module))
        module.forward = module.__dict__[_ABSORBED]
    try:
        yield
    finally:
        for module in modules:
            del module.forward
