"""Triton routing kernels (top-k, counting-sort dispatch) against the reference, on CPU through TRITON_INTERPRET=1."""
import pytest
import torch

from moecompile.kernels import reference as R
from moecompile.kernels import triton_routing as TR


@pytest.mark.parametrize("tokens,experts,top_k", [(37, 8, 2), (50, 128, 8), (9, 6, 6), (5, 3, 1), (1, 16, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_matches_reference_route(tokens, experts, top_k, renormalize):
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens + experts))
    weights, ids = TR.topk(logits, top_k, renormalize)
    want_w, want_ids = R.route(logits, top_k, 0.0, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)


def test_topk_sigmoid_bias_scaling_matches_route_grouped():
    gen = torch.Generator().manual_seed(4)
    logits, bias = torch.randn(23, 12, generator=gen), torch.randn(12, generator=gen)
    weights, ids = TR.topk(logits, 3, True, "sigmoid", bias, 2.5)
    want_w, want_ids = R.route_grouped(logits, 3, 0.0, True, "sigmoid", bias, 1, 1, 2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("tokens,experts,top_k,n_group,topk_group", [(19, 256, 8, 8, 4), (5, 16, 3, 4, 2),
                                                                      (3, 8, 2, 8, 3), (1, 64, 6, 4, 1)])
def test_topk_expert_groups_match_route_grouped(tokens, experts, top_k, n_group, topk_group):
    """DeepSeek-V3's group-limited selection (sigmoid + correction bias, the topk_group best groups by the sum of
    their two best experts); groups of one expert too."""
    gen = torch.Generator().manual_seed(tokens + experts)
    logits, bias = torch.randn(tokens, experts, generator=gen), torch.randn(experts, generator=gen) * 0.1
    assert TR.groups_supported(experts, n_group, topk_group)
    weights, ids = TR.topk(logits, top_k, True, "sigmoid", bias, 2.5, n_group, topk_group)
    want_w, want_ids = R.route_grouped(logits, top_k, 0.0, True, "sigmoid", bias, n_group, topk_group, 2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)
    got = TR.small_route_dispatch(torch.randn(tokens, 8, generator=gen), logits, top_k, True, "sigmoid", bias, 2.5,
                                  n_group, topk_group)
    assert torch.equal(got[1], want_ids)


def test_groups_supported_needs_equal_power_of_2_groups():
    assert TR.groups_supported(60, 1, 1) and TR.groups_supported(256, 8, 4)
    assert not TR.groups_supported(96, 8, 4) and not TR.groups_supported(256, 8, 9)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_ties_go_to_the_lowest_expert_in_kernels_and_reference(n_group, topk_group):
    """16-bit logits tie often: the kernels and the reference pick the lowest expert (and group) among equal scores
    alike, so that a backward recomputing the selection (either one's) agrees with the forward that made the ids."""
    logits = torch.randint(0, 3, (40, 16), generator=torch.Generator().manual_seed(3)).bfloat16()
    grad_w = torch.randn(40, 4, generator=torch.Generator().manual_seed(4))
    weights, ids = TR.topk(logits, 4, True, "softmax", None, 1.0, n_group, topk_group)
    want_w, want_ids = R.route_grouped(logits, 4, 0.0, True, "softmax", None, n_group, topk_group, 1.0)
    assert torch.equal(ids, want_ids)
    assert (ids.diff(dim=1)[weights.diff(dim=1) == 0] > 0).all()  # equal weights: ascending experts
    got = TR.topk_backward(grad_w, logits, ids, 4, True, "softmax", None, 1.0, n_group, topk_group)
    want = R.route_grouped_backward(grad_w, logits, ids, 4, True, "softmax", None, n_group, topk_group, 1.0)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=1e-2)  # a bf16 step


def test_topk_all_tokens_to_one_expert():
    logits = torch.randn(10, 5, generator=torch.Generator().manual_seed(5))
    logits[:, 3] += 100.0
    _, ids = TR.topk(logits, 2, True)
    assert (ids[:, 0] == 3).all()


@pytest.fixture(params=["one-launch", "counting-sort"])
def dispatch_path(request, monkeypatch):
    """Both dispatch paths on the same inputs: the one-launch kernel of few assignments and the counting sort."""
    if request.param == "counting-sort":
        monkeypatch.setattr(TR, "SMALL_DISPATCH", 0)
    return request.param


def _check_dispatch(x, ids, experts):
    got, want = TR.dispatch(x, ids, experts), R.dispatch(x, ids, experts)
    bits = (lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)  # (no torch.equal for FP8)
    for name, g, w in zip(("rows", "order", "offsets"), got, want):
        assert g.dtype == w.dtype and torch.equal(bits(g), bits(w)), name
    rows, order, offsets = TR.dispatch(x, ids, experts, copy_rows=False)  # rank only: for GEMMs that gather rows
    assert rows is None and torch.equal(order, want[1]) and torch.equal(offsets, want[2])


@pytest.mark.parametrize("tokens,experts,top_k", [(37, 8, 2), (60, 128, 8), (9, 6, 6), (13, 5, 1), (1, 8, 2),
                                                  (1, 128, 8)])
def test_dispatch_matches_reference(tokens, experts, top_k, dispatch_path):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[::4, -1] = experts  # dropped by capacity: sorted after every group
    _check_dispatch(torch.randn(tokens, 24, generator=gen), ids, experts)  # 60 x 8 rows: several rank blocks


def test_dispatch_moves_fp8_rows(dispatch_path):
    """FP8 dispatch (quantised tokens, moecompile.ir.fp8): the rows keep their bits; odd width, several copy blocks."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(21)])
    _check_dispatch((torch.randn(21, 1100, generator=gen) * 50).to(torch.float8_e4m3fn), ids, 16)


def test_dispatch_edge_cases(dispatch_path):
    x = torch.randn(11, 20)
    _check_dispatch(x, torch.full((11, 2), 1), 4)  # everything to one expert, the others empty
    ids = torch.tensor([[0, 1, 2]] * 11)  # k = E
    _check_dispatch(x, ids, 3)
    _check_dispatch(x, torch.full((11, 1), 4), 4)  # everything dropped
    rows, order, offsets = TR.dispatch(x[:0], torch.zeros(0, 2, dtype=torch.int64), 4)
    assert rows.shape == (0, 20) and order.shape == (0,) and torch.equal(offsets, torch.zeros(4, dtype=torch.int32))


def test_counting_sort_over_many_rank_blocks(monkeypatch):
    """One assignment per rank block and a running sum over the blocks in several steps: the scan's carry."""
    monkeypatch.setattr(TR, "SMALL_DISPATCH", 0)
    monkeypatch.setattr(TR, "_RANK_BLOCK", 1)
    monkeypatch.setattr(TR, "_SCAN_CHUNK", 4)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (37, 2), generator=gen)  # id 5 of 5 experts: dropped
    _check_dispatch(torch.randn(37, 12, generator=gen), ids, 5)


