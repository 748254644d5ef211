"""Policy losses and CA-GRPO weights against the paper's equations in float64.

The references (`tests/loss_reference.py`) are loops over tokens in float64 (numpy, or
torch scalars where a gradient is needed); they implement the paper's formulas, not the
library's code paths, and run here on fresh random batches (hypothesis) and edge cases.
"""

import math

import loss_reference as reference
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from cagrpo_ray.algo.losses import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    LossSpec,
    cagrpo_token_weights,
    kl_estimate,
    policy_loss,
    prepare_loss_inputs,
    register_policy_loss,
    token_covariance,
)
from cagrpo_ray.algo.off_policy import truncated_is_weights

pytestmark = pytest.mark.unit

LOSSES = ("grpo", "cagrpo", "clip_cov", "kl_cov")
PPO_CLIP_LOSSES = ("grpo", "cagrpo", "clip_cov")
# dual-clip bounds: off, the default (never binds on these batches: r < e^0.625 < 3), and two
# that bind on tokens with A < 0 and r > c
CLIP_RATIO_C = st.sampled_from([None, 3.0, 1.1, 1.5])
HYPOTHESIS = settings(max_examples=60, deadline=None, derandomize=True)

# ------------------------------------------------------------------------------------------------
# References: the paper's equations as float64 loops (tests/loss_reference.py)
# ------------------------------------------------------------------------------------------------

reference_covariance = reference.token_covariance
reference_weights = reference.kernel_weights


def reference_advantages(rewards, group_size):
    return reference.group_advantages(rewards, group_size).astype(np.float32)


def reference_loss(
    name, logp, old, adv, mask, token_weight, penalty, agg, eps_low, eps_high, **options
):
    return reference.policy_loss(
        name, logp, old, adv, mask, token_weight, penalty, loss_agg=agg,
        clip_eps_low=eps_low, clip_eps_high=eps_high, **options,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Random batches
# ------------------------------------------------------------------------------------------------

LOGPROB = st.one_of(
    st.floats(-20, 0, width=32),
    st.sampled_from([0.0, -0.5, -1e-3, -80.0, -80.0009765625, -1e4]),
)


@st.composite
def batches(draw, max_groups=3, max_group_size=4, max_T=6):
    groups = draw(st.integers(1, max_groups))
    group_size = draw(st.integers(1, max_group_size))
    B, T = groups * group_size, draw(st.integers(1, max_T))
    old = draw(arrays(np.float32, (B, T), elements=LOGPROB))
    delta = draw(arrays(np.float32, (B, T), elements=st.floats(-0.625, 0.625, width=32)))
    mask = draw(arrays(np.bool_, (B, T)))
    reward = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0, 1, width=32))
    rewards = draw(arrays(np.float32, (B,), elements=reward))
    return {
        "old": old,
        "new": (old + delta).astype(np.float32),
        "mask": mask,
        "adv": reference_advantages(rewards, group_size),
        "group_ids": np.repeat(np.arange(groups), group_size),
    }


def as_torch(b):
    return (
        torch.from_numpy(b["new"]).clone().requires_grad_(),
        torch.from_numpy(b["old"]),
        torch.from_numpy(b["adv"]),
        torch.from_numpy(b["mask"]),
        torch.from_numpy(b["group_ids"]),
    )


# ------------------------------------------------------------------------------------------------
# CA-GRPO weights
# ------------------------------------------------------------------------------------------------


@HYPOTHESIS
@given(batches(), st.sampled_from(["group", "batch"]))
def test_weights_match_reference(b, scope):
    _, old, adv, mask, gid = as_torch(b)
    got = cagrpo_token_weights(old, adv, mask, gid, scope=scope)
    want = reference_weights(b["old"], b["adv"], b["mask"], b["group_ids"], scope)
    assert torch.isfinite(got).all()
    assert not got.requires_grad
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=2e-5)
    # the budget is redistributed, not shrunk: mean_S w~ = 1 on every scope with tokens
    if b["mask"].any() and scope == "batch":
        assert got[mask].mean().item() == pytest.approx(1.0, rel=1e-5)


@HYPOTHESIS
@given(batches(), st.sampled_from(["group", "batch"]))
def test_covariance_matches_reference(b, scope):
    _, old, adv, mask, gid = as_torch(b)
    got = token_covariance(old, adv, mask, gid, scope=scope)
    want = reference_covariance(b["old"], b["adv"], b["mask"], b["group_ids"], scope)
    scale = max(np.abs(want).max(), 1e-6)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6 * scale)


def test_sigma_zero_gives_unit_weights():
    mask = torch.ones(4, 3, dtype=torch.bool)
    gid = torch.tensor([0, 0, 1, 1])
    # group 0: equal rewards (A = 0); group 1: every log-prob equal (-0.7 is inexact in binary)
    logp = torch.tensor([[-0.1, -2.0, -5.0], [-0.3, -0.2, -9.0], [-0.7] * 3, [-0.7] * 3])
    adv = torch.tensor([0.0, 0.0, 0.7071, -0.7071])
    w = cagrpo_token_weights(logp, adv, mask, gid)
    assert torch.equal(w, torch.ones(4, 3))


def test_two_single_token_responses_are_degenerate():
    # c_1 = c_2 exactly, so sigma = 0; float32 rounding must not turn it into a kernel
    logp = torch.tensor([[-5.0], [-5.001]])
    adv = torch.tensor([1.3, -0.4])
    w = cagrpo_token_weights(logp, adv, torch.ones(2, 1), torch.tensor([0, 0]))
    assert torch.equal(w, torch.ones(2, 1))


