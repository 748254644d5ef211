"""The inspector page's inline CSS and JavaScript (no fonts, scripts or styles from anywhere else).

The script colours the tokens from their data attributes and the scales in the page's
`#scales` JSON, applies the filters, keeps the legend and the count of matching tokens, and
shows a token's values on hover. Colours: diverging blue (negative) / white (0) / red
(positive) for c and the advantage; white to dark violet for the others.
"""

PAGE_CSS = """
*{box-sizing:border-box}
body{margin:0;background:#f4f4f1;color:#1f1f24;font:14px/1.45 system-ui,-apple-system,
 "Segoe UI",Roboto,sans-serif}
header{padding:12px 18px 6px}
h1{font-size:19px;margin:0 0 2px}
header p,nav{margin:2px 0;color:#444}
nav a,nav b,nav span{display:inline-block;padding:0 6px;border-radius:3px}
nav b{background:#2d1964;color:#fff}
.bar{position:sticky;top:0;z-index:3;display:flex;flex-wrap:wrap;gap:6px 18px;
 align-items:center;padding:8px 18px;background:#fff;border-bottom:1px solid #d8d8d2;
 box-shadow:0 1px 3px #0001}
.bar select{font:inherit;padding:1px 3px}
.legend{display:inline-flex;align-items:center;gap:6px;font-size:12px;color:#444}
#lg-bar{display:inline-block;width:130px;height:12px;border:1px solid #bbb;border-radius:2px}
#shown{font-weight:600}
.key{font-size:12px;color:#555}
.key u{text-decoration:underline wavy #d35400}
.key s{text-decoration:none;outline:2px solid #e67e00;outline-offset:-1px;padding:0 2px}
.stats{display:flex;flex-wrap:wrap;gap:18px;align-items:flex-end;padding:8px 18px 0}
figure{margin:0}
figcaption{font-size:12px;color:#555}
svg rect{fill:#6a5acd}
svg text{font-size:10px;fill:#555}
svg .mark{stroke:#c0392b;stroke-dasharray:3 2}
svg .zero{stroke:#888}
.tails{border-collapse:collapse;font-size:12px}
.tails td,.tails th{padding:1px 8px;border-bottom:1px solid #ddd;text-align:right}
main{padding:4px 18px 40px;max-width:1280px}
.g{background:#fff;border:1px solid #d8d8d2;border-radius:6px;margin:12px 0;padding:10px 14px}
.g h2{font-size:15px;margin:0 0 6px}
.g code{font-size:13px;background:#eef;padding:0 4px;border-radius:3px}
.prompt{white-space:pre-wrap;margin:4px 0 6px;padding:6px 9px;max-height:9.5em;overflow:auto;
 background:#f3f3ee;border-left:3px solid #8a8a80;font:12.5px/1.4 ui-monospace,
 "DejaVu Sans Mono",Menlo,Consolas,monospace}
.r{border-top:1px solid #ececea;padding:6px 0 4px}
.rh{font-size:12.5px;color:#3a3a40;margin-bottom:3px}
.badge{display:inline-block;padding:0 7px;border-radius:9px;font-size:11.5px;font-weight:600}
.ok{background:#d9f2dc;color:#17621f}
.bad{background:#fbe0de;color:#8e1b14}
.toks{font:13px/1.9 ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace}
.toks span{display:inline-block;white-space:pre;padding:0 1px;margin:0 1px 1px 0;
 border-radius:2px;line-height:1.45;cursor:default}
.toks span[data-clipped="1"]{text-decoration:underline wavy #d35400}
.toks span[data-sel]{outline:2px solid #e67e00;outline-offset:-1px}
.toks span:hover{box-shadow:0 0 0 2px #000}
.toks em.env{white-space:pre-wrap;background:#eef1f5;color:#555;border:1px dashed #8a96a8;
padding:0 3px;margin:0 2px}
.off{display:none!important}
.dim .toks span.off{display:inline-block!important;opacity:.15}
body:not(.dim) .toks .off+br{display:none}
body:not(.dim) .toks .off+span:not(.off),body:not(.dim) .toks .off+br+span:not(.off){
 margin-left:12px}
#tip{position:absolute;z-index:5;background:#1f1f24;color:#f4f4f1;font:12px/1.35 ui-monospace,
 "DejaVu Sans Mono",monospace;border-radius:4px;padding:5px 8px;pointer-events:none;
 box-shadow:0 2px 8px #0004}
#tip td{padding:0 6px 0 0}
#tip td:first-child{color:#b9b9c6}
"""

