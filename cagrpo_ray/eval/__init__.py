"""Evaluation: pass@k, maj@k, length and entropy of a policy's samples on held-out prompts."""

from cagrpo_ray.eval.evaluate import evaluate, print_results
from cagrpo_ray.eval.metrics import maj_at_k, majority_answer, pass_at_k

__all__ = ["evaluate", "maj_at_k", "majority_answer", "pass_at_k", "print_results"]
