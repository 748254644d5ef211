"""Free-text answers: `extract_answer_text` and the `reasoning_gym_text` verifier, on real
greedy responses of SmolLM2-135M-Instruct (tests/fixtures/smollm2_responses.json), on answers
written the ways a model writes them inside random sentences, on hostile megabytes, and in the
reward pool's `parsed` flag."""

from __future__ import annotations

import functools
import json
import re
import secrets
import time
from pathlib import Path

import pytest
import reasoning_gym
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cagrpo_ray.data.reasoning_gym_source import ReasoningGymSource
from cagrpo_ray.rewards import RewardFunction
from cagrpo_ray.rewards.extract import extract_answer_text, normalize_number
from cagrpo_ray.rewards.verifiers import answer_parser, verify_reasoning_gym_text

pytestmark = pytest.mark.unit

FIXTURE = json.loads(
    (Path(__file__).parent / "fixtures" / "smollm2_responses.json").read_text(encoding="utf-8")
)
RESPONSES = FIXTURE["responses"]


@functools.cache
def drawn_items(task: str, config_json: str, draw_json: str) -> tuple[dict, ...]:
    config, draw = json.loads(config_json), json.loads(draw_json)
    if draw["via"] == "create_dataset":
        dataset = reasoning_gym.create_dataset(task, seed=draw["seed"], size=draw["size"], **config)
        return tuple(
            {"uid": f"{task}:{draw['seed']}:{i}", **dataset[i]} for i in range(draw["size"])
        )
    source = ReasoningGymSource(task, config, draw["seed"], draw["size"], draw["split"])
    return tuple(
        {"uid": it.uid, "question": it.question, "answer": it.answer, "metadata": it.metadata}
        for it in source
    )


def fixture_item(entry: dict) -> dict:
    """The reasoning_gym item the response answered, drawn again from its dataset (so the
    verifier sees the dataset's own metadata), as a verifier item dict."""
    draw = {k: v for k, v in entry["draw"].items() if k != "index"}
    items = drawn_items(entry["task"], json.dumps(entry["config"]), json.dumps(draw))
    item = items[entry["draw"]["index"]]
    assert (item["question"], item["answer"]) == (entry["question"], entry["reference"])
    return item


# ---------------------------------------------------------------- real SmolLM2 responses


@pytest.mark.parametrize(
    "entry", RESPONSES, ids=[f"{i}-{e['task']}" for i, e in enumerate(RESPONSES)]
)
def test_extraction_reads_the_answer_the_model_stated(entry):
    answer, how = extract_answer_text(entry["response"])
    assert answer == entry["model_answer"], (answer, how, entry["response"])
    assert how in ("tag", "boxed", "marker", "last_number", None)
    assert (how is None) == (answer is None)


def test_the_fixture_is_varied():
    texts = [e["response"] for e in RESPONSES]
    assert len(RESPONSES) >= 12
    assert any(re.fullmatch(r"The answer is -?\d+\.", t) for t in texts)
    assert any(re.fullmatch(r"-?\d+ [-+] -?\d+ = -?\d+\.?", t) for t in texts)
    assert sum("\n" in t for t in texts) >= 4
    assert sum(len(re.findall(r"\d+", t)) >= 4 for t in texts) >= 4
    assert any(e["model_answer"] is None for e in RESPONSES)
    right = [e["model_answer"] == e["reference"] for e in RESPONSES]
    assert sum(right) >= 3 and not all(right)
    assert {"basic_arithmetic", "chain_sum"} <= {e["task"] for e in RESPONSES}


def test_the_text_verifier_scores_the_model_answer_against_the_reference():
    for entry in RESPONSES:
        item = fixture_item(entry)
        score = verify_reasoning_gym_text(entry["response"], item)
        stated, reference = entry["model_answer"], entry["reference"]
        # Numbers are right or wrong: no partial credit for "10" against "1" (which the
        # datasets' default string scoring would give, len("1") / len("10")).
        assert score == (1.0 if stated == reference else 0.0), entry
    assert any(e["model_answer"] == e["reference"] for e in RESPONSES)


# ---------------------------------------------------------------- answers in random sentences

WORDS = ("first", "we", "add", "then", "take", "away", "the", "sum", "of", "and", "gives", "so",
         "total", "apples", "left", "step", "result", "carry", "each", "box", "holds")  # fmt: skip