def test_rows_without_tokens_single_token_and_empty_batch():
    logp = torch.tensor([[-1.0, -2.0], [-3.0, -0.5], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    adv = torch.tensor([1.0, -1.0, 0.5])
    w = cagrpo_token_weights(logp, adv, mask, scope="batch")
    assert torch.equal(w[1], torch.zeros(2)) and w[2, 1] == 0
    want = reference_weights(logp.numpy(), adv.numpy(), mask.numpy().astype(bool), None, "batch")
    np.testing.assert_allclose(w.numpy(), want, rtol=1e-5)
    one = cagrpo_token_weights(logp[:1], adv[:1], torch.tensor([[0, 1]]), scope="batch")
    assert torch.equal(one, torch.tensor([[0.0, 1.0]]))
    none = cagrpo_token_weights(logp, adv, torch.zeros(3, 2), scope="batch")
    assert torch.equal(none, torch.zeros(3, 2))


def test_extreme_token_is_tamed_and_tiny_spread_is_resolved():
    # one token at -1e4 dominates the covariance: its weight must vanish, the others stay near 1
    logp = -torch.rand(2, 20, generator=torch.Generator().manual_seed(0))
    logp[0, 0] = -1e4
    adv = torch.tensor([1.0, -1.0])
    w = cagrpo_token_weights(logp, adv, torch.ones(2, 20), scope="batch")
    want = reference_weights(logp.numpy(), adv.numpy(), np.ones((2, 20), bool), None, "batch")
    np.testing.assert_allclose(w.numpy(), want, rtol=1e-4, atol=1e-6)
    assert w[0, 0] < 1e-6 and w[:, 1:].min() > 0.9
    # log-probs near -80 with a spread of 1e-3: the differences survive float32
    mask = torch.ones(2, 3)
    logp = -80.0 + torch.tensor([[0.0, 2.0**-10, 3 * 2.0**-10], [2.0**-9, 0.0, 2.0**-11]])
    w = cagrpo_token_weights(logp, adv, mask, scope="batch")
    want = reference_weights(
        logp.double().numpy(), adv.numpy(), np.ones((2, 3), bool), None, "batch"
    )
    np.testing.assert_allclose(w.numpy(), want, rtol=1e-4)


def test_scope_where_every_kernel_weight_underflows():
    # c = (1, 1, 1.01, 1.01): sigma = 0.005, so every exp(-c^2 / 2 sigma^2) is below 1e-40000;
    # w~ is still defined (the weights of a scope may share any factor): (2, 2, 0, 0)
    logp = torch.tensor([[-1.0], [-3.0], [-0.99], [-3.01]])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    w = cagrpo_token_weights(logp, adv, torch.ones(4, 1), scope="batch")
    want = reference_weights(logp.numpy(), adv.numpy(), np.ones((4, 1), bool), None, "batch")
    np.testing.assert_allclose(w.numpy(), want, atol=1e-6)
    torch.testing.assert_close(w[:, 0], torch.tensor([2.0, 2.0, 0.0, 0.0]))


def test_weights_reject_bad_scope_and_missing_groups():
    x = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="group_ids"):
        cagrpo_token_weights(x, torch.zeros(2), x, scope="group")
    with pytest.raises(ValueError, match="group, batch"):
        cagrpo_token_weights(x, torch.zeros(2), x, scope="prompt")


# ------------------------------------------------------------------------------------------------
# Losses
# ------------------------------------------------------------------------------------------------


def library_and_reference(name, b, agg, eps_low=0.2, eps_high=0.28, options=None, ref_options=None):
    """(library output, library grad, reference loss, reference grad) on batch `b`."""
    new, old, adv, mask, gid = as_torch(b)
    out = policy_loss(
        name,
        new,
        old,
        adv,
        mask,
        gid,
        clip_eps_low=eps_low,
        clip_eps_high=eps_high,
        loss_agg=agg,
        seed=3,
        **(options or {}),
    )
    out.loss.backward()
    prepared = prepare_loss_inputs(name, old, adv, mask, gid, seed=3)
    token_weight = np.ones(b["mask"].shape)
    if name == "cagrpo":  # the contract's weights, from the reference
        token_weight = reference_weights(b["old"], b["adv"], b["mask"], b["group_ids"], "group")
    elif name == "clip_cov":  # a random choice: take the library's, checked separately
        token_weight = prepared.token_weights.numpy()
    penalty = prepared.kl_penalty.numpy() if name == "kl_cov" else None
    ref_new = torch.from_numpy(b["new"]).double().requires_grad_()
    ref = reference_loss(
        name,
        ref_new,
        b["old"],
        b["adv"],
        b["mask"],
        token_weight,
        penalty,
        agg,
        eps_low,
        eps_high,
        **(ref_options or {}),
    )
    if ref.requires_grad:
        ref.backward()
    ref_grad = ref_new.grad if ref_new.grad is not None else torch.zeros_like(ref_new)
    return out, new.grad, float(ref.detach()), ref_grad


@HYPOTHESIS
@given(batches(), st.sampled_from(LOSSES), st.sampled_from(LOSS_AGG_MODES), CLIP_RATIO_C)
def test_losses_match_reference(b, name, agg, clip_ratio_c):
    c = {"clip_ratio_c": clip_ratio_c}
    out, grad, ref, ref_grad = library_and_reference(name, b, agg, options=c, ref_options=c)
    assert math.isfinite(out.loss.item()) and torch.isfinite(grad).all()
    assert out.loss.item() == pytest.approx(ref, rel=2e-4, abs=1e-5)
    np.testing.assert_allclose(grad.numpy(), ref_grad.numpy(), rtol=2e-4, atol=1e-5)
    assert all(isinstance(v, float) and math.isfinite(v) for v in out.metrics.values())


@HYPOTHESIS
@given(batches(), st.sampled_from(PPO_CLIP_LOSSES), st.sampled_from(LOSS_AGG_MODES))
def test_dual_clip_changes_nothing_on_policy_bit_for_bit(b, name, agg):
    """r = 1 on the first pass: with c = 3 the loss and gradient are those without dual-clip."""
    b = {**b, "new": b["old"].copy()}
    results = []
    for clip_ratio_c in (3.0, None):
        new, old, adv, mask, gid = as_torch(b)
        prepared = prepare_loss_inputs(name, old, adv, mask, gid, seed=3)
        out = policy_loss(
            name, new, old, adv, mask, loss_agg=agg, clip_ratio_c=clip_ratio_c, prepared=prepared
        )
        out.loss.backward()
        results.append((out.loss.detach(), new.grad, out.metrics))
    (loss_dual, grad_dual, metrics), (loss_plain, grad_plain, _) = results
    assert torch.equal(loss_dual, loss_plain)
    assert torch.equal(grad_dual, grad_plain)
    assert metrics["policy/dual_clip_frac"] == 0.0


def test_dual_clip_bounds_negative_advantage_tokens_and_cuts_their_gradient():
    # row 0: A = +1, row 1: A = -1; ratios 0.5, 2, 5 on each row
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[0.5, 2.0, 5.0]] * 2)).requires_grad_()
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 3)
    out = policy_loss("grpo", new, old, adv, mask, clip_ratio_c=3.0, clip_eps_low=0.2)
    out.loss.backward()
    # A > 0: -r capped at 1.2 -> (-0.5, -1.2, -1.2); A < 0: max(r, 0.8) at most c = 3 -> (0.8,
    # 2, 3); the last one is bound, a constant, and the floored one has no gradient either
    torch.testing.assert_close(out.loss, torch.tensor((-0.5 - 1.2 - 1.2 + 0.8 + 2.0 + 3.0) / 6))
    want = torch.tensor([[-0.5, 0.0, 0.0], [0.0, 2.0, 0.0]]) / 6  # d(+-r)/d log r = +-r
    torch.testing.assert_close(new.grad, want)
    assert out.metrics["policy/dual_clip_frac"] == pytest.approx(1 / 6)
    without = policy_loss("grpo", new.detach(), old, adv, mask, clip_ratio_c=None)
    assert without.loss.item() == pytest.approx((-0.5 - 1.2 - 1.2 + 0.8 + 2.0 + 5.0) / 6)
    assert without.metrics["policy/dual_clip_frac"] == 0.0


