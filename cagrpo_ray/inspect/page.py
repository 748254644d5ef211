"""One self-contained HTML page of an inspected step: which tokens CA-GRPO tames, and why.

Per prompt group: the prompt, then each response with its reward, advantage, verdict, finish
reason and length, and its tokens coloured by a chosen quantity (kernel weight w~, covariance
c, entropy, advantage, learner log-prob, IS weight), every value exact on hover. Filters keep
the tokens with w~ < 0.5, those in a covariance tail (the paper's 0.01%/1%/20%/40% top and
bottom fractions of c over the step's inspected tokens) and the incorrect responses; inline
SVG histograms show c and w~ over the step. The CSS and JS are inline (`assets.py`): the page
needs no network and no other file.

Every token is one `<span>` whose data attributes carry its values, as the shortest decimal
that reads back to the same float32:

    data-w  data-c  data-logp  data-ent  data-adv  data-blogp  data-is   (numbers)
    data-clipped   1 if the PPO ratio was clipped, else 0
    data-tail      the narrowest covariance tail holding c, in percent, signed: "+1" (top 1%),
                   "-0.01" (bottom 0.01%); "" when c lies in none of them
    data-sel       "clip_cov" or "kl_cov" when that loss chose the token; absent otherwise

A multi-turn episode's environment text (tool results) sits between its tokens as `<em
class=env>`: context the policy read, with no loss and no value, in no statistic.

Size, measured (`tests/test_inspect.py` keeps it): a token costs about 187 bytes of page and 36
bytes of zstd Parquet (float32 values barely compress), so an inspected group of 8 responses
of 200 tokens is 0.30 MB of page and 58 KB of Parquet, of 500 tokens 0.74 MB and 145 KB;
`metrics.inspect_groups` times the responses' lengths bounds both. The rest of a page (CSS,
script, histograms) is about 12 KB.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from cagrpo_ray.algo.losses import shown_field
from cagrpo_ray.inspect.assets import PAGE_CSS, PAGE_JS
from cagrpo_ray.inspect.figures import (
    COLOURINGS,
    TAIL_FRACTIONS,
    colour_scales,
    flat_values,
    histogram_svg,
    tail_labels,
    tail_table,
    tail_thresholds,
)

# data attribute -> column, in the order they are written on each token
TOKEN_ATTRIBUTES = {
    "w": "weight",
    "c": "cov",
    "logp": "logprob",
    "ent": "entropy",
    "adv": "advantage",
    "blogp": "behavior_logprob",
    "is": "is_weight",
}
# The browser itself keeps the page offline: nothing but its own inline style and script.
OFFLINE_POLICY = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
VISIBLE_WHITESPACE = str.maketrans({" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"})


def render_page(
    table: pa.Table,
    metadata: dict,
    steps: list[int],
    step_href: Callable[[int], str | None] = lambda step: f"/step/{step}",
    reward_errors: dict[tuple[int, int], str] | None = None,
) -> str:
    """The HTML page of one inspected step (`records.read_step`'s table and metadata).

    `steps` are the run's inspected steps, linked through `step_href(step)` (None: shown
    without a link). `reward_errors` ((group id, response index) -> message, from the run's
    `logs/reward_errors.jsonl`: `rewards.errors.read_errors`) marks the responses whose reward
    had an error."""
    reward_errors = reward_errors or {}
    rows = table.to_pylist()
    step = int(metadata.get("step", rows[0]["step"] if rows else 0))
    flat = {column: flat_values(table, column) for column in ("cov", "weight")}
    thresholds = tail_thresholds(flat["cov"])
    title = f"step {step} · {metadata.get('run_name', '')} · token inspector"
    # the loss says which of its values the tokens are coloured by first
    shown = shown_field(str(metadata.get("policy_loss")))
    default = next((key for key, c in COLOURINGS.items() if c[0] == shown), "c")
    parts = [
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        f'<meta http-equiv="Content-Security-Policy" content="{OFFLINE_POLICY}">',
        f"<title>{html.escape(title)}</title><style>{PAGE_CSS}</style></head><body>",
        _header(metadata, step, rows, steps, step_href),
        _controls(default),
        '<section class="stats">',
        histogram_svg(flat["cov"], "covariance c", thresholds),
        histogram_svg(flat["weight"], "kernel weight w~", {}),
        tail_table(thresholds),
        "</section><main>",
    ]
    groups: dict[int, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["group_id"], []).append(row)
    for group_id, responses in groups.items():
        parts.append(_group(group_id, responses, thresholds, reward_errors))
    scales = json.dumps(colour_scales(table)).replace("</", "<\\/")
    parts += [
        "</main><table id=tip hidden></table>",
        f'<script type="application/json" id=scales>{scales}</script>',
        f"<script>{PAGE_JS}</script></body></html>",
    ]
    return "".join(parts)


def _header(metadata, step, rows, steps, step_href) -> str:
    tokens = sum(len(row["tokens"]) for row in rows)
    groups = len({row["group_id"] for row in rows})
    meta = (
        f"policy loss <b>{html.escape(str(metadata.get('policy_loss', '?')))}</b> · "
        f"c and w~ over each <b>{html.escape(str(metadata.get('cov_scope', '?')))}</b> · "
        f"{groups} groups, {len(rows)} responses, {tokens} tokens"
    )
    links = []
    for other in steps:
        href = step_href(other)
        if other == step:
            links.append(f"<b>{other}</b>")
        elif href is None:
            links.append(f"<span>{other}</span>")
        else:
            links.append(f'<a href="{html.escape(href)}">{other}</a>')
    run = html.escape(str(metadata.get("run_name", "")))
    return (
        f"<header><h1>Token inspector · {run} · step {step}</h1><p>{meta}</p>"
        f"<nav>inspected steps: {' '.join(links)}</nav></header>"
    )


def _controls(default: str) -> str:
    options = "".join(
        f"<option value={key}{' selected' * (key == default)}>{label.split(' (')[0]}</option>"
        for key, (_, label, _, _) in COLOURINGS.items()
    )
    tails = "".join(
        f"<option value={f * 100:g}>top or bottom {f * 100:g}%</option>"
        for f in sorted(TAIL_FRACTIONS, reverse=True)
    )
    return (
        '<div class="bar"><label>colour by <select id=colour>' + options + "</select></label>"
        "<span class=legend><span id=lg-lo></span><span id=lg-bar></span><span id=lg-hi></span>"
        "<span id=lg-label></span></span>"
        "<label><input type=checkbox id=f-w> w~ &lt; 0.5</label>"
        f"<label>c tail: <select id=f-tail><option value=0>any</option>{tails}</select></label>"
        "<label><input type=checkbox id=f-wrong> incorrect only</label>"
        "<label>other tokens: <select id=f-mode><option value=hide>hidden</option>"
        "<option value=dim>dimmed</option></select></label><span id=shown></span>"
        "<span class=key><u>underlined</u>: ratio clipped · <s>boxed</s>: chosen by "
        "Clip-Cov / KL-Cov</span></div>"
    )


def _group(group_id: int, responses: list[dict], thresholds, reward_errors) -> str:
    first = responses[0]
    right = sum(r["correct"] for r in responses)
    mean_reward = sum(r["reward"] for r in responses) / len(responses)
    parts = [
        f"<section class=g data-group={group_id}><h2>group {group_id} · "
        f"<code>{html.escape(first['prompt_uid'])}</code> · {right}/{len(responses)} correct · "
        f"mean reward {mean_reward:.3g}</h2>",
        f"<pre class=prompt>{html.escape(first['prompt_text'])}</pre>",
    ]
    parts += [
        _response(r, thresholds, reward_errors.get((group_id, r["response_index"])))
        for r in responses
    ]
    parts.append("</section>")
    return "".join(parts)


def _response(row: dict, thresholds, reward_error: str | None = None) -> str:
    n = len(row["tokens"])
    badge, verdict = ("ok", "correct") if row["correct"] else ("bad", "incorrect")
    mean_w = sum(row["weight"]) / n if n else 1.0
    failed = (
        f"<span class='badge bad rerr' title='{html.escape(reward_error, quote=True)}'>"
        f"reward error</span> "
        if reward_error is not None
        else ""
    )
    head = (
        f"<div class=rh><span class='badge {badge}'>{verdict}</span> {failed}"
        f"#{row['response_index']} · reward {row['reward']:.3g} · "
        f"A {row['advantage']:+.3g} · finish: {html.escape(row['finish_reason'])} · {n} tokens · "
        f"policy v{row['policy_version']} · mean w~ {mean_w:.3g}</div>"
    )
    values = {
        key: np.full(n, row[column], np.float32) if key == "adv" else np.asarray(row[column])
        for key, column in TOKEN_ATTRIBUTES.items()
    }
    text = {key: v.astype(np.float32).astype(str) for key, v in values.items()}
    tails = tail_labels(values["c"].astype(np.float32), thresholds)
    spans, replies = [], {}
    for segment in row.get("environment") or []:  # tool results: context, shown apart
        replies.setdefault(segment["at"], []).append(
            f"<em class=env title='environment: context, no loss'>"
            f"{html.escape(segment['text'])}</em>"
        )
    for t, token in enumerate(row["tokens"]):
        spans += replies.get(t, [])
        attrs = " ".join(f"data-{key}={text[key][t]}" for key in TOKEN_ATTRIBUTES)
        chosen = "clip_cov" if row["clip_cov"][t] else "kl_cov" if row["kl_cov"][t] else None
        sel = f" data-sel={chosen}" if chosen else ""
        shown = html.escape(token.translate(VISIBLE_WHITESPACE)) or "∅"
        spans.append(
            f'<span {attrs} data-clipped={int(row["clipped"][t])} data-tail="{tails[t]}"{sel}>'
            f"{shown}</span>" + ("<br>" * ("\n" in token))
        )
    spans += replies.get(n, [])
    correct = int(row["correct"])
    return (
        f"<div class=r data-correct={correct} data-reward={np.float32(row['reward'])} "
        f"data-adv={np.float32(row['advantage'])}>{head}<div class=toks>{''.join(spans)}</div>"
        "</div>"
    )