UNITS = ("", " apples", " cm", "%", " dollars", " m/s", " points")
ENDINGS = ("", ".", "!", "?", ",", ")", ".\n\nThat is all.", "\n")
MINUS = ("-", "\N{MINUS SIGN}")


@st.composite
def written_numbers(draw) -> tuple[str, str]:
    """(the number as a model writes it, its one canonical spelling, built independently)."""
    whole = draw(st.integers(0, 10**10))
    fraction = draw(st.one_of(st.just(""), st.text("0123456789", min_size=1, max_size=4)))
    grouped = draw(st.booleans()) and whole >= 1000
    digits = f"{whole:,}" if grouped else str(whole)
    negative = draw(st.booleans())
    sign = draw(st.sampled_from(MINUS)) if negative else ""
    written = sign + digits + (f".{fraction}" if fraction else "")
    kept = fraction.rstrip("0")
    canonical = str(whole) + (f".{kept}" if kept else "")
    if negative and canonical != "0":
        canonical = "-" + canonical
    return written, canonical


@st.composite
def preamble(draw) -> str:
    """Sentences of working with numbers in them, none of them a final answer."""
    sentences = []
    for _ in range(draw(st.integers(0, 4))):
        words = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=6))
        a, b = draw(st.integers(0, 999)), draw(st.integers(0, 99_999))
        shape = draw(st.sampled_from(["{w} {a} + {a} = {b}", "{w} {b:,} {w2}", "{a}.5 {w}"]))
        sentences.append(shape.format(w=" ".join(words), w2=words[0], a=a, b=b).capitalize())
    return "".join(s + draw(st.sampled_from([". ", ".\n", "\n\n", ": "])) for s in sentences)


FORMS = {
    "Answer: {n}": "marker",
    "Final answer: {n}": "marker",
    "The answer is {n}": "marker",
    "So the final answer is {n}": "marker",
    "The answer to {a} + {b} is {n}": "marker",
    "The final answer to this problem is {n}": "marker",
    "answer = {n}": "marker",
    "Answer: {a} + {b} = {n}": "marker",
    "\\boxed{{{n}}}": "boxed",
    "so the result is \\boxed{{ {n} }}": "boxed",
    "<answer>{n}</answer>": "tag",
    "<answer> \\boxed{{{n}}} </answer>": "tag",
    "so x = {n}": "last_number",
    "{a} + {b} = {n}": "last_number",
}


@settings(max_examples=300, deadline=None)
@given(
    number=written_numbers(),
    form=st.sampled_from(sorted(FORMS)),
    before=preamble(),
    unit=st.sampled_from(UNITS),
    ending=st.sampled_from(ENDINGS),
    a=st.integers(0, 999),
    b=st.integers(0, 999),
)
def test_the_final_answer_is_found_after_other_numbers(number, form, before, unit, ending, a, b):
    written, canonical = number
    if FORMS[form] in ("boxed", "tag"):
        unit = ""  # a unit inside a box or tag is a different answer text
    text = before + form.format(n=written, a=a, b=b) + unit + ending
    assert normalize_number(written) == canonical
    assert extract_answer_text(text) == (canonical, FORMS[form]), text


@settings(max_examples=100, deadline=None)
@given(
    number=written_numbers(),
    before=preamble(),
    form=st.sampled_from(["So {a} + {b} = {n}.", "Answer: {n}", "The answer is {n}."]),
    mention=st.sampled_from(
        ["This is the final answer to the problem.", "That is the answer to the question!"]
    ),
    a=st.integers(0, 999),
    b=st.integers(0, 999),
)
def test_a_mention_of_the_answer_after_it_gives_no_other_answer(
    number, before, form, mention, a, b
):
    # SmolLM2 writes "So, 50 - 75 = 25.\n\nThis is the final answer to the given arithmetic
    # problem." (tests/fixtures): the mention names no answer, the number before it is one.
    written, canonical = number
    text = before + form.format(n=written, a=a, b=b) + "\n\n" + mention
    assert extract_answer_text(text) == (canonical, "last_number"), text


