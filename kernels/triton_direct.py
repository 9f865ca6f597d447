"""Triton expert FFNs over unsorted token assignments, for batches of a few tokens (decode): no sort, no dispatched
copy of the rows, no separate combine.

    routed_experts(x, weights, ids, ...)[t] = sum_j weights[t, j] * FFN_{ids[t, j]}(x[t])

Two launches: the first projection (+ bias, activation) per (assignment, column tile), reading the assignment's
expert id and its token's row directly; the second projection per (token, column tile), looping over the token's
k experts and folding their routing weights into the sum, so the combine is its epilogue. Each program streams a
narrow tile of one expert's weights as a matrix-vector product, and each hit expert's weights are read once when
the tokens' experts are distinct (always for one token). Dropped assignments (id outside 0..E-1 or weight 0) add
nothing and read nothing. Deterministic: no atomics. Math in float32; the activation is stored in x's dtype
between the projections, as the grouped kernels store it.
"""
import torch
import triton
import triton.language as tl

from moecompile.kernels.triton_moe import ACTIVATION_IDS, _bias_activation


def _in_configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in ((8, 256, 2, 4), (16, 256, 4, 4), (16, 128, 2, 5), (32, 128, 4, 4),
                                 (8, 512, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3))]


def _out_configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in ((8, 256, 2, 4), (16, 256, 4, 4), (16, 128, 2, 5), (4, 512, 2, 4),
                                 (8, 512, 4, 3), (32, 128, 4, 4), (4, 256, 2, 6), (8, 128, 2, 8), (4, 128, 1, 8))]


