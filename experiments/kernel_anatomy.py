"""Anatomy of CA-GRPO's kernel on batches of a policy's own rollouts (no training).

Round 1 found CA-GRPO's entropy rising and its accuracy falling where GRPO improves on the
built-in `chain_sum` policy. This script looks inside on-policy batches of an untrained policy
to see why: which tokens the kernel down-weights, how much of GRPO's policy gradient they
carry, and what one optimizer step along each gradient does to the policy's entropy and to the
likelihood of correct and incorrect responses. `--config` names the task, instruction, reward
and policy (`model.path`, or `--model`); `--temperature` the sampling temperature, at which
the log-probs and entropies are taken (`log_softmax(logits / T)`, as the learner does).

    flock /tmp/cagrpo-cpu.lock .venv/bin/python experiments/kernel_anatomy.py \
        --out runs/study/anatomy.json
    flock /tmp/cagrpo-cpu.lock .venv/bin/python experiments/kernel_anatomy.py \
        --config configs/cpu-smollm2.yaml --temperature 0.7 --prompts 8 --seeds 0 \
        --no-step --out runs/round3/anatomy-smollm2-T0.7.json

The "step" is AdamW's first step from a fresh state at the first step's learning rate,
theta - lr * sign(g) (Adam's first update is m / sqrt(v) = sign(g), bias-corrected), which is
how every run of the study starts. Each loss is the token-mean policy-gradient surrogate of
the study's runs at ratio 1:
-(1/N) sum_t w_t A_i log pi(o_t), with w = 1 (GRPO) or CA-GRPO's normalized kernel weights
over each prompt group's tokens.

The mechanism (each batch's "mechanism" entry):
  * c's distribution in units of its group's sigma (z = c / std_group(c), the kernel's own
    scale: w = exp(-z^2 / 2 kappa^2) before normalisation): quantiles, and the tail shares
    |z| > 2 and |z| > 3 with the share of c > 0 among them;
  * R = |g_down| / |g_GRPO|, the share of GRPO's gradient norm carried by the tokens with
    w~ < 0.5 alone (and their projection on GRPO's gradient, g_down . g / |g|^2);
  * the kernel's removed share of gradient mass: 1 - g_CA . g_GRPO / |g_GRPO|^2 (what of GRPO's
    direction the kernel's gradient lacks), and by tokens sum |A| (1 - w~)+ / sum |A|;
  * the first-order entropy change of one step, exactly from the full softmax: with
    H(theta) the mean over the batch's response positions of the entropy of
    softmax(logits / T), dH = grad H . delta for delta = -lr g (SGD) and delta = -lr sign(g)
    (Adam's first step), per unit lr, for GRPO's and the kernel's gradients.

Gradients are accumulated over `--chunk-rows` rows at a time (the kernel's weights come from
the whole batch first), so a 49k-token vocabulary fits in memory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cagrpo_ray.algo.advantages import group_advantages
from cagrpo_ray.algo.covariance import cagrpo_token_weights, token_covariance
from cagrpo_ray.config import load_config
from cagrpo_ray.data.prompts import format_prompt, prompt_preamble
from cagrpo_ray.data.reasoning_gym_source import ReasoningGymSource
from cagrpo_ray.policies.build import load_policy
from cagrpo_ray.rewards import RewardFunction

QUANTILES = (0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999)


@torch.no_grad()
def rollouts(model, tok, items, args, seed: int):
    """Sampled responses at args.temperature, as token ids: (prompt+response ids, prompt width,
    prompt attention mask, response mask, items per row)."""
    rows = [item for item in items for _ in range(args.group_size)]
    prompts = [format_prompt(tok, item.question, args.instruction) for item in rows]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    # from the lengths: a chat template may hold the pad token (SmolLM2's <|im_end|>)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        do_sample=True,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=args.max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    gen = out[:, width:]
    # valid: every token up to and including the first eos
    is_eos = (gen == tok.eos_token_id).long()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0
    mask = (~after_eos) & (gen != tok.pad_token_id) | (is_eos.bool() & ~after_eos)
    return out, width, attn, mask, rows


def rewards_of(tok, out, width, rows, reward_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, reward) per response, by the config's verifiers."""
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    results = reward_fn(texts, rows)
    correct = torch.tensor([float(r.correct) for r in results], dtype=torch.float64)
    return correct, torch.tensor([r.reward for r in results], dtype=torch.float64)


