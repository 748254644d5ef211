"""The entropy mechanism on a tabular softmax policy, measured.

For pi = softmax(z) over K actions and a natural-policy-gradient step z' = z + eta * A
(the NPG direction of a tabular softmax policy), the entropy changes by

    H(pi') - H(pi) = -eta * Cov_{a ~ pi}(log pi(a), A(a)) + O(eta^2)       (Cui et al. 2025)

A batch of N one-token "responses" drawn from pi (quasi-randomly: action a appears
round(N pi(a)) times) turns that covariance into the library's token covariance, whose mean
must predict the measured entropy change. CA-GRPO trains on w~ * A instead of A; as w~ is a
function of the action here, its step is z' = z + eta * w~(a) A(a), and its entropy change
must follow the covariance of log pi with w~ * A, and be far smaller in magnitude when a few
tokens in the tails of c dominate the covariance (for a near-Gaussian c the kernel only about
halves it).
"""

import functools

import pytest
import torch

from cagrpo_ray.algo.losses import cagrpo_token_weights, token_covariance

pytestmark = pytest.mark.unit

ETA = 1e-3
N = 100_000


def entropy(z):
    return float(-(torch.softmax(z, 0) * torch.log_softmax(z, 0)).sum())


def policy_and_batch(seed, logit_scale, sign):
    """A peaked policy over 200 actions whose likely actions tend to be rewarded (sign=+1:
    exploitation, entropy falls) or punished (sign=-1: entropy rises); the one-token batch."""
    g = torch.Generator().manual_seed(seed)
    K = 200
    z = logit_scale * torch.randn(K, generator=g, dtype=torch.float64)
    logpi = torch.log_softmax(z, 0)
    pi = logpi.exp()
    rewarded = torch.rand(K, generator=g, dtype=torch.float64) < torch.sigmoid(logpi + 3)
    advantage = sign * torch.where(rewarded, 1.0, -1.0).double()
    advantage = advantage - (pi * advantage).sum()
    actions = torch.repeat_interleave(torch.arange(K), torch.round(pi * N).long())
    batch = (
        logpi[actions].float()[:, None],  # logprobs [N, 1]
        advantage[actions].float(),  # advantages [N]
        torch.ones(len(actions), 1),  # mask
    )
    return z, advantage, actions, batch


HEAVY_TAILED = [(0, 1.0, 1.0), (0, 1.0, -1.0), (3, 4.0, 1.0), (4, 1.0, 1.0)]
NEAR_GAUSSIAN = (2, 2.5, 1.0)


@functools.cache
def entropy_changes(seed, logit_scale, sign):
    """(c [N] float64, GRPO's entropy change, CA-GRPO's, CA-GRPO's predicted by w~ A's cov)."""
    z, advantage, actions, (logp, adv, mask) = policy_and_batch(seed, logit_scale, sign)
    c = token_covariance(logp, adv, mask, scope="batch")[:, 0].double()
    weights = cagrpo_token_weights(logp, adv, mask, scope="batch")[:, 0]
    per_action = torch.zeros_like(advantage)
    per_action[actions] = weights.double()  # w~ depends on the action only
    plain = entropy(z + ETA * advantage) - entropy(z)
    reweighted = entropy(z + ETA * per_action * advantage) - entropy(z)
    c_weighted = token_covariance(logp, weights * adv, mask, scope="batch")
    return c, plain, reweighted, -ETA * float(c_weighted.double().mean())


@pytest.mark.parametrize("case", HEAVY_TAILED + [NEAR_GAUSSIAN, (2, 2.5, -1.0)])
def test_token_covariance_predicts_the_entropy_change(case):
    seed, logit_scale, sign = case
    c, plain, reweighted, reweighted_predicted = entropy_changes(seed, logit_scale, sign)
    assert plain * sign < 0  # exploitation lowers entropy, the opposite raises it
    assert plain == pytest.approx(-ETA * float(c.mean()), rel=0.02)
    assert reweighted == pytest.approx(reweighted_predicted, rel=0.02)


def tail_statistics(c):
    """Kurtosis of c (3 for a Gaussian) and the share of sum(c) carried by the top 1% of |c|."""
    centred = c - c.mean()
    kurtosis = float((centred**4).mean() / (centred**2).mean() ** 2)
    top = c.abs() >= c.abs().quantile(0.99)
    return kurtosis, float(c[top].sum() / c.sum())


@pytest.mark.parametrize("case", HEAVY_TAILED)
def test_cagrpo_shrinks_the_entropy_change_under_heavy_tails(case):
    c, plain, reweighted, _ = entropy_changes(*case)
    kurtosis, top_share = tail_statistics(c)
    assert kurtosis > 5 and top_share > 0.25  # a few extreme tokens carry the covariance
    assert abs(reweighted) < 0.35 * abs(plain)


def test_shrinkage_is_milder_for_a_near_gaussian_covariance():
    c, plain, reweighted, _ = entropy_changes(*NEAR_GAUSSIAN)
    kurtosis, top_share = tail_statistics(c)
    assert kurtosis < 3.5 and top_share < 0.1
    # a Gaussian kernel on a Gaussian c roughly halves its mean; heavy tails lose far more
    assert 0.5 * abs(plain) < abs(reweighted) < abs(plain)