@triton.jit
def _direct_ffn_in_kernel(x_ptr, ids_ptr, w_ptr, bias_ptr, out_ptr, assignments, top_k, num_experts,
                          hidden: tl.constexpr, width: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                          ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[a, cols] = act(x[a // top_k] W_in[ids[a]][cols]^T + b) (gated: act(gate) * up), one program per
    (assignment a, column tile)."""
    tiles_n: tl.constexpr = (width + BLOCK_N - 1) // BLOCK_N
    a = tl.program_id(0) // tiles_n
    pid_n = tl.program_id(0) % tiles_n
    expert = tl.load(ids_ptr + a)
    if (expert >= 0) & (expert < num_experts):
        x_row = x_ptr + (a // top_k).to(tl.int64) * hidden
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < width
        in_width: tl.constexpr = 2 * width if GATED else width
        w_base = w_ptr + expert.to(tl.int64) * in_width * hidden
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < hidden
            xk = tl.load(x_row + ks, mask=kmask, other=0.0).to(tl.float32)[None, :]
            wmask = cmask[:, None] & kmask[None, :]
            w = tl.load(w_base + cols[:, None].to(tl.int64) * hidden + ks[None, :], mask=wmask, other=0.0)
            acc += w.to(tl.float32) * xk
            if GATED:
                wu = tl.load(w_base + (width + cols[:, None]).to(tl.int64) * hidden + ks[None, :], mask=wmask,
                             other=0.0)
                acc_up += wu.to(tl.float32) * xk
        out = _bias_activation(tl.sum(acc, axis=1)[None, :], tl.sum(acc_up, axis=1)[None, :], bias_ptr, expert,
                               cols, cmask, width, HAS_BIAS, GATED, ACT)
        tl.store(out_ptr + a.to(tl.int64) * width + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=cmask[None, :])


@triton.jit
def _direct_ffn_out_kernel(a_ptr, ids_ptr, weights_ptr, w_ptr, bias_ptr, out_ptr, tokens, num_experts,
                           TOP_K: tl.constexpr, K_PAD: tl.constexpr, hidden: tl.constexpr, width: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, cols] = sum_j weights[t, j] * (a[t k + j] W_out[ids[t, j]][cols]^T + b_out[ids[t, j]][cols]), one
    program per (token t, column tile); one loop over the k experts' K steps, so loads pipeline across experts. The
    token's ids and weights are read once, before the loop: no weight load waits on a load of the same step."""
    tiles_n: tl.constexpr = (hidden + BLOCK_N - 1) // BLOCK_N
    steps: tl.constexpr = (width + BLOCK_K - 1) // BLOCK_K
    token = tl.program_id(0) // tiles_n
    cols = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hidden
    slots = tl.arange(0, K_PAD)
    smask = slots < TOP_K
    all_ids = tl.load(ids_ptr + token * TOP_K + slots, mask=smask, other=-1)
    all_weights = tl.load(weights_ptr + token * TOP_K + slots, mask=smask, other=0.0).to(tl.float32)
    all_kept = (all_ids >= 0) & (all_ids < num_experts) & (all_weights != 0.0)
    all_weights = tl.where(all_kept, all_weights, 0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i in range(0, TOP_K * steps):
        j = i // steps
        expert = tl.sum(tl.where(slots == j, all_ids, 0), axis=0)
        weight = tl.sum(tl.where(slots == j, all_weights, 0.0), axis=0)
        ks = (i % steps) * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = ks < tl.where(weight != 0.0, width, 0)  # a dropped assignment reads nothing
        ak = tl.load(a_ptr + (token * TOP_K + j).to(tl.int64) * width + ks, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + expert.to(tl.int64) * hidden * width + cols[:, None].to(tl.int64) * width + ks[None, :],
                    mask=cmask[:, None] & kmask[None, :], other=0.0)
        acc += w.to(tl.float32) * (ak * weight)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        for j in tl.static_range(TOP_K):
            expert = tl.sum(tl.where(slots == j, all_ids, 0), axis=0)
            weight = tl.sum(tl.where(slots == j, all_weights, 0.0), axis=0)
            b = tl.load(bias_ptr + expert.to(tl.int64) * hidden + cols, mask=cols < tl.where(weight != 0.0, hidden, 0),
                        other=0.0)
            out += weight * b.to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=cmask)


_direct_ffn_in_tuned = triton.autotune(configs=_in_configs(), key=["hidden", "width", "GATED", "assignments"])(
    _direct_ffn_in_kernel)
_direct_ffn_out_tuned = triton.autotune(configs=_out_configs(), key=["hidden", "width", "TOP_K", "tokens"])(
    _direct_ffn_out_kernel)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_in: torch.Tensor, b_in, w_out, b_out,
                   activation: str, gated: bool, config: dict | None = None) -> torch.Tensor:
    """[tokens, hidden]: each token's k experts' FFN outputs, weighted by its routing weights and summed. x [T, H],
    weights / ids [T, k], w_in [E, (2)F, H], w_out [E, H, F]. `config` fixes both kernels' tiles (tests, the
    interpreter: {"in": {BLOCK_N, BLOCK_K}, "out": {...}}); otherwise each is autotuned per shape."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, in_width, _ = w_in.shape
    width = in_width // 2 if gated else in_width
    out = x.new_empty(tokens, hidden)
    if tokens == 0:
        return out
    x, ids = x.contiguous(), ids.contiguous()
    w_in, w_out = w_in.contiguous(), w_out.contiguous()
    act = x.new_empty(tokens * top_k, width)
    first = dict(hidden=hidden, width=width, HAS_BIAS=b_in is not None, GATED=gated,
                 ACT=ACTIVATION_IDS[activation] if activation else -1)
    if config is None:
        _direct_ffn_in_tuned[lambda meta: (tokens * top_k * triton.cdiv(width, meta["BLOCK_N"]),)](
            x, ids, w_in, b_in if b_in is not None else x, act, tokens * top_k, top_k, num_experts, **first)
        _direct_ffn_out_tuned[lambda meta: (tokens * triton.cdiv(hidden, meta["BLOCK_N"]),)](
            act, ids, weights.contiguous(), w_out, b_out if b_out is not None else x, out, tokens, num_experts,
            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), hidden=hidden, width=width, HAS_BIAS=b_out is not None)
        return out
    _direct_ffn_in_kernel[(tokens * top_k * triton.cdiv(width, config["in"]["BLOCK_N"]),)](
        x, ids, w_in, b_in if b_in is not None else x, act, tokens * top_k, top_k, num_experts, **first,
        **config["in"])
    _direct_ffn_out_kernel[(tokens * triton.cdiv(hidden, config["out"]["BLOCK_N"]),)](
        act, ids, weights.contiguous(), w_out, b_out if b_out is not None else x, out, tokens, num_experts,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), hidden=hidden, width=width, HAS_BIAS=b_out is not None,
        **config["out"])
    return out