@pytest.mark.parametrize("tokens,experts,top_k,block_t,scoring,groups", [
    (70, 128, 8, 32, "softmax", (1, 1)), (1, 8, 2, None, "softmax", (1, 1)), (23, 6, 6, 4, "softmax", (1, 1)),
    (41, 16, 3, 8, "sigmoid", (4, 2)), (9, 5, 1, 2, "softmax", (1, 1))])
def test_ranked_topk_replaces_dispatchs_rank_kernel(tokens, experts, top_k, block_t, scoring, groups, monkeypatch):
    """topk(ranked=True)'s ranks (each token block as a rank block) give dispatch the same rows, order and offsets
    as the reference: several blocks and a partial last one, k = E, one token, odd E, expert groups, and every
    token to one expert."""
    monkeypatch.setattr(TR, "SMALL_DISPATCH", 0)  # the counting sort, which the ranks feed
    gen = torch.Generator().manual_seed(tokens * experts)
    logits = torch.randn(tokens, experts, generator=gen)
    bias = torch.randn(experts, generator=gen) if scoring == "sigmoid" else None
    for skew in (0.0, 100.0):
        logits[:, 1] += skew
        ids = TR.topk(logits, top_k, True, scoring, bias, 1.0, *groups, block_t=block_t)[1]
        x = torch.randn(tokens, 12, generator=gen)
        for copy_rows in (True, False):
            _, ranked_ids, ranks = TR.topk(logits, top_k, True, scoring, bias, 1.0, *groups, block_t=block_t,
                                           ranked=True)
            assert torch.equal(ranked_ids, ids)
            for got, want in zip(TR.dispatch(x, ids, experts, copy_rows, ranks=ranks), R.dispatch(x, ids, experts)):
                assert got is None or torch.equal(got, want)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (1, 8, 2), (3, 6, 6), (16, 128, 8), (5, 3, 1),
                                                  (2, 256, 8)])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_small_route_dispatch_equals_topk_then_dispatch(tokens, experts, top_k, scoring):
    """The one-launch route + dispatch of few tokens against the reference route_grouped then dispatch."""
    gen = torch.Generator().manual_seed(10 * tokens + experts)
    logits, x = torch.randn(tokens, experts, generator=gen), torch.randn(tokens, 20, generator=gen)
    bias = torch.randn(experts, generator=gen) if scoring == "sigmoid" else None
    assert TR.route_dispatch_fits(tokens, experts)
    got = TR.small_route_dispatch(x, logits, top_k, scoring == "softmax", scoring, bias, 1.5)
    weights, ids = R.route_grouped(logits, top_k, 0.0, scoring == "softmax", scoring, bias, 1, 1, 1.5)
    want = (weights, ids, *R.dispatch(x, ids, experts))
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    for name, g, w in zip(("ids", "rows", "order", "offsets"), got[1:], want[1:]):
        assert g.dtype == w.dtype and torch.equal(g, w), name


