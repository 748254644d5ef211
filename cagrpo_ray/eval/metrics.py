"""Sample-based accuracy metrics: pass@k (Chen et al. 2021) and majority-vote maj@k."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from `n` samples of which `c` are correct.

    pass@k = 1 - C(n - c, k) / C(n, k), the probability that a random k-subset of the n
    samples holds at least one correct one (Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code", eq. 1). Computed as the product
    1 - prod_{i = n - c + 1}^{n} (1 - k / i), which avoids the huge binomials.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def normalize_answer(answer: str) -> str:
    """The form answers are grouped by for voting: whitespace runs collapsed, ends stripped."""
    return " ".join(answer.split())


def majority_answer(answers: Sequence[str | None]) -> int | None:
    """Index of the sample whose answer wins the vote; None if no sample has an answer.

    Samples without an answer (None) do not vote. Answers vote by `normalize_answer`, so
    equivalent answers spelled differently ("0.5" and "1/2") are different votes. Ties go to
    the answer that appears first among the samples.
    """
    votes = Counter(normalize_answer(a) for a in answers if a is not None)
    if not votes:
        return None
    most = max(votes.values())
    for index, answer in enumerate(answers):
        if answer is not None and votes[normalize_answer(answer)] == most:
            return index
    raise AssertionError("unreachable: some answer has the most votes")


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int | None = None) -> float:
    """1.0 if the majority answer of the first `k` samples is correct, else 0.0.

    `answers[i]` is sample i's extracted final answer (None: none given) and `correct[i]` its
    verifier verdict; the majority answer's verdict is that of its first sample (see
    `majority_answer` for the vote and the tie-break). No answer at all scores 0.
    """
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers but {len(correct)} verdicts")
    k = len(answers) if k is None else k
    if not 1 <= k <= len(answers):
        raise ValueError(f"need 1 <= k <= {len(answers)}, got k={k}")
    winner = majority_answer(answers[:k])
    return 0.0 if winner is None else float(bool(correct[winner]))


def k_values(samples: int) -> list[int]:
    """The k of the reported pass@k: 1, the powers of two below `samples`, and `samples`."""
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return [*ks, samples]
