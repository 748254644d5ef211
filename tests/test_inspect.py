"""The token inspector: the records round-trip, the page carries the learner's exact values
(kernel weights from `algo.covariance`), the CLI and the live server, and the page in a real
browser (headless Chromium through Selenium)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from html.parser import HTMLParser

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from cagrpo_ray.algo.advantages import group_advantages
from cagrpo_ray.algo.covariance import cagrpo_token_weights, token_covariance
from cagrpo_ray.algo.stats import COVARIANCE_TABLE_FRACTIONS, covariance_quantiles
from cagrpo_ray.console import log_dir
from cagrpo_ray.inspect import (
    INSPECT_SCHEMA,
    InspectorServer,
    inspected_steps,
    read_step,
    records_from_arrays,
    render_page,
    select_groups,
    write_step,
)
from cagrpo_ray.inspect.cli import main
from cagrpo_ray.inspect.figures import TAIL_FRACTIONS
from cagrpo_ray.rewards.errors import ERRORS_FILE, RewardErrorLog

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = pytest.mark.clock

METADATA = {"policy_loss": "cagrpo", "cov_scope": "group", "run_name": "inspect-test"}
# Measured with `synthetic_step(groups=4, size=8, max_tokens=200, terms=30)`, two steps of 4
# groups of 8 responses of 200 tokens: 299 KB of page and 58 KB of Parquet a group (see the
# size note in cagrpo_ray/inspect/page.py).
PAGE_BYTES_PER_GROUP = 320_000
PARQUET_BYTES_PER_GROUP = 64_000
FLOAT_ATTRIBUTES = {
    "w": "weight",
    "c": "cov",
    "logp": "logprob",
    "ent": "entropy",
    "blogp": "behavior_logprob",
    "is": "is_weight",
}


def response_text(rng: np.random.Generator, terms: list[int], right: bool) -> str:
    """A short chain-of-thought for a chain sum, ending in the right answer or a wrong one."""
    lines, total = ["<think>", "Add the numbers one at a time."], terms[0]
    for term in terms[1:]:
        step = total + term
        if not right and rng.random() < 0.5:
            step += int(rng.integers(1, 9)) * (1 if rng.random() < 0.5 else -1)
        lines.append(f"Then {total} {'+' if term >= 0 else '-'} {abs(term)} = {step}.")
        total = step
    if not right and total == sum(terms):
        total += 1
    return "\n".join(lines) + f"\n</think>\n<answer>{total}</answer>"


def split_tokens(text: str) -> list[str]:
    """A BPE-like split: words with their leading space, single digits, tags, punctuation."""
    return re.findall(r" ?[A-Za-z]+| ?\d|</?[a-z]+>|\n| ?[^\sA-Za-z\d]| ", text)


def synthetic_step(step=3, groups=4, size=4, max_tokens=12, terms=3, seed=0, kl_cov=False):
    """One inspected step as the learner would record it: chain-sum prompts, responses half
    right, plausible log-probs, and c and w~ from `cagrpo_ray.algo.covariance` with group
    scope (with `kl_cov`, the tokens of the largest c are marked as KL-Cov's choice).
    Returns (table, arrays) with the padded [B, T] arrays and the mask."""
    rng = np.random.default_rng(seed * 1000 + step)
    B = groups * size
    group_ids = np.repeat(np.arange(groups) + 100 * step, size)
    correct = np.zeros(B, dtype=bool)
    prompts, texts = [], []
    for g in range(groups):
        numbers = [int(t) for t in rng.integers(-30, 60, size=terms)]
        wins = rng.permutation(size) < max(1, size // 2)  # every group has both verdicts
        correct[g * size : (g + 1) * size] = wins
        question = " ".join(f"{'-' if t < 0 else '+'} {abs(t)}" for t in numbers)[2:]
        prompts.append(f'Compute {question}. Put the result in <answer> tags & "quote" it.')
        texts += [split_tokens(response_text(rng, numbers, bool(w)))[:max_tokens] for w in wins]
    lengths = np.array([len(t) for t in texts])
    T = int(lengths.max())
    mask = np.arange(T)[None, :] < lengths[:, None]
    logprob = np.where(
        rng.random((B, T)) < 0.12, -rng.uniform(2, 7, (B, T)), -rng.exponential(0.15, (B, T))
    ).astype(np.float32)
    behavior = (logprob + rng.normal(0, 0.03, (B, T))).astype(np.float32)
    rewards = correct.astype(np.float32)
    advantages = group_advantages(torch.tensor(rewards), size)
    m, lp, gid = torch.tensor(mask), torch.tensor(logprob * mask), torch.tensor(group_ids)
    cov = token_covariance(lp, advantages, m, gid, scope="group").numpy()
    weight = cagrpo_token_weights(lp, advantages, m, gid, scope="group").numpy()
    arrays = {
        "behavior_logprob": behavior * mask,
        "logprob": logprob * mask,
        "entropy": (np.abs(logprob) * rng.uniform(0.5, 1.5, (B, T)) + 0.05) * mask,
        "cov": cov,
        "weight": weight,
        "is_weight": np.minimum(np.exp(logprob - behavior), 2.0) * mask,
        "clipped": (rng.random((B, T)) < 0.08) & mask,
        "clip_cov": None,
        "kl_cov": (cov >= np.quantile(cov[mask], 0.98)) & mask if kl_cov else None,
    }
    table = records_from_arrays(
        step=step,
        group_ids=group_ids,
        prompt_uids=[f"chain_sum:train:{g}" for g in group_ids],
        prompt_texts=[prompts[i // size] for i in range(B)],
        rewards=rewards,
        correct=correct,
        advantages=advantages,
        policy_version=np.full(B, step - 1),
        finish_reason=["length" if n == max_tokens else "stop" for n in lengths],
        token_ids=rng.integers(0, 32000, (B, T)),
        token_texts=texts,
        response_mask=mask,
        **arrays,
    )
    return table, arrays | {"mask": mask, "advantages": advantages.numpy(), "correct": correct}


class TokenSpans(HTMLParser):
    """Every token span's attributes, with the group (`data-group`) it is in."""

    def __init__(self):
        super().__init__()
        self.tokens: list[dict] = []
        self.group = None
        self.in_tokens = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section" and "data-group" in attrs:
            self.group = int(attrs["data-group"])
        elif tag == "div":
            self.in_tokens = attrs.get("class") == "toks"
        elif tag == "span" and self.in_tokens:
            self.tokens.append(attrs | {"group": self.group})


def page_tokens(page: str) -> list[dict]:
    parser = TokenSpans()
    parser.feed(page)
    return parser.tokens


def run_dir_with_steps(tmp_path, steps=(3, 7), **options):
    for step in steps:
        write_step(tmp_path, step, synthetic_step(step=step, **options)[0], METADATA)
    return tmp_path


@pytest.mark.unit
def test_a_step_round_trips_through_parquet_with_its_metadata(tmp_path):
    table, _ = synthetic_step()
    path = write_step(tmp_path, 3, table, METADATA)
    assert path == tmp_path / "inspect" / "step_000003.parquet"
    write_step(tmp_path, 12, table.to_pydict(), METADATA)  # a mapping of columns works too
    assert inspected_steps(tmp_path) == [3, 12]
    read, metadata = read_step(tmp_path, 3)
    assert read.schema.remove_metadata() == INSPECT_SCHEMA and read.equals(table)
    assert metadata == METADATA | {"step": 3}
    assert read_step(tmp_path)[1]["step"] == 12  # no step: the newest
    assert not list((tmp_path / "inspect").glob(".*"))  # no partial file left
    with pytest.raises(FileNotFoundError, match="step 5 was not inspected .* inspected: 3, 12"):
        read_step(tmp_path, 5)
    with pytest.raises(ValueError, match="lacks cov_scope"):
        write_step(tmp_path, 4, table, {"policy_loss": "grpo", "run_name": "r"})
    pq.write_table(table, tmp_path / "inspect" / "step_000020.parquet")  # not by write_step
    with pytest.raises(ValueError, match="step_000020.parquet has no cagrpo_inspect metadata"):
        read_step(tmp_path, 20)


@pytest.mark.unit
def test_records_take_the_masked_tokens_and_default_the_missing_arrays():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    values = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
    rows = records_from_arrays(
        step=5,
        group_ids=torch.tensor([4, 4, 9]),
        prompt_uids=["a", "a", "b"],
        prompt_texts=["pa", "pa", "pb"],
        rewards=[1.0, 0.0, 1.0],
        correct=[True, False, True],
        advantages=torch.tensor([0.7, -0.7, 0.0]),
        policy_version=[2, 2, 3],
        finish_reason=["stop", "length", "stop"],
        token_ids=torch.arange(12).view(3, 4),
        token_texts=[["x", "y"], ["z", "\n"], [" "]],
        response_mask=mask,
        behavior_logprob=values,
        logprob=values,
        entropy=values,
        cov=values,
    ).to_pylist()
    assert [r["response_index"] for r in rows] == [0, 1, 0]
    assert [r["token_ids"] for r in rows] == [[1, 2], [6, 7], [8]]
    assert rows[1]["logprob"] == [6.0, 7.0] and rows[2]["tokens"] == [" "]
    assert all(r["weight"] == r["is_weight"] == [1.0] * len(r["tokens"]) for r in rows)
    assert not any(any(r[k]) for r in rows for k in ("clip_cov", "kl_cov", "clipped"))
    with pytest.raises(ValueError, match=r"token_texts\[0\] has 1 texts for 2 tokens"):
        records_from_arrays(
            step=5,
            group_ids=[4, 4, 9],
            prompt_uids=["a"] * 3,
            prompt_texts=["p"] * 3,
            rewards=[1.0] * 3,
            correct=[True] * 3,
            advantages=[0.0] * 3,
            policy_version=[0] * 3,
            finish_reason=["stop"] * 3,
            token_ids=np.zeros((3, 4)),
            token_texts=[["x"], ["z", "w"], ["v"]],
            response_mask=mask,
            behavior_logprob=values,
            logprob=values,
            entropy=values,
            cov=values,
        )


@pytest.mark.unit
def test_environment_text_shows_between_the_tokens_and_in_no_statistic():
    """A multi-turn row's tool result is shown where it came, as context: no token span, so
    no value, no colour and no place in the histograms or the tails."""
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    values = torch.arange(8, dtype=torch.float32).view(2, 4)
    table = records_from_arrays(
        step=1, group_ids=[0, 0], prompt_uids=["a", "a"], prompt_texts=["p", "p"],
        rewards=[1.0, 0.0], correct=[True, False], advantages=[0.5, -0.5],
        policy_version=[0, 0], finish_reason=["stop", "stop"], token_ids=torch.zeros(2, 4),
        token_texts=[["<tool>", "x", "</tool>", "42"], ["a", "b"]], response_mask=mask,
        behavior_logprob=values, logprob=values, entropy=values, cov=values,
        environment=[[(3, "<result>42</result>")], []],
    )  # fmt: skip
    page = render_page(table, {"step": 1}, [1])
    assert re.search(r"&lt;/tool&gt;</span><em class=env[^>]*>&lt;result&gt;42&lt;/result&gt;"
                     r"</em><span [^>]*>42</span>", page)  # fmt: skip
    spans = TokenSpans()
    spans.feed(page)
    assert len(spans.tokens) == 6  # the policy's tokens only
    assert table.column("environment").to_pylist()[1] is None


@pytest.mark.unit
def test_select_groups_picks_whole_groups_the_same_way_each_time():
    group_ids = np.repeat([5, 9, 2, 7, 11], 3)
    rows = select_groups(group_ids, 2, seed=4)
    assert rows.tolist() == select_groups(torch.tensor(group_ids), 2, seed=4).tolist()
    chosen = set(group_ids[rows].tolist())
    assert len(chosen) == 2 and len(rows) == 6 and list(rows) == sorted(rows)
    assert {len(set(group_ids[select_groups(group_ids, 2, s)])) for s in range(20)} == {2}
    assert len({tuple(select_groups(group_ids, 2, s)) for s in range(20)}) > 1
    assert select_groups(group_ids, 10, seed=0).tolist() == list(range(15))


@pytest.mark.unit
def test_the_page_carries_the_exact_values_and_the_kernel_normalisation():
    table, arrays = synthetic_step()
    page = render_page(table, METADATA | {"step": 3}, [3])
    tokens = page_tokens(page)
    mask = arrays["mask"]
    assert len(tokens) == mask.sum()
    for key, column in FLOAT_ATTRIBUTES.items():
        shown = np.array([np.float32(float(t[f"data-{key}"])) for t in tokens])
        assert np.array_equal(shown, arrays[column][mask].astype(np.float32)), key
    advantages = np.broadcast_to(arrays["advantages"][:, None], mask.shape)[mask]
    assert np.array_equal([np.float32(float(t["data-adv"])) for t in tokens], advantages)
    assert [t["data-clipped"] == "1" for t in tokens] == arrays["clipped"][mask].tolist()
    assert not any("data-sel" in t for t in tokens)
    by_group: dict[int, list[dict]] = {}
    for t in tokens:
        by_group.setdefault(t["group"], []).append(t)
    assert len(by_group) == 4
    for group in by_group.values():
        w = np.array([float(t["data-w"]) for t in group])
        c = np.array([float(t["data-c"]) for t in group])
        assert w.mean() == pytest.approx(1.0, abs=1e-5)  # w~ keeps the group's budget
        assert np.argmax(np.abs(c)) == np.argmin(w)  # the most extreme token is tamed most
        order = np.argsort(np.abs(c), kind="stable")
        assert np.all(np.diff(w[order]) <= 1e-6)  # w~ falls as |c| grows, within a group


@pytest.mark.unit
def test_the_tails_are_the_papers_covariance_table_over_the_step():
    assert TAIL_FRACTIONS == COVARIANCE_TABLE_FRACTIONS
    table, arrays = synthetic_step(groups=6, size=8, max_tokens=40)
    tokens = page_tokens(render_page(table, METADATA, [3]))
    c = np.array([float(t["data-c"]) for t in tokens], dtype=np.float32).astype(np.float64)
    tails = [t["data-tail"] for t in tokens]
    quantiles = covariance_quantiles(torch.tensor(arrays["cov"]), torch.tensor(arrays["mask"]))
    for f in TAIL_FRACTIONS:
        pct = f"{f * 100:g}"
        top = c >= quantiles[f"pos_{pct}pct"]
        bottom = c <= quantiles[f"neg_{pct}pct"]
        inside = np.array([t != "" and abs(float(t)) <= f * 100 for t in tails])
        assert np.array_equal(inside, top | bottom), pct
    top_1pct = sum(t.startswith("+") and float(t) <= 1 for t in tails)
    assert abs(top_1pct - 0.01 * len(c)) <= 1


@pytest.mark.unit
def test_tokens_chosen_by_kl_cov_are_marked():
    table, arrays = synthetic_step(groups=4, size=4, max_tokens=30, kl_cov=True)
    tokens = page_tokens(render_page(table, METADATA | {"policy_loss": "kl_cov"}, [3]))
    chosen = [t.get("data-sel") == "kl_cov" for t in tokens]
    assert chosen == arrays["kl_cov"][arrays["mask"]].tolist() and any(chosen)
    assert all(t.get("data-sel") in (None, "kl_cov") for t in tokens)


@pytest.mark.unit
@pytest.mark.parametrize(
    "loss, colouring", [("cagrpo", "w"), ("grpo", "c"), ("kl_cov", "c"), ("not_registered", "c")]
)
def test_the_page_colours_by_what_the_loss_shows_first(loss, colouring):
    table, _ = synthetic_step()
    page = render_page(table, METADATA | {"policy_loss": loss}, [3])
    assert re.findall(r"<option value=(\w+) selected>", page) == [colouring]


@pytest.mark.unit
def test_the_page_is_offline_and_escapes_every_text():
    table, _ = synthetic_step()
    page = render_page(table, METADATA, [3, 7])
    for outside in ("http:", "https:", "src=", "<link", "@import", "url("):
        assert outside not in page, outside
    assert "<answer>" not in page and "&lt;answer&gt;" in page
    assert "&amp; &quot;quote&quot;" in page
    assert "␣the" in page and "⏎</span><br>" in page
    assert '<a href="/step/7">7</a>' in page and "<b>3</b>" in page


@pytest.mark.unit
def test_the_cli_writes_the_newest_step_or_the_one_asked_for(tmp_path, capsys):
    run = run_dir_with_steps(tmp_path / "run")
    main([str(run)])
    newest = run / "inspect" / "step_000007.html"
    assert capsys.readouterr().out.strip() == str(newest)
    assert "step 7</h1>" in newest.read_text()
    main([str(run), "--step", "3", "--out", str(tmp_path / "three.html")])
    page = (tmp_path / "three.html").read_text()
    assert "step 3</h1>" in page and "<span>7</span>" in page  # no link from a file


@pytest.mark.unit
def test_a_response_whose_reward_had_an_error_is_marked_with_the_message(tmp_path):
    run = run_dir_with_steps(tmp_path / "run", steps=(3,))
    table, _ = synthetic_step()
    group, index = table.column("group_id")[5].as_py(), table.column("response_index")[5].as_py()
    errors = RewardErrorLog(log_dir(run) / ERRORS_FILE)
    failed = "reward function 'f' on sample 'x:1' raised ValueError: <bad> & \"odd\""
    errors.record(3, failed, "x:1", 1, group, index, "text")
    main([str(run)])
    page = (run / "inspect" / "step_000003.html").read_text()
    assert page.count("reward error</span>") == 1  # that response only
    escaped = "raised ValueError: &lt;bad&gt; &amp; &quot;odd&quot;"
    assert f"title='reward function &#x27;f&#x27; on sample &#x27;x:1&#x27; {escaped}'" in page
    head = page[: page.index("reward error</span>")]
    assert head.rindex(f"data-group={group}>") > head.rindex("<section class=g")  # its group
    assert "reward error</span>" not in render_page(table, METADATA, [3])


@pytest.mark.unit
@pytest.mark.parametrize("case", ["no run", "no step", "nothing inspected"])
def test_a_missing_run_or_step_is_one_line_and_status_2(tmp_path, case, capsys):
    run_dir_with_steps(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    argv, expected = {
        "no run": ([str(tmp_path / "nope")], "error: run directory .*nope does not exist"),
        "no step": ([str(tmp_path / "run"), "--step", "4"], "step 4 was not inspected"),
        "nothing inspected": ([str(tmp_path / "empty")], "has no inspected step"),
    }[case]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(expected, err), err


def fetch(url: str, host: str | None = None) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


@pytest.mark.unit
def test_the_server_serves_the_steps_read_only_on_loopback(tmp_path):
    run = run_dir_with_steps(tmp_path)
    with InspectorServer(run, port=0) as server:
        assert server.url == f"http://127.0.0.1:{server.port}/"
        assert fetch(server.url + "steps.json")[2] == b"[3, 7]"
        status, kind, body = fetch(server.url)
        assert (status, kind) == (200, "text/html; charset=utf-8") and b"step 7</h1>" in body
        assert b'<a href="/step/3">3</a>' in body
        assert b"step 3</h1>" in fetch(server.url + "step/3")[2]
        assert fetch(server.url + "step/4")[0] == 404
        assert fetch(server.url + "other")[0] == 404
        assert fetch(server.url, host="evil.example:80")[0] == 403
        post = urllib.request.Request(server.url, data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(post, timeout=20)
        assert refused.value.code == 501
        write_step(run, 9, synthetic_step(step=9)[0], METADATA)  # a new step while serving
        assert b"step 9</h1>" in fetch(server.url)[2]
    with InspectorServer(tmp_path / "later") as server:  # before the run's first step
        status, _, body = fetch(server.url)
        assert status == 404 and b"http-equiv=refresh" in body


@pytest.mark.integration
def test_the_cli_serves_on_loopback_by_default(tmp_path):
    run = run_dir_with_steps(tmp_path)
    command = [sys.executable, "-m", "cagrpo_ray.inspect", str(run), "--serve", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        url = re.search(r"http://\S+/", line).group(0)
        assert url.startswith("http://127.0.0.1:"), line
        assert json.loads(fetch(url + "steps.json")[2]) == [3, 7]
        assert b"step 7</h1>" in fetch(url)[2] and b"step 3</h1>" in fetch(url + "step/3")[2]
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.mark.unit
def test_page_and_records_stay_within_the_documented_bytes_per_group(tmp_path):
    run = run_dir_with_steps(tmp_path, groups=4, size=8, max_tokens=200, terms=30)
    for step in inspected_steps(run):
        table, metadata = read_step(run, step)
        page = render_page(table, metadata, inspected_steps(run)).encode()
        parquet = (run / "inspect" / f"step_{step:06d}.parquet").stat().st_size
        tokens = sum(len(t) for t in table.column("tokens").to_pylist())
        assert tokens > 4 * 8 * 150  # the responses are about as long as measured
        assert len(page) / 4 < PAGE_BYTES_PER_GROUP, len(page) / tokens
        assert parquet / 4 < PARQUET_BYTES_PER_GROUP, parquet / tokens


# --- in a real browser -------------------------------------------------------------------

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1000",
)
VISIBLE_TOKENS = (
    "return Array.from(document.querySelectorAll('.toks span'))"
    ".filter(e => e.getClientRects().length > 0).length"
)


@pytest.fixture
def browser():
    """Headless Chromium driven by Selenium through Debian's chromedriver."""
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    problem = None
    if chromium is None or driver_path is None:
        problem = "chromium not installed (apt-get install -y chromium chromium-driver)"
    elif webdriver is None:
        problem = "selenium not installed (pip install -e '.[dev]')"
    if problem and os.environ.get("CI") == "1":
        pytest.fail(f"{problem}, and CI=1 runs every test")
    if problem:
        pytest.skip(problem)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    with tempfile.TemporaryDirectory() as profile:
        options.add_argument(f"--user-data-dir={profile}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
        try:
            yield driver
        finally:
            driver.quit()


def screenshot_is_not_blank(driver) -> None:
    from PIL import Image

    image = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("L")
    pixels = np.asarray(image, dtype=np.float64)
    assert pixels.shape[0] > 500 and pixels.var() > 200, pixels.var()


def check_the_filters(driver, arrays) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    mask = arrays["mask"]
    assert driver.execute_script(VISIBLE_TOKENS) == mask.sum()
    first = driver.find_element(By.CSS_SELECTOR, ".toks span")
    by_weight = first.value_of_css_property("background-color")
    Select(driver.find_element(By.ID, "colour")).select_by_value("c")
    assert first.value_of_css_property("background-color") != by_weight
    assert driver.find_element(By.ID, "lg-label").text == "covariance c"

    driver.find_element(By.ID, "f-w").click()
    low = arrays["weight"][mask] < 0.5
    assert 0 < low.sum() < mask.sum()
    assert driver.execute_script(VISIBLE_TOKENS) == low.sum()
    driver.find_element(By.ID, "f-wrong").click()
    wrong = np.broadcast_to(~arrays["correct"][:, None], mask.shape)[mask]
    assert driver.execute_script(VISIBLE_TOKENS) == (low & wrong).sum()
    assert driver.find_element(By.ID, "shown").text.startswith(f"{(low & wrong).sum()} of ")
    shown = [e for e in driver.find_elements(By.CSS_SELECTOR, ".toks span") if e.is_displayed()]
    ActionChains(driver).move_to_element(shown[0]).perform()
    assert shown[0].get_attribute("data-w") in driver.find_element(By.ID, "tip").text
    screenshot_is_not_blank(driver)
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


@pytest.mark.integration
def test_the_written_page_filters_and_colours_in_chromium(tmp_path, browser):
    table, arrays = synthetic_step(groups=4, size=4, max_tokens=30)
    write_step(tmp_path, 3, table, METADATA)
    main([str(tmp_path), "--out", str(tmp_path / "page.html")])
    browser.get((tmp_path / "page.html").as_uri())
    check_the_filters(browser, arrays)


@pytest.mark.integration
def test_the_live_page_filters_and_links_the_steps_in_chromium(tmp_path, browser):
    from selenium.webdriver.common.by import By

    table, arrays = synthetic_step(step=7, groups=4, size=4, max_tokens=30)
    write_step(tmp_path, 3, synthetic_step(step=3)[0], METADATA)
    write_step(tmp_path, 7, table, METADATA)
    with InspectorServer(tmp_path) as server:
        browser.get(server.url)
        check_the_filters(browser, arrays)
        browser.find_element(By.LINK_TEXT, "3").click()
        assert browser.current_url == server.url + "step/3"
        assert browser.find_element(By.TAG_NAME, "h1").text.endswith("step 3")
