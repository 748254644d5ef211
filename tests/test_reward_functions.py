"""Reward functions of one's own (`cagrpo_ray/rewards/custom.py`): TRL's, verl's and the
project's conventions, detected from the signature, run in the verifier pool; their errors."""

from __future__ import annotations

import math

import pytest

from cagrpo_ray.data import PromptItem
from cagrpo_ray.rewards import (
    RewardError,
    RewardFunction,
    RewardFunctionError,
    load_reward_functions,
)
from cagrpo_ray.rewards.custom import calling_convention

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = [pytest.mark.unit, pytest.mark.clock]

REWARDS_PY = '''
import math
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's convention: 1 if the text after '####' is the ground truth."""
    answer = solution_str.split("####")[-1].strip()
    if extra_info and extra_info.get("detailed"):
        return {"score": float(answer == ground_truth), "length": len(solution_str),
                "source": data_source}
    return float(answer == ground_truth)

def trl_reward(completions, solution, **kwargs):
    """TRL's convention: the last word of each completion against the `solution` column."""
    seen.append(sorted(kwargs))
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [None if t == "skip" else float(t.split()[-1] == s)
            for t, s in zip(texts, solution)]

seen = []

def trl_echo(prompts, completions, completion_ids, **kwargs):
    """Scores what it received, so that the test can check the arguments."""
    return [float(len(p) * 100 + len(c) * 10 + (len(i) if i else 0))
            for p, c, i in zip(prompts, completions, completion_ids)]

def trl_short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def trl_nan(completions, **kwargs):
    return [math.nan if c == "bad" else 1.0 for c in completions]

def trl_hang(completions, **kwargs):
    time.sleep(60)

def mine(response, item):
    return 2.0 if item["answer"] in response else 0.0

def mine_raises(response, item):
    raise KeyError("boom")

def verl_no_score(data_source, solution_str, ground_truth, extra_info):
    return {"acc": 1.0}

def three_args(a, b, c):
    return 0.0
'''


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_rewards.py"
    path.write_text(REWARDS_PY)
    return path


def spec(path, name):
    return f"{path}:{name}"


def verl_item(uid, question, answer, detailed=False):
    return PromptItem(
        uid=uid,
        question=[{"role": "user", "content": question}],
        answer=answer,
        metadata={"data_source": "toy/gsm", "extra_info": {"detailed": detailed},
                  "reward_model": {"ground_truth": answer}},  # fmt: skip
    )


def trl_item(uid, answer, conversational=False, **columns):
    question = [{"role": "user", "content": "q?"}] if conversational else "q?"
    return PromptItem(uid, question, answer, {"solution": answer, **columns})


def test_conventions_are_detected_from_the_signature(rewards_file):
    loaded = load_reward_functions(
        {n: spec(rewards_file, n) for n in ("compute_score", "trl_reward", "trl_echo", "mine")}
    )
    assert {n: f.kind for n, f in loaded.items()} == {
        "compute_score": "verl", "trl_reward": "trl", "trl_echo": "trl", "mine": "item"
    }  # fmt: skip
    assert loaded["trl_reward"].batched and not loaded["mine"].batched
    assert calling_convention("f", lambda completions, **kw: []) == "trl"
    assert calling_convention("f", lambda response, item, scale=1.0: 0.0) == "item"
    assert calling_convention("f", lambda *args: 0.0) == "item"


@pytest.mark.parametrize(
    ("functions", "message"),
    [
        ({"x": "missing_file.py:f"}, r"reward function 'x': cannot import .*missing_file\.py"),
        ({"x": "no_such_module_xyz:f"}, r"reward function 'x': cannot import 'no_such_module"),
        ({"x": "{file}:absent"}, r"reward function 'x': .* has no function 'absent'"),
        ({"x": "{file}:three_args"}, r"reward function 'x' has the signature x\(a, b, c\)"),
        ({"x": "nocolon"}, r"reward function 'x': 'nocolon' is not 'path/to/file\.py:function'"),
        ({"x": "{broken}:f"}, r"reward function 'x': cannot import .*SyntaxError"),
    ],
)
def test_import_errors_and_wrong_signatures_name_the_function(
    rewards_file, tmp_path, functions, message
):
    broken = tmp_path / "broken.py"
    broken.write_text("def f(response, item:\n")
    functions = {
        k: v.format(file=rewards_file, broken=broken) for k, v in functions.items()
    }
    with pytest.raises(RewardFunctionError, match=message):
        load_reward_functions(functions, search_path=str(tmp_path))
    # and RewardFunction, which the run builds before it trains, refuses the same
    with pytest.raises(RewardFunctionError, match=message):
        RewardFunction({"x": 1.0}, functions=functions)


