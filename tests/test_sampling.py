"""The sampling function of the compiled decode step against HF's own warpers, statistically: on fixed logits, many
seeded draws fall only in the set HF's top-k / top-p / min-p warpers keep, with the frequencies of HF's renormalised
probabilities."""
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from moecompile.core.errors import MoECompileError
from moecompile.generation import Sampling, greedy_token, sample_token

DRAWS = 200_000
# distinct probabilities, no ties at any filter's boundary: [0.3, 0.2, 0.15, 0.12, 0.1, 0.07, 0.04, 0.02] shuffled
PROBS = torch.tensor([0.1, 0.02, 0.3, 0.07, 0.15, 0.04, 0.2, 0.12])
LOGITS = PROBS.log() + 1.5


def _hf_probs(temperature=1.0, top_k=None, top_p=1.0, min_p=None) -> torch.Tensor:
    """HF's sampling distribution: its warpers in its order, then softmax."""
    scores = LOGITS[None].clone()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p is not None:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores.softmax(-1)[0]


def _frequencies(seed=0, **sampling) -> torch.Tensor:
    logits = LOGITS.expand(DRAWS, -1)
    noise = torch.empty(DRAWS, len(PROBS)).exponential_(generator=torch.Generator().manual_seed(seed))
    tokens = sample_token(logits, noise, **{"temperature": 1.0, **sampling})
    assert tokens.shape == (DRAWS, 1) and tokens.dtype == torch.long
    return torch.bincount(tokens[:, 0], minlength=len(PROBS)).double()


@pytest.mark.parametrize("sampling", [
    {},
    {"temperature": 0.7},
    {"temperature": 1.6, "top_k": 3},
    {"top_p": 0.6},  # keeps 0.3, 0.2, 0.15: the smallest set reaching 0.6
    {"top_p": 0.66},  # 0.3 + 0.2 + 0.15 < 0.66: one more
    {"top_k": 5, "top_p": 0.8},  # top-p over the renormalised top 5
    {"min_p": 0.3},  # p >= 0.09
    {"temperature": 0.5, "top_k": 6, "top_p": 0.95, "min_p": 0.1},
])
def test_samples_follow_hf_warpers(sampling):
    """Tokens HF's warpers drop are never drawn; each kept token's count is within 5 standard deviations of its
    binomial expectation under HF's renormalised probabilities (a fixed seed: the counts are the same every run;
    5 sigma: a correct sampler fails one category in about 3.5 million)."""
    want = _hf_probs(**sampling).double()
    counts = _frequencies(**sampling)
    allowed = want > 0
    assert counts[~allowed].sum() == 0, (counts, want)
    expected = DRAWS * want[allowed]
    sigma = (expected * (1 - want[allowed])).sqrt()
    assert ((counts[allowed] - expected).abs() <= 5 * sigma).all(), (counts, expected)
    # and the statistic is sensitive: every kept token but the likeliest is drawn often enough to be seen
    assert (counts[allowed] > 0).all()


def test_the_same_noise_gives_the_same_tokens_and_other_noise_other_tokens():
    logits = LOGITS.expand(64, -1)
    draw = lambda seed: torch.empty(64, len(PROBS)).exponential_(generator=torch.Generator().manual_seed(seed))  # noqa: E731
    first = sample_token(logits, draw(1), 1.0, top_p=0.9)
    assert torch.equal(first, sample_token(logits, draw(1), 1.0, top_p=0.9))
    assert not torch.equal(first, sample_token(logits, draw(2), 1.0, top_p=0.9))


def test_one_candidate_is_the_greedy_token():
    """top_k=1 or a tiny top_p leave the argmax whatever the noise, a large vocabulary (two-stage choice) included;
    noise that is exactly zero does not turn a dropped token into a winner."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40_000, generator=g)
    noise = torch.empty(3, 40_000).exponential_(generator=g)
    noise[:, :100] = 0.0
    want = greedy_token(logits)
    assert torch.equal(sample_token(logits, noise, 1.0, top_k=1), want)
    assert torch.equal(sample_token(logits, noise, 0.3, top_p=1e-6), want)
    assert torch.equal(sample_token(logits, noise, 1.0, min_p=1.0), want)


@pytest.mark.parametrize("bad", [{"temperature": 0.0}, {"temperature": -1.0}, {"top_k": -1}, {"top_k": 2.5},
                                 {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": 1.5}])
def test_bad_sampling_settings_are_one_line_errors(bad):
    with pytest.raises(MoECompileError):
        Sampling(**bad)