def token_logprobs_and_entropy(model, out, width, prompt_attn, mask, temperature: float):
    """log pi of the sampled response tokens and the entropy of softmax(logits / T) at each
    response position ([B, L] each, 0 outside the mask)."""
    attn = torch.ones_like(out)
    attn[:, :width] = prompt_attn
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=out, attention_mask=attn, position_ids=positions).logits
    logits = logits[:, width - 1 : -1]
    logits = (logits if logits.dtype == torch.float64 else logits.float()) / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, out[:, width:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    m = mask.float()
    return logp * m, entropy * m


def chunks(rows: int, size: int):
    return [slice(start, min(rows, start + size)) for start in range(0, rows, size)]


@torch.no_grad()
def scores(model, batch, args) -> tuple[torch.Tensor, torch.Tensor]:
    out, width, attn, mask = batch
    parts = [
        token_logprobs_and_entropy(model, out[r], width, attn[r], mask[r], args.temperature)
        for r in chunks(out.shape[0], args.chunk_rows)
    ]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def accumulated_gradients(model, batch, weights: dict, adv, n, args) -> dict:
    """Flat gradients of -(1/n) sum_t weight_t A_i log pi(o_t) for each named weight tensor,
    and of the mean entropy H ("entropy"), accumulated chunk by chunk."""
    out, width, attn, mask = batch
    params = [p for p in model.parameters() if p.requires_grad]
    size, dtype = sum(p.numel() for p in params), params[0].dtype
    total = {name: torch.zeros(size, dtype=dtype) for name in [*weights, "entropy"]}
    for r in chunks(out.shape[0], args.chunk_rows):
        logp, ent = token_logprobs_and_entropy(model, out[r], width, attn[r], mask[r],
                                               args.temperature)  # fmt: skip
        base = -(adv[r, None] * logp)
        losses = {name: (w[r] * base).sum() / n for name, w in weights.items()}
        losses["entropy"] = ent.sum() / n
        for index, (name, loss) in enumerate(losses.items()):
            grads = torch.autograd.grad(loss, params, retain_graph=index < len(losses) - 1,
                                        allow_unused=True)  # fmt: skip
            total[name] += torch.cat([
                (g if g is not None else torch.zeros_like(p)).reshape(-1)
                for g, p in zip(grads, params, strict=True)
            ])  # fmt: skip
    return total


def after_step(model, flat_grad, lr, batch, args, correct) -> dict:
    """Entropy and mean response log-likelihood (correct vs incorrect) after theta - lr sign(g)."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        offset = 0
        for p in params:
            g = flat_grad[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            p.sub_(lr * torch.sign(g))
        logp, ent = scores(model, batch, args)
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
    mask = batch[3].float()
    seq = logp.sum(1)
    ok = correct > 0.5
    return {
        "entropy": float(ent.sum() / mask.sum()),
        "loglik_correct": float(seq[ok].mean()) if ok.any() else float("nan"),
        "loglik_incorrect": float(seq[~ok].mean()) if (~ok).any() else float("nan"),
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


def group_sigma(c, mask, group_ids) -> torch.Tensor:
    """[B, L]: the population std of c over each row's group's valid tokens."""
    m = mask.float()
    sigma = torch.zeros(c.shape[0], dtype=torch.float64)
    for g in group_ids.unique():
        rows = group_ids == g
        values = c[rows][mask[rows].bool()].double()
        sigma[rows] = values.std(unbiased=False) if values.numel() else 0.0
    return sigma[:, None].expand_as(c) * m


def mechanism(c, w, adv, mask, group_ids, grads: dict) -> dict:
    valid = mask.bool()
    sigma = group_sigma(c, mask, group_ids)
    z = (c.double() / sigma.clamp(min=1e-30))[valid & (sigma > 0)]
    cz = c[valid & (sigma > 0)]
    g, g_ca, g_down, g_h = grads["grpo"], grads["cagrpo"], grads["down"], grads["entropy"]
    gg = float(g @ g)
    a = adv[:, None].expand_as(c)[valid].abs().double()
    wv = w[valid].double()
    tails = {}
    for k in (2, 3):
        tail = z.abs() > k
        tails[f"|z|>{k}"] = {
            "share_of_tokens": float(tail.double().mean()),
            "share_with_c_positive": float((cz[tail] > 0).double().mean()) if tail.any() else 0,
        }
    return {
        "z_quantiles": {str(q): float(torch.quantile(z, q)) for q in QUANTILES},
        "tails": tails,
        "share_w_below_0.5": float((wv < 0.5).double().mean()),
        "R_norm_share": float(g_down.norm() / g.norm()),
        "R_projection_share": float(g_down @ g) / gg,
        "removed_share_projection": 1.0 - float(g_ca @ g) / gg,
        "removed_share_token_mass": float((a * (1 - wv).clamp(min=0)).sum() / a.sum()),
        "first_order_entropy_change_per_unit_lr": {
            name: {
                "sgd": -float(g_h @ grads[name]),
                "adam_first_step": -float(g_h @ grads[name].sign()),
            }
            for name in ("grpo", "cagrpo")
        },
    }


def analyze_batch(model, tok, items, args, seed: int, reward_fn) -> dict:
    """Everything reported for one sampled batch of `items` x group size."""
    out, width, attn, mask, rows = rollouts(model, tok, items, args, seed)
    batch = (out, width, attn, mask)
    correct, reward = rewards_of(tok, out, width, rows, reward_fn)
    adv = group_advantages(reward.float(), args.group_size)
    group_ids = torch.arange(len(rows)) // args.group_size
    logp, ent_tok = scores(model, batch, args)
    m = mask.float()
    n = m.sum()
    w = cagrpo_token_weights(logp, adv, mask, group_ids, "group")
    c = token_covariance(logp, adv, mask, group_ids, "group")
    weights = {"down": m * (w < 0.5), "rest": m * (w >= 0.5), "cagrpo": w * m}
    grads = accumulated_gradients(model, batch, weights, adv, n, args)
    grads["grpo"] = grads["down"] + grads["rest"]
    valid = mask.bool()
    lp, adv_tok = logp, adv[:, None].expand_as(logp)
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
            "entropy": float(ent_tok.sum() / n),
            "mean_response_tokens": float(n / len(rows)),
        },
        "tokens": {
            "w~<0.5, c>0": describe((w < 0.5) & (c > 0), lp, adv_tok, correct_tok, valid),
            "w~<0.5, c<0": describe((w < 0.5) & (c < 0), lp, adv_tok, correct_tok, valid),
            "w~>=0.5": describe(w >= 0.5, lp, adv_tok, correct_tok, valid),
        },
        "mechanism": mechanism(c, w, adv, mask, group_ids, grads),
        "gradients": {},
    }
    names = {"grpo": "grpo", "cagrpo": "cagrpo", "down": "down_weighted_only (w~<0.5)",
             "rest": "rest (w~>=0.5)"}  # fmt: skip
    g_grpo = grads["grpo"]
    before = None if args.no_step else after_step(model, torch.zeros_like(g_grpo), 0.0, batch,
                                                  args, correct)  # fmt: skip
    if before is not None:
        result["before_step"] = before
    for key, name in names.items():
        fg = grads[key]
        entry = {
            "norm": float(fg.norm()),
            "cosine_to_grpo": min(1.0, float(fg @ g_grpo / (fg.norm() * g_grpo.norm() + 1e-30))),
        }
        if before is not None:
            step = after_step(model, fg, args.lr, batch, args, correct)
            entry["entropy_change_after_one_adam_step"] = step["entropy"] - before["entropy"]
            entry["loglik_correct_change"] = step["loglik_correct"] - before["loglik_correct"]
            entry["loglik_incorrect_change"] = step["loglik_incorrect"] - before["loglik_incorrect"]
        result["gradients"][name] = entry
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/cpu-tiny.yaml",
                    help="Task, instruction, reward and policy of the batches.")  # fmt: skip
    ap.add_argument("--model", default=None, help="Policy (default: the config's model.path).")
    ap.add_argument("--temperature", type=float, default=None,
                    help="Sampling temperature (default: rollout.temperature).")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=64, help="Prompts per batch.")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="Default: the config's rollout.max_tokens.")  # fmt: skip
    ap.add_argument(
        "--lr", type=float, default=2e-5, help="2e-5: the first step's lr (2e-4, 10 warm-up steps)."
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="One batch per seed.")
    ap.add_argument("--chunk-rows", type=int, default=64, help="Rows per gradient pass.")
    ap.add_argument("--no-step", action="store_true",
                    help="Skip the Adam-step evaluations (a forward per gradient).")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("runs/study/anatomy.json"))
    args = ap.parse_args(argv)
    config = load_config(args.config)
    args.model = args.model or config.model.path
    args.temperature = args.temperature or config.rollout.temperature
    args.max_new_tokens = args.max_new_tokens or config.rollout.max_tokens
    args.instruction = prompt_preamble(config.data)
    d = config.data
    torch.manual_seed(0)
    model, tok = load_policy(args.model, dtype=torch.float32)
    model.train(False)
    reward_fn = RewardFunction(weights=dict(config.reward.weights), num_workers=1)
    items = list(ReasoningGymSource(d.dataset, d.dataset_config, d.seed,
                                    args.prompts * len(args.seeds), "train"))  # fmt: skip
    batches = [
        analyze_batch(
            model, tok, items[i * args.prompts : (i + 1) * args.prompts], args, seed, reward_fn
        )  # fmt: skip
        for i, seed in enumerate(args.seeds)
    ]
    result = {"config": vars(args) | {"out": str(args.out)}, "batches": batches}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(summary_table(result))
    print(f"wrote {args.out}")
    return 0


def summary_table(result: dict) -> str:
    """One markdown row per batch: the mechanism's headline numbers."""
    cfg = result["config"]
    head = (
        "| policy | T | batch seed | entropy (nats/token) | accuracy | w~<0.5 share | R | "
        "removed (projection) | dH/lr GRPO, Adam step | dH/lr CA-GRPO, Adam step |"
    )
    lines = [head, "|" + "---|" * 10]
    for b in result["batches"]:
        m = b["mechanism"]
        dh = m["first_order_entropy_change_per_unit_lr"]
        lines.append(
            f"| {Path(str(cfg['model'])).name} | {cfg['temperature']:g} | {b['seed']} | "
            f"{b['batch']['entropy']:.3f} | {b['batch']['accuracy']:.3f} | "
            f"{m['share_w_below_0.5']:.3f} | {m['R_norm_share']:.2f} | "
            f"{m['removed_share_projection']:.2f} | {dh['grpo']['adam_first_step']:+.3g} | "
            f"{dh['cagrpo']['adam_first_step']:+.3g} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