def test_relative_files_and_modules_resolve_against_the_search_path(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "rel.py").write_text("def f(response, item):\n    return 1.0\n")
    (tmp_path / "user_scoring_mod.py").write_text("def g(response, item):\n    return 3.0\n")
    loaded = load_reward_functions(
        {"f": "sub/rel.py:f", "g": "user_scoring_mod:g"}, search_path=str(tmp_path)
    )
    assert loaded["f"].spec == f"{tmp_path / 'sub' / 'rel.py'}:f"
    assert loaded["g"].spec == "user_scoring_mod:g"
    assert loaded["g"].score_job("r", {"uid": "u", "answer": "a"}) == (3.0, None, {})


def test_verl_compute_score_float_and_dict_through_the_pool(rewards_file):
    items = [
        verl_item("gsm:0", "6*7?", "42"),
        verl_item("gsm:1", "1+1?", "2", detailed=True),
        verl_item("gsm:2", "2+3?", "5"),
    ]
    responses = ["so #### 42", "#### 2", "#### 6"]
    with RewardFunction(
        {"gsm": 1.0}, timeout_s=10, num_workers=1,
        functions={"gsm": spec(rewards_file, "compute_score")},
    ) as reward_fn:  # fmt: skip
        results = reward_fn(responses, items)
    assert [r.reward for r in results] == [1.0, 1.0, 0.0]
    assert [r.correct for r in results] == [True, True, False]  # the function's verdict
    assert results[0].components == {"gsm": 1.0}
    # a dict's other numeric keys are components; a string one is left out
    assert results[1].components == {"gsm": 1.0, "gsm/length": len("#### 2")}
    assert all(r.error is None for r in results)


def test_trl_function_gets_the_batch_columns_and_none_means_no_reward(rewards_file):
    items = [
        trl_item("t:0", "4", level=1),
        trl_item("t:1", "9", conversational=True, level=2),
        trl_item("t:2", "5", level=3),
    ]
    responses = ["it is 4", "it is 8", "skip"]
    with RewardFunction(
        {"trl": 0.5, "echo": 0.0},
        timeout_s=10,
        num_workers=2,
        functions={"trl": spec(rewards_file, "trl_reward"), "echo": spec(rewards_file, "trl_echo")},
    ) as reward_fn:
        results = reward_fn(responses, items, completion_ids=[[1, 2], [3], [4, 5, 6]])
    assert [r.components["trl"] for r in results] == [1.0, 0.0, 0.0]
    assert [r.reward for r in results] == [0.5, 0.0, 0.0]
    assert all(r.error is None for r in results)  # None is no reward, not an error
    # prompts as the dataset has them (text, or one message), completions as text or as one
    # assistant message, and the token ids
    assert [r.components["echo"] for r in results] == [
        len("q?") * 100 + len("it is 4") * 10 + 2,
        1 * 100 + 1 * 10 + 1,
        len("q?") * 100 + len("skip") * 10 + 3,
    ]


def test_trl_kwargs_are_every_other_column(rewards_file):
    from cagrpo_ray.rewards.custom import _loaded

    function = load_reward_functions({"trl": spec(rewards_file, "trl_reward")})["trl"]
    items = [{"uid": "u", "question": "q", "answer": "1",
              "metadata": {"solution": "1", "level": 3, "source_file": "f.jsonl"}}]  # fmt: skip
    assert function.score_job(["x 1"], items) == [(1.0, None, {})]
    module_seen = _loaded[function.spec].__globals__["seen"]
    assert module_seen[-1] == ["completion_ids", "level", "prompts"]


