"""The single-rank Learner: its update, its log-probs, micro-batch invariance, checkpoints.

These tests run DeepSpeed in the test process as a world of one rank (gloo); the two-rank
checks are in test_learner_group.py. With no cluster and no clock to answer, the integration
ones are `beside` tests: `make test` runs them at nice 19 beside the Ray tests (conftest.py).
"""

from __future__ import annotations

import math
import socket

import pytest
import torch
from transformers import AutoModelForCausalLM

from cagrpo_ray.algo import LossSpec, group_advantages, policy_loss
from cagrpo_ray.learner.batch import check_batch, group_sizes, position_ids
from cagrpo_ray.learner.learner import Learner
from cagrpo_ray.learner.settings import LearnerSettings
from cagrpo_ray.policies.model import random_policy

TINY = dict(hidden_size=64, num_layers=2, num_heads=1, intermediate_size=128)


def random_batch(
    num_groups: int = 8,
    group_size: int = 4,
    width: int = 24,
    vocab: int = 17,
    seed: int = 0,
    shared_prompts: bool = False,
) -> dict[str, torch.Tensor]:
    """A learner batch (docs/architecture.md) of random tokens: prompts of 3 to 7 tokens,
    responses of 1 to width - 8 tokens, right-padded, 0/1 rewards; with `shared_prompts`
    a group's rows share one prompt."""
    g = torch.Generator().manual_seed(seed)
    rows = num_groups * group_size
    prompt = torch.randint(3, 8, (rows,), generator=g)
    response = torch.randint(1, width - 8, (rows,), generator=g)
    columns = torch.arange(width)
    input_ids = torch.randint(3, vocab, (rows, width), generator=g)
    if shared_prompts:  # a group's rows share its first row's prompt, as rollouts do
        first = torch.arange(num_groups).repeat_interleave(group_size) * group_size
        prompt = prompt[first]
        input_ids = torch.where(columns < prompt[:, None], input_ids[first], input_ids)
    attention = (columns < (prompt + response)[:, None]).long()
    response_mask = (columns >= prompt[:, None]) & attention.bool()
    batch = {
        "input_ids": input_ids * attention,
        "attention_mask": attention,
        "response_mask": response_mask,
        "behavior_logprobs": -torch.rand(rows, width, generator=g) * response_mask,
        "rewards": torch.randint(0, 2, (rows,), generator=g).float(),
        "group_ids": torch.arange(num_groups).repeat_interleave(group_size),
        "policy_version": torch.zeros(rows, dtype=torch.long),
    }
    # scored groups carry their advantages (computed once, when the rewards come in)
    batch["advantages"] = group_advantages(batch["rewards"], group_size)
    return batch


def hf_logprobs(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """Independent reference: log-probs at the token from a plain HF forward, full width."""
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=position_ids(batch["attention_mask"]),
        ).logits.double()
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    picked = logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0)).float()


def hf_model(path, weights: dict[str, torch.Tensor] | None = None):
    """The policy at `path`, with `weights` (by HF name, as the learner exports them) loaded."""
    model = AutoModelForCausalLM.from_pretrained(path)
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    return model.eval()


def settings_at(path, **options) -> LearnerSettings:
    """Settings of a learner of the policy at `path`: the lr in full from the first step (no
    warm-up) unless `options` say otherwise."""
    return LearnerSettings(str(path), **{"warmup_steps": 0, **options})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory):
    return random_policy(tmp_path_factory.mktemp("policy"), seed=0, **TINY)


@pytest.fixture(scope="session")
def one_rank():
    """Arguments for learners that are rank 0 of 1 in the test process. The first one creates
    the process group and the rest reuse it; it stays for the session, because DeepSpeed keeps
    references to it that a destroyed and re-created group would not replace."""
    return dict(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())


