"""experiments/kernel_anatomy.py's mechanism numbers, on a small random policy and fresh random
batches: the chunked gradients equal one unchunked pass, the first-order entropy change equals
a float64 finite difference of the full-softmax entropy, and the shares are what they claim."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from kernel_anatomy import accumulated_gradients, group_sigma, mechanism, scores  # noqa: E402

from cagrpo_ray.algo.advantages import group_advantages  # noqa: E402
from cagrpo_ray.algo.covariance import cagrpo_token_weights, token_covariance  # noqa: E402
from cagrpo_ray.policies.model import random_policy  # noqa: E402

pytestmark = pytest.mark.unit

SIZE = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
ROWS, GROUP, WIDTH, GEN = 8, 4, 5, 7


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return random_policy(tmp_path_factory.mktemp("anatomy") / "policy", seed=3, **SIZE)


def random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(3, 17, (ROWS, WIDTH + GEN), generator=g)
    prompt_len = torch.randint(2, WIDTH + 1, (ROWS,), generator=g)
    attn = (torch.arange(WIDTH)[None] >= WIDTH - prompt_len[:, None]).long()
    response_len = torch.randint(1, GEN + 1, (ROWS,), generator=g)
    mask = torch.arange(GEN)[None] < response_len[:, None]
    rewards = torch.randint(0, 2, (ROWS,), generator=g).float()
    rewards[:GROUP] = torch.tensor([1.0, 0.0, 0.0, 1.0])  # a group with signal, whatever else
    return (out, WIDTH, attn, mask), group_advantages(rewards, GROUP)


def weights_of(model, batch, adv, args):
    logp, _ = scores(model, batch, args)
    mask = batch[3]
    group_ids = torch.arange(ROWS) // GROUP
    w = cagrpo_token_weights(logp, adv, mask, group_ids, "group")
    c = token_covariance(logp, adv, mask, group_ids, "group")
    m = mask.float()
    return {"down": m * (w < 0.5), "rest": m * (w >= 0.5), "cagrpo": w * m}, w, c, group_ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_gradients_are_one_pass_and_the_entropy_change_is_first_order(policy, seed):
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float64)
    batch, adv = random_case(seed)
    args = SimpleNamespace(temperature=0.7, chunk_rows=ROWS)
    weights, w, c, group_ids = weights_of(model, batch, adv.double(), args)
    n = batch[3].sum()
    whole = accumulated_gradients(model, batch, weights, adv.double(), n, args)
    chunked = accumulated_gradients(
        model, batch, weights, adv.double(), n, SimpleNamespace(temperature=0.7, chunk_rows=3)
    )
    for name in whole:
        torch.testing.assert_close(chunked[name], whole[name], rtol=1e-10, atol=1e-12)

    # d/d eps of H(theta - eps * g) at 0, by a central difference in float64
    def entropy_at(step):
        params = [p for p in model.parameters() if p.requires_grad]
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            offset = 0
            for p in params:
                p.sub_(step[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            _, ent = scores(model, batch, args)
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        return float(ent.sum() / n)

    grads = {**whole, "grpo": whole["down"] + whole["rest"]}
    result = mechanism(c, w, adv.double(), batch[3], group_ids, grads)
    # A step of 1e-3 along the unit direction: float64 throughout except the model's rotary
    # embedding (float32 in transformers), whose rounding limits how small the step can be.
    h = 1e-3
    for name in ("grpo", "cagrpo"):
        for key, direction in (("sgd", grads[name]), ("adam_first_step", grads[name].sign())):
            u = direction / direction.norm()
            slope = (entropy_at(h * u) - entropy_at(-h * u)) / (2 * h)
            numeric = float(direction.norm()) * slope
            got = result["first_order_entropy_change_per_unit_lr"][name][key]
            assert got == pytest.approx(numeric, rel=1e-3), (name, key)

    # R is the down-weighted tokens' gradient norm over GRPO's; the projections add up to 1
    g = grads["grpo"]
    assert result["R_norm_share"] == pytest.approx(float(grads["down"].norm() / g.norm()))
    rest = float(grads["rest"] @ g) / float(g @ g)
    assert result["R_projection_share"] + rest == pytest.approx(1.0, abs=1e-9)
    assert 0.0 <= result["share_w_below_0.5"] <= 1.0


def test_group_sigma_is_each_groups_population_std():
    g = torch.Generator().manual_seed(7)
    c = torch.randn(ROWS, GEN, generator=g, dtype=torch.float64)
    mask = torch.rand(ROWS, GEN, generator=g) < 0.7
    mask[:, 0] = True
    group_ids = torch.arange(ROWS) // GROUP
    sigma = group_sigma(c, mask, group_ids)
    for group in range(ROWS // GROUP):
        rows = slice(group * GROUP, (group + 1) * GROUP)
        kept = zip(c[rows].flatten(), mask[rows].flatten(), strict=True)
        values = [float(x) for x, keep in kept if keep]
        mean = sum(values) / len(values)
        want = (sum((x - mean) ** 2 for x in values) / len(values)) ** 0.5
        assert torch.allclose(sigma[rows][mask[rows]], torch.tensor(want, dtype=torch.float64))
    assert (sigma[~mask] == 0).all()


def test_scores_are_the_full_softmax_at_the_temperature(policy):
    """Row by row, without padding: log pi(o_t) and the entropy of softmax(logits / T)."""
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float64)
    batch, _ = random_case(5)
    out, width, attn, mask = batch
    logp, ent = scores(model, batch, SimpleNamespace(temperature=0.7, chunk_rows=3))
    for row in range(ROWS):
        start = int((attn[row] == 0).sum())
        ids = out[row, start:][None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, width - start - 1 : -1] / 0.7
        dist = torch.log_softmax(logits, -1)
        want_logp = dist.gather(-1, out[row, width:, None]).squeeze(-1)
        want_ent = -(dist.exp() * dist).sum(-1)
        keep = mask[row]
        torch.testing.assert_close(logp[row][keep], want_logp[keep], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ent[row][keep], want_ent[keep], rtol=1e-6, atol=1e-6)
