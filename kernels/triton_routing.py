"""Triton kernels for routing and dispatch: top-k over the router scores, and the stable counting sort of the
assignments by expert with the token rows copied into expert order. No host synchronisation, no radix sort.

Layout as in kernels/reference.py: assignment a = token * k + slot; dispatch orders the assignments by expert,
token order inside an expert, dropped ones (id E) last; offsets are the groups' cumulative ends.
They run on CUDA and, for testing, on CPU under TRITON_INTERPRET=1.
"""
import torch
import triton
import triton.language as tl

from moecompile.kernels.triton_moe import HAS_GRID_DEPENDENCY, dependent_launch

SCORING_IDS = {"softmax": 0, "sigmoid": 1}
MAX_EXPERTS = 1024  # one token's scores live in registers
_RANK_BLOCK = 64  # assignments per program of the rank kernel (each compared with the block's earlier ones)
_SCAN_CHUNK = 1024  # rank blocks per step of a bin's running sum
# Up to this many assignments (decode) one kernel sorts and copies: each program compares its assignments with all
# of them (quadratic, but one launch instead of the counting sort's several).
SMALL_DISPATCH = 1024
# Up to this many (tokens x experts, padded to powers of 2) route_dispatch runs as one launch: every program
# computes the top-k of all the tokens (few: decode) and then dispatches its share of the assignments.
SMALL_ROUTE = 4096


