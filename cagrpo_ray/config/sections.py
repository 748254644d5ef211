"""The typed configuration tree: one section per role, every field with a default and a one-line
description (the help of `python -m cagrpo_ray.config --describe`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from cagrpo_ray.config.algorithm import AlgorithmConfig
from cagrpo_ray.config.section import Section

# Every linear layer of attention and MLP in Llama, Qwen2 and Mistral-style models.
DEFAULT_LORA_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)


NODE_LABELS_HELP = (
    "Ray node labels that the node of {what} must carry, e.g. {{'ray.io/node-group': "
    "'{group}'}} (Ray sets ray.io/node-group from RAY_NODE_TYPE_NAME, as KubeRay does for each "
    "worker group; `ray start --labels` sets others). Empty: any node."
)


class RunConfig(Section):
    name: str = Field("cpu-tiny", description="Run name; outputs go to <output_dir>/<name>.")
    output_dir: str = Field("runs", description="Folder for checkpoints, metrics and plots.")
    mode: Literal["sync", "async"] | None = Field(
        None,
        description="Shorthand for run.max_staleness: sync is 0 (generate, score, train, sync in "
        "turn; on-policy), async is 1 unless max_staleness says otherwise. sync with a "
        "max_staleness above 0 is an error.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="The most policy versions a trained sample may lag the learner. 0 is the "
        "synchronous schedule; above 0 generators keep sampling while the learner trains. "
        "Generation that would exceed it is not started; groups that exceed it anyway are "
        "dropped and counted. Unset (or null): from run.mode, 1 for async, else 0.",
    )
    seed: int = Field(0, description="Seed for data order, sampling and learner RNG.")
    steps: int = Field(40, ge=1, description="Learner steps (one optimizer step each).")
    checkpoint_every: int = Field(
        10, ge=0, description="Checkpoint every K steps (0: only at the end)."
    )
    keep_checkpoints: int = Field(2, ge=1, description="How many most recent checkpoints to keep.")
    # 3: on preemptible nodes a process is lost every few hours, a few times in a long run;
    # a rank that dies again and again (out of memory at one step, a bad node) is not cured by
    # another attempt, and 3 bounds what it wastes to about 3 * checkpoint_every steps.
    max_restarts: int = Field(
        3,
        ge=0,
        description="How often a lost learner rank is recovered inside the job: the learner "
        "group is rebuilt from the latest checkpoint, the schedule rewinds to it and the "
        "generators, which stay up, get its weights. The loss after that stops the run (exit "
        "status 1, the checkpoint intact). 0: the first loss stops it.",
    )
    eval_every: int = Field(
        0, ge=0, description="Evaluate every K steps (0: only before and after)."
    )
    wait_warn_s: float = Field(
        60.0,
        gt=0,
        description="A wait longer than this (seconds) is logged with what it waits for.",
    )
    ray_num_cpus: int | None = Field(
        None, description="CPUs for a local Ray cluster started by the run (None: all)."
    )
    placement_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long Ray may take to reserve every actor's GPUs and CPUs before the run "
        "gives up (nodes still starting, or another job holding them).",
    )
    save_policy: Literal["checkpoints", "end", "never"] = Field(
        "checkpoints",
        description="Write the trained policy as a Hugging Face model directory (safetensors, "
        "config, tokenizer): with every checkpoint and at the end (<run>/policy), only at the "
        "end, or never.",
    )

    @model_validator(mode="before")
    @classmethod
    def _staleness_from_mode(cls, data: Any) -> Any:
        """run.max_staleness, when the input leaves it unset, from run.mode; a sync mode with a
        bound above 0 is refused."""
        if not isinstance(data, dict):
            return data
        mode, bound = data.get("mode"), data.get("max_staleness")
        if mode == "sync" and bound not in (None, 0):
            raise ValueError(
                f"run.mode 'sync' is run.max_staleness 0, but run.max_staleness is "
                f"{bound}: drop run.mode (a bound above 0 is asynchronous) or set "
                "run.max_staleness to 0"
            )
        if bound is None:
            return {**data, "max_staleness": 1 if mode == "async" else 0}
        return data

    @property
    def asynchronous(self) -> bool:
        return bool(self.max_staleness)


class LoraConfig(Section):
    rank: int = Field(
        0,
        ge=0,
        description="LoRA rank r (0: full fine-tuning). Above 0 the learner trains only a "
        "low-rank adapter on the frozen base, and the weight sync moves only the adapter.",
    )
    alpha: float = Field(
        16.0, gt=0, description="LoRA alpha: the adapter's update is scaled by alpha / rank."
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter's input (0 keeps the recomputed log-probs equal to "
        "the generators').",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        min_length=1,
        description="Names of the linear layers that get an adapter (the default: every linear "
        "layer of attention and MLP of Llama, Qwen2 and Mistral-style models).",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class ModelConfig(Section):
    path: str = Field(
        "chain_sum",
        description="Policy: a built-in small-policy preset (chain_sum, chain_sum_hard, "
        "chain_sum_tools; built on "
        "first use and cached), the built-in pretrained smollm2-135m-instruct (converted once "
        "from its wheel's GGUF file), a local HF model directory, a local .gguf file, or a hub "
        "name.",
    )
    gguf_file: str | None = Field(
        None,
        description="A GGUF file in the model.path folder, converted once to a cached HF folder.",
    )
    download_dir: str | None = Field(
        None,
        description="For a hub model: the driver downloads it here once and every actor loads "
        "from this folder (put it on a volume all nodes mount). None: each process resolves "
        "the hub name itself.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Parameter dtype of learners and generators alike (bfloat16: fp32 master "
        "weights and gradient accumulation; float16 would need loss scaling, not implemented).",
    )
    lora: LoraConfig = Field(
        default_factory=LoraConfig, description="Low-rank adapters (LoRA) instead of full weights."
    )


class DataConfig(Section):
    source: Literal["reasoning_gym", "file"] = Field(
        "reasoning_gym", description="Where prompts come from."
    )
    dataset: str = Field("chain_sum", description="reasoning_gym dataset name.")
    dataset_config: dict[str, Any] = Field(
        default_factory=dict, description="reasoning_gym dataset options (e.g. min_terms)."
    )
    seed: int = Field(
        0, description="Base seed of the prompt splits (train and eval lie far apart)."
    )
    train_size: int = Field(20_000, ge=1, description="Number of distinct training prompts.")
    eval_size: int = Field(200, ge=1, description="Number of held-out evaluation prompts.")
    path: str | None = Field(
        None,
        description="Parquet or JSONL file, or a datasets folder (save_to_disk), when source is "
        "'file'.",
    )
    eval_path: str | None = Field(None, description="Held-out file when source is 'file'.")
    format: Literal["auto", "plain", "verl", "trl", "openrlhf"] = Field(
        "auto",
        description="Layout of the files: auto (detected from the columns), plain, verl, trl "
        "or openrlhf (cagrpo_ray/data/files.py).",
    )
    question_column: str | None = Field(
        None,
        description="Column holding the prompt, text or chat messages; dotted for nested "
        "columns (None: the layout's: prompt, input, or problem/prompt/question).",
    )
    answer_column: str | None = Field(
        None,
        description="Column holding the reference answer; dotted for nested columns (None: "
        "the layout's: reward_model.ground_truth for verl, label for openrlhf, else answer).",
    )
    on_bad_row: Literal["skip", "error"] = Field(
        "skip", description="What a malformed data row does: skipped (and counted) or an error."
    )
    instruction: str = Field(
        "r1",
        description="Instruction before each problem: 'r1' (the R1 reasoning instruction), "
        "'none', or the text itself. Templates of the small policies leave it out.",
    )
    few_shot: list[dict[str, str]] = Field(
        default_factory=list,
        description="Example turns between the instruction and each problem, as chat "
        "messages ({role: user|assistant, content: ...}), e.g. a worked tool call; needs a "
        "chat template.",
    )

    @model_validator(mode="after")
    def _files_named(self) -> DataConfig:
        if self.source == "file" and (self.path is None or self.eval_path is None):
            missing = [k for k in ("path", "eval_path") if getattr(self, k) is None]
            raise ValueError(
                f"data.source 'file' needs data.path and data.eval_path; missing: "
                f"{', '.join('data.' + k for k in missing)}"
            )
        for i, message in enumerate(self.few_shot):
            if set(message) != {"role", "content"} or message["role"] not in ("user", "assistant"):
                raise ValueError(
                    f"data.few_shot[{i}] is {message!r}; each is {{role: user or assistant, "
                    "content: text}"
                )
        return self


class RolloutConfig(Section):
    engine: Literal["vllm", "hf"] = Field("vllm", description="Generation engine.")
    num_generators: int = Field(2, ge=1, description="Generator replicas (Ray actors).")
    num_cpus_per_generator: float = Field(0.5, gt=0, description="Ray CPUs per generator.")
    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description=NODE_LABELS_HELP.format(what="each generator replica", group="generators"),
    )
    num_gpus_per_generator: float = Field(
        0.0,
        ge=0,
        description="GPUs per tensor-parallel worker of a generator replica (a replica holds "
        "tensor_parallel_size of them, on one node).",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism per replica.")
    prompts_per_step: int = Field(16, ge=1, description="Prompts per learner step.")
    group_size: int = Field(8, ge=2, description="Responses sampled per prompt (G).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    max_tokens: int = Field(64, ge=1, description="Completion tokens per response.")
    max_model_len: int = Field(256, ge=8, description="Prompt + completion tokens (vLLM).")
    kv_cache_gib: float = Field(1.0, gt=0, description="vLLM CPU KV-cache size in GiB.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM GPU memory share.")
    enforce_eager: bool = Field(False, description="vLLM without torch.compile: a faster start.")
    chunk_prompts: int = Field(
        4, ge=1, description="Prompts per generation request; small chunks balance replicas."
    )
    weight_update: Literal["drain", "in_flight"] = Field(
        "drain",
        description="How a replica loads new weights: drain (its requests in flight finish "
        "first, then it loads) or in_flight (vLLM only: they are frozen, the weights loaded, "
        "their KV recomputed and they go on; a response's staleness is its first token's).",
    )
    max_prompts_in_flight: int = Field(
        0,
        ge=0,
        description="Prompts one replica may hold at once (0: as many as the staleness bound "
        "admits). Each replica's engine batches all of them.",
    )
    max_turns: int = Field(
        1,
        ge=1,
        description="Policy turns per episode (1: single-turn). Above 1 a turn that ends in a "
        "tool call (the env section) gets the tool's result and the policy goes on; "
        "max_tokens then bounds the whole episode after the prompt, tool results included.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_truncated_sampling(cls, data: Any) -> Any:
        """rollout.top_p and rollout.top_k are gone: name them and say why."""
        named = [f"rollout.{k}" for k in ("top_p", "top_k") if isinstance(data, dict) and k in data]
        if named:
            raise ValueError(
                f"{' and '.join(named)}: removed. Training samples from the "
                "full softmax at rollout.temperature, because the learner computes its log-probs "
                "with the full softmax: truncated sampling (vLLM's log-probs renormalised over "
                "the kept tokens) would bias algorithm.tis_cap's weights and train another "
                "policy than the one sampled. Remove the key (evaluation's own top_p/top_k are "
                "options of python -m cagrpo_ray.eval)"
            )
        return data


class EnvConfig(Section):
    """The environment of multi-turn episodes (`rollout.max_turns` > 1; `cagrpo_ray/env`)."""

    tools: list[Literal["calculator", "python"]] = Field(
        default_factory=lambda: ["calculator"], description="Tools the policy may call."
    )
    call_open: str = Field("<tool>", description="Opens a tool call: <tool>name: input</tool>.")
    call_close: str = Field("</tool>", description="Closes a tool call; ends the policy's turn.")
    result_template: str = Field(
        "<result>{output}</result>",
        description="The environment's reply; {output} is the tool's output (a chat "
        "template's own tool turn can go here).",
    )
    max_output_chars: int = Field(400, ge=16, description="A tool's output is cut past this.")
    python_wall_s: float = Field(2.0, gt=0, description="Wall-time limit of a python call.")

    @model_validator(mode="after")
    def _template_has_output(self) -> EnvConfig:
        if "{output}" not in self.result_template:
            raise ValueError(f"env.result_template {self.result_template!r} lacks {{output}}")
        return self


class RewardConfig(Section):
    weights: dict[str, float] = Field(
        default_factory=lambda: {"reasoning_gym": 1.0, "format": 0.1},
        description="Verifier name -> weight of its score in the reward.",
    )
    timeout_s: float = Field(5.0, gt=0, description="Per-call verifier timeout (seconds).")
    num_workers: int = Field(1, ge=1, description="Verifier worker processes.")
    num_cpus: float = Field(0.25, gt=0, description="Ray CPUs of the reward pool actor.")
    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description=NODE_LABELS_HELP.format(what="the reward pool", group="verifiers"),
    )
    functions: dict[str, str] = Field(
        default_factory=dict,
        description="Reward functions of one's own, name -> 'path/to/file.py:function' or "
        "'module:function' (TRL's, verl's compute_score or (response, item) signature); "
        "their names go in weights like a verifier's.",
    )
    on_error: Literal["zero", "raise"] = Field(
        "zero",
        description="A verifier or reward function that fails on a sample: zero (reward 0, "
        "counted in reward/verifier_errors) or raise (the run stops, naming it and the sample).",
    )

    @model_validator(mode="after")
    def _function_specs(self) -> RewardConfig:
        for name, spec in self.functions.items():
            target, _, attribute = spec.rpartition(":")
            if not target or not attribute:
                raise ValueError(
                    f"reward.functions.{name} is {spec!r}; write 'path/to/file.py:function' or "
                    "'module:function'"
                )
        return self


class LearnerConfig(Section):
    num_learners: int = Field(2, ge=1, description="Data-parallel learner ranks (Ray actors).")
    num_cpus_per_learner: float = Field(0.5, gt=0, description="Ray CPUs per learner.")
    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description=NODE_LABELS_HELP.format(what="each learner rank", group="learners"),
    )
    num_gpus_per_learner: float = Field(0.0, ge=0, description="Ray GPUs per learner.")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage.")
    micro_batch_size: int = Field(32, ge=1, description="Responses per forward/backward pass.")
    length_buckets: int = Field(
        4,
        ge=1,
        description="When a rank's batch fits one micro-batch and a step is one update, its "
        "training pass runs in this many length-sorted parts (less padding) and doubles as the "
        "proximal pass.",
    )
    share_prompts: bool = Field(
        True,
        description="Run the prompt a group's responses share once per micro-batch, with the "
        "responses packed after it (each attends to the prompt and itself), where the decoder's "
        "estimated cost is lower than one padded row per response; micro-batches then hold "
        "whole groups. false: one padded row per response.",
    )
    shard_by: Literal["tokens", "count"] = Field(
        "tokens",
        description="How a step's prompt groups are shared among the ranks, as many groups each "
        "as an even split gives: 'tokens' balances the ranks' token counts (the longest groups "
        "first, each to the least-loaded rank), 'count' takes consecutive groups.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer in the backward pass instead of keeping its "
        "activations (non-reentrant; on in the GPU recipes).",
    )
    logits_chunk_mib: float = Field(
        1024.0,
        gt=0,
        description="Memory (MiB) for one chunk of the output head's float32 work: full-vocabulary "
        "logits never exist for a whole micro-batch.",
    )
    dist_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Timeout (s) of the learners' collectives (DeepSpeed's included); longer than "
        "sync.timeout_s, so a weight sync gives up before the learners' collectives do.",
    )


class SyncConfig(Section):
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Weight-sync backend (auto: nccl on GPU, gloo on CPU)."
    )
    bucket_mb: float = Field(64.0, gt=0, description="Broadcast bucket size in MiB.")
    timeout_s: float = Field(120.0, gt=0, description="Timeout of every sync collective.")


class EvalConfig(Section):
    samples: int = Field(4, ge=1, description="Samples per held-out prompt (k of pass@k).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature for evaluation.")
    temperatures: list[float] = Field(
        default_factory=list,
        description="More temperatures the held-out prompts are evaluated at, each time (0: "
        "greedy, one sample a prompt); their metrics are eval/T<t>/<name>.",
    )
    hard_config: dict[str, Any] = Field(
        default_factory=dict,
        description="reasoning_gym options of a second held-out split, harder than training "
        "(e.g. {min_terms: 5, max_terms: 6}); evaluated alongside, as eval/hard/<name>. "
        "Empty: none.",
    )
    hard_size: int = Field(64, ge=1, description="Prompts of the harder held-out split.")

    @model_validator(mode="after")
    def _temperatures_valid(self) -> EvalConfig:
        bad = [t for t in self.temperatures if not t >= 0]
        if bad:
            raise ValueError(f"eval.temperatures must be >= 0 (0: greedy), got {bad}")
        return self


class MetricsConfig(Section):
    enabled: bool = Field(True, description="Serve live metrics for Prometheus from the driver.")
    port: int = Field(9400, ge=0, le=65535, description="Exporter port (0: pick a free one).")
    host: str = Field("0.0.0.0", description="Interface the exporter binds.")
    inspect_every: int = Field(
        1,
        ge=0,
        description="Keep the tokens of some prompt groups every this many learner steps for "
        "the token inspector (python -m cagrpo_ray.inspect RUN_DIR; 0: never).",
    )
    inspect_groups: int = Field(2, ge=1, description="Whole prompt groups kept per inspected step.")
    inspect_host: str = Field(
        "127.0.0.1",
        description="Interface the live token inspector binds (prompts and responses can be "
        "sensitive: loopback unless you say otherwise).",
    )
    inspect_port: int | None = Field(
        9401,
        ge=0,
        le=65535,
        description="Port of the live token inspector the driver serves (0: a free one; "
        "null: no live page, the files only).",
    )
    loggers: list[Literal["wandb", "mlflow", "tensorboard"]] = Field(
        default_factory=list,
        description="Experiment trackers beside metrics.jsonl and the Prometheus exporter "
        "(the `track` extra): per-step scalars, the config as parameters, the held-out table "
        "as summary values, under runs/<name>/ (cagrpo_ray/metrics/trackers.py).",
    )
    tracker_project: str = Field(
        "cagrpo_ray", description="W&B project and MLflow experiment the run is logged in."
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="W&B offline (files under runs/<name>/wandb/, uploaded later with "
        "`wandb sync`) or online (needs `wandb login` and the network).",
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking server or store (null: a local file store in "
        "runs/<name>/mlruns/).",
    )


class ClusterConfig(Section):
    nodes: int | None = Field(
        None,
        ge=1,
        description="Nodes of the GPU cluster the plan checks against (None: the Ray cluster the "
        "run joins; `python -m cagrpo_ray.plan` then needs --nodes).",
    )
    gpus_per_node: int = Field(8, ge=0, description="GPUs per node.")
    gpu_memory_gib: float = Field(80.0, gt=0, description="Memory of one GPU in GiB.")


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig, description="The run as a whole.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt sources.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generators.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Multi-turn tools.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Verifiers.")
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="Advantages and policy loss."
    )
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="Learners.")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Weight sync.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation.")
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig, description="Prometheus exporter."
    )
    cluster: ClusterConfig = Field(
        default_factory=ClusterConfig, description="The GPU cluster's shape, for the planner."
    )
