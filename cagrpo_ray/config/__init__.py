"""The typed configuration: one tree, one place for defaults, loaded from YAML.

Every field has a default and a one-line description. Unknown keys are rejected, and a wrong
key or value fails before anything starts, with the dotted path of the key, what was given and
what is allowed:

    algorithm.policy_loss: 'cagrpo2' is not one of grpo, cagrpo, clip_cov, kl_cov

YAML files in `configs/` hold only what differs from these defaults. Command-line overrides
use dotted paths: `--set algorithm.lr=1e-6 --set rollout.group_size=8`.

`cagrpo_ray/learner/settings.py` is the one translation into the learner's and the loss's
settings (`learner_settings`, `loss_spec`).

Print the resolved tree with `python -m cagrpo_ray.config --config configs/cpu-tiny.yaml`.
"""

from cagrpo_ray.config.algorithm import DEFAULT_TIS_CAP
from cagrpo_ray.config.loading import (
    ConfigError,
    add_config_args,
    describe_fields,
    from_dict,
    load_config,
    main,
    parse_overrides,
    to_yaml,
)
from cagrpo_ray.config.sections import (
    AlgorithmConfig,
    ClusterConfig,
    Config,
    DataConfig,
    EnvConfig,
    EvalConfig,
    LearnerConfig,
    LoraConfig,
    MetricsConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    Section,
    SyncConfig,
)

__all__ = [
    "DEFAULT_TIS_CAP",
    "AlgorithmConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "LearnerConfig",
    "LoraConfig",
    "MetricsConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "Section",
    "SyncConfig",
    "add_config_args",
    "describe_fields",
    "from_dict",
    "load_config",
    "main",
    "parse_overrides",
    "to_yaml",
]
