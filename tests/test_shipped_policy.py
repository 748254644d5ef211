"""The default preset's build ships with the package (`cagrpo_ray/policies/shipped/`): a run
of `chain_sum` starts from it on every machine instead of building it (229 s of one core on a
fresh machine), so long as the recipe's key is the shipped one's; and it is what the recipe
builds: a rebuild gives the same weights, bit for bit, on a CPU of the capability it was built
on (the float kernels, and so the last bits of a warm start, differ between AVX2 and AVX512).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from cagrpo_ray.policies import build
from cagrpo_ray.policies.build import PRESETS, resolve_policy, shipped_policy
from cagrpo_ray.policies.cache import BUILD_INFO

SPEC = PRESETS["chain_sum"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shipped_facts() -> tuple[Path, dict]:
    path = shipped_policy(SPEC)
    assert path is not None, (
        f"no shipped build of chain_sum's current key {SPEC.key()} in {build.SHIPPED} (the "
        "recipe changed?): python -m cagrpo_ray.policies.build --task chain_sum --ship"
    )
    return path, json.loads((path / build.SHIPPED_INFO).read_text())


@pytest.mark.unit
def test_the_default_preset_ships_under_its_current_key_and_is_taken_as_it_is(monkeypatch):
    path, facts = shipped_facts()
    assert json.loads((path / BUILD_INFO).read_text())["key"] == SPEC.key() == facts["key"]
    assert sha256(path / "model.safetensors") == facts["model_sha256"]

    def no_build(*args, **kwargs):
        raise AssertionError("a shipped preset was built")

    monkeypatch.setattr(build, "build_policy", no_build)
    assert resolve_policy("chain_sum") == str(path)
    # the rest of a model folder, as a build writes it, for transformers and vLLM
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names


@pytest.mark.integration
@pytest.mark.beside
@pytest.mark.early  # one thread for ~4 minutes
def test_a_rebuild_reproduces_the_shipped_weights(tmp_path):
    path, facts = shipped_facts()
    here = {"torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability()}
    there = {"torch": facts["torch"], "capability": facts["torch_cpu_capability"]}
    if here != there:
        pytest.skip(
            f"the shipped chain_sum was built with {there}; this machine has {here}: its "
            "rebuild's last bits differ by design (other float kernels), so it is not compared"
        )
    rebuilt = build.build_policy(
        SPEC, tmp_path / "rebuilt", progress=False, threads=facts["threads"]
    )
    assert sha256(rebuilt / "model.safetensors") == facts["model_sha256"]
    mine = json.loads((rebuilt / BUILD_INFO).read_text())
    theirs = json.loads((path / BUILD_INFO).read_text())
    for key in (
        "sft_steps_run",
        "final_loss",
        "heldout_accuracy_sampled",
        "heldout_accuracy_greedy",
    ):
        assert mine[key] == theirs[key], key