# ----------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_check_batch_names_the_missing_key_and_the_bad_shape():
    batch = random_batch()
    del batch["group_ids"]
    with pytest.raises(ValueError, match="group_ids"):
        check_batch(batch)
    batch = random_batch()
    batch["response_mask"] = batch["response_mask"][:, :-1]
    with pytest.raises(ValueError, match="response_mask"):
        check_batch(batch)
    batch = random_batch(num_groups=2, group_size=3)
    batch["group_ids"][-1] = 2  # groups of 3, then 2 and 1
    with pytest.raises(ValueError, match="one size"):
        check_batch(batch)


@pytest.mark.unit
def test_group_sizes_requires_contiguous_groups():
    assert group_sizes(torch.tensor([3, 3, 5, 5, 5])).tolist() == [2, 3]
    with pytest.raises(ValueError, match="contiguous"):
        group_sizes(torch.tensor([0, 0, 1, 0]))


@pytest.mark.unit
def test_position_ids_count_real_tokens_only():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    assert position_ids(mask).tolist() == [[0, 1, 2, 2], [0, 0, 1, 2]]


# ----------------------------------------------------------------------------- DeepSpeed


def snapshot(learner: Learner) -> dict[str, torch.Tensor]:
    return learner.state_dict_for_sync()


@pytest.mark.integration
@pytest.mark.beside
def test_step_lowers_the_surrogate_and_reports_metrics(policy_path, one_rank, tmp_path):
    batch = random_batch()
    temperature = 0.7
    before = hf_model(policy_path)
    # Behavior log-probs from an independent HF forward: the learner's recomputation under
    # ZeRO-3 must agree with them.
    batch["behavior_logprobs"] = hf_logprobs(before, batch, temperature) * batch["response_mask"]
    learner = Learner(
        settings_at(
            policy_path, zero_stage=3, lr=1e-3, micro_batch_size=8, temperature=temperature
        ),
        LossSpec("cagrpo"),
        **one_rank,
    )
    initial = snapshot(learner)
    metrics = learner.train_step(batch)

    assert metrics["logprob/mismatch_max"] < 1e-5
    for key in (
        "loss/total",
        "policy/loss",
        "policy/clip_frac",
        "cagrpo/weight_min",
        "cagrpo/weight_p01",
        "cov/pos_1pct",
        "entropy/mean",
        "logprob/mismatch_mean",
        "grad_norm",
        "lr",
        "learner/tokens",
        "time/train_step_s",
    ):
        assert key in metrics, key
    assert metrics["learner/tokens"] == float(batch["response_mask"].sum())
    assert metrics["lr"] == pytest.approx(1e-3)
    assert 0 < metrics["entropy/mean"] <= torch.log(torch.tensor(before.config.vocab_size)) + 1e-4
    assert metrics["grad_norm"] > 0

    after = snapshot(learner)
    assert after.keys() == initial.keys()
    assert any(not torch.equal(after[k], initial[k]) for k in after)

    # The CA-GRPO surrogate, evaluated independently on the weights before and after.
    mask = batch["response_mask"]
    old = hf_logprobs(before, batch, temperature)
    new = hf_logprobs(hf_model(policy_path, after), batch, temperature)
    advantages = batch["advantages"]

    def surrogate(logprobs):
        return policy_loss("cagrpo", logprobs, old, advantages, mask, batch["group_ids"]).loss

    assert surrogate(new) < surrogate(old) - 1e-4

    # The Hugging Face export of the ZeRO-3 partitioned model holds the whole weights.
    exported = AutoModelForCausalLM.from_pretrained(learner.save_hf(tmp_path / "hf"))
    for name, value in after.items():
        assert torch.equal(exported.state_dict()[name], value), name