@HYPOTHESIS
@given(
    batches(),
    st.sampled_from(LOSS_AGG_MODES),
    st.sampled_from(KL_ESTIMATORS),
    st.sampled_from([-0.1, 0.5, 4.0, -12.0]),  # 4 and -12 put every token's k3 above 10
)
def test_kl_estimators_match_reference(b, agg, estimator, ref_offset):
    ref_logp = (b["old"] + np.float32(ref_offset)).astype(np.float32)
    options = {"ref_logprobs": torch.from_numpy(ref_logp), "kl_coef": 0.05}
    ref_options = {"ref_logp": ref_logp, "kl_coef": 0.05, "kl_estimator": estimator}
    out, grad, ref, ref_grad = library_and_reference(
        "grpo", b, agg, options={**options, "kl_estimator": estimator}, ref_options=ref_options
    )
    assert out.loss.item() == pytest.approx(ref, rel=2e-4, abs=1e-5)
    np.testing.assert_allclose(grad.numpy(), ref_grad.numpy(), rtol=2e-4, atol=1e-5)
    # the metric: the estimate's mean over valid tokens, named after the estimator
    new = b["new"].astype(np.float64)
    want = [
        float(reference.kl_estimate(torch.tensor(new[i, t]), float(ref_logp[i, t]), estimator))
        for i, t in zip(*np.nonzero(b["mask"]), strict=True)
    ]
    mean = float(np.mean(want)) if want else 0.0
    assert out.metrics[f"kl/ref_{estimator}"] == pytest.approx(mean, rel=2e-4, abs=1e-5)


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -1.0, -1.0, 0.0], requires_grad=True)
    ref = torch.tensor([-1.5, -0.5, -1.0, -4.0])  # d = 0.5, -0.5, 0, 4
    e = math.exp
    want = {
        "k1": [0.5, -0.5, 0.0, 4.0],
        "abs": [0.5, 0.5, 0.0, 4.0],
        "k2": [0.125, 0.125, 0.0, 8.0],
        # e^-d + d - 1 (below the clamp at 10 here)
        "k3": [e(-0.5) - 0.5, e(0.5) - 1.5, 0.0, e(-4.0) + 3.0],
    }
    for estimator, values in want.items():
        torch.testing.assert_close(kl_estimate(logp, ref, estimator), torch.tensor(values))
    far = torch.tensor([-4.0], requires_grad=True)  # d = -4: k3 = e^4 - 5, clamped to 10
    clamped = kl_estimate(far, torch.tensor([0.0]), "k3")
    clamped.sum().backward()
    assert clamped.item() == 10.0 and far.grad.item() == 0.0  # verl's clamp: no gradient
    kl_estimate(logp, ref, "k3").sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([1 - e(-0.5), 1 - e(0.5), 0.0, 1 - e(-4.0)]))
    with pytest.raises(ValueError, match="k1, abs, k2, k3"):
        kl_estimate(logp, ref, "low_var_kl")