@pytest.mark.parametrize(
    ("name", "responses", "message"),
    [
        ("trl_short", ["a", "b"], "returned 1 rewards for a batch of 2 completions"),
        ("trl_nan", ["ok", "bad"], "returned nan"),
        ("mine_raises", ["a", "b"], "raised KeyError: 'boom'"),
        ("verl_no_score", ["a", "b"], "returned a dict without 'score'"),
    ],
)
def test_run_time_errors_name_function_and_sample_and_score_zero(
    rewards_file, name, responses, message
):
    items = [trl_item(f"s:{i}", response[0]) for i, response in enumerate(responses)]
    with RewardFunction(
        {name: 1.0, "mine": 1.0}, timeout_s=10, num_workers=1,
        functions={name: spec(rewards_file, name), "mine": spec(rewards_file, "mine")},
    ) as reward_fn:  # fmt: skip
        results = reward_fn(responses, items)
    failed = [r for r in results if r.error]
    assert failed, "the error must be reported"
    for result in failed:
        assert f"reward function {name!r} on sample 's:" in result.error
        assert message in result.error
        assert result.components[name] == 0.0
    # the other function still counts: `mine` gives 2 when the answer is in the response
    assert [r.components["mine"] for r in results] == [2.0, 2.0]
    for result in results:
        assert result.reward == result.components[name] + result.components["mine"]
        assert not math.isnan(result.reward)


def test_on_error_raise_stops_naming_function_and_sample(rewards_file):
    with RewardFunction(
        {"bad": 1.0}, timeout_s=10, num_workers=1, on_error="raise",
        functions={"bad": spec(rewards_file, "mine_raises")},
    ) as reward_fn:  # fmt: skip
        with pytest.raises(RewardError, match=r"sample 's:0': reward function 'bad' on sample"):
            reward_fn(["a"], [trl_item("s:0", "a")])
    with pytest.raises(ValueError, match="on_error must be 'zero' or 'raise'"):
        RewardFunction({"math": 1.0}, on_error="ignore")


def test_a_hanging_batch_function_is_killed_and_every_sample_scores_zero(rewards_file):
    with RewardFunction(
        {"hang": 1.0, "mine": 1.0}, timeout_s=1, num_workers=1,
        functions={"hang": spec(rewards_file, "trl_hang"), "mine": spec(rewards_file, "mine")},
    ) as reward_fn:  # fmt: skip
        results = reward_fn(["a", "b"], [trl_item("h:0", "a"), trl_item("h:1", "b")])
        assert [r.error for r in results] == ["hang timed out after 1 s (batch of 2)"] * 2
        assert [r.reward for r in results] == [2.0, 2.0]
        assert reward_fn.pool.restarts == 1


def test_function_names_must_not_shadow_builtins_and_mix_with_them(rewards_file):
    with pytest.raises(ValueError, match=r"reward functions \['math'\] reuse a built-in"):
        RewardFunction({"math": 1.0}, functions={"math": spec(rewards_file, "mine")})
    with RewardFunction(
        {"math": 1.0, "mine": 0.5}, timeout_s=10, num_workers=1,
        functions={"mine": spec(rewards_file, "mine")},
    ) as reward_fn:  # fmt: skip
        [result] = reward_fn(["\\boxed{7}"], [PromptItem("m:0", "3+4?", "7")])
    # a built-in task verifier in the weights gives the verdict; the function only adds reward
    assert reward_fn.task_names == ["math"]
    assert result.correct and result.reward == 1.0 + 0.5 * 2.0


def test_config_names_a_malformed_spec():
    from cagrpo_ray.config.sections import RewardConfig

    with pytest.raises(ValueError, match=r"reward.functions.mine is 'rewards.py'; write"):
        RewardConfig(functions={"mine": "rewards.py"})
    assert RewardConfig(functions={"mine": "r.py:f"}).on_error == "zero"


def test_functions_pickle_as_names_only(rewards_file):
    import pickle

    function = load_reward_functions({"gsm": spec(rewards_file, "compute_score")})["gsm"]
    assert len(pickle.dumps(function)) < 1000