NO_MARKER = re.compile(r"(?i)answer|\\boxed|\\fbox")


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(exclude_categories=("Nd", "Cs")), max_size=200))
def test_text_without_digits_or_an_answer_gives_nothing(text):
    assume(not NO_MARKER.search(text))
    assert extract_answer_text(text) == (None, None)
    assert answer_parser("reasoning_gym_text")(text, {}) is False


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(WORDS + ("<think>", "</think>", "\n", "{", "}")), max_size=40))
def test_working_without_numbers_gives_nothing(words):
    text = " ".join(words)
    assert extract_answer_text(text) == (None, None)
    assert extract_answer_text(text + "<|im_end|>") == (None, None)


def test_an_answer_without_a_number_is_its_text():
    assert extract_answer_text("<answer> forty two </answer>") == ("forty two", "tag")
    assert extract_answer_text("The answer is forty-two.") == ("forty-two", "marker")
    assert extract_answer_text("Answer:\nseven!") == ("seven", "marker")


@pytest.mark.parametrize(
    "unit",
    [
        "1234567890 Answer: ",  # markers and digits alternating
        "Answer:",  # markers only, the last one followed by nothing
        "9" * 997 + ",",  # digit runs almost thousands-grouped
        "1,000" * 50 + "=",  # long grouped numbers and equals signs
        "answer " + " " * 200,  # a marker's optional "is" after long whitespace
        "<answer>\\boxed{",  # unclosed tags and boxes
    ],
)
def test_a_megabyte_response_is_parsed_in_linear_time(unit):
    text = unit * (2**20 // len(unit) + 1)
    # CPU time, not wall time: on the shared 2-core machine one run took 7.7 s of wall time for
    # 0.4 s of CPU. A guard against catastrophic backtracking, not a benchmark: parsing these
    # 2 MB linearly takes well under a second; a quadratic pattern would take minutes.
    start = time.process_time()
    extract_answer_text(text + "Answer: 7")
    extract_answer_text(text)
    elapsed = time.process_time() - start
    assert elapsed < 2.0, f"{elapsed:.2f} s of CPU"
    assert extract_answer_text(text + "\nAnswer: 7") == ("7", "marker")


# ---------------------------------------------------------------- the reward pool's parsed flag


# The first job of a fresh worker imports reasoning_gym: several seconds on the loaded 2-core
# machine, and the pool pre-imports it for "reasoning_gym" but not for "reasoning_gym_text"
# (rewards/pool.py HEAVY_IMPORTS), so the default 5 s budget is not enough here.
TIMEOUT_S = 60.0


def fresh_items(n: int) -> list:
    seed = secrets.randbelow(10**6)
    return list(ReasoningGymSource("chain_sum", {"min_terms": 2, "max_terms": 3}, seed, n))


def test_the_text_verifier_marks_exactly_the_answerless_responses_unparsed():
    items = fresh_items(6)
    wrong = str(int(items[2].answer) + 1)
    cases = [  # (response, parsed, correct)
        (f"Adding up: the answer is {items[0].answer}.", True, True),
        ("I am not sure how to do this.", False, False),
        (f"\\boxed{{{wrong}}}", True, False),
        ("<answer>unsure</answer>", True, False),
        ("", False, False),
        (f"First 3 + 4 = 7, so x = {items[5].answer}", True, True),
    ]
    with RewardFunction({"reasoning_gym_text": 1.0}, TIMEOUT_S, num_workers=1) as reward:
        results = reward([c[0] for c in cases], items)
    assert all(r.error is None for r in results), [r.error for r in results]
    assert [r.parsed for r in results] == [c[1] for c in cases]
    assert [r.correct for r in results] == [c[2] for c in cases]
    assert [r.reward for r in results] == [float(c[2]) for c in cases]


def test_the_tag_verifier_marks_a_tagless_response_unparsed():
    items = fresh_items(3)
    responses = [
        f"The answer is {items[0].answer}.",  # right, but not in the tag it asks for
        f"<answer>{items[1].answer}</answer>",
        f"<answer>{items[2].answer}",  # never closed
    ]
    with RewardFunction({"reasoning_gym": 1.0}, TIMEOUT_S, num_workers=1) as reward:
        results = reward(responses, items)
    assert [r.parsed for r in results] == [False, True, False]
    assert [r.correct for r in results] == [False, True, False]