@HYPOTHESIS
@given(batches(), st.sampled_from(LOSS_AGG_MODES))
def test_k3_kl_to_reference_policy(b, agg):
    ref_logp = (b["old"] - 0.1).astype(np.float32)
    options = {"ref_logprobs": torch.from_numpy(ref_logp), "kl_coef": 0.05}
    ref_options = {"ref_logp": ref_logp, "kl_coef": 0.05}
    out, grad, ref, ref_grad = library_and_reference(
        "grpo", b, agg, options=options, ref_options=ref_options
    )
    assert out.loss.item() == pytest.approx(ref, rel=2e-4, abs=1e-5)
    np.testing.assert_allclose(grad.numpy(), ref_grad.numpy(), rtol=2e-4, atol=1e-5)
    assert "kl/ref_k3" in out.metrics  # the default estimator keeps the metric's old name


def test_aggregation_modes_by_hand():
    # r = 1, so the token loss is -A: row 0 (A = 1) has 1 token, row 1 (A = -1) 3, row 2 none
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    adv = torch.tensor([1.0, -1.0, 5.0])
    x = torch.zeros(3, 3)
    want = {
        "token-mean": (-1 + 3) / 4,
        "seq-mean-token-mean": (-1 + 1) / 2,
        "seq-mean-token-sum": (-1 + 3) / 2,
        "seq-mean-token-sum-norm": (-1 + 3) / (2 * 3),
    }
    assert set(want) == set(LOSS_AGG_MODES)
    for agg, value in want.items():
        loss = policy_loss("grpo", x, x, adv, mask, loss_agg=agg).loss.item()
        assert loss == pytest.approx(value, rel=1e-7), agg


