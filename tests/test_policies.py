"""Small local policies: tokenizer, model files, warm start, cache, loading."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cagrpo_ray.data import PromptItem, ReasoningGymSource
from cagrpo_ray.policies import build
from cagrpo_ray.policies.accuracy import accuracy, extract_answer, is_correct
from cagrpo_ray.policies.build import (
    PRESETS,
    PolicySpec,
    ensure_policy,
    heldout_items,
    load_policy,
    resolve_policy,
)
from cagrpo_ray.policies.cache import cache_root
from cagrpo_ray.policies.model import PolicySize, new_policy, parameter_count, random_policy
from cagrpo_ray.policies.sft import (
    IGNORE,
    collate,
    encode_examples,
    response_loss,
    shared_prefix_length,
)
from cagrpo_ray.policies.tokenizer import R1_TAGS, char_tokenizer

# --- tokenizer ---------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "text",
    [
        "State the final answer to the following arithmetic problem: 98 + 93 - 77 =",
        "<think>98+93=191 191-77=114</think><answer>114</answer>",
        "tabs\tand\nnewlines  and  double spaces ",
        "unicode: é, ∑, 数学, 🙂",
    ],
)
def test_tokenizer_round_trips_text(text):
    tokenizer = char_tokenizer()
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.unit
def test_tokenizer_is_one_token_per_ascii_character_and_per_tag():
    tokenizer = char_tokenizer()
    assert len(tokenizer.encode("98 + 93 =")) == 9
    ids = tokenizer.encode("<think>1+2=3</think><answer>3</answer>")
    assert len(ids) == 5 + 4 + 1
    assert [tokenizer.convert_ids_to_tokens(i) for i in ids[:1]] == ["<think>"]
    # Tags are ordinary tokens: vLLM's and skip_special_tokens' decoding keep them.
    text = tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True)
    assert text == "<think>1+2=3</think><answer>3</answer>"
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert len(tokenizer) == 265
    assert tokenizer.convert_tokens_to_ids(list(R1_TAGS)) == [261, 262, 263, 264]


# --- model files -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory) -> Path:
    return random_policy(tmp_path_factory.mktemp("random") / "policy", seed=0)


@pytest.mark.unit
def test_random_policy_is_a_standard_hugging_face_checkpoint(random_dir):
    names = {p.name for p in random_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    config = json.loads((random_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (192, 3)
    generation = json.loads((random_dir / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(random_dir)
    assert generation["eos_token_id"] == tokenizer.eos_token_id == config["eos_token_id"]
    model = AutoModelForCausalLM.from_pretrained(random_dir)
    assert 1.7e6 < parameter_count(model) < 1.9e6


@pytest.mark.unit
def test_auto_tokenizer_loads_the_same_tokenizer(random_dir):
    # AutoTokenizer rebuilds qwen2 tokenizers from their vocabulary; it must come out the same.
    loaded, built = AutoTokenizer.from_pretrained(random_dir), char_tokenizer()
    text = "<s><|user|>State: 12 - 7 =\n<|assistant|><think>12-7=5</think><answer>5</answer></s>"
    assert loaded.encode(text) == built.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    messages = [{"role": "user", "content": "1 + 2 ="}]
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "<s><|user|>1 + 2 =<|assistant|>"
    )


@pytest.mark.unit
def test_random_policy_depends_on_the_seed_only(tmp_path):
    a, _ = new_policy(seed=5)
    b, _ = new_policy(seed=5)
    c, _ = new_policy(seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


@pytest.mark.unit
def test_head_size_vllm_cannot_run_is_refused():
    with pytest.raises(ValueError, match="head size 48"):
        PolicySize(hidden_size=192, num_heads=4)
    assert PolicySize(hidden_size=128, num_heads=2, num_layers=2).num_heads == 2


# --- warm start pieces -------------------------------------------------------------------------


def chain_items(n: int, seed: int = 0) -> list[PromptItem]:
    return list(ReasoningGymSource("chain_sum", PRESETS["chain_sum"].task_config, seed, n, "sft"))


@pytest.mark.unit
def test_labels_cover_the_response_and_eos_only():
    tokenizer = char_tokenizer()
    items = chain_items(3)
    targets = ["<think>x</think><answer>1</answer>", "<answer>22</answer>", "<answer>3</answer>"]
    examples = encode_examples(tokenizer, items, targets)
    batch = collate(examples, tokenizer.pad_token_id)
    for row, ((ids, prompt_length), target) in enumerate(zip(examples, targets, strict=True)):
        labelled = batch["labels"][row][batch["labels"][row] != IGNORE].tolist()
        assert tokenizer.decode(labelled) == target + tokenizer.eos_token
        assert batch["attention_mask"][row].sum() == len(ids)
        assert tokenizer.decode(ids[:prompt_length]).endswith("=<|assistant|>")


@pytest.mark.unit
def test_shared_prefix_forward_gives_the_full_forward_loss_and_gradients():
    torch.manual_seed(0)
    model, tokenizer = new_policy(seed=1, size=PolicySize(hidden_size=64, num_heads=2))
    items = chain_items(6)
    examples = encode_examples(
        tokenizer, items, ["<answer>1</answer>"] * 3 + ["<answer>12</answer>"] * 3
    )
    batch = collate(examples, tokenizer.pad_token_id)
    prefix = shared_prefix_length(examples)
    assert prefix >= 60  # "<s><|user|>State the final answer to the following ... problem: "
    full = response_loss(model, batch, prefix_length=0)
    full.backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    shared = response_loss(model, batch, prefix_length=prefix)
    shared.backward()
    assert shared.item() == pytest.approx(full.item(), rel=1e-5)
    for expected, p in zip(full_grads, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>1+2=3</think><answer>3</answer>", True),
        ("<think>1+2=3</think><answer> 3 </answer>", True),
        ("<answer>4</answer><answer>3</answer>", True),  # the last tagged answer counts
        ("<think>1+2=3</think>3", False),
        ("<answer>4</answer>", False),
        ("", False),
    ],
)
def test_answers_are_scored_by_reasoning_gym(response, expected):
    item = PromptItem("u", "... 1 + 2 =", "3", {"source_dataset": "chain_sum"})
    assert is_correct(response, item) is expected
    assert extract_answer("<answer>a</answer> x <answer>b</answer>") == "b"


# --- cache and loading -------------------------------------------------------------------------


@pytest.mark.unit
def test_spec_key_follows_every_field(monkeypatch, tmp_path):
    spec = PolicySpec()
    assert spec.key() == PolicySpec().key() and spec.key().startswith("chain_sum-")
    assert spec.with_budget(40).key() != spec.key()
    assert dataclasses.replace(spec, seed=1).key() != spec.key()
    assert PRESETS["chain_sum_hard"].key() != spec.key()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "cagrpo_ray" / "policies"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "cagrpo_ray" / "policies"


@pytest.mark.unit
def test_load_policy_takes_a_directory_and_passes_hub_names_through(random_dir):
    model, tokenizer = load_policy(random_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM" and tokenizer.eos_token == "</s>"
    assert resolve_policy(random_dir) == str(random_dir)
    assert resolve_policy("Qwen/Qwen2.5-Math-1.5B") == "Qwen/Qwen2.5-Math-1.5B"


@pytest.mark.unit
def test_preset_name_resolves_to_the_cached_build(monkeypatch, tmp_path):
    built = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(build, "SHIPPED", tmp_path / "none shipped")  # a preset that is built

    def fake_build(spec, out_dir, **_):
        built.append(spec)
        random_policy(out_dir)
        (Path(out_dir) / build.BUILD_INFO).write_text("{}")
        return Path(out_dir)

    monkeypatch.setattr(build, "build_policy", fake_build)
    path = resolve_policy("chain_sum")
    assert path == str(cache_root() / PRESETS["chain_sum"].key())
    assert resolve_policy("chain_sum") == path and len(built) == 1
    assert not list(cache_root().glob(".*building*"))


# --- builds (slow) -----------------------------------------------------------------------------


def clopper_pearson(successes: int, trials: int, confidence: float) -> tuple[float, float]:
    """Two-sided exact binomial interval, by bisection on the binomial tail."""

    def tail_at_least(k: int, p: float) -> float:
        return sum(
            math.comb(trials, j) * p**j * (1 - p) ** (trials - j) for j in range(k, trials + 1)
        )

    def solve(f, target) -> float:  # f increasing in p
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return (lo + hi) / 2

    alpha = (1 - confidence) / 2
    lower = 0.0 if successes == 0 else solve(lambda p: tail_at_least(successes, p), alpha)
    upper = (
        1.0 if successes == trials else solve(lambda p: tail_at_least(successes + 1, p), 1 - alpha)
    )
    return lower, upper


@pytest.mark.unit
def test_clopper_pearson_known_values():
    lower, upper = clopper_pearson(0, 256, 0.98)
    assert lower == 0 and upper == pytest.approx(1 - 0.01 ** (1 / 256), rel=1e-6)
    lower, upper = clopper_pearson(5, 10, 0.95)
    assert lower == pytest.approx(0.1871, abs=1e-4) and upper == pytest.approx(0.8129, abs=1e-4)


@pytest.mark.integration
@pytest.mark.preset
@pytest.mark.timeout(900)
def test_the_warm_started_preset_beats_random_init():
    """The preset every run starts from (built once into the shared cache, by `make test`'s
    background build or the first test that needs it) answers measurably more held-out prompts
    than its random initialisation."""
    spec = PRESETS["chain_sum"]
    path = ensure_policy(spec, progress=False)
    info = json.loads((path / build.BUILD_INFO).read_text())
    n = info["heldout_size"]
    _, held_out = heldout_items(spec)
    assert len(held_out) == n
    random_model, tokenizer = new_policy(spec.seed, spec.size)
    random_accuracy, _, _ = accuracy(
        random_model, tokenizer, held_out, sample=False, max_new_tokens=spec.max_new_tokens
    )
    # Measurably above: the exact 98% intervals of the two accuracies on the same n held-out
    # prompts do not overlap, so each side errs with probability at most 1%.
    built_low, _ = clopper_pearson(round(info["heldout_accuracy_greedy"] * n), n, 0.98)
    _, random_high = clopper_pearson(round(random_accuracy * n), n, 0.98)
    assert built_low > random_high, (info, random_accuracy)
    assert info["mean_sampled_response_tokens"] > 10
    # the recorded accuracy is the policy's own: recomputed from the cached weights
    model, _ = load_policy(path)
    greedy, _, _ = accuracy(model, tokenizer, held_out, sample=False,
                            max_new_tokens=spec.max_new_tokens)  # fmt: skip
    # (within 4 prompts: another thread count rounds differently and may flip a near-tie)
    assert greedy == pytest.approx(info["heldout_accuracy_greedy"], abs=4 / n)

    # Reused from the cache, loadable by name-or-dir.
    assert ensure_policy(spec, progress=False) == path
    assert parameter_count(model) == info["parameters"]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_build_is_deterministic_for_a_spec(tmp_path):
    spec = dataclasses.replace(PRESETS["chain_sum"].with_budget(4), eval_size=8, max_new_tokens=16)
    first = build.build_policy(spec, tmp_path / "a", progress=False, threads=1)
    second = build.build_policy(spec, tmp_path / "b", progress=False, threads=1)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    infos = [json.loads((p / build.BUILD_INFO).read_text()) for p in (first, second)]
    for key in ("heldout_accuracy_sampled", "heldout_accuracy_greedy", "example_responses"):
        assert infos[0][key] == infos[1][key]


@pytest.mark.unit
def test_a_hub_model_is_fetched_once_into_the_download_dir(tmp_path, monkeypatch):
    """The driver downloads; the actors get the folder (no hub access here: the download
    function is replaced by one that records its calls and writes a config)."""
    import huggingface_hub

    from cagrpo_ray.policies.build import HUB_FILES, resolve_policy

    calls = []

    def fake_download(repo_id, local_dir, allow_patterns):
        calls.append((repo_id, local_dir, allow_patterns))
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        (Path(local_dir) / "config.json").write_text("{}")
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    got = resolve_policy("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", tmp_path / "models")
    assert got == str(tmp_path / "models" / "deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B")
    assert calls == [("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", Path(got), HUB_FILES)]
    assert resolve_policy(got) == got  # the actors' view: a folder, loaded as it is
    assert resolve_policy("Qwen/Qwen2.5-Math-1.5B") == "Qwen/Qwen2.5-Math-1.5B"  # no dir: as is
    assert len(calls) == 1