def test_small_route_dispatch_all_tokens_to_one_expert():
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(6))
    logits[:, 5] += 100.0
    x = torch.randn(4, 16)
    _, ids, rows, order, offsets = TR.small_route_dispatch(x, logits, 2, True)
    want_rows, want_order, want_offsets = R.dispatch(x, ids, 8)
    assert (ids[:, 0] == 5).all()
    assert torch.equal(order, want_order) and torch.equal(offsets, want_offsets) and torch.equal(rows, want_rows)


def test_route_dispatch_fits_only_few_tokens():
    assert TR.route_dispatch_fits(1, 256) and TR.route_dispatch_fits(16, 256)
    assert not TR.route_dispatch_fits(64, 128) and not TR.route_dispatch_fits(0, 8)


def test_one_launch_route_policy():
    """runtime/choices: the one-launch route + dispatch except one token over many experts (bench/route_dispatch.py)."""
    from moecompile.runtime import choices

    assert choices.one_launch_route(16, 128) and choices.one_launch_route(1, 8)
    assert not choices.one_launch_route(1, 128)


@pytest.mark.parametrize("tokens,top_k,width,dtype", [(37, 2, 300, torch.float32), (1, 8, 64, torch.bfloat16),
                                                      (9, 6, 1000, torch.float8_e4m3fn), (0, 2, 16, torch.float32)])
