"""Anatomy of CA-GRPO's kernel on one batch of the `chain_sum` policy's own rollouts.

The study found CA-GRPO's entropy rising and its accuracy falling where GRPO improves. This
script looks inside one on-policy batch of the untrained policy to see why: which tokens the
kernel down-weights, how much of GRPO's policy gradient they carry, and what one optimizer
step along each gradient does to the policy's entropy and to the likelihood of correct and
incorrect responses.

    flock /tmp/cagrpo-cpu.lock .venv/bin/python experiments/kernel_anatomy.py \
        --out runs/study/anatomy.json

The "step" is AdamW's first step from a fresh state at the first step's learning rate,
theta - lr * sign(g) (Adam's first update is m / sqrt(v) = sign(g), bias-corrected), which is
how every run of the study starts. Each loss is the token-mean policy-gradient surrogate of
the study's runs at ratio 1:
-(1/N) sum_t w_t A_i log pi(o_t), with w = 1 (GRPO) or CA-GRPO's normalized kernel weights
over each prompt group's tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cagrpo_ray.algo.advantages import group_advantages
from cagrpo_ray.algo.covariance import cagrpo_token_weights, token_covariance
from cagrpo_ray.data.prompts import format_prompt
from cagrpo_ray.data.reasoning_gym_source import ReasoningGymSource
from cagrpo_ray.policies.build import load_policy
from cagrpo_ray.rewards.verifiers import verify_format, verify_reasoning_gym

TASK_CONFIG = {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 1}  # cpu-tiny.yaml
FORMAT_WEIGHT = 0.1  # reward = correct + 0.1 * format (config/sections.py)


@torch.no_grad()
def rollouts(model, tok, items, group_size: int, max_new_tokens: int, seed: int):
    """Sampled responses (temperature 1), as token ids: (prompt+response ids, response mask,
    items per row)."""
    rows = [item for item in items for _ in range(group_size)]
    prompts = [format_prompt(tok, item.question) for item in rows]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    attn = (ids != tok.pad_token_id).long()
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    gen = out[:, width:]
    # valid: every token up to and including the first eos
    is_eos = (gen == tok.eos_token_id).long()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0
    mask = (~after_eos) & (gen != tok.pad_token_id) | (is_eos.bool() & ~after_eos)
    return out, width, mask, rows


def rewards_of(tok, out, width, rows) -> tuple[torch.Tensor, torch.Tensor]:
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    correct, fmt = [], []
    for text, item in zip(texts, rows, strict=True):
        entry = {
            "uid": item.uid,
            "question": item.question,
            "answer": item.answer,
            "metadata": dict(item.metadata),
        }
        correct.append(verify_reasoning_gym(text, entry))
        fmt.append(verify_format(text, entry))
    correct_t = torch.tensor(correct, dtype=torch.float64)
    return correct_t, correct_t + FORMAT_WEIGHT * torch.tensor(fmt, dtype=torch.float64)


def token_logprobs_and_entropy(model, out, width, mask):
    """log pi of the sampled response tokens and the policy's entropy at those positions."""
    # prompts are left-padded: mask the padding and start each row's positions at its prompt
    attn = torch.ones_like(out)
    attn[:, :width] = (out[:, :width] != model.config.pad_token_id).long()
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=out, attention_mask=attn, position_ids=positions).logits
    logits = logits[:, width - 1 : -1].float()
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, out[:, width:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    m = mask.float()
    return logp * m, (entropy * m).sum() / m.sum()


def gradient(model, loss) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    return [p.grad.detach().clone() for p in model.parameters()]


def flat(grads) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def after_step(model, grads, lr, out, width, mask, correct) -> dict:
    """Entropy and mean response log-likelihood (correct vs incorrect) after theta - lr sign(g)."""
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads, strict=True):
            p.sub_(lr * torch.sign(g))
        logp, ent = token_logprobs_and_entropy(model, out, width, mask)
        seq = logp.sum(1)
        for p, s in zip(model.parameters(), saved, strict=True):
            p.copy_(s)
    ok = correct > 0.5
    return {
        "entropy": float(ent),
        "loglik_correct": float(seq[ok].mean()),
        "loglik_incorrect": float(seq[~ok].mean()),
    }