def test_cagrpo_gradient_is_ppo_clip_gradient_with_reweighted_advantages():
    g = torch.Generator().manual_seed(0)
    B, T = 12, 9
    old = -3 * torch.rand(B, T, generator=g)
    new = (old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_()
    mask = torch.rand(B, T, generator=g) < 0.8
    adv = torch.randn(B, generator=g)
    gid = torch.arange(B) // 4
    policy_loss("cagrpo", new, old, adv, mask, gid, clip_eps_high=0.28).loss.backward()
    # PPO-clip, written out, with A replaced by the constant w~ * A
    weighted = (cagrpo_token_weights(old, adv, mask, gid) * adv[:, None]).detach()
    x = new.detach().clone().requires_grad_()
    ratio = torch.exp(x - old)
    token = torch.maximum(-weighted * ratio, -weighted * ratio.clamp(0.8, 1.28))
    (token * mask).sum().div(mask.sum()).backward()
    torch.testing.assert_close(new.grad, x.grad, rtol=1e-5, atol=1e-7)
    assert (new.grad != 0).any()


def test_clip_cov_selection_follows_its_definition():
    g = torch.Generator().manual_seed(1)
    B, T = 32, 64
    old = -4 * torch.rand(B, T, generator=g) ** 2
    adv = 3 * torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.9
    ratio, lb, ub = 0.01, 0.5, 5.0
    prepared = prepare_loss_inputs(
        "clip_cov", old, adv, mask, clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub, seed=7
    )
    chosen = (prepared.token_weights == 0) & mask
    c = reference_covariance(old.numpy(), adv.numpy(), mask.numpy(), None, "batch")
    eligible = mask.numpy() & (c > lb) & (c < ub)
    assert eligible[chosen.numpy()].all()
    assert int(chosen.sum()) == min(max(int(ratio * int(mask.sum())), 1), int(eligible.sum()))
    assert torch.equal(prepared.token_weights[~chosen], mask.float()[~chosen])
    again = prepare_loss_inputs(
        "clip_cov", old, adv, mask, clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub, seed=7
    )
    other = prepare_loss_inputs(
        "clip_cov", old, adv, mask, clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub, seed=8
    )
    assert torch.equal(again.token_weights, prepared.token_weights)
    assert not torch.equal(other.token_weights, prepared.token_weights)


def test_kl_cov_selects_top_covariance_tokens():
    g = torch.Generator().manual_seed(2)
    B, T = 16, 40
    old = -4 * torch.rand(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.7
    prepared = prepare_loss_inputs("kl_cov", old, adv, mask, kl_cov_ratio=0.05)
    chosen = prepared.kl_penalty.bool()
    c = reference_covariance(old.numpy(), adv.numpy(), mask.numpy(), None, "batch")
    k = int(0.05 * int(mask.sum()))
    assert int(chosen.sum()) == k and not (chosen & ~mask).any()
    threshold = np.sort(c[mask.numpy()])[::-1][k - 1]
    assert (c[chosen.numpy()] >= threshold - 1e-6).all()


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_micro_batches_sum_to_the_full_batch_gradient(name, agg):
    g = torch.Generator().manual_seed(3)
    B, T = 24, 48
    old = -3 * torch.rand(B, T, generator=g) ** 2
    new0 = old + 0.3 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[5] = False  # a response without tokens
    adv = torch.randn(B, generator=g)
    gid = torch.arange(B) // 6
    ref_logp, entropy = old - 0.2, torch.rand(B, T, generator=g)
    options = {
        "clip_eps_high": 0.28,
        "clip_ratio_c": 1.2,  # binds on some tokens with A < 0
        "loss_agg": agg,
        "ref_logprobs": ref_logp,
        "kl_coef": 0.1,
    }
    settings_ = {"clip_cov_ratio": 0.02, "kl_cov_ratio": 0.02, "seed": 11, "cov_scope": "group"}

    full = new0.clone().requires_grad_()
    ent_full = entropy.clone().requires_grad_()
    out = policy_loss(
        name, full, old, adv, mask, gid, entropy=ent_full, entropy_coef=0.01, **options, **settings_
    )
    out.loss.backward()

    parts = new0.clone().requires_grad_()
    ent_parts = entropy.clone().requires_grad_()
    prepared = prepare_loss_inputs(name, old, adv, mask, gid, **settings_)
    total = 0.0
    for rows in (slice(0, 7), slice(7, 8), torch.tensor([8, 9, 20, 21]), slice(10, 20), [22, 23]):
        rows = torch.as_tensor(rows) if isinstance(rows, list) else rows
        part = policy_loss(
            name,
            parts[rows],
            old[rows],
            adv[rows],
            mask[rows],
            entropy=ent_parts[rows],
            entropy_coef=0.01,
            prepared=prepared.rows(rows),
            **{**options, "ref_logprobs": ref_logp[rows]},
        )
        part.loss.backward()
        total += part.loss.item()
    assert total == pytest.approx(out.loss.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(parts.grad, full.grad, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(ent_parts.grad, ent_full.grad, rtol=1e-5, atol=1e-8)
    assert full.grad.abs().sum() > 0


def test_metrics_keys_and_types():
    g = torch.Generator().manual_seed(4)
    old = -2 * torch.rand(8, 16, generator=g)
    new = (old + 0.5 * torch.randn(8, 16, generator=g)).requires_grad_()
    mask = torch.ones(8, 16, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0] * 4)
    out = policy_loss("cagrpo", new, old, adv, mask, torch.arange(8) // 4)
    for key in [
        "policy/clip_frac",
        "policy/clip_frac_high",
        "policy/clip_frac_low",
        "policy/dual_clip_frac",
        "policy/approx_kl",
        "policy/ratio_mean",
        "policy/ratio_max",
        "policy/loss",
        "policy/tokens",
        "loss/total",
        "cagrpo/weight_min",
        "cagrpo/weight_mean",
        "cagrpo/weight_max",
        "cagrpo/weight_p01",
        "cagrpo/weight_frac_below_0.5",
        "cagrpo/sigma_mean",
        "cagrpo/degenerate_frac",
        "cov/mean",
        "cov/std",
        "cov/pos_0.01pct",
        "cov/neg_0.01pct",
        "cov/pos_1pct",
        "cov/neg_1pct",
        "cov/pos_20pct",
        "cov/neg_20pct",
        "cov/pos_40pct",
        "cov/neg_40pct",
    ]:
        assert isinstance(out.metrics[key], float), key
    r = torch.exp(new.detach() - old)
    assert out.metrics["policy/approx_kl"] == pytest.approx(
        float((r - 1 - r.log()).mean()), rel=1e-4
    )
    clipped = ((r > 1.2) & (adv[:, None] > 0)) | ((r < 0.8) & (adv[:, None] < 0))
    assert out.metrics["policy/clip_frac"] == pytest.approx(float(clipped.float().mean()))
    assert out.metrics["cagrpo/weight_mean"] == pytest.approx(1.0, rel=1e-5)


def test_no_nan_on_edge_batches_and_nan_inputs_are_refused():
    for name in LOSSES:
        for mask in (
            torch.zeros(4, 3, dtype=torch.bool),
            torch.tensor([[1, 0, 0]] + [[0] * 3] * 3),
        ):
            new = torch.full((4, 3), -1e4, requires_grad=True)
            out = policy_loss(
                name,
                new,
                torch.zeros(4, 3),
                torch.zeros(4),
                mask.bool(),
                torch.tensor([0, 0, 1, 1]),
            )
            out.loss.backward()
            assert torch.isfinite(new.grad).all() and math.isfinite(out.loss.item())
            assert all(math.isfinite(v) for v in out.metrics.values())
    bad = torch.tensor([[float("nan"), -1.0]], requires_grad=True)
    with pytest.raises(FloatingPointError, match="NaN"):
        policy_loss("grpo", bad, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2))


def test_registry_errors_and_extension():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="grpo, cagrpo, clip_cov, kl_cov"):
        policy_loss("cagrpo2", x, x, torch.zeros(2), x)
    with pytest.raises(ValueError, match="token-mean"):
        policy_loss("grpo", x, x, torch.zeros(2), x, loss_agg="sum")
    prepared = prepare_loss_inputs("grpo", x, torch.zeros(2), x)
    with pytest.raises(ValueError, match="cagrpo"):
        policy_loss("cagrpo", x, x, torch.zeros(2), x, prepared=prepared)

    @register_policy_loss("vanilla_pg")
    def vanilla_pg(inputs):
        return -inputs.advantages * inputs.ratio, {}

    try:
        new = torch.zeros(2, 3, requires_grad=True)
        policy_loss(
            "vanilla_pg", new, x, torch.tensor([1.0, -1.0]), torch.ones(2, 3)
        ).loss.backward()
        torch.testing.assert_close(new.grad, torch.tensor([[-1.0] * 3, [1.0] * 3]) / 6)
    finally:
        POLICY_LOSSES.remove("vanilla_pg")


# ------------------------------------------------------------------------------------------------
# Ablation kernels
# ------------------------------------------------------------------------------------------------


@HYPOTHESIS
@given(batches(), st.sampled_from(["group", "batch"]))
def test_unnormalized_kernel_matches_reference(b, scope):
    _, old, adv, mask, gid = as_torch(b)
    prepared = prepare_loss_inputs(
        "cagrpo", old, adv, mask, gid, cov_scope=scope, cagrpo_kernel="unnormalized"
    )
    want = reference_weights(b["old"], b["adv"], b["mask"], b["group_ids"], scope, normalize=False)
    got = prepared.token_weights.numpy()
    # exp underflows to 0 in float32 where the float64 reference is below ~1e-38
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-30)
    assert (got <= 1.0 + 1e-6).all()


@HYPOTHESIS
@given(batches(), st.sampled_from(LOSS_AGG_MODES), st.sampled_from(["group", "batch"]))
def test_kernel_frozen_at_one_is_grpo_bit_for_bit(b, agg, scope):
    results = []
    for name, kernel in (("grpo", "normalized"), ("cagrpo", "ones")):
        new, old, adv, mask, gid = as_torch(b)
        prepared = prepare_loss_inputs(
            name, old, adv, mask, gid, cov_scope=scope, cagrpo_kernel=kernel
        )
        out = policy_loss(name, new, old, adv, mask, gid, loss_agg=agg, prepared=prepared)
        out.loss.backward()
        results.append((out.loss.detach(), new.grad))
    (loss_grpo, grad_grpo), (loss_ones, grad_ones) = results
    assert torch.equal(loss_grpo, loss_ones)
    assert torch.equal(grad_grpo, grad_ones)


@HYPOTHESIS
@given(
    batches(),
    st.sampled_from(["group", "batch"]),
    st.sampled_from([0.5, 1.0, 2.0, 8.0]),
    st.sampled_from(["both", "positive", "negative"]),
)
def test_kernel_width_and_side_match_reference(b, scope, kappa, side):
    _, old, adv, mask, gid = as_torch(b)
    got = cagrpo_token_weights(old, adv, mask, gid, scope=scope, kappa=kappa, side=side)
    want = reference_weights(
        b["old"], b["adv"], b["mask"], b["group_ids"], scope, kappa=kappa, side=side
    )
    assert torch.isfinite(got).all()
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=2e-5)
    if b["mask"].any() and scope == "batch":
        assert got[mask].mean().item() == pytest.approx(1.0, rel=1e-5)
    # through the loss's options: the same weights
    kernel = "normalized" if side == "both" else side
    prepared = prepare_loss_inputs(
        "cagrpo", old, adv, mask, gid, cov_scope=scope, cagrpo_kernel=kernel, cagrpo_kappa=kappa
    )
    assert torch.equal(prepared.token_weights, got)