def test_gather_rows_is_index_select_of_the_tokens(tokens, top_k, width, dtype):
    """The row copy for an order dispatch computed without rows: a random order of every assignment (odd widths
    over several column blocks, one token, FP8 rows, no rows)."""
    gen = torch.Generator().manual_seed(tokens + width)
    hidden = torch.randn(tokens, width, generator=gen).to(dtype)
    order = torch.randperm(tokens * top_k, generator=gen)
    got = TR.gather_rows(hidden, order, top_k)
    assert got.dtype == dtype and got.shape == (tokens * top_k, width)
    assert torch.equal(got.view(torch.uint8), hidden.index_select(0, order // top_k).view(torch.uint8))


@pytest.mark.parametrize("experts", [1, 5, 128, 257])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_group_starts_puts_a_zero_before_the_ends(experts, dtype):
    offsets = torch.randint(0, 50, (experts,), generator=torch.Generator().manual_seed(experts)).cumsum(0).to(dtype)
    starts = TR.group_starts(offsets)
    assert starts.dtype == torch.int32
    assert torch.equal(starts, torch.nn.functional.pad(offsets.to(torch.int32), (1, 0)))


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 1), (300, 128, 8), (1500, 7, 3), (0, 5, 2)])
def test_gather_indices_are_the_starts_and_each_rows_token(tokens, experts, top_k):
    """One launch for QuACK's gathered first projection: the group starts and order // k (int32), across blocks."""
    gen = torch.Generator().manual_seed(tokens + experts)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    _, order, offsets = R.dispatch(torch.zeros(tokens, 4), ids, experts, copy_rows=False)
    starts, token_of = TR.gather_indices(order, offsets, top_k)
    assert starts.dtype == token_of.dtype == torch.int32
    assert torch.equal(starts, TR.group_starts(offsets))
    assert torch.equal(token_of, (order // top_k).to(torch.int32))


@pytest.mark.parametrize("tokens,experts,top_k,capacity", [(37, 8, 2, 0.0), (20, 128, 8, 0.0), (9, 6, 6, 0.0),
                                                           (30, 4, 2, 0.5), (1, 16, 4, 0.0)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_backward_matches_route_backward(tokens, experts, top_k, capacity, renormalize):
    """The logits' gradient of the softmax top-k weights in one launch against the reference (k = E, drops)."""
    gen = torch.Generator().manual_seed(tokens * experts)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = R.route(logits, top_k, capacity, renormalize)
    if capacity:
        assert (ids == experts).any()
    grad_w = torch.randn(weights.shape, generator=gen)
    got = TR.topk_backward(grad_w, logits, ids, top_k, renormalize)
    torch.testing.assert_close(got, R.route_backward(grad_w, logits, ids, top_k, renormalize), atol=1e-6, rtol=1e-5)
    half = logits.bfloat16()  # the gradient in the logits' dtype (bf16 logits tie often: against the float32 math)
    got = TR.topk_backward(grad_w, half, ids, top_k, renormalize)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), TR.topk_backward(grad_w, half.float(), ids, top_k, renormalize),
                               atol=1e-6, rtol=1e-2)  # a bf16 step


@pytest.mark.parametrize("tokens,experts,top_k,n_group,topk_group,scoring", [
    (19, 256, 8, 8, 4, "sigmoid"), (5, 16, 3, 4, 2, "softmax"), (11, 12, 3, 1, 1, "sigmoid")])
def test_topk_backward_matches_route_grouped_backward(tokens, experts, top_k, n_group, topk_group, scoring):
    """DeepSeek-V3's routing (sigmoid, correction bias, groups, scaling) and the grouped softmax: the logits' gradient
    against the reference, the bias getting none."""
    gen = torch.Generator().manual_seed(tokens + experts)
    logits, bias = torch.randn(tokens, experts, generator=gen), torch.randn(experts, generator=gen) * 0.1
    args = (True, scoring, bias, n_group, topk_group, 2.5)
    weights, ids = R.route_grouped(logits, top_k, 0.0, *args)
    grad_w = torch.randn(weights.shape, generator=gen)
    got = TR.topk_backward(grad_w, logits, ids, top_k, True, scoring, bias, 2.5, n_group, topk_group)
    want = R.route_grouped_backward(grad_w, logits, ids, top_k, *args)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
