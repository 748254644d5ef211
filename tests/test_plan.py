"""The launch planner: model shapes, placement on nodes and GPUs, per-GPU memory estimates,
the fit verdict and the command line. The estimates are checked against measurements on CPU
in test_plan_memory.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cagrpo_ray.config import load_config
from cagrpo_ray.plan import ClusterShape, ModelShapeError, PlanError, check, plan, render, to_json
from cagrpo_ray.plan.cli import main
from cagrpo_ray.plan.layout import place
from cagrpo_ray.plan.memory import GiB, kv_bytes_per_token, learner_memory
from cagrpo_ray.plan.shapes import model_shape

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
R1_1_5B = str(CONFIGS / "gpu-r1-distill-1.5b.yaml")
R1_7B = str(CONFIGS / "gpu-7b-multinode.yaml")
ONE_NODE = ClusterShape(nodes=1, gpus_per_node=8, gpu_memory_gib=80)
TWO_NODES = ClusterShape(nodes=2, gpus_per_node=8, gpu_memory_gib=80)


def gpu_config(**overrides):
    """The 1.5B recipe with `section.key=value` overrides (dots as double underscores)."""
    return load_config(R1_1_5B, [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()])


def by_role(result, role):
    return [g for g in result.gpus if g.slot.role == role]


# ----------------------------------------------------------------------------- shapes


def test_recipe_models_have_their_published_parameter_counts():
    small = model_shape("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B")
    assert (small.layers, small.hidden_size, small.num_kv_heads) == (28, 1536, 2)
    assert small.parameters() == 1_777_088_000  # the model card's 1.78 B
    big = model_shape("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B")
    assert big.parameters() == 7_615_616_512  # 7.62 B
    assert not big.tied_embeddings and big.qkv_bias
    assert "config.json" in big.source


def test_a_folder_model_reads_its_config_json_and_counts_like_torch(tmp_path):
    from cagrpo_ray.policies.model import PolicySize, new_policy, parameter_count, random_policy

    size = dict(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256)
    folder = random_policy(tmp_path / "policy", seed=0, **size)
    shape = model_shape(str(folder))
    assert shape.source.endswith("config.json")
    assert shape.parameters() == parameter_count(new_policy(0, PolicySize(**size))[0])


def test_a_preset_is_read_without_building_it():
    from cagrpo_ray.policies.model import PolicySize, new_policy, parameter_count

    shape = model_shape("chain_sum")
    assert shape.parameters() == parameter_count(new_policy(0, PolicySize())[0])
    assert shape.vocab_size == 265 and shape.tied_embeddings


def test_online_a_hub_config_is_downloaded_and_llama_has_no_qkv_bias(monkeypatch):
    import transformers

    llama_3_8b = dict(  # meta-llama/Meta-Llama-3-8B's config.json
        model_type="llama",
        num_hidden_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    )
    config = type("Config", (), {"to_dict": lambda self: llama_3_8b})()
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda name: config)
    shape = model_shape("meta-llama/Meta-Llama-3-8B", online=True)
    assert not shape.qkv_bias and shape.kv_width == 1024
    assert shape.parameters() == 8_030_261_248  # the published 8.03 B


def test_an_unknown_hub_model_names_the_file_to_extend(tmp_path):
    with pytest.raises(ModelShapeError, match="models.json"):
        model_shape("someone/unknown-model-7B")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelShapeError, match="no config.json"):
        model_shape(str(tmp_path / "empty"))


# ----------------------------------------------------------------------------- the recipes


def test_the_1_5b_recipe_fits_one_node_of_80_gb():
    """Per GPU, as planned (GiB; P = 1,777,088,000 parameters, N = 4 learner ranks):

    GPUs 0-3, generator replicas (TP 1): vLLM's share 68.0 (0.85 x 80) = weights 3.31 (2P)
      + activations 3.86 (profile of 16384 tokens, sampler over 1024 sequences) + CUDA graphs
      2.00 + KV cache 58.83, which holds 430 sequences of 5120 tokens (28 KiB a token).
    GPUs 4-7, ZeRO-2 learner ranks: 20.19 = resident weights 3.31 (2P) + gradients 1.66
      (4P/N, fp32 partition) + optimizer 4.97 (12P/N) + CUDA context 1.50; then the larger of
      backward 8.76 (reduce bucket 1.76, activations 4.11 for 4 x 5120 tokens with
      checkpointing, logits 2.87, batch 0.02) and step 1.66 (AdamW's 4P/N temporary).
    """
    result = plan(load_config(R1_1_5B), ONE_NODE)
    assert result.fits, result.problems
    assert [g.slot.role for g in result.gpus] == ["generator"] * 4 + ["learner"] * 4
    p, n = 1_777_088_000, 4
    learner = by_role(result, "learner")[0].estimate
    states = sum(learner.component(c).bytes for c in ("weights", "gradients", "optimizer"))
    # Hand check against DeepSpeed's estimate_zero2_model_states_mem_needs: 2P + 18P/N
    # (bf16 weights and gradients, fp32 gradients, master and Adam). The learner accumulates in
    # fp32 straight into the partition, so between steps it holds 2P + 16P/N, and at the step
    # AdamW adds a 4P/N temporary: DeepSpeed's number lies in between.
    assert states == pytest.approx(2 * p + 16 * p / n, abs=8)
    assert states < 2 * p + 18 * p / n < states + learner.component("optimizer_step").bytes
    assert learner.total / GiB == pytest.approx(20.19, abs=0.01)
    generator = by_role(result, "generator")[0].estimate
    assert kv_bytes_per_token(model_shape(load_config(R1_1_5B).model.path), 2, 1) == (
        2 * 28 * 2 * 128 * 2  # keys and values, 28 layers, 2 KV heads of 128, bf16
    )
    assert generator.component("kv_cache").bytes / GiB == pytest.approx(58.83, abs=0.01)
    assert int(generator.detail["kv_sequences"]) == 430


def test_the_7b_recipe_fits_two_nodes_of_80_gb():
    result = plan(load_config(R1_7B), TWO_NODES)
    assert result.fits, result.problems
    assert {g.slot.node for g in by_role(result, "generator")} == {0}
    assert {g.slot.node for g in by_role(result, "learner")} == {1}
    learner = by_role(result, "learner")[0].estimate
    p, n = 7_615_616_512, 8
    # ZeRO-3: bf16 weights, fp32 gradient partition, master and moments all split 8 ways
    assert learner.component("optimizer").bytes == pytest.approx(12 * p / n, abs=8)
    assert learner.component("gradients").bytes == pytest.approx(4 * p / n, abs=8)
    assert learner.total < 40 * GiB
    assert by_role(result, "generator")[0].estimate.detail["kv_sequences"] > 100
    check(load_config(R1_7B), TWO_NODES)  # does not raise


def test_checkpointing_and_micro_batch_size_move_the_activations():
    on = learner_memory(gpu_config(), model_shape("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"))
    off = learner_memory(
        gpu_config(learner__gradient_checkpointing="false"),
        model_shape("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"),
    )
    ratio = off.component("activations").bytes / on.component("activations").bytes
    assert ratio > 10  # 28 layers kept whole instead of their inputs and one layer


# ----------------------------------------------------------------------------- not fitting


def test_an_oversized_micro_batch_is_rejected_naming_the_component_and_the_gpu():
    config = gpu_config(learner__micro_batch_size=64, learner__gradient_checkpointing="false")
    result = plan(config, ONE_NODE)
    assert not result.fits
    assert not any(g.fits for g in by_role(result, "learner"))
    (problem,) = result.problems
    assert "node 0 GPU 4 (learner rank 0)" in problem and "activations" in problem
    with pytest.raises(PlanError, match="activations"):
        check(config, ONE_NODE)


def test_a_small_gpu_is_rejected():
    result = plan(load_config(R1_1_5B), ClusterShape(1, 8, gpu_memory_gib=16))
    assert not result.fits
    assert "of 16.0 GiB" in result.problems[0] and "learner rank 0" in result.problems[0]


def test_a_kv_cache_without_room_for_one_sequence_is_rejected():
    result = plan(gpu_config(rollout__gpu_memory_utilization=0.1), ONE_NODE)
    problem = next(p for p in result.problems if "generator" in p)
    assert "node 0 GPU 0 (generator 0 (TP rank 0/1)) and 3 more" in problem
    assert "kv_cache" in problem and "rollout.max_model_len 5120" in problem


# ----------------------------------------------------------------------------- placement


def test_tp_groups_stay_on_one_node_and_learners_are_packed():
    config = gpu_config(
        rollout__num_generators=4, rollout__tensor_parallel_size=3, learner__num_learners=4
    )
    slots, problems = place(config, TWO_NODES)
    assert not problems
    assert len({(s.node, s.gpu) for s in slots}) == len(slots) == 16
    for replica in range(4):
        group = [s for s in slots if s.role == "generator" and s.index == replica]
        assert len({s.node for s in group}) == 1
        assert sorted(s.tp_rank for s in group) == [0, 1, 2]
    # two replicas of 3 per node leave 2 GPUs on each: the learners fill node 0 first
    learners = [
        (s.node, s.gpu) for s in sorted(slots, key=lambda s: s.index) if s.role == "learner"
    ]
    assert learners == [(0, 6), (0, 7), (1, 6), (1, 7)]


def test_learners_fill_nodes_in_order():
    config = gpu_config(rollout__num_generators=2, learner__num_learners=10)
    slots, problems = place(config, TWO_NODES)
    assert not problems
    nodes = [s.node for s in sorted(slots, key=lambda s: s.index) if s.role == "learner"]
    assert nodes == [0] * 6 + [1] * 4


def test_impossible_layouts_are_named():
    _, problems = place(gpu_config(learner__num_learners=5), ONE_NODE)
    assert problems == [problems[0]] and "learner rank 4 needs a GPU" in problems[0]
    _, problems = place(gpu_config(rollout__tensor_parallel_size=16), TWO_NODES)
    assert "generator replica 0 needs 16 GPUs on one node" in problems[0]
    assert "nodes have 8" in problems[0]
    fragmented = gpu_config(rollout__num_generators=3, rollout__tensor_parallel_size=3)
    _, problems = place(fragmented, ClusterShape(2, 4))
    assert "generator replica 2 needs 3 GPUs on one node" in problems[0]
    assert "node 0 has 1 left" in problems[0]
    result = plan(gpu_config(learner__num_gpus_per_learner=2), ONE_NODE)
    assert "learner.num_gpus_per_learner 2: a learner rank uses one GPU" in result.problems[0]


def test_the_cluster_shape_from_ray_counts_alive_gpu_nodes():
    head = {"Alive": True, "Resources": {"CPU": 8.0}}
    worker = {"Alive": True, "Resources": {"CPU": 64.0, "GPU": 8.0}}
    dead = {"Alive": False, "Resources": {"GPU": 8.0}}
    assert ClusterShape.from_ray(80, [head, worker, worker, dead]) == ClusterShape(2, 8, 80)
    odd = ClusterShape.from_ray(40, [worker, {"Alive": True, "Resources": {"GPU": 4.0}}])
    assert odd.node_gpus == (8, 4) and odd.total_gpus == 12


def test_the_cpu_default_plans_cpu_actors_only():
    result = plan(load_config())
    assert result.fits and result.gpus == [] and result.cluster is None
    assert [role for role, _ in result.cpu_actors] == [
        "generator 0",
        "generator 1",
        "learner rank 0",
        "learner rank 1",
    ]
    assert "on CPUs" in render(result)
    assert to_json(result)["gpus"] == []


# ----------------------------------------------------------------------------- command line


def test_the_cli_prints_one_line_per_gpu_and_exits_0_when_it_fits(capsys):
    assert main(["--config", R1_1_5B, "--nodes", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("learner rank") == 4 and out.count("(TP rank 0/1)") == 4
    assert out.rstrip().endswith("fits")


def test_the_cli_json_has_fits_and_gpus_with_role_and_gib(capsys):
    assert main(["--config", R1_7B, "--nodes", "2", "--json"]) == 0
    plan_json = json.loads(capsys.readouterr().out)
    assert plan_json["fits"] is True and plan_json["problems"] == []
    assert len(plan_json["gpus"]) == 16
    first = plan_json["gpus"][0]
    assert first["role"] == "generator 0 (TP rank 0/1)" and (first["node"], first["gpu"]) == (0, 0)
    assert first["total_gib"] == pytest.approx(68.0)
    learner = plan_json["gpus"][-1]
    assert learner["role"] == "learner rank 7" and 20 < learner["total_gib"] < 40
    assert {c["name"] for c in learner["components"]} >= {"weights", "optimizer", "activations"}


def test_the_cli_process_prints_only_json_on_stdout():
    done = subprocess.run(
        [sys.executable, "-m", "cagrpo_ray.plan", "--config", R1_1_5B, "--nodes", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["fits"] is True


def test_the_cli_exit_codes(capsys):
    oversized = ["--set=learner.micro_batch_size=64", "--set=learner.gradient_checkpointing=false"]
    assert main(["--config", R1_1_5B, "--nodes", "1", *oversized]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "node 0 GPU 4" in out and "activations" in out
    assert main(["--config", R1_1_5B, "--nodes", "1", "--gpu-memory-gib", "16", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["fits"] is False
    assert main(["--config", R1_1_5B]) == 0  # the recipe names its cluster
    capsys.readouterr()
    assert main(["--config", R1_1_5B, "--set", "cluster.nodes=null"]) == 2  # no cluster known
    assert "cluster.nodes is not set" in capsys.readouterr().err
    assert main(["--config", R1_1_5B, "--nodes", "0"]) == 2  # cluster.nodes must be >= 1
    assert main(["--set", "learner.nope=1"]) == 2
    assert main(["--set", "model.path=someone/unknown-model", "--nodes", "1"]) == 2
    assert "models.json" in capsys.readouterr().err
    assert main([]) == 0
