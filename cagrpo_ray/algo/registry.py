"""The loss registry: a loss is one function and one name, and gets its options as one object.

`LossSpec` holds every option of every loss (the config's `algorithm` section, field by field:
`learner/settings.py`); `register_policy_loss` adds a loss under a name, which is then
an allowed `algorithm.policy_loss`. A registered loss sees one micro-batch as `LossInputs` and
returns its per-token loss [B, T] and metrics (and, if it clips the ratio, which tokens its
clip held); the losses themselves are in `losses.py`, which registers them when
`cagrpo_ray.algo` is imported. A loss also says what the token inspector shows of it: its
per-token fields (`INSPECTOR_FIELDS`) and the record column the page colours by default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

from torch import Tensor

from cagrpo_ray.algo.aggregation import LOSS_AGG_MODES
from cagrpo_ray.algo.batch_stats import BatchInputs, PreparedLoss, TokenStats, no_statistics
from cagrpo_ray.algo.kl_penalty import KL_ESTIMATORS
from cagrpo_ray.algo.registries import Registry
from cagrpo_ray.algo.stats import SCOPES

CAGRPO_KERNELS = ("normalized", "unnormalized", "ones", "positive", "negative")


@dataclass(frozen=True)
class LossSpec:
    """Every option of a policy loss, in one typed value. Each default is defined here once;
    the config's `algorithm.<option>` takes it from here.

    name: the registered loss ("grpo", "cagrpo", "clip_cov", "kl_cov", ...).
    loss_agg: how token losses aggregate (`aggregation.py`).
    clip_eps_low, clip_eps_high: PPO clip range [1 - eps_low, 1 + eps_high] (DAPO: 0.2, 0.28).
    clip_ratio_c: dual-clip bound c > 1 on the loss of a token with A < 0 (`ppo_clip`; verl's
        clip_ratio_c); None: off.
    cov_scope: CA-GRPO's token set S, "group" (a prompt group's tokens) or "batch".
    cagrpo_kernel: "normalized" (the paper's w~), or the ablations "unnormalized" (w),
        "ones" (every weight 1: GRPO bit for bit), "positive" and "negative" (w~ with the
        kernel on the tokens with c > 0, resp. c < 0, only; the others' w is 1).
    cagrpo_kappa: the kernel's width in units of sigma, w = exp(-c^2 / (2 kappa^2 sigma^2));
        1 is the paper's, infinity GRPO's (a controller may set it step by step:
        `algo/controllers.py`).
    clip_cov_ratio, clip_cov_lb, clip_cov_ub: Clip-Cov's fraction of tokens and covariance band.
    kl_cov_ratio, kl_cov_coef: KL-Cov's fraction of tokens and coefficient of |log r|.
    kl_coef: coefficient of the KL penalty to a reference policy (0: off).
    kl_estimator: its per-token estimator, "k1", "abs", "k2" or "k3" (`kl_penalty.py`).
    entropy_coef: entropy bonus (0: off).
    tis_cap: truncation of the behavior->proximal importance weight (None: no correction;
        see `off_policy.py`).
    """

    name: str = "cagrpo"
    loss_agg: str = "token-mean"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    cov_scope: str = "group"
    cagrpo_kernel: str = "normalized"
    cagrpo_kappa: float = 1.0
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        lookup_loss(self.name)
        for value, allowed, what in (
            (self.loss_agg, LOSS_AGG_MODES, "loss_agg"),
            (self.cagrpo_kernel, CAGRPO_KERNELS, "cagrpo_kernel"),
            (self.cov_scope, SCOPES, "cov_scope"),
            (self.kl_estimator, KL_ESTIMATORS, "kl_estimator"),
        ):
            if value not in allowed:
                raise ValueError(f"{what} {value!r} is not one of {', '.join(allowed)}")
        if not self.cagrpo_kappa > 0:
            raise ValueError(f"cagrpo_kappa must be positive, got {self.cagrpo_kappa}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ValueError(
                f"clip_ratio_c must be above 1 or None (off), got {self.clip_ratio_c}: at c <= 1 "
                "the bound would bind at r = 1 and cut every negative-advantage token's gradient"
            )
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be positive or None (off), got {self.tis_cap}")

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The fields other than `name` (each one an `algorithm.<field>` of the config)."""
        return tuple(f.name for f in fields(cls) if f.name != "name")


def as_spec(spec: LossSpec | str, options: dict) -> LossSpec:
    """A `LossSpec` from a spec or a loss name, with `options` (LossSpec fields) replaced."""
    unknown = set(options) - set(LossSpec.option_names())
    if unknown:
        raise TypeError(f"{sorted(unknown)} are not LossSpec options; those are "
                        f"{', '.join(LossSpec.option_names())}")  # fmt: skip
    if isinstance(spec, str):
        return LossSpec(spec, **options)
    return replace(spec, **options) if options else spec


@dataclass(frozen=True)
class LossInputs:
    """What a registered loss sees for one micro-batch; every tensor [B, T] unless noted."""

    logprobs: Tensor  # log pi(o_t), with gradient
    log_ratio: Tensor  # log r_t = log pi - log pi_old, 0 off the mask, clamped to +-20
    ratio: Tensor  # r_t
    advantages: Tensor  # [B, 1] A_i
    mask: Tensor  # float32 0/1
    num_valid: float  # valid tokens in this micro-batch
    prepared: PreparedLoss  # this micro-batch's rows of the batch statistics
    spec: LossSpec  # the loss's options


class TokenLoss(NamedTuple):
    """What a registered loss returns; a plain (loss, metrics) pair is one without clipping."""

    loss: Tensor  # [B, T] per-token loss
    metrics: dict[str, float]
    clipped: Tensor | None = None  # [B, T] bool: the loss's clip held the ratio (no gradient)


# The per-token fields a loss may show in the token inspector (inspect/records.py columns):
# CA-GRPO's kernel weight w~ (float), and the tokens Clip-Cov / KL-Cov selected (bool).
INSPECTOR_FIELDS = ("weight", "clip_cov", "kl_cov")

TokenLossFn = Callable[[LossInputs], TokenLoss | tuple[Tensor, dict[str, float]]]
StatisticsFn = Callable[[BatchInputs], TokenStats]
TokenFieldsFn = Callable[[PreparedLoss, Tensor], dict[str, Tensor]]


def no_token_fields(prepared: PreparedLoss, mask: Tensor) -> dict[str, Tensor]:
    return {}


@dataclass(frozen=True)
class RegisteredLoss:
    token_loss: TokenLossFn
    statistics: StatisticsFn
    token_fields: TokenFieldsFn
    shows: str  # the inspector column the page colours by default


POLICY_LOSSES: Registry[RegisteredLoss] = Registry("policy loss", takes=1)


def register_policy_loss(
    name: str,
    statistics: StatisticsFn = no_statistics,
    token_fields: TokenFieldsFn = no_token_fields,
    shows: str = "cov",
):
    """Register `fn(x: LossInputs) -> (per-token loss [B, T], metrics[, clipped [B, T]])`
    under `name`.

    `statistics(b: BatchInputs) -> TokenStats` computes what the loss needs from the whole
    batch (e.g. token weights); it runs once per batch in `prepare_loss_inputs`.
    `token_fields(prepared, mask [B, T]) -> {field: [B, T]}` gives the inspector the loss's
    own per-token values (keys from `INSPECTOR_FIELDS`), and `shows` the inspector column
    (e.g. "weight", "cov") its page colours the tokens by at first.
    """

    def decorator(fn: TokenLossFn) -> TokenLossFn:
        POLICY_LOSSES.add(name, RegisteredLoss(fn, statistics, token_fields, shows), fn)
        return fn

    return decorator


def lookup_loss(name: str) -> RegisteredLoss:
    """The registered loss `name`; an unknown name is an error that lists the known ones."""
    return POLICY_LOSSES.lookup(name)