@pytest.mark.integration
@pytest.mark.beside
def test_reference_kl_and_entropy_bonus_under_zero3(policy_path, one_rank):
    learner = Learner(
        settings_at(
            policy_path,
            zero_stage=3,
            lr=1e-2,
            micro_batch_size=16,
            ref_model_path=str(policy_path),
        ),
        LossSpec("grpo", kl_coef=0.1, entropy_coef=0.01),
        **one_rank,
    )
    first = learner.train_step(random_batch(seed=4))
    assert first["kl/ref_k3"] == pytest.approx(0.0, abs=1e-7)  # policy == reference
    second = learner.train_step(random_batch(seed=4))
    assert second["kl/ref_k3"] > 1e-5
    expected = second["policy/loss"] + 0.1 * second["kl/ref_k3"] - 0.01 * second["entropy/mean"]
    assert second["loss/total"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.integration
@pytest.mark.beside
def test_micro_batches_give_the_update_of_one_batch(policy_path, one_rank):
    batch = random_batch(num_groups=8, group_size=4)
    lr = 1e-3
    results = []
    for micro_batch_size in (32, 8, 7):  # one pass; four; five with an uneven last one
        learner = Learner(
            settings_at(policy_path, zero_stage=2, lr=lr, micro_batch_size=micro_batch_size),
            LossSpec("cagrpo", loss_agg="token-mean"),
            **one_rank,
        )
        metrics = learner.train_step(batch)
        results.append((metrics, snapshot(learner)))
    (whole, whole_params), *split = results
    for metrics, params in split:
        # Adam's first step is about lr * sign(g): the loss and the gradient norm check the
        # scale, the parameters check the direction.
        assert metrics["loss/total"] == pytest.approx(whole["loss/total"], rel=1e-5, abs=1e-7)
        assert metrics["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
        for name, value in params.items():
            torch.testing.assert_close(value, whole_params[name], rtol=0, atol=0.02 * lr)


@pytest.mark.unit
@pytest.mark.parametrize("micro_batch_size", [32, 8])
def test_shared_prompts_give_the_update_of_one_row_per_response(
    policy_path, one_rank, micro_batch_size
):
    """A group's prompt run once with its responses packed after it (`share_prompts`) gives
    the step of one padded row per response: the same loss, gradient norm, log-probs and
    update, in one pass (the fused proximal pass) and in micro-batches of two groups."""
    from cagrpo_ray.learner.packing import pack_prompts

    batch = random_batch(num_groups=8, group_size=4, seed=5, shared_prompts=True)
    lr = 1e-3
    results = []
    for share in (False, True):
        learner = Learner(
            settings_at(policy_path, lr=lr, micro_batch_size=micro_batch_size, share_prompts=share),
            LossSpec("cagrpo", loss_agg="token-mean"),
            **one_rank,
        )
        if share:  # the cost model does pack this batch's micro-batches
            rows = learner.passes.micro_batches(
                batch["attention_mask"].sum(1), groups=batch["group_ids"]
            )[0]
            packed = pack_prompts(
                batch["input_ids"][rows],
                batch["attention_mask"][rows],
                batch["response_mask"][rows],
                batch["group_ids"][rows],
                learner.engine.module.packing_cost,
            )
            assert packed is not None and packed.input_ids.shape[0] < rows.numel()
        metrics = learner.train_step(batch)
        results.append((metrics, snapshot(learner)))
    (rows_metrics, rows_params), (packed_metrics, packed_params) = results
    for name in ("loss/total", "grad_norm", "entropy/mean", "logprob/mismatch_mean"):
        assert packed_metrics[name] == pytest.approx(rows_metrics[name], rel=1e-5, abs=1e-7), name
    # Adam's first step is about lr * sign(g): a gradient element within rounding of 0 may
    # step either way (at most 2 lr apart); every other element takes the same step.
    gap = torch.cat([(v - rows_params[n]).abs().flatten() for n, v in packed_params.items()])
    assert gap.max() <= 2.05 * lr
    assert (gap > 0.02 * lr).float().mean() <= 1e-3


@pytest.mark.integration
@pytest.mark.beside
def test_checkpoint_round_trip_repeats_the_step(policy_path, one_rank, tmp_path):
    learner = Learner(
        settings_at(policy_path, zero_stage=2, lr=1e-3, warmup_steps=3, micro_batch_size=16),
        LossSpec("grpo", tis_cap=2.0),
        **one_rank,
    )
    learner.train_step(random_batch(seed=1))  # optimizer moments and lr schedule under way
    learner.save_checkpoint(tmp_path / "ckpt", {"data_cursor": 7})
    noise_after_save = torch.rand(3)
    first = learner.train_step(random_batch(seed=2))
    first_params = snapshot(learner)

    client_state = learner.load_checkpoint(tmp_path / "ckpt")
    assert client_state == {"data_cursor": 7}
    assert learner.step == 1
    assert torch.equal(torch.rand(3), noise_after_save)
    second = learner.train_step(random_batch(seed=2))
    assert second["lr"] == first["lr"] == pytest.approx(1e-3 * 2 / 3)
    assert second["tis/weight_mean"] == first["tis/weight_mean"]
    for name, value in snapshot(learner).items():
        assert torch.equal(value, first_params[name]), name

    # The Hugging Face export holds the same weights.
    out = learner.save_hf(tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(out)
    for name, value in snapshot(learner).items():
        assert torch.equal(exported.state_dict()[name], value), name
    assert (out / "tokenizer.json").exists() or (out / "tokenizer_config.json").exists()


# ------------------------------------------------------------------- several updates per batch


def several_updates(policy_path, one_rank, loss="cagrpo", micro=32, **settings):
    return Learner(
        settings_at(
            policy_path, zero_stage=2, lr=1e-2, micro_batch_size=micro, **settings
        ),  # fmt: skip
        LossSpec(loss, clip_eps_low=0.1, clip_eps_high=0.1),
        **one_rank,
    )


@pytest.mark.integration
@pytest.mark.beside
def test_epochs_and_mini_batches_move_the_ratio_and_the_clip_binds(policy_path, one_rank):
    batch = random_batch(num_groups=8, group_size=4, seed=5)
    one = several_updates(policy_path, one_rank).train_step(batch)
    assert one["policy/ratio_max"] == 1.0 and one["policy/clip_frac"] == 0.0  # on-policy
    assert "policy/ratio_max_last" not in one  # one update: its own metrics, unchanged

    learner = several_updates(policy_path, one_rank, ppo_epochs=2, mini_batches=2)
    metrics = learner.train_step(batch)
    assert metrics["learner/updates"] == 4.0
    # from the second update on the policy has moved away from the one that scored the batch
    assert metrics["policy/ratio_max_last"] > 1.01
    assert metrics["policy/clip_frac_last"] > 0.0
    assert metrics["policy/approx_kl_last"] > 0.0
    # the step's statistics are the rollout batch's, computed once
    assert metrics["learner/tokens"] == one["learner/tokens"]
    assert metrics["cov/std"] == one["cov/std"]


@pytest.mark.integration
@pytest.mark.beside
def test_mini_batch_updates_do_not_depend_on_the_micro_batch_size(policy_path, one_rank):
    batch = random_batch(num_groups=8, group_size=4, seed=6)
    results = []
    for micro in (16, 5):  # one micro-batch per mini-batch; four, uneven
        learner = several_updates(policy_path, one_rank, micro=micro, mini_batches=2)
        results.append((learner.train_step(batch), snapshot(learner)))
    (a, params_a), (b, params_b) = results
    assert a["loss/total"] == pytest.approx(b["loss/total"], rel=1e-5, abs=1e-7)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for name, value in params_a.items():
        torch.testing.assert_close(value, params_b[name], rtol=0, atol=1e-3 * 2)


@pytest.mark.integration
@pytest.mark.beside
def test_kernel_weights_from_the_rollout_or_the_current_policy(policy_path, one_rank):
    batch = random_batch(num_groups=8, group_size=4, seed=7)
    snapshots = {}
    for token_stats in ("rollout", "minibatch"):
        learner = several_updates(policy_path, one_rank, mini_batches=2, token_stats=token_stats)
        metrics = learner.train_step(batch)
        assert metrics["learner/updates"] == 2.0
        snapshots[token_stats] = snapshot(learner)
    # the first update is the same; the second's weights come from different log-probs
    differs = [
        not torch.equal(snapshots["rollout"][n], snapshots["minibatch"][n])
        for n in snapshots["rollout"]
    ]
    assert any(differs)


@pytest.mark.integration
@pytest.mark.beside
def test_the_policy_change_of_a_step_is_measured(policy_path, one_rank):
    batch = random_batch(seed=8)
    learner = several_updates(policy_path, one_rank, measure_policy_change=True)
    metrics = learner.train_step(batch)
    assert metrics["policy/kl_step"] > 0.0  # k3: never negative, 0 only if nothing moved
    assert math.isfinite(metrics["policy/kl_step_k1"])  # k1: unbiased on sampled tokens only
    quiet = several_updates(policy_path, one_rank).train_step(batch)
    assert "policy/kl_step" not in quiet


@pytest.mark.integration
@pytest.mark.beside
def test_zero3_gathers_the_output_head_once_per_pass_however_many_logits_chunks(tmp_path, one_rank):
    """The head runs once per chunk of positions (`TokenLogprobs`); under ZeRO-3 a module's
    parameters are gathered when it runs and may be released after, so a head gathered per
    chunk would cost a full all-gather of it per chunk (~18 a pass for the 7B recipe's 1 GB
    head). DeepSpeed (0.19.8) registers the head's weight as an external parameter of the
    log-prob module, which keeps it gathered for its whole pass: counted here, the head is
    partitioned as often in a step whose logits run in 16-position chunks (dozens of head
    calls, a different number each step) at most as often as with one chunk, and the
    log-probs stay the recomputed ones. (At most, not exactly: once DeepSpeed's recorded module
    trace holds, it also keeps a parameter it sees reused within `max_reuse_distance`, and
    whether the trace holds depends on the head calls of each micro-batch, so the chunked
    passes may release the head less often.)"""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    # above DeepSpeed's persistence threshold (1e5 elements), so the head is partitioned
    path = random_policy(tmp_path / "policy", seed=0, hidden_size=512, num_layers=2,
                         num_heads=8, intermediate_size=512)  # fmt: skip
    cls = coordinator.PartitionedParameterCoordinator
    release = cls._PartitionedParameterCoordinator__release_param
    counts = {"released": 0, "calls": 0}
    head_weight = {}

    def counting_release(self, param, *args, **kwargs):
        out = release(self, param, *args, **kwargs)
        if param is head_weight.get("w") and param.ds_status == ZeroParamStatus.NOT_AVAILABLE:
            counts["released"] += 1
        return out

    per_setting = {}
    cls._PartitionedParameterCoordinator__release_param = counting_release
    try:
        for mib in (0.05, 1024.0):  # 16 positions a chunk; one chunk
            learner = Learner(
                settings_at(path, zero_stage=3, lr=1e-3, micro_batch_size=8,
                                logits_chunk_mib=mib, gradient_checkpointing=True),
                LossSpec("cagrpo"), **one_rank,
            )  # fmt: skip
            head = learner.engine.module.policy.get_output_embeddings()
            head_weight["w"] = head.weight
            hook = head.register_forward_pre_hook(
                lambda *_: counts.update(calls=counts["calls"] + 1)
            )
            steps = []
            for step in range(3):
                before = hf_model(path, snapshot(learner))
                batch = random_batch(seed=step, width=40 + 16 * step)  # other widths each step
                batch["behavior_logprobs"] = hf_logprobs(before, batch) * batch["response_mask"]
                counts.update(released=0, calls=0)
                metrics = learner.train_step(batch)
                assert metrics["logprob/mismatch_max"] < 1e-5
                steps.append((counts["released"], counts["calls"]))
            hook.remove()
            per_setting[mib] = steps
    finally:
        cls._PartitionedParameterCoordinator__release_param = release
    one, many = per_setting[1024.0], per_setting[0.05]
    assert all(calls >= 4 * one_calls for (_, calls), (_, one_calls) in zip(many, one, strict=True))
    assert len({calls for _, calls in many}) > 1  # the chunk count changed between steps
    # a head gathered per chunk would be released about once per call, dozens a step
    assert all(r <= one_r for (r, _), (one_r, _) in zip(many, one, strict=True)), per_setting
    assert all(r > 0 for r, _ in one)  # the head is partitioned between passes at all