@HYPOTHESIS
@given(batches(), st.sampled_from(["group", "batch"]))
def test_one_sided_kernels_leave_the_other_side_alone(b, scope):
    """The tokens off the kernel's side share one weight per scope (the normalizer), the
    paper's kernel at kappa 1 is the default bit for bit, and a wide kernel is GRPO's 1."""
    _, old, adv, mask, gid = as_torch(b)
    c = token_covariance(old, adv, mask, gid, scope=scope)
    default = cagrpo_token_weights(old, adv, mask, gid, scope=scope)
    assert torch.equal(cagrpo_token_weights(old, adv, mask, gid, scope=scope, kappa=1.0), default)
    wide = cagrpo_token_weights(old, adv, mask, gid, scope=scope, kappa=1e4)
    np.testing.assert_allclose(wide[mask].numpy(), 1.0, rtol=1e-5)
    for side, off in (("positive", c <= 0), ("negative", c >= 0)):
        w = cagrpo_token_weights(old, adv, mask, gid, scope=scope, side=side)
        rows = [torch.arange(len(gid))] if scope == "batch" else [gid == g for g in gid.unique()]
        for r in rows:
            kept = w[r][(off & mask)[r]]
            if kept.numel():
                torch.testing.assert_close(kept, kept[:1].expand_as(kept))
                assert kept[0] >= 1.0 - 1e-6  # the others only lose weight


