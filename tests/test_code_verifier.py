"""The code verifier's sandbox against hostile solutions: each scores 0, the caller stays fine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import psutil
import pytest

from cagrpo_ray.rewards import RewardFunction, SandboxLimits, run_solution
from cagrpo_ray.rewards import sandbox as sandbox_module
from cagrpo_ray.rewards.verifiers import code_tests, verify_code

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = pytest.mark.clock

LIMITS = SandboxLimits(wall_s=2.0)
SLACK_S = 1.5
DOUBLE = "n = int(input())\nprint(2 * n)\n"
FORK_BOMB = (
    "import os\nwhile True:\n    try:\n        os.fork()\n    except BaseException:\n        pass\n"
)
DOUBLE_ITEM = {
    "uid": "double",
    "answer": "",
    "metadata": {"test_cases": [{"input": "2\n", "output": "4"}, {"input": "21", "output": "42"}]},
}


def fenced(code: str) -> str:
    return f"<think>easy</think><answer>```python\n{code}```</answer>"


def harness_processes() -> list[int]:
    """The sandbox interpreters still running that this process started (its descendants) or
    that outlived their parent (orphans, adopted by init); not those of another pytest-xdist
    worker, which runs its own sandbox tests at the same time."""
    ours = {child.pid for child in psutil.Process().children(recursive=True)}
    return [
        process.pid
        for process in psutil.process_iter(["cmdline", "ppid"])
        if any("sandbox_harness.py" in part for part in process.info["cmdline"] or ())
        and (process.pid in ours or process.info["ppid"] == 1)
    ]


@pytest.mark.unit
def test_a_right_solution_passes_every_case():
    run = run_solution(DOUBLE, ["2\n", "21"], limits=LIMITS)
    assert run.outputs == ["4\n", "42\n"] and run.case_status == ["ok", "ok"]
    assert run.isolation in ("namespace", "audit-hook")
    assert verify_code(fenced(DOUBLE), DOUBLE_ITEM, LIMITS) == 1.0
    assert verify_code(fenced("print(4)\n"), DOUBLE_ITEM, LIMITS) == 0.5
    assert verify_code("no code here", DOUBLE_ITEM, LIMITS) == 0.0


@pytest.mark.unit
def test_stdin_reading_styles_and_whitespace_insensitive_outputs():
    code = (
        "import sys\ndata = sys.stdin.buffer.read().split()\n"
        "sys.stdout.buffer.write(b' '.join(data[::-1]))"
    )
    item = {"metadata": {"test_cases": json.dumps([{"input": "1 2\n3", "output": "3\n2  1\n"}])}}
    assert verify_code(fenced(code), item, LIMITS) == 1.0
    apps_shape = {"metadata": {"test_cases": {"inputs": ["5\n"], "outputs": ["10\n"]}}}
    assert verify_code(fenced(DOUBLE), apps_shape, LIMITS) == 1.0


@pytest.mark.unit
def test_assert_style_tests():
    item = {"metadata": {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}}
    assert verify_code(fenced("def add(a, b):\n    return a + b\n"), item, LIMITS) == 1.0
    assert (
        verify_code(fenced("def add(a, b):\n    return a + b if a > 0 else 1\n"), item, LIMITS)
        == 0.5
    )
    assert verify_code(fenced("def add(a, b):\n    raise ValueError\n"), item, LIMITS) == 0.0


@pytest.mark.unit
def test_an_item_without_tests_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="no metadata\\['test_cases'\\]"):
        code_tests({"uid": "q1", "metadata": {}})


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "code", "status"),
    [
        ("crash", "raise RuntimeError('boom')", "RuntimeError"),
        ("exit code", "import sys; print(4); sys.exit(3)", "SystemExit(3)"),
        ("syntax", "def f(:\n", "did not finish"),
        ("memory", "x = bytearray(8 << 30)\nprint(4)", "MemoryError"),
        ("fork", "import os\nos.fork()\nprint(4)", "PermissionError"),
        ("subprocess", "import subprocess\nsubprocess.run(['true'])\nprint(4)", "ImportError"),
        ("system", "import os\nos.system('true')\nprint(4)", "PermissionError"),
        ("ctypes", "import ctypes\nprint(4)", "ImportError"),
        ("kill parent", "import os\nos.kill(os.getppid(), 9)", "PermissionError"),
        ("flood", "while True:\n    print('x' * 4096)", "output limit"),
        ("write outside", "open('/tmp/cagrpo-escape', 'w').write('x')", "PermissionError"),
        (
            "caller's environ",
            "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())",
            "PermissionError",
        ),
    ],
)
def test_hostile_solutions_fail_cleanly(name, code, status):
    run = run_solution(code, ["2\n"], limits=LIMITS)
    assert run.case_status == [status], name
    assert not run.timed_out
    assert not os.path.exists("/tmp/cagrpo-escape")


@pytest.mark.unit
def test_infinite_loop_and_sleep_are_cut_at_the_wall_clock_limit():
    for code in ("while True:\n    pass\n", "import time\ntime.sleep(3600)\n"):
        start = time.monotonic()
        run = run_solution(code, ["2\n", "3\n"], limits=LIMITS)
        assert time.monotonic() - start < LIMITS.wall_s + SLACK_S
        assert run.timed_out and run.case_status == ["did not finish"] * 2
    assert not harness_processes()


@pytest.mark.unit
def test_a_flood_past_the_python_level_cap_is_cut_by_the_caller():
    code = "import os\nwhile True:\n    os.write(1, b'x' * 65536)\n"  # fd 1 is /dev/null here
    run = run_solution(code, ["2\n"], limits=LIMITS)
    assert run.outputs == [None] and run.timed_out
    assert not harness_processes()


@pytest.mark.unit
def test_a_fork_bomb_scores_zero_and_leaves_no_process():
    assert verify_code(fenced(FORK_BOMB), DOUBLE_ITEM, LIMITS) == 0.0
    bomb = (
        "import multiprocessing\nwhile True:\n    multiprocessing.Process(target=print).start()\n"
    )
    assert verify_code(fenced(bomb), DOUBLE_ITEM, LIMITS) == 0.0
    assert not harness_processes()


@pytest.mark.unit
def test_the_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("CAGRPO_FAKE_SECRET", "hunter2-do-not-leak")
    code = "import os\nprint(sorted(os.environ.items()))\n"
    run = run_solution(code, [""], limits=LIMITS)
    assert run.case_status == ["ok"]
    assert "hunter2" not in run.outputs[0] and "CAGRPO_FAKE_SECRET" not in run.outputs[0]
    # Only what the interpreter sets for itself (UTF-8 locale coercion), nothing inherited.
    assert set(eval(run.outputs[0])) <= {("LC_CTYPE", "C.UTF-8")}


@pytest.fixture
def listening_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server.getsockname()[1]
    server.close()


@pytest.mark.unit
def test_sockets_fail(listening_port):
    code = (
        "import socket\n"
        f"socket.create_connection(('127.0.0.1', {listening_port}), timeout=1)\n"
        "print('connected')\n"
    )
    run = run_solution(code, [""], limits=LIMITS)
    assert run.case_status == ["PermissionError"] and run.outputs == [""]


def kernel_allows_network_namespaces() -> bool:
    flags = ["-n"] if os.geteuid() == 0 else ["-r", "-n"]
    try:
        return subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


@pytest.mark.unit
@pytest.mark.skipif(not kernel_allows_network_namespaces(), reason="no network namespaces here")
def test_the_child_gets_its_own_network_namespace_where_the_kernel_allows():
    assert run_solution("print(1)", [""], limits=LIMITS).isolation == "namespace"


@pytest.mark.unit
def test_sockets_fail_without_a_network_namespace_too(monkeypatch, listening_port):
    monkeypatch.setattr(sandbox_module, "_enter_network_namespace", lambda: None)
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {listening_port}))\n"
    run = run_solution(code, [""], limits=LIMITS)
    assert run.isolation == "audit-hook"
    assert run.case_status == ["PermissionError"]


@pytest.mark.unit
def test_the_working_directory_is_private_and_removed():
    code = "import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())\n"
    run = run_solution(code, [""], limits=LIMITS)
    workdir = run.outputs[0].strip()
    assert run.case_status == ["ok"] and "cagrpo-sandbox-" in workdir
    assert not os.path.exists(workdir)


@pytest.mark.unit
def test_hostile_code_through_the_reward_function_leaves_the_caller_healthy():
    hostile = [
        "while True:\n    pass\n",
        FORK_BOMB,
        "while True:\n    print('flood' * 1000)\n",
        "raise SystemExit(1)\n",
        DOUBLE,
    ]
    with RewardFunction({"code": 1.0}, timeout_s=3.0, num_workers=2) as reward_fn:
        reward_fn.pool.wait_ready()
        start = time.monotonic()
        results = reward_fn([fenced(code) for code in hostile], [DOUBLE_ITEM] * len(hostile))
        assert time.monotonic() - start < 3 * 3.0  # three rounds at most on two workers
        assert [r.reward for r in results] == [0.0, 0.0, 0.0, 0.0, 1.0]
        assert [r.correct for r in results] == [False] * 4 + [True]
        assert all(r.error is None for r in results)  # the sandbox's deadline, not the pool's
        assert reward_fn.pool.restarts == 0
    assert not harness_processes()


@pytest.mark.unit
def test_the_interpreters_start_is_not_the_solutions_time(tmp_path, monkeypatch):
    # A harness that takes 1.5 s to start (a loaded machine): a solution with a 1 s budget
    # still runs, its clock starting at the harness's first report; a start past `start_s`
    # is the sandbox's failure, said as one.
    slow = tmp_path / "sandbox_harness.py"
    slow.write_text(
        "import runpy, time\ntime.sleep(1.5)\n"
        f"runpy.run_path({str(sandbox_module.HARNESS)!r}, run_name='__main__')\n"
    )
    monkeypatch.setattr(sandbox_module, "HARNESS", slow)
    run = run_solution(DOUBLE, ["2\n"], limits=SandboxLimits(wall_s=1.0))
    assert run.outputs == ["4\n"] and run.case_status == ["ok"] and not run.timed_out
    hang = run_solution("while True:\n    pass\n", ["2\n"], limits=SandboxLimits(wall_s=1.0))
    assert hang.timed_out and hang.case_status == ["did not finish"]
    with pytest.raises(RuntimeError, match="sent no report .* timed out"):
        run_solution(DOUBLE, ["2\n"], limits=SandboxLimits(wall_s=1.0, start_s=0.5))
    assert not harness_processes()
