"""A step's figures, over all its inspected tokens: covariance tails, colour scales, histograms.

The tails are the paper's covariance table (after Cui et al. 2025): for each fraction f, the
top f and the bottom f of the tokens by c. Here they are taken over the step's inspected
tokens (a sample of whole prompt groups), not the whole batch; `metrics.jsonl` has the
batch's thresholds (`cov/pos_1pct`, ...).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

# The paper's covariance table fractions (= cagrpo_ray.algo.stats.COVARIANCE_TABLE_FRACTIONS,
# repeated here so that the inspector does not import torch; a test keeps them equal).
TAIL_FRACTIONS = (1e-4, 1e-2, 0.2, 0.4)

# colouring key (= data attribute) -> (column, legend label, scale kind, which end is dark)
COLOURINGS = {
    "w": ("weight", "kernel weight w~ (dark: tamed)", "sequential", "low"),
    "c": ("cov", "covariance c", "diverging", None),
    "ent": ("entropy", "entropy, nats (dark: uncertain)", "sequential", "high"),
    "adv": ("advantage", "advantage A", "diverging", None),
    "logp": ("logprob", "learner log-prob (dark: unlikely)", "sequential", "low"),
    "is": ("is_weight", "IS weight (dark: down-weighted)", "sequential", "low"),
}


def tail_thresholds(cov: np.ndarray) -> dict[float, tuple[float, float]]:
    """{f: (bottom, top)}: c <= bottom holds the bottom f of the tokens, c >= top the top f
    (linear-interpolated quantiles, as `algo.stats.covariance_quantiles`). {} when every c
    is the same, where no token is extreme."""
    if cov.size == 0 or cov.min() == cov.max():
        return {}
    values = cov.astype(np.float64)
    return {f: (np.quantile(values, f), np.quantile(values, 1.0 - f)) for f in TAIL_FRACTIONS}


def tail_labels(cov: np.ndarray, thresholds: dict[float, tuple[float, float]]) -> list[str]:
    """Each token's `data-tail`: the narrowest tail holding it, e.g. "+1" or "-0.01", or ""."""
    labels = np.full(cov.shape, "", dtype=object)
    for f in sorted(thresholds, reverse=True):  # widest first; narrower tails overwrite
        bottom, top = thresholds[f]
        pct = f"{f * 100:g}"
        labels[cov <= bottom] = "-" + pct
        labels[cov >= top] = "+" + pct
    return labels.tolist()


def histogram_svg(
    values: np.ndarray, label: str, marks: dict[float, tuple[float, float]], bins: int = 40
) -> str:
    """An inline SVG histogram, counts on a log scale (the tails are a handful of tokens),
    with the 1% and 20% tail thresholds of `marks` as dashed lines."""
    width, height, pad = 300, 90, 16
    caption = f"{label}: {values.size} tokens" + (", dashed: 1% and 20% tails" if marks else "")
    if values.size == 0:
        values = np.zeros(1)
    lo, hi = float(values.min()), float(values.max())
    if hi <= lo:
        hi = lo + 1.0
    counts, _ = np.histogram(values, bins=bins, range=(lo, hi))
    scale = (height - pad) / np.log1p(counts.max())
    bar = width / bins
    parts = [f'<svg width={width} height={height} role="img" aria-label="{label}">']
    for i, n in enumerate(counts):
        if n:
            h = np.log1p(n) * scale
            parts.append(
                f'<rect x="{i * bar:.1f}" y="{height - pad - h:.1f}" width="{bar - 1:.1f}" '
                f'height="{h:.1f}"><title>{n} tokens</title></rect>'
            )
    for f in (1e-2, 0.2):
        for x in marks.get(f, ()):
            px = (x - lo) / (hi - lo) * width
            parts.append(f'<line class="mark" x1="{px:.1f}" x2="{px:.1f}" y1="0" y2="{height}"/>')
    if lo < 0 < hi:
        zero = -lo / (hi - lo) * width
        parts.append(
            f'<line class="zero" x1="{zero:.1f}" x2="{zero:.1f}" y1="0" y2="{height - pad}"/>'
        )
        parts.append(f'<text x="{zero:.1f}" y="{height - 3}" text-anchor="middle">0</text>')
    parts.append(f'<text x="0" y="{height - 3}">{lo:.3g}</text>')
    parts.append(f'<text x="{width}" y="{height - 3}" text-anchor="end">{hi:.3g}</text></svg>')
    return f"<figure>{''.join(parts)}<figcaption>{caption}</figcaption></figure>"


def tail_table(thresholds: dict[float, tuple[float, float]]) -> str:
    rows = "".join(
        f"<tr><td>{f * 100:g}%</td><td>{bottom:+.4g}</td><td>{top:+.4g}</td></tr>"
        for f, (bottom, top) in thresholds.items()
    )
    return (
        "<table class=tails><tr><th>tail</th><th>bottom: c &le;</th><th>top: c &ge;</th></tr>"
        f"{rows}</table>"
    )


def flat_values(table: pa.Table, column: str) -> np.ndarray:
    return table.column(column).combine_chunks().flatten().to_numpy(zero_copy_only=False)


def colour_scales(table: pa.Table) -> dict:
    """Each colouring's range for the page's script. Robust (1% or 99% quantiles) for c,
    entropy and log-prob, where a few extreme tokens would wash every other token out: the
    legend shows the range, and values beyond it saturate."""
    scales = {}
    for key, (column, label, kind, dark) in COLOURINGS.items():
        if column == "advantage":
            v = table.column(column).to_numpy().astype(np.float64)
        else:
            v = flat_values(table, column).astype(np.float64)
        if v.size == 0:
            v = np.zeros(1)
        if kind == "diverging":
            limit = np.quantile(np.abs(v), 0.99) if key == "c" else np.abs(v).max()
            scales[key] = {"kind": kind, "label": label, "lim": float(limit or np.abs(v).max())}
            continue
        lo, hi = float(v.min()), float(v.max())
        if key == "ent":
            lo, hi = 0.0, float(np.quantile(v, 0.99))
        elif key == "logp":
            lo, hi = float(np.quantile(v, 0.01)), 0.0
        elif key == "w":
            lo, hi = 0.0, max(hi, 1.0)
        scales[key] = {"kind": kind, "label": label, "lo": lo, "hi": hi, "dark": dark}
    return scales