def test_one_sided_kernel_underflow_and_bad_options():
    # c = (1, 1, 1.01, 1.01): every kernel value underflows; all four c are positive
    logp = torch.tensor([[-1.0], [-3.0], [-0.99], [-3.01]])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, 1)
    positive = cagrpo_token_weights(logp, adv, mask, scope="batch", side="positive")
    torch.testing.assert_close(positive[:, 0], torch.tensor([2.0, 2.0, 0.0, 0.0]))
    negative = cagrpo_token_weights(logp, adv, mask, scope="batch", side="negative")
    assert torch.equal(negative, torch.ones(4, 1))  # no token has c < 0
    # two groups: the first underflows, the second has tokens off the kernel's side
    logp2 = torch.cat([logp, torch.tensor([[-0.1], [-2.0], [-0.2], [-5.0]])])
    adv2 = torch.cat([adv, torch.tensor([1.0, 1.0, -1.0, -1.0])])
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    for side in ("positive", "negative", "both"):
        got = cagrpo_token_weights(logp2, adv2, torch.ones(8, 1), gid, side=side)
        want = reference_weights(logp2.numpy(), adv2.numpy(), np.ones((8, 1), bool),
                                 gid.numpy(), "group", side=side)  # fmt: skip
        np.testing.assert_allclose(got.numpy(), want, atol=1e-6)
    with pytest.raises(ValueError, match="kappa"):
        cagrpo_token_weights(logp, adv, mask, scope="batch", kappa=0.0)
    with pytest.raises(ValueError, match="both, positive, negative"):
        cagrpo_token_weights(logp, adv, mask, scope="batch", side="upper")
    with pytest.raises(ValueError, match="cagrpo_kappa"):
        LossSpec("cagrpo", cagrpo_kappa=-1.0)


def test_unknown_kernel_is_refused_with_the_choices():
    _, old, adv, mask, gid = as_torch(
        {
            "new": np.zeros((2, 3), np.float32),
            "old": np.zeros((2, 3), np.float32),
            "adv": np.array([1.0, -1.0], np.float32),
            "mask": np.ones((2, 3), bool),
            "group_ids": np.zeros(2, np.int64),
        }
    )
    with pytest.raises(ValueError, match="normalized, unnormalized, ones, positive, negative"):
        prepare_loss_inputs("cagrpo", old, adv, mask, gid, cagrpo_kernel="flat")