@triton.jit
def _best_groups(choice, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr):
    """choice with the experts outside the TOPK_GROUP best groups at -inf; a group's score is the sum of its two best
    experts (DeepSeek-V3's rule; E_PAD experts, N_GROUP equal groups)."""
    size: tl.constexpr = E_PAD // N_GROUP
    grouped = tl.reshape(choice, (BLOCK_T, N_GROUP, size))
    best = tl.max(grouped, axis=2)
    group_score = best
    if size > 1:
        i = tl.arange(0, size)[None, None, :]
        first = tl.min(tl.where(grouped == best[:, :, None], i, size), axis=2)
        group_score = best + tl.max(tl.where(i == first[:, :, None], float("-inf"), grouped), axis=2)
    g = tl.arange(0, N_GROUP)[None, :]
    keep = tl.zeros((BLOCK_T, N_GROUP), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        top = tl.max(group_score, axis=1)
        pick = tl.min(tl.where(group_score == top[:, None], g, N_GROUP), axis=1)
        keep = tl.where(g == pick[:, None], 1, keep)
        group_score = tl.where(g == pick[:, None], float("-inf"), group_score)
    kept = tl.reshape(tl.broadcast_to(keep[:, :, None], (BLOCK_T, N_GROUP, size)), (BLOCK_T, E_PAD))
    return tl.where(kept != 0, choice, float("-inf"))


@triton.jit
def _selection(logits_ptr, bias_ptr, tok, tmask, num_experts, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
               E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr,
               N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr):
    """(scores [tokens, E_PAD], the selected ones' scores [tokens, K_PAD], their ids, which experts each token chose
    [tokens, E_PAD]) of the tokens `tok`: scores (softmax or sigmoid), the top_k by score + bias (lowest id first on
    ties) among the TOPK_GROUP best of N_GROUP expert groups."""
    e = tl.arange(0, E_PAD)
    emask = e < num_experts
    x = tl.load(logits_ptr + tok[:, None].to(tl.int64) * num_experts + e[None, :],
                mask=tmask[:, None] & emask[None, :], other=0.0).to(tl.float32)
    x = tl.where(emask[None, :], x, float("-inf"))
    if SCORING == 0:
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = p / tl.sum(p, axis=1)[:, None]
    else:
        scores = tl.sigmoid(x)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + e, mask=emask, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(emask[None, :], choice, float("-inf"))
    if N_GROUP > 1:
        choice = _best_groups(choice, BLOCK_T, E_PAD, N_GROUP, TOPK_GROUP)
    # the choices as int32 ordered as the floats are: a warp reduces them in one instruction (redux.sync)
    bits = choice.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    slot = tl.arange(0, K_PAD)
    top_s = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    top_id = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    chosen = tl.zeros((BLOCK_T, E_PAD), dtype=tl.int1)
    for j in tl.static_range(TOP_K):
        best = tl.max(ordered, axis=1)
        pick = tl.min(tl.where(ordered == best[:, None], e[None, :], E_PAD), axis=1)
        hit = e[None, :] == pick[:, None]
        if HAS_BIAS or N_GROUP > 1:  # the choice is not the score: read it
            w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        else:  # the best choice's float back from its ordered bits
            w = (best ^ ((best >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        ordered = tl.where(hit, -2147483648, ordered)
        chosen = chosen | hit
        top_s = tl.where(slot[None, :] == j, w[:, None], top_s)
        top_id = tl.where(slot[None, :] == j, pick[:, None], top_id)
    return scores, top_s, top_id, chosen


@triton.jit
def _top_k(logits_ptr, bias_ptr, tok, tmask, num_experts, scaling, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
           E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr,
           RENORM: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr):
    """(weights, ids) [tokens, K_PAD] and the chosen experts [tokens, E_PAD] of the tokens `tok`: _selection's, the
    weights its scores (without the bias), optionally renormalised to sum to 1, times scaling."""
    _, top_w, top_id, chosen = _selection(logits_ptr, bias_ptr, tok, tmask, num_experts, TOP_K, K_PAD, E_PAD,
                                          BLOCK_T, SCORING, HAS_BIAS, N_GROUP, TOPK_GROUP)
    if RENORM:
        top_w = top_w / (tl.sum(top_w, axis=1)[:, None] + 1e-20)
    return top_w * scaling, top_id, chosen


@triton.jit
def _topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, rank_ptr, counts_ptr, tokens, num_experts, scaling,
                 TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                 SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, N_GROUP: tl.constexpr,
                 TOPK_GROUP: tl.constexpr, RANK: tl.constexpr, PDL: tl.constexpr):
    """_top_k of a block of tokens, stored. RANK: also what dispatch's rank kernel computes with the block's
    assignments as its block (each one's rank among the block's earlier ones to its expert, the block's count per
    expert, expert-major), from the choices already in registers. PDL: launched as a programmatic dependent
    (dependent_launch)."""
    dependent_launch(PDL)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < tokens
    top_w, top_id, chosen = _top_k(logits_ptr, bias_ptr, tok, tmask, num_experts, scaling, TOP_K, K_PAD, E_PAD,
                                   BLOCK_T, SCORING, HAS_BIAS, RENORM, N_GROUP, TOPK_GROUP)
    slot = tl.arange(0, K_PAD)
    out = tok[:, None].to(tl.int64) * TOP_K + slot[None, :]
    smask = tmask[:, None] & (slot[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=smask)
    tl.store(ids_ptr + out, top_id.to(tl.int64), mask=smask)
    if RANK:  # a token's choices are distinct experts: its rank is the count of earlier tokens choosing the same
        chose = (chosen & tmask[:, None]).to(tl.int32)
        tl.store(rank_ptr + out, tl.gather(tl.cumsum(chose, axis=0) - chose, top_id, axis=1), mask=smask)
        e = tl.arange(0, E_PAD)
        tl.store(counts_ptr + e * tl.num_programs(0) + tl.program_id(0), tl.sum(chose, axis=0),
                 mask=e < num_experts)


@triton.jit
def _topk_backward_kernel(logits_ptr, bias_ptr, ids_ptr, grad_w_ptr, grad_ptr, tokens, num_experts, scaling,
                          TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                          SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                          N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr):
    """The logits' gradient of _topk_kernel's weights for a block of tokens, from the weights' gradient: the
    selection recomputed (as before any capacity drop), a dropped slot (id E) contributing nothing."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < tokens
    scores, top_s, top_id, _ = _selection(logits_ptr, bias_ptr, tok, tmask, num_experts, TOP_K, K_PAD, E_PAD,
                                          BLOCK_T, SCORING, HAS_BIAS, N_GROUP, TOPK_GROUP)
    slot = tl.arange(0, K_PAD)
    at = tok[:, None].to(tl.int64) * TOP_K + slot[None, :]
    smask = tmask[:, None] & (slot[None, :] < TOP_K)
    kept = tl.load(ids_ptr + at, mask=smask, other=num_experts) < num_experts
    g = tl.where(kept, tl.load(grad_w_ptr + at, mask=smask, other=0.0).to(tl.float32), 0.0) * scaling
    if RENORM:  # w_j = s_j / (sum of the selected s + eps)
        denom = tl.sum(top_s, axis=1)[:, None] + 1e-20
        g = (g - tl.sum(g * top_s, axis=1)[:, None] / denom) / denom
    e = tl.arange(0, E_PAD)
    grad_scores = tl.zeros((BLOCK_T, E_PAD), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        g_j = tl.sum(tl.where(slot[None, :] == j, g, 0.0), axis=1)
        id_j = tl.sum(tl.where(slot[None, :] == j, top_id, 0), axis=1)
        grad_scores += tl.where(e[None, :] == id_j[:, None], g_j[:, None], 0.0)
    if SCORING == 0:
        grad = scores * (grad_scores - tl.sum(grad_scores * scores, axis=1)[:, None])
    else:
        grad = grad_scores * scores * (1.0 - scores)
    tl.store(grad_ptr + tok[:, None].to(tl.int64) * num_experts + e[None, :], grad,
             mask=tmask[:, None] & (e < num_experts)[None, :])


def groups_supported(num_experts: int, n_group: int, topk_group: int) -> bool:
    """Whether the kernels take this expert grouping: one group, or equal groups of a power-of-2 expert count."""
    return n_group == 1 or (num_experts == triton.next_power_of_2(num_experts) and num_experts % n_group == 0
                            and 1 <= topk_group <= n_group)


def _selection_launch(tokens: int, num_experts: int, top_k: int, renormalize: bool, scoring: str, correction_bias,
                      n_group: int, topk_group: int, block_t: int, num_warps: int) -> tuple[tuple[int], dict]:
    """(grid, tiles and constants) of a kernel over _selection's token blocks of block_t tokens: topk's and its
    backward's."""
    return (triton.cdiv(tokens, block_t),), dict(
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts), BLOCK_T=block_t,
        SCORING=SCORING_IDS[scoring], HAS_BIAS=correction_bias is not None, RENORM=renormalize, N_GROUP=n_group,
        TOPK_GROUP=topk_group, num_warps=num_warps)


def _selection_tile(tokens: int, num_experts: int, ranked: bool = False,
                    full_block_warps: int = 8) -> tuple[int, int]:
    """(tokens a program, warps) over _selection's blocks: up to 4,096 scores a block (8 tokens where topk also ranks
    its assignments), a full block on full_block_warps, decode's few scores on fewer (one warp's reductions). topk's
    defaults as bench/results/gpu-routing-kernels.md timed them at prefill; its backward keeps 4 warps."""
    e_pad = triton.next_power_of_2(num_experts)
    block_t = max(1, min(8 if ranked else 64, 4096 // e_pad, triton.next_power_of_2(tokens)))
    scores = block_t * e_pad
    return block_t, full_block_warps if scores >= 4096 else max(1, min(4, scores // 256))


def topk(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
         correction_bias: torch.Tensor | None = None, scaling_factor: float = 1.0, n_group: int = 1,
         topk_group: int = 1, pdl: bool = False, block_t: int | None = None, num_warps: int | None = None,
         ranked: bool = False):
    """(weights [T, k] float32, ids [T, k] int64) as kernels/reference.py's route_grouped (groups_supported); pdl:
    launched as a programmatic dependent (sm_90+, Triton with triton_moe.HAS_GRID_DEPENDENCY); block_t, num_warps:
    the tile's overrides (_selection_tile's by default). ranked: (weights, ids, ranks), ranks what dispatch would
    compute first (its `ranks`), in the same launch."""
    tokens, num_experts = router_logits.shape
    device = router_logits.device
    default_block_t, default_warps = _selection_tile(tokens, num_experts, ranked)
    block_t, num_warps = block_t or default_block_t, num_warps or default_warps
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    grid, meta = _selection_launch(tokens, num_experts, top_k, renormalize, scoring, correction_bias, n_group,
                                   topk_group, block_t, num_warps)
    rank = torch.empty(tokens, top_k, dtype=torch.int32, device=device) if ranked else ids
    counts = torch.empty(num_experts, grid[0], dtype=torch.int32, device=device) if ranked else ids
    if tokens:
        logits = router_logits.contiguous()
        pdl = pdl and HAS_GRID_DEPENDENCY  # a Triton without it launches it in stream order
        _topk_kernel[grid](logits, correction_bias if correction_bias is not None else logits, weights, ids, rank,
                           counts, tokens, num_experts, float(scaling_factor), RANK=ranked, PDL=pdl, launch_pdl=pdl,
                           **meta)
    return (weights, ids, (rank, counts, meta["BLOCK_T"] * top_k)) if ranked else (weights, ids)


def topk_backward(grad_weights: torch.Tensor, router_logits: torch.Tensor, expert_ids: torch.Tensor, top_k: int,
                  renormalize: bool, scoring: str = "softmax", correction_bias: torch.Tensor | None = None,
                  scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """The router logits' gradient [T, E] (their dtype) of topk's weights, as kernels/reference.py's
    route_grouped_backward, in one launch."""
    tokens, num_experts = router_logits.shape
    grad = torch.empty_like(router_logits)
    if tokens == 0:
        return grad
    logits = router_logits.contiguous()
    grid, meta = _selection_launch(tokens, num_experts, top_k, renormalize, scoring, correction_bias, n_group,
                                   topk_group, *_selection_tile(tokens, num_experts, full_block_warps=4))
    _topk_backward_kernel[grid](logits, correction_bias if correction_bias is not None else logits,
                                expert_ids.contiguous(), grad_weights.contiguous(), grad, tokens, num_experts,
                                float(scaling_factor), **meta)
    return grad


@triton.jit
def _rank_kernel(ids_ptr, rank_ptr, counts_ptr, n, num_bins, BLOCK: tl.constexpr, B_PAD: tl.constexpr):
    """For a block of assignments: each one's rank among the block's assignments to the same expert (in order),
    and the block's count per expert (bin E holds the dropped ones), stored expert-major: counts[bin, block]."""
    i = tl.arange(0, BLOCK)
    a = tl.program_id(0) * BLOCK + i
    bins = tl.arange(0, B_PAD)
    e = tl.load(ids_ptr + a, mask=a < n, other=-1).to(tl.int32)
    earlier_same = (e[None, :] == e[:, None]) & (i[None, :] < i[:, None])  # [assignment, earlier assignment]
    tl.store(rank_ptr + a, tl.sum(earlier_same.to(tl.int32), axis=1), mask=a < n)
    tl.store(counts_ptr + bins * tl.num_programs(0) + tl.program_id(0), tl.histogram(e, B_PAD, mask=a < n),
             mask=bins < num_bins)


@triton.jit
def _copy_rows(x_ptr, rows_ptr, a, pos, amask, hidden: tl.constexpr, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """rows[pos] = x[token of assignment a] for the assignments in amask."""
    src = x_ptr + (a // TOP_K).to(tl.int64)[:, None] * hidden
    dst = rows_ptr + pos.to(tl.int64)[:, None] * hidden
    for h0 in range(0, hidden, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = amask[:, None] & (cols < hidden)[None, :]
        tl.store(dst + cols[None, :], tl.load(src + cols[None, :], mask=m), mask=m)


@triton.jit
def _scan_counts_kernel(counts_ptr, totals_ptr, num_blocks, CHUNK: tl.constexpr):
    """For one bin: its counts over the rank blocks become their exclusive running sum (in place), and totals[bin]
    their sum."""
    row = counts_ptr + tl.program_id(0).to(tl.int64) * num_blocks
    carry = tl.full((), 0, tl.int32)
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        c = tl.load(row + b, mask=b < num_blocks, other=0)
        tl.store(row + b, carry + tl.cumsum(c, axis=0) - c, mask=b < num_blocks)
        carry += tl.sum(c, axis=0)
    tl.store(totals_ptr + tl.program_id(0), carry)


@triton.jit
def _scatter_rows_kernel(x_ptr, ids_ptr, rank_ptr, prefix_ptr, totals_ptr, order_ptr, rows_ptr, offsets_ptr, n,
                         num_experts, num_bins, num_blocks, hidden: tl.constexpr, TOP_K: tl.constexpr,
                         RANK_BLOCK: tl.constexpr, BLOCK_A: tl.constexpr, B_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                         COPY: tl.constexpr):
    """Sorted position of each assignment = its expert's start (the totals of the bins before it) + the earlier
    blocks' count of its expert + its rank; writes order[pos] = a and (COPY) copies the token's row to rows[pos].
    The first program also writes the groups' ends (offsets)."""
    a = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    amask = a < n
    e = tl.load(ids_ptr + a, mask=amask, other=0).to(tl.int32)
    bins = tl.arange(0, B_PAD)
    totals = tl.load(totals_ptr + bins, mask=bins < num_bins, other=0)
    ends = tl.cumsum(totals, axis=0)
    if tl.program_id(0) == 0:
        tl.store(offsets_ptr + bins, ends, mask=bins < num_experts)
    pos = tl.gather(ends - totals, e, axis=0) + \
        tl.load(prefix_ptr + e * num_blocks + a // RANK_BLOCK, mask=amask, other=0) + \
        tl.load(rank_ptr + a, mask=amask, other=0)
    tl.store(order_ptr + pos, a.to(tl.int64), mask=amask)
    if COPY:
        _copy_rows(x_ptr, rows_ptr, a, pos, amask, hidden, TOP_K, BLOCK_H)


@triton.jit
def _small_dispatch_kernel(x_ptr, ids_ptr, order_ptr, rows_ptr, offsets_ptr, n, num_experts, hidden: tl.constexpr,
                           TOP_K: tl.constexpr, BLOCK_A: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr):
    """The whole dispatch of few assignments in one launch. Program p places assignments [p*BLOCK_A, +BLOCK_A):
    position = assignments to lower experts + earlier ones to the same expert; and writes offsets[e] (assignments
    to experts <= e) for e in the same range."""
    a = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    amask = a < n
    e = tl.load(ids_ptr + a, mask=amask, other=0).to(tl.int32)
    experts = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    pos = tl.zeros((BLOCK_A,), dtype=tl.int32)
    ends = tl.zeros((BLOCK_A,), dtype=tl.int32)
    for j0 in range(0, n, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        ej = tl.load(ids_ptr + j, mask=j < n, other=2147483647).to(tl.int32)[None, :]
        earlier = (ej == e[:, None]) & (j[None, :] < a[:, None])
        pos += tl.sum(((ej < e[:, None]) | earlier).to(tl.int32), axis=1)
        ends += tl.sum((ej <= experts[:, None]).to(tl.int32), axis=1)
    tl.store(offsets_ptr + experts, ends, mask=experts < num_experts)
    tl.store(order_ptr + pos, a.to(tl.int64), mask=amask)
    _copy_rows(x_ptr, rows_ptr, a, pos, amask, hidden, TOP_K, BLOCK_H)


def _row_copy_block(hidden: torch.Tensor) -> int:
    return 512 if hidden.element_size() == 1 else 256  # FP8 rows (FP8 dispatch): 512 bytes a copy, as bf16


def sorts_by_counting(assignments: int, copy_rows: bool) -> bool:
    """Whether dispatch runs the counting sort (rank, running sum, scatter: what topk's ranks feed) rather than the
    one-launch kernel of few assignments."""
    return assignments > SMALL_DISPATCH or not copy_rows


def dispatch(hidden: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, copy_rows: bool = True,
             rank_block: int | None = None, ranks=None):
    """(sorted rows [T*k, H], order [T*k] int64, offsets [E] int32) as kernels/reference.py's dispatch. Without
    copy_rows only the order and offsets are computed (rows is None): for GEMMs that gather their rows themselves.
    rank_block: assignments a program of the rank kernel compares (a power of 2; _RANK_BLOCK). ranks:
    topk(ranked=True)'s for these ids (none dropped), which replace the rank kernel; used up (their counts become
    running sums in place)."""
    tokens, top_k = expert_ids.shape
    n, width = tokens * top_k, hidden.shape[1]
    rows = hidden.new_empty(n, width) if copy_rows else None
    order = torch.empty(n, dtype=torch.int64, device=hidden.device)
    if n == 0:
        return rows, order, torch.zeros(num_experts, dtype=torch.int32, device=hidden.device)
    block_h = min(_row_copy_block(hidden), triton.next_power_of_2(width))
    ids = expert_ids.reshape(-1).contiguous()
    if not sorts_by_counting(n, copy_rows):
        offsets = torch.empty(num_experts, dtype=torch.int32, device=hidden.device)
        block_a = 16
        _small_dispatch_kernel[(triton.cdiv(max(n, num_experts), block_a),)](
            hidden.contiguous(), ids, order, rows, offsets, n, num_experts, hidden=width, TOP_K=top_k,
            BLOCK_A=block_a, CHUNK=min(128, max(16, triton.next_power_of_2(n))), BLOCK_H=block_h)
        return rows, order, offsets
    b_pad = triton.next_power_of_2(num_experts + 1)
    if ranks is None:
        num_bins = num_experts + 1  # the last bin: dropped assignments (id E), sorted after every group
        rank_block = rank_block or _RANK_BLOCK
        blocks = triton.cdiv(n, rank_block)
        rank = torch.empty(n, dtype=torch.int32, device=hidden.device)
        counts = torch.empty(num_bins, blocks, dtype=torch.int32, device=hidden.device)
        _rank_kernel[(blocks,)](ids, rank, counts, n, num_bins, BLOCK=rank_block, B_PAD=b_pad)
    else:
        rank, counts, rank_block = ranks
        rank = rank.reshape(-1)
        num_bins, blocks = counts.shape
    totals = torch.empty(num_bins, dtype=torch.int32, device=hidden.device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=hidden.device)
    _scan_counts_kernel[(num_bins,)](counts, totals, blocks, CHUNK=min(_SCAN_CHUNK, triton.next_power_of_2(blocks)))
    block_a = 32
    _scatter_rows_kernel[(triton.cdiv(n, block_a),)](
        hidden.contiguous(), ids, rank, counts, totals, order, rows if copy_rows else order, offsets, n, num_experts,
        num_bins, blocks, hidden=width, TOP_K=top_k, RANK_BLOCK=rank_block, BLOCK_A=block_a, B_PAD=b_pad,
        BLOCK_H=block_h, COPY=copy_rows)
    return rows, order, offsets


@triton.jit
def _group_indices_kernel(offsets_ptr, starts_ptr, order_ptr, token_of_ptr, n, num_experts, TOP_K: tl.constexpr,
                          BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    """token_of[p] = order[p] // TOP_K (int32) for a block of the n sorted rows; the first program also writes the
    group starts."""
    if tl.program_id(0) == 0:
        i = tl.arange(0, E_PAD)
        ends = tl.load(offsets_ptr + i - 1, mask=(i > 0) & (i <= num_experts), other=0)
        tl.store(starts_ptr + i, ends.to(tl.int32), mask=i <= num_experts)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(order_ptr + p, mask=p < n, other=0)
    tl.store(token_of_ptr + p, (a // TOP_K).to(tl.int32), mask=p < n)


def gather_indices(order: torch.Tensor, offsets: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(group_starts(offsets), each sorted row's token order // top_k as int32): what a GEMM gathering its rows
    from the tokens reads (QuACK's cu_seqlens and A_idx), in one launch."""
    num_experts, n = offsets.shape[0], order.shape[0]
    starts = torch.empty(num_experts + 1, dtype=torch.int32, device=offsets.device)
    token_of = torch.empty(n, dtype=torch.int32, device=offsets.device)
    block = 1024
    _group_indices_kernel[(max(1, triton.cdiv(n, block)),)](
        offsets.contiguous(), starts, order.contiguous(), token_of, n, num_experts, TOP_K=top_k, BLOCK=block,
        E_PAD=triton.next_power_of_2(num_experts + 1))
    return starts, token_of


def group_starts(offsets: torch.Tensor) -> torch.Tensor:
    """[E + 1] int32 from 0: each group's start, then the last group's end (the groups' cumulative ends, offsets,
    behind a zero; QuACK's cu_seqlens) in one launch."""
    return gather_indices(offsets.new_empty(0, dtype=torch.int64), offsets, 1)[0]


@triton.jit
def _gather_rows_kernel(x_ptr, order_ptr, rows_ptr, n, hidden: tl.constexpr, TOP_K: tl.constexpr,
                        BLOCK_A: tl.constexpr, BLOCK_H: tl.constexpr):
    """rows[pos] = x[order[pos] // TOP_K]: dispatch's row copy for an order already computed."""
    pos = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    amask = pos < n
    a = tl.load(order_ptr + pos, mask=amask, other=0)
    _copy_rows(x_ptr, rows_ptr, a, pos, amask, hidden, TOP_K, BLOCK_H)


def gather_rows(hidden: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """hidden.index_select(0, order // top_k) in one launch of dispatch's row copy (torch's index_select of rows is
    slower): the rows a GEMM that cannot gather reads where dispatch wrote none."""
    n, width = order.shape[0], hidden.shape[1]
    rows = hidden.new_empty(n, width)
    if n:
        block_a = 32
        _gather_rows_kernel[(triton.cdiv(n, block_a),)](
            hidden.contiguous(), order, rows, n, hidden=width, TOP_K=top_k, BLOCK_A=block_a,
            BLOCK_H=min(_row_copy_block(hidden), triton.next_power_of_2(width)))
    return rows


@triton.jit
def _small_route_dispatch_kernel(logits_ptr, bias_ptr, x_ptr, weights_ptr, ids_ptr, order_ptr, rows_ptr, offsets_ptr,
                                 tokens, num_experts, scaling, hidden: tl.constexpr, TOP_K: tl.constexpr,
                                 K_PAD: tl.constexpr, E_PAD: tl.constexpr, T_PAD: tl.constexpr,
                                 SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                                 N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_A: tl.constexpr,
                                 BLOCK_H: tl.constexpr):
    """topk and then _small_dispatch_kernel's work in one launch: each program routes every token (the few of a
    decode step) itself, so it knows all the assignments without waiting for another program."""
    tok = tl.arange(0, T_PAD)
    tmask = tok < tokens
    top_w, top_id, _ = _top_k(logits_ptr, bias_ptr, tok, tmask, num_experts, scaling, TOP_K, K_PAD, E_PAD, T_PAD,
                           SCORING, HAS_BIAS, RENORM, N_GROUP, TOPK_GROUP)
    slot = tl.arange(0, K_PAD)
    flat = tok[:, None] * TOP_K + slot[None, :]  # the assignment of (token, slot)
    valid = tmask[:, None] & (slot[None, :] < TOP_K)
    if tl.program_id(0) == 0:
        tl.store(weights_ptr + flat, top_w, mask=valid)
        tl.store(ids_ptr + flat, top_id.to(tl.int64), mask=valid)
    ids = tl.where(valid, top_id, 2147483647)[None, :, :]  # [1, T_PAD, K_PAD]; padding sorts last
    a = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    amask = a < tokens * TOP_K
    mine = (flat[None, :, :] == a[:, None, None]) & valid[None, :, :]  # (padding slots alias the next token's)
    e = tl.sum(tl.sum(tl.where(mine, ids, 0), axis=2), axis=1)  # this program's assignments' experts
    before = (ids < e[:, None, None]) | ((ids == e[:, None, None]) & (flat[None, :, :] < a[:, None, None]))
    pos = tl.sum(tl.sum(before.to(tl.int32), axis=2), axis=1)
    experts = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    ends = tl.sum(tl.sum((ids <= experts[:, None, None]).to(tl.int32), axis=2), axis=1)
    tl.store(offsets_ptr + experts, ends, mask=experts < num_experts)
    tl.store(order_ptr + pos, a.to(tl.int64), mask=amask)
    _copy_rows(x_ptr, rows_ptr, a, pos, amask, hidden, TOP_K, BLOCK_H)


def route_dispatch_fits(tokens: int, num_experts: int) -> bool:
    """Whether small_route_dispatch takes this many tokens and experts (one program routes them all)."""
    return 0 < tokens and triton.next_power_of_2(tokens) * triton.next_power_of_2(num_experts) <= SMALL_ROUTE


def small_route_dispatch(hidden: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool,
                         scoring: str = "softmax", correction_bias: torch.Tensor | None = None,
                         scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1):
    """topk then dispatch (dropless) in one launch, for route_dispatch_fits sizes: (weights, ids, rows, order,
    offsets) as topk and dispatch return them."""
    tokens, num_experts = router_logits.shape
    n, width = tokens * top_k, hidden.shape[1]
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=hidden.device)
    rows = hidden.new_empty(n, width)
    order = torch.empty(n, dtype=torch.int64, device=hidden.device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=hidden.device)
    logits = router_logits.contiguous()
    block_a = 16
    _small_route_dispatch_kernel[(triton.cdiv(max(n, num_experts), block_a),)](
        logits, correction_bias if correction_bias is not None else logits, hidden.contiguous(), weights, ids, order,
        rows, offsets, tokens, num_experts, float(scaling_factor), hidden=width, TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts),
        T_PAD=triton.next_power_of_2(tokens), SCORING=SCORING_IDS[scoring], HAS_BIAS=correction_bias is not None,
        RENORM=renormalize, N_GROUP=n_group, TOPK_GROUP=topk_group, BLOCK_A=block_a,
        BLOCK_H=min(256, triton.next_power_of_2(width)))
    return weights, ids, rows, order, offsets
