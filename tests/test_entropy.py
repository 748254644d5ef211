"""Chunked entropies / log-probs from logits, and the covariance-quantile table."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cagrpo_ray.algo.entropy import entropy_from_logits, logprobs_from_logits
from cagrpo_ray.algo.stats import covariance_quantiles, format_covariance_table, masked_quantiles

pytestmark = pytest.mark.unit


def reference_entropy_and_logprobs(logits, targets):
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    entropy = -(np.exp(logp) * logp).sum(-1)
    picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return entropy, picked


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.integers(1, 3),
    st.integers(1, 7),
    st.integers(1, 50),
    st.sampled_from([1, 3, 8, 1024]),
    st.sampled_from([0.1, 3.0, 30.0]),
    st.integers(0, 2**31 - 1),
)
def test_matches_reference(B, T, V, chunk_size, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    want_h, want_lp = reference_entropy_and_logprobs(logits.numpy(), targets.numpy())
    h = entropy_from_logits(logits, chunk_size=chunk_size)
    lp = logprobs_from_logits(logits, targets, chunk_size=chunk_size)
    assert h.shape == (B, T) and lp.shape == (B, T) and h.dtype == torch.float32
    np.testing.assert_allclose(h.numpy(), want_h, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lp.numpy(), want_lp, rtol=1e-5, atol=1e-5)


def test_gradients_equal_unchunked_autograd():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 33, generator=g, dtype=torch.float64).to(torch.float32)
    targets = torch.randint(0, 33, (2, 9), generator=g)
    weights = torch.randn(2, 9, generator=g)
    x = logits.clone().requires_grad_()
    (entropy_from_logits(x, chunk_size=4) * weights).sum().backward()
    y = logits.clone().requires_grad_()
    p = torch.softmax(y, -1)
    (-(p * torch.log_softmax(y, -1)).sum(-1) * weights).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-6)

    x = logits.clone().requires_grad_()
    (logprobs_from_logits(x, targets, chunk_size=5) * weights).sum().backward()
    y = logits.clone().requires_grad_()
    (torch.log_softmax(y, -1).gather(-1, targets[..., None])[..., 0] * weights).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-6)


def test_saved_activations_stay_bounded():
    """With gradient, only the (bf16) logits are kept for backward, never a float32 softmax."""
    logits = torch.randn(4, 256, 512).to(torch.bfloat16).requires_grad_()
    saved = []

    def pack(t):  # count what is saved beyond views of the logits themselves
        is_view = t.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
        saved.append(0 if is_view else t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = entropy_from_logits(logits, chunk_size=64)
        lp = logprobs_from_logits(logits, torch.zeros(4, 256, dtype=torch.long), chunk_size=64)
    full_softmax = 4 * 256 * 512 * 4
    assert sum(saved) < full_softmax / 8
    (h.sum() + lp.sum()).backward()
    assert torch.isfinite(logits.grad.float()).all()


def test_extreme_and_uniform_logits():
    logits = torch.tensor([[[1e4, -1e4, 0.0], [0.0, 0.0, 0.0]]])
    h = entropy_from_logits(logits)
    torch.testing.assert_close(h, torch.tensor([[0.0, math.log(3)]]))
    lp = logprobs_from_logits(logits, torch.tensor([[1, 2]]))
    torch.testing.assert_close(lp, torch.tensor([[-2e4, -math.log(3)]]))
    assert entropy_from_logits(torch.zeros(0, 5)).shape == (0,)
    with pytest.raises(ValueError, match="targets"):
        logprobs_from_logits(logits, torch.tensor([1, 2]))


def test_covariance_quantiles_and_table():
    g = torch.Generator().manual_seed(0)
    cov = torch.randn(64, 300, generator=g) ** 3
    mask = torch.rand(64, 300, generator=g) < 0.7
    table = covariance_quantiles(cov, mask)
    valid = cov[mask].double().numpy()
    for f, key in [(1e-4, "0.01pct"), (1e-2, "1pct"), (0.2, "20pct"), (0.4, "40pct")]:
        assert table[f"pos_{key}"] == pytest.approx(np.quantile(valid, 1 - f), rel=1e-6)
        assert table[f"neg_{key}"] == pytest.approx(np.quantile(valid, f), rel=1e-6)
    text = format_covariance_table(table)
    assert text.splitlines()[0].startswith("| top / bottom fraction")
    assert "| 0.01% |" in text and "| 40% |" in text
    assert masked_quantiles(cov, torch.zeros_like(mask), [0.5]) == [0.0]