@pytest.mark.parametrize("kernel", ["normalized", "unnormalized"])
def test_advantages_equal_up_to_float32_rounding_give_unit_weights(kernel):
    """Batch scope over groups whose advantages differ only in their last float32 bits: c is
    constant up to rounding, so every weight is 1 (this once gave NaN off the mask)."""
    old = torch.tensor([[-1.0], [0.0], [-1.0], [-1.0]])
    adv = torch.tensor([0.7070988, -0.7070988, 0.70710576, -0.70710576])
    mask = torch.tensor([[False], [True], [False], [True]])
    gid = torch.tensor([0, 0, 1, 1])
    prepared = prepare_loss_inputs(
        "cagrpo", old, adv, mask, gid, cov_scope="batch", cagrpo_kernel=kernel
    )
    want = reference_weights(old.numpy(), adv.numpy(), mask.numpy(), gid.numpy(), "batch")
    np.testing.assert_allclose(prepared.token_weights.numpy(), want, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------
# The off-policy correction and the loss specification
# ------------------------------------------------------------------------------------------------


@HYPOTHESIS
@given(batches(), st.sampled_from(LOSSES), st.floats(0.5, 3.0))
def test_truncated_is_weights_scale_each_tokens_gradient(b, name, cap):
    new, old, adv, mask, gid = as_torch(b)
    behavior = torch.from_numpy(b["old"] - np.float32(0.3) * np.sign(b["new"] - b["old"]))
    weights, metrics = truncated_is_weights(old, behavior, mask, cap)
    want = reference.truncated_is_weights(b["old"], behavior.numpy(), b["mask"], cap)
    np.testing.assert_allclose(weights.numpy(), want, rtol=1e-6, atol=1e-7)
    if b["mask"].any():
        assert metrics["tis/weight_mean"] == pytest.approx(want[b["mask"]].mean(), rel=1e-5)
    prepared = prepare_loss_inputs(name, old, adv, mask, gid, seed=3)
    plain = policy_loss(name, new, old, adv, mask, prepared=prepared)
    new_w = new.detach().clone().requires_grad_()
    out = policy_loss(name, new_w, old, adv, mask, is_weights=weights, prepared=prepared)
    out.loss.backward()
    assert out.metrics["policy/loss"] == plain.metrics["policy/loss"]  # the value is kept
    token_weight = None if prepared.token_weights is None else prepared.token_weights.numpy()
    penalty = None if prepared.kl_penalty is None else prepared.kl_penalty.numpy()
    ref_new = torch.from_numpy(b["new"]).double().requires_grad_()
    ref = reference.policy_loss(
        name, ref_new, b["old"], b["adv"], b["mask"], token_weight, penalty, is_weights=want
    )
    if ref.requires_grad:
        ref.backward()
        np.testing.assert_allclose(new_w.grad.numpy(), ref_new.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_loss_spec_checks_its_options_and_names_the_choices():
    assert LossSpec().name == "cagrpo"
    with pytest.raises(ValueError, match="grpo, cagrpo, clip_cov, kl_cov"):
        LossSpec("cagrpo2")
    with pytest.raises(ValueError, match="token-mean"):
        LossSpec("grpo", loss_agg="sum")
    with pytest.raises(ValueError, match="group, batch"):
        LossSpec("cagrpo", cov_scope="prompt")
    with pytest.raises(ValueError, match="tis_cap"):
        LossSpec("grpo", tis_cap=0.0)
    with pytest.raises(ValueError, match="clip_ratio_c must be above 1"):
        LossSpec("grpo", clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="kl_estimator 'mse' is not one of k1, abs, k2, k3"):
        LossSpec("grpo", kl_estimator="mse")
    assert LossSpec("grpo", clip_ratio_c=None).clip_ratio_c is None
    with pytest.raises(TypeError, match="clip_eps_high"):
        policy_loss("grpo", torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1),
                    torch.ones(1, 2), clip_eps_hi=0.3)  # fmt: skip


def test_options_reach_the_loss_through_the_spec():
    """Clip-Cov's band and ratio, KL-Cov's ratio and coefficient are the spec's, not fixed."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 50, generator=g) * 4
    adv = torch.tensor([2.0, -2.0] * 4)
    mask = torch.ones(8, 50, dtype=torch.bool)
    few = prepare_loss_inputs("kl_cov", old, adv, mask, kl_cov_ratio=2e-4)
    many = prepare_loss_inputs("kl_cov", old, adv, mask, kl_cov_ratio=0.05)
    assert few.kl_penalty.sum() == 1 and many.kl_penalty.sum() == 20
    band = prepare_loss_inputs("clip_cov", old, adv, mask, clip_cov_ratio=0.05, clip_cov_lb=-1e9,
                               clip_cov_ub=1e9, seed=1)  # fmt: skip
    assert (band.token_weights == 0).sum() == 20
    new = (old + 0.1).requires_grad_()
    small = policy_loss(LossSpec("kl_cov", kl_cov_coef=0.1), new, old, adv, mask,
                        prepared=many)  # fmt: skip
    large = policy_loss(LossSpec("kl_cov", kl_cov_coef=1.0), new, old, adv, mask,
                        prepared=many)  # fmt: skip
    extra = 0.9 * float((many.kl_penalty * 0.1).sum()) / 400
    assert large.metrics["policy/loss"] - small.metrics["policy/loss"] == pytest.approx(
        extra, rel=1e-4
    )


# ------------------------------------------------------------------------------------------------
# What the token inspector shows: the loss's own clip rule and per-token fields
# ------------------------------------------------------------------------------------------------


@HYPOTHESIS
@given(batches(), st.sampled_from(LOSSES), CLIP_RATIO_C)
def test_clipped_tokens_are_the_losses_clip_rule(b, name, clip_ratio_c):
    """A token is clipped where its effective advantage w_t A_i > 0 and r_t > 1 + eps_high, or
    w_t A_i < 0 and r_t < 1 - eps_low (float64 here); KL-Cov does not clip."""
    new, old, adv, mask, gid = as_torch(b)
    eps_low, eps_high = 0.2, 0.28
    options = {"clip_eps_low": eps_low, "clip_eps_high": eps_high, "clip_ratio_c": clip_ratio_c}
    out = policy_loss(name, new, old, adv, mask, gid, seed=3, **options)
    if name == "kl_cov":
        assert out.clipped is None
        return
    prepared = prepare_loss_inputs(name, old, adv, mask, gid, seed=3, **options)
    weight = np.ones(b["mask"].shape)
    if prepared.token_weights is not None:
        weight = prepared.token_weights.double().numpy()
    effective = b["adv"].astype(np.float64)[:, None] * weight
    ratio = np.exp(b["new"].astype(np.float64) - b["old"].astype(np.float64))
    want = b["mask"] & (
        ((effective > 0) & (ratio > 1 + eps_high)) | ((effective < 0) & (ratio < 1 - eps_low))
    )
    # float32 and float64 may disagree on a ratio within rounding of a clip bound
    near = (np.abs(ratio - (1 + eps_high)) < 1e-5) | (np.abs(ratio - (1 - eps_low)) < 1e-5)
    got = out.clipped.numpy()
    assert got.dtype == np.bool_ and got.shape == b["mask"].shape
    np.testing.assert_array_equal(got[~near], want[~near])
    n = max(int(b["mask"].sum()), 1)
    assert out.metrics["policy/clip_frac"] == pytest.approx(got.sum() / n)


def test_each_loss_shows_its_own_token_fields():
    from cagrpo_ray.algo.losses import INSPECTOR_FIELDS, shown_field, token_fields

    rng = np.random.default_rng()  # fresh inputs every run
    B, T = 8, 40
    old = torch.from_numpy(rng.normal(-2, 1, (B, T)).astype(np.float32))
    adv = torch.from_numpy(rng.normal(0, 1, B).astype(np.float32))
    mask = torch.from_numpy(rng.random((B, T)) < 0.8)
    gid = torch.arange(B) // 4
    options = {"clip_cov_ratio": 0.2, "kl_cov_ratio": 0.2, "clip_cov_lb": -1e9, "clip_cov_ub": 1e9}
    shown = {}
    for name in LOSSES:
        prepared = prepare_loss_inputs(name, old, adv, mask, gid, seed=5, **options)
        shown[name] = token_fields(LossSpec(name, **options), prepared, mask)
        assert set(shown[name]) == set(INSPECTOR_FIELDS)
        if name == "cagrpo":
            assert torch.equal(shown[name]["weight"], prepared.token_weights)
        if name == "clip_cov":
            assert torch.equal(shown[name]["clip_cov"], (prepared.token_weights == 0) & mask)
            assert shown[name]["clip_cov"].any()
        if name == "kl_cov":
            assert torch.equal(shown[name]["kl_cov"], prepared.kl_penalty > 0)
            assert shown[name]["kl_cov"].any()
    present = {name: {k for k, v in got.items() if v is not None} for name, got in shown.items()}
    assert present == {
        "grpo": set(), "cagrpo": {"weight"}, "clip_cov": {"clip_cov"}, "kl_cov": {"kl_cov"}
    }  # fmt: skip
    assert [shown_field(name) for name in LOSSES] == ["cov", "weight", "cov", "cov"]
    assert shown_field("a_loss_from_another_program") == "cov"
