"""Controllers that set a loss option step by step from what the run measures, behind one
registry.

A controller is built from the recipe's options (`register_controller(name)`: `fn(spec:
RecipeSpec) -> controller`) and has four methods: `loss_options()`, the `LossSpec` options
the next learner step uses; `observe(metrics)`, which takes that step's learner metrics and
returns what to log beside them; `state()` and `from_state(state)` for checkpoints.

`KappaController` steers CA-GRPO's kernel width kappa (`LossSpec.cagrpo_kappa`) to hold the
policy's token entropy within a band around its starting value:

    H_0      = the learner's mean token entropy at the first step it sees
    r_t      = H_t / H_0
    kappa_{t+1} = clip(kappa_t * e^{+rate},  kappa_range)    if r_t > band_high
                  clip(kappa_t * e^{-rate},  kappa_range)    if r_t < band_low
                  kappa_t                                      otherwise

A wide kernel (kappa -> infinity) weights every token 1, which is GRPO, whose entropy falls as
it trains; a narrow one down-weights the extreme-covariance tokens, which slows that fall (and
at this project's CPU scale reverses it: docs/results/evidence-round1.md). The controller moves
between the two only when entropy leaves the band, so inside it the loss is a fixed-kappa
CA-GRPO. The kappa of step t is decided from the entropies of steps before t (the entropy of a
step is measured on its batch before the update).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from cagrpo_ray.algo.registries import Registry

CONTROLLERS: Registry[Callable] = Registry("controller", takes=1)


def register_controller(name: str):
    """Register `fn(spec: RecipeSpec) -> controller` (see the module docstring) under `name`."""

    def decorator(fn: Callable) -> Callable:
        CONTROLLERS.add(name, fn, fn)
        return fn

    return decorator


@dataclass
class KappaController:
    kappa: float  # the value the next step uses
    band: tuple[float, float] = (0.85, 1.15)
    rate: float = 0.1
    kappa_range: tuple[float, float] = (0.25, 64.0)
    reference_entropy: float | None = None  # H_0, set by the first update

    def __post_init__(self) -> None:
        low, high = self.band
        if not 0 < low < 1 < high:
            raise ValueError(f"band must satisfy 0 < low < 1 < high, got {self.band}")
        if not self.rate > 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if not 0 < self.kappa_range[0] <= self.kappa <= self.kappa_range[1]:
            raise ValueError(f"kappa {self.kappa} must lie in kappa_range {self.kappa_range}")

    def update(self, entropy: float) -> float:
        """Take step t's mean token entropy; return the kappa of step t + 1."""
        if not math.isfinite(entropy) or entropy < 0:
            raise ValueError(f"entropy must be a finite non-negative number, got {entropy}")
        if self.reference_entropy is None:
            if entropy == 0:
                return self.kappa  # nothing to be relative to yet
            self.reference_entropy = float(entropy)
        ratio = entropy / self.reference_entropy
        low, high = self.band
        direction = 1 if ratio > high else -1 if ratio < low else 0
        lowest, highest = self.kappa_range
        self.kappa = min(highest, max(lowest, self.kappa * math.exp(direction * self.rate)))
        return self.kappa

    def loss_options(self) -> dict[str, float]:
        """The next step's options: its kernel width."""
        return {"cagrpo_kappa": self.kappa}

    def observe(self, metrics: dict[str, float]) -> dict[str, float]:
        """Step t's learner metrics in (its mean token entropy); t's kappa out, to log."""
        used = self.kappa
        self.update(metrics["entropy/mean"])
        return {"cagrpo/kappa": used}

    def state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> KappaController:
        state = dict(state)
        state["band"], state["kappa_range"] = tuple(state["band"]), tuple(state["kappa_range"])
        return cls(**state)


@register_controller("kappa_entropy")
def kappa_entropy(spec) -> KappaController:
    """CA-GRPO's kappa held to an entropy band (`algorithm.kappa_control: entropy`)."""
    return KappaController(
        spec.cagrpo_kappa, spec.kappa_entropy_band, spec.kappa_rate, spec.kappa_range
    )