PAGE_JS = r"""
"use strict";
const $ = (id) => document.getElementById(id);
const scales = JSON.parse($("scales").textContent);
const tokens = Array.from(document.querySelectorAll(".toks span"));
const responses = Array.from(document.querySelectorAll(".r"));
const groups = Array.from(document.querySelectorAll(".g"));
const WHITE = [255, 255, 255], DARK = [45, 25, 100], BLUE = [33, 102, 172], RED = [178, 24, 43];
const rgb = (c) => `rgb(${c.join(",")})`;
const mix = (to, t) => WHITE.map((w, i) => Math.round(w + (to[i] - w) * t));
const fmt = (x) => String(Number(Number(x).toPrecision(3)));

// [colour, strength in 0..1] of a value on a scale
function shade(scale, value) {
  if (scale.kind === "diverging") {
    const t = scale.lim > 0 ? Math.max(-1, Math.min(1, value / scale.lim)) : 0;
    return [mix(t < 0 ? BLUE : RED, Math.abs(t)), Math.abs(t)];
  }
  let t = scale.hi > scale.lo ? (value - scale.lo) / (scale.hi - scale.lo) : 0.5;
  t = Math.max(0, Math.min(1, t));
  if (scale.hi <= scale.lo) t = 0;
  else if (scale.dark === "low") t = 1 - t;
  return [mix(DARK, t), t];
}

function colour() {
  const key = $("colour").value, scale = scales[key];
  for (const el of tokens) {
    const [c, t] = shade(scale, parseFloat(el.dataset[key]));
    el.style.background = rgb(c);
    el.style.color = t > 0.55 ? "#fff" : "";
  }
  if (scale.kind === "diverging") {
    $("lg-bar").style.background = `linear-gradient(to right,${rgb(BLUE)},#fff,${rgb(RED)})`;
    $("lg-lo").textContent = fmt(-scale.lim);
    $("lg-hi").textContent = "+" + fmt(scale.lim);
  } else {
    const ends = scale.dark === "low" ? [rgb(DARK), "#fff"] : ["#fff", rgb(DARK)];
    $("lg-bar").style.background = `linear-gradient(to right,${ends.join(",")})`;
    $("lg-lo").textContent = fmt(scale.lo);
    $("lg-hi").textContent = fmt(scale.hi);
  }
  $("lg-label").textContent = scale.label;
}

function filter() {
  const lowWeight = $("f-w").checked, wrongOnly = $("f-wrong").checked;
  const tail = parseFloat($("f-tail").value), hide = $("f-mode").value === "hide";
  document.body.classList.toggle("dim", !hide);
  let shown = 0;
  for (const r of responses) {
    const skip = wrongOnly && r.dataset.correct === "1";
    let visible = 0;
    for (const el of r.querySelectorAll(".toks span")) {
      const d = el.dataset;
      const on = !skip && (!lowWeight || parseFloat(d.w) < 0.5) &&
        (!tail || (d.tail !== "" && Math.abs(parseFloat(d.tail)) <= tail));
      el.classList.toggle("off", !on);
      visible += on;
    }
    r.classList.toggle("off", hide && visible === 0);
    shown += visible;
  }
  for (const g of groups) g.classList.toggle("off", hide && !g.querySelector(".r:not(.off)"));
  $("shown").textContent = `${shown} of ${tokens.length} tokens match`;
}

function tailText(tail) {
  if (!tail) return "none of the tails";
  return (tail[0] === "+" ? "top " : "bottom ") + tail.slice(1) + "%";
}

const tip = $("tip");
document.addEventListener("mouseover", (event) => {
  const el = event.target.closest(".toks span");
  if (!el) { tip.hidden = true; return; }
  const d = el.dataset;
  const rows = [
    ["token", el.textContent], ["w~", d.w], ["c", d.c], ["c tail", tailText(d.tail)],
    ["log-prob", d.logp], ["generator log-prob", d.blogp], ["entropy", d.ent],
    ["advantage", d.adv], ["IS weight", d.is], ["ratio clipped", d.clipped === "1" ? "yes" : "no"],
    ["Clip-Cov / KL-Cov", d.sel || "-"],
  ];
  tip.replaceChildren(...rows.map(([name, value]) => {
    const tr = document.createElement("tr");
    for (const text of [name, value]) tr.insertCell().textContent = text;
    return tr;
  }));
  const box = el.getBoundingClientRect();
  tip.style.left = `${Math.min(box.left, window.innerWidth - 300) + window.scrollX}px`;
  tip.style.top = `${box.bottom + window.scrollY + 6}px`;
  tip.hidden = false;
});

$("colour").addEventListener("change", colour);
for (const id of ["f-w", "f-tail", "f-wrong", "f-mode"]) $(id).addEventListener("change", filter);
colour();
filter();
"""
