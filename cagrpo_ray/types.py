"""What an engine is asked for (`SamplingConfig`) and what it returns per sample (`Completion`).

The records shared by `env/` (an episode samples turns and returns a `Completion`), `rollout/`
(the engines, the generator and its pool) and `eval/`: they sit below all three, so that none
of those packages imports another to reach them. This module imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingConfig:
    """What an engine needs to sample.

    `temperature == 0` means greedy decoding. `top_k = 0` and `top_p = 1.0` disable those
    filters, which is what the learner assumes when it recomputes log-probs as
    `log_softmax(logits / temperature)`.
    """

    n: int = 1  # samples per prompt (the GRPO group size G)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    max_tokens: int = 64  # completion tokens
    seed: int | None = None  # None: the engine's own seeded stream
    # Strings that end a sample besides the end of sequence (a multi-turn episode's tool call,
    # `cagrpo_ray/env`); the stop string stays in the sample, finish_reason "stop".
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingConfig.n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens must be at least 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Completion:
    """One sampled response.

    `logprobs[t]` is the behavior log-prob of `token_ids[t]` under the distribution it was
    sampled from: `log_softmax(logits / temperature)` after the top-k / top-p filters
    (renormalised over the kept tokens), and `log_softmax(logits)` when greedy.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]  # sampled response tokens (eos included when sampled)
    logprobs: list[float]  # behavior log-prob of each sampled token, same length
    text: str  # decoded response (special tokens kept, e.g. <think>)
    finish_reason: str  # "stop" | "length"
    policy_version: int  # version of the weights that sampled its first token (its oldest)
    # In-flight weight updates (rollout.weight_update = "in_flight"): (t, v) when tokens t..
    # were sampled by version v, one pair per load the response spanned; empty otherwise.
    loads: list[tuple[int, int]] = field(default_factory=list)
    # A multi-turn episode (`cagrpo_ray/env`): `token_ids` holds the policy's turns and the
    # environment's replies in order; `from_policy[t]` says who wrote token t (None: the
    # policy wrote every token, as in a single-turn response). Environment tokens carry
    # log-prob 0 and are never trained on.
    from_policy: list[bool] | None = None
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