def describe(mask_sel, logp, adv_tok, correct_tok, valid) -> dict:
    sel = mask_sel & valid
    n = int(sel.sum())
    if n == 0:
        return {"tokens": 0}
    return {
        "tokens": n,
        "share_of_tokens": n / int(valid.sum()),
        "mean_logp": float(logp[sel].mean()),
        "mean_abs_advantage": float(adv_tok[sel].abs().mean()),
        "share_in_correct_responses": float(correct_tok[sel].float().mean()),
        "share_with_positive_advantage": float((adv_tok[sel] > 0).float().mean()),
    }


def analyze_batch(model, tok, items, args, seed: int) -> dict:
    """Everything reported for one sampled batch of `items` x group size."""
    out, width, mask, rows = rollouts(model, tok, items, args.group_size, args.max_new_tokens, seed)
    correct, reward = rewards_of(tok, out, width, rows)
    adv = group_advantages(reward.float(), args.group_size)
    group_ids = torch.arange(len(rows)) // args.group_size
    logp, ent0 = token_logprobs_and_entropy(model, out, width, mask)
    m = mask.float()
    w = cagrpo_token_weights(logp.detach(), adv, mask, group_ids, "group")
    c = token_covariance(logp.detach(), adv, mask, group_ids, "group")
    n = m.sum()
    base = -(adv[:, None] * logp * m)
    losses = {
        "grpo": base.sum() / n,
        "cagrpo": (w * base).sum() / n,
        "down_weighted_only (w~<0.5)": (base * (w < 0.5)).sum() / n,
        "rest (w~>=0.5)": (base * (w >= 0.5)).sum() / n,
    }
    grads = {k: gradient(model, v) for k, v in losses.items()}
    g_grpo = flat(grads["grpo"])
    zero = [torch.zeros_like(p) for p in model.parameters()]
    before = after_step(model, zero, 0.0, out, width, mask, correct)
    valid = mask.bool()
    lp, adv_tok = logp.detach(), adv[:, None].expand_as(logp)
    correct_tok = (correct > 0.5)[:, None].expand_as(logp)
    result = {
        "seed": seed,
        "batch": {
            "responses": len(rows),
            "tokens": int(n),
            "accuracy": float(correct.mean()),
            "equal_reward_groups": float(
                (reward.view(-1, args.group_size).std(1) == 0).float().mean()
            ),
            "entropy": float(ent0),
        },
        "before_step": before,
        "tokens": {
            "w~<0.5, c>0": describe((w < 0.5) & (c > 0), lp, adv_tok, correct_tok, valid),
            "w~<0.5, c<0": describe((w < 0.5) & (c < 0), lp, adv_tok, correct_tok, valid),
            "w~>=0.5": describe(w >= 0.5, lp, adv_tok, correct_tok, valid),
        },
        "gradients": {},
    }
    for name, g in grads.items():
        fg = flat(g)
        step = after_step(model, g, args.lr, out, width, mask, correct)
        result["gradients"][name] = {
            "norm": float(fg.norm()),
            "cosine_to_grpo": min(1.0, float(fg @ g_grpo / (fg.norm() * g_grpo.norm() + 1e-30))),
            "entropy_change_after_one_adam_step": step["entropy"] - before["entropy"],
            "loglik_correct_change": step["loglik_correct"] - before["loglik_correct"],
            "loglik_incorrect_change": step["loglik_incorrect"] - before["loglik_incorrect"],
        }
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64, help="Prompts per batch.")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--lr", type=float, default=2e-5, help="2e-5: the first step's lr (2e-4, 10 warm-up steps)."
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="One batch per seed.")
    ap.add_argument("--out", type=Path, default=Path("runs/study/anatomy.json"))
    args = ap.parse_args(argv)
    model, tok = load_policy("chain_sum", dtype=torch.float32)
    model.train(False)
    items = list(
        ReasoningGymSource("chain_sum", TASK_CONFIG, 0, args.prompts * len(args.seeds), "train")
    )
    batches = [
        analyze_batch(model, tok, items[i * args.prompts : (i + 1) * args.prompts], args, seed)
        for i, seed in enumerate(args.seeds)
    ]
    result = {"config": vars(args) | {"out": str(args.out)}, "batches": batches}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
