"""How CPU generator replicas share out a node's cores (`cpu_engine_env`)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from cagrpo_ray.rollout.engines import cpu_engine_env

pytestmark = pytest.mark.unit


def cores_of(worker: str) -> list[int]:
    first, _, last = worker.partition("-")
    return list(range(int(first), int(last or first) + 1))


@pytest.mark.parametrize("cores", [1, 2, 3, 8])
@pytest.mark.parametrize("replicas,tp", [(1, 1), (2, 1), (2, 2), (4, 1), (3, 2)])
def test_cpu_replicas_share_out_the_cores(cores, replicas, tp):
    rollout = SimpleNamespace(tensor_parallel_size=tp, num_generators=replicas)
    binds = [cpu_engine_env(rollout, r, cores)["VLLM_CPU_OMP_THREADS_BIND"]
             for r in range(replicas)]  # fmt: skip
    workers = [w for bind in binds for w in bind.split("|")]
    assert all(len(bind.split("|")) == tp for bind in binds)  # one binding per TP worker
    used = [c for w in workers for c in cores_of(w)]
    assert all(0 <= c < cores for c in used)
    if replicas * tp <= cores:  # every worker has cores of its own, as many as the others
        assert len(used) == len(set(used))
        assert len({len(cores_of(w)) for w in workers}) == 1
        assert len(cores_of(workers[0])) == cores // (replicas * tp)
    else:  # one core each, round robin over all of them
        assert [cores_of(w) for w in workers] == [[k % cores] for k in range(replicas * tp)]


@pytest.mark.parametrize(
    "bind, user, want",
    [
        ("1", None, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
                     "OMP_PLACES": "{1}", "OMP_PROC_BIND": "true"}),
        ("0-1", None, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2",
                       "OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}),
        ("auto", None, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),  # vLLM's own threads
        ("0-1", "1", {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}),  # the user's worker process
    ],
)  # fmt: skip
def test_a_one_worker_replica_binds_its_engine_core_as_vllm_binds_a_worker(
    monkeypatch, bind, user, want
):
    from cagrpo_ray.rollout.vllm_engine import one_process_cpu_worker

    names = ["VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND"]
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # as Ray sets it in an actor: replaced
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    if user is not None:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", user)
    one_process_cpu_worker()
    got = {name: os.environ[name] for name in names if name in os.environ}
    assert got == {"OMP_NUM_THREADS": "7", **want}
