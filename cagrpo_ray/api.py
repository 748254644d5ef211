"""The Python API, `train()` (`from cagrpo_ray import train`), and what it shares with
`python -m cagrpo_ray.run`: `run_training()`, the run both start, and `final_report()`, the
before/after table both print.

`train()` takes a config file or `Config`, overrides as Python values, and a user's reward
functions and data as Python objects, which it hands to the config's own keys
(`reward.functions`, `data.path`, `data.eval_path`) so that they load as files do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import yaml

from cagrpo_ray.config import Config, ConfigError, from_dict, load_config, parse_overrides
from cagrpo_ray.errors import UserError

PROCESS_GROUP_CLEANUP = "RAY_process_group_cleanup_enabled"
GCS_RECONNECT_TIMEOUT = "RAY_gcs_rpc_server_reconnect_timeout_s"
LOCAL_GCS_RECONNECT_TIMEOUT_S = 15


class ClusterUnreachable(UserError, ConnectionError):
    """The cluster of RAY_ADDRESS could not be joined; the message says what to check."""


def join_cluster(address: str) -> None:
    """`ray.init(address=...)`, with one line naming what to check when it fails: a cluster
    with token authentication (Ray 2.60's default for `ray start --head`) refuses a client
    without its token, and Ray then only says that it could not connect."""
    import ray

    try:
        ray.init(address=address)
    except ConnectionError as exc:
        token = os.environ.get("RAY_AUTH_MODE") == "token"
        hint = (
            "is the token the cluster's? (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)"
            if token
            else "a cluster with token authentication needs RAY_AUTH_MODE=token and its token "
            "(RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH) in this environment (docs/deployment.md)"
        )
        raise ClusterUnreachable(
            f"cannot join the Ray cluster at RAY_ADDRESS={address}: {exc}; is it up, and {hint}"
        ) from exc


def run_training(config: Config, resume: bool = False) -> dict:
    """Train as `config` says and return the run's summary (what summary.json holds); raises
    what the run raised. Joins the Ray cluster of `RAY_ADDRESS`, or one this process already
    joined (left up), or else starts a local one and shuts it down at the end."""
    from cagrpo_ray.console import configure_driver_logging

    configure_driver_logging(Path(config.run.output_dir) / config.run.name)  # libraries: a file
    import ray

    from cagrpo_ray.driver.trainer import Trainer, required_cpus

    started = not ray.is_initialized()
    address = os.environ.get("RAY_ADDRESS")
    if started and address:
        join_cluster(address)
    elif started:
        # Each Ray worker in a process group of its own, ended by the raylet when the worker
        # exits: a replica that dies takes its vLLM engine's processes with it
        # (tests/test_replica_exit.py). A cluster started elsewhere sets it itself (k8s/).
        os.environ.setdefault(PROCESS_GROUP_CLEANUP, "1")
        # A local cluster's GCS that stops answering is gone (it is not restarted): the
        # driver gives up after this many seconds, not Ray's 60.
        os.environ.setdefault(GCS_RECONNECT_TIMEOUT, str(LOCAL_GCS_RECONNECT_TIMEOUT_S))
        # Logical CPUs only schedule actors; a 2-core machine hosts the whole pipeline.
        num_cpus = config.run.ray_num_cpus or max(
            os.cpu_count() or 1, math.ceil(required_cpus(config))
        )
        ray.init(num_cpus=num_cpus, include_dashboard=False)
    try:
        return Trainer(config, resume=resume).run()
    finally:
        if started:
            # The actors are gone; what Ray would still forward from them is in their log
            # files, and nothing prints after what comes next.
            ray.shutdown()


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What `train()` returns: where the run is, and its held-out evaluation before and after
    training (the keys of the final table: `pass@1`, `pass@k`, `maj@k`, ...; `eval_after` is
    empty when a signal stopped the run before its final evaluation)."""

    run_dir: Path
    eval_before: dict
    eval_after: dict
    summary: dict  # summary.json: the above, and first/last/min/max/mean of every metric

    @property
    def policy_dir(self) -> Path | None:
        """The trained policy as a Hugging Face folder (None with `run.save_policy: never`)."""
        return Path(self.summary["policy_dir"]) if self.summary.get("policy_dir") else None

    def __str__(self) -> str:
        return final_report(self.summary)


def train(
    config: str | Path | list[str | Path] | Config = "configs/cpu-tiny.yaml",
    overrides: Mapping[str, object] | list[str] | None = None,
    *,
    reward_functions: Mapping[str, Callable] | None = None,
    train_data=None,
    eval_data=None,
    resume: bool = False,
) -> TrainResult:
    """Train as `python -m cagrpo_ray.run` does, from Python; returns a `TrainResult`.

    - `config`: a YAML file (or a list of them, layered), or a `Config`.
    - `overrides`: `{"run.steps": 3, "algorithm.lr": 1e-6}` (Python values), or `--set`
      strings (`["run.steps=3"]`, parsed as YAML).
    - `reward_functions`: `{name: callable}`. Each is pickled (cloudpickle) into a module of its
      own and named in the config as `reward.functions.<name>: "<module>.py:<name>"`, the key
      that names a reward function written in a file; weigh it in `reward.weights` as a
      verifier is weighed (`overrides={"reward.weights": {"mine": 1.0}}`).
    - `train_data` / `eval_data`: a file or folder (`data.path` / `data.eval_path`), or rows:
      a list of dicts, a pyarrow Table, a pandas DataFrame or a `datasets.Dataset`, written
      to a Parquet file first. Either sets `data.source: file`.

    Raises `ConfigError` for a wrong key or value, and what the run raised otherwise.
    """
    sets = _as_set_strings(overrides)
    for name, fn in (reward_functions or {}).items():
        sets.append(f"reward.functions.{name}={_pickled_reward_function(name, fn)}:{name}")
    for key, data in (("data.path", train_data), ("data.eval_path", eval_data)):
        if data is not None:
            sets += ["data.source=file", f"{key}={_data_path(data, key)}"]
    if isinstance(config, Config):
        resolved = from_dict(_merge(config.model_dump(mode="json"), parse_overrides(sets)))
    else:
        resolved = load_config(config, sets)
    summary = run_training(resolved, resume=resume)
    return TrainResult(
        run_dir=Path(summary["run_dir"]),
        eval_before=summary.get("eval_before") or {},
        eval_after=summary.get("eval_after") or {},
        summary=summary,
    )


def _as_set_strings(overrides) -> list[str]:
    """`--set` strings; a dict's values as YAML flow text, which parses back to the same value
    (1e-6 stays a float, "3" a string, a dict a dict)."""
    if overrides is None:
        return []
    if isinstance(overrides, list | tuple):
        return [str(item) for item in overrides]
    sets = []
    for key, value in overrides.items():
        plain = str(value) if isinstance(value, Path) else value
        text = yaml.safe_dump(plain, default_flow_style=True).removesuffix("\n...\n")
        sets.append(f"{key}={text.strip()}")
    return sets


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if both else value
    return out


def _api_cache(kind: str, content: bytes) -> Path:
    """A folder named by the content's hash under `$XDG_CACHE_HOME/cagrpo_ray/api/<kind>/`:
    the same function or rows land in the same place, and every process of this machine (the
    Ray actors too) can read it."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = base / "cagrpo_ray" / "api" / kind / hashlib.sha256(content).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _pickled_reward_function(name: str, fn: Callable) -> Path:
    """`<cache>/<name>.py`, a module whose attribute `name` is `fn` (unpickled from
    `<name>.pkl` beside it), so that the reward pool imports it as it imports any file."""
    if not name.isidentifier():
        raise ConfigError(f"reward_functions: {name!r} is not a Python identifier")
    if not callable(fn):
        raise ConfigError(f"reward_functions[{name!r}]: {fn!r} is not callable")
    import cloudpickle

    blob = cloudpickle.dumps(fn)
    folder = _api_cache("reward_functions", blob)
    (folder / f"{name}.pkl").write_bytes(blob)
    module = folder / f"{name}.py"
    module.write_text(
        f'"""Reward function {name!r}, given to cagrpo_ray.train() as a Python callable."""\n\n'
        "from pathlib import Path\n\nimport cloudpickle\n\n"
        f'{name} = cloudpickle.loads(Path(__file__).with_name("{name}.pkl").read_bytes())\n'
    )
    return module


def _data_path(data, key: str) -> str:
    """A path as it is (made absolute); rows (a list of dicts, a pyarrow Table, a pandas
    DataFrame, a datasets.Dataset) written to a Parquet file, whose path is returned."""
    if isinstance(data, str | Path):
        return str(Path(data).resolve())
    import pyarrow as pa
    import pyarrow.parquet as pq

    if isinstance(data, list):
        table = pa.Table.from_pylist(data)
    elif isinstance(data, pa.Table):
        table = data
    elif hasattr(data, "features") and hasattr(data, "with_format"):  # datasets.Dataset
        table = data.with_format("arrow")[:]
    elif hasattr(data, "to_parquet"):  # pandas.DataFrame
        table = pa.Table.from_pandas(data, preserve_index=False)
    else:
        raise ConfigError(
            f"{key}: {type(data).__name__} is not a path, a list of dicts, a pyarrow Table, a "
            "pandas DataFrame or a datasets.Dataset"
        )
    if table.num_rows == 0:
        raise ConfigError(f"{key}: no rows")
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    blob = sink.getvalue().to_pybytes()
    path = _api_cache("data", blob) / f"{key.rsplit('.', 1)[-1]}.parquet"
    path.write_bytes(blob)
    return str(path)


REPORT_ROWS = (  # (label, key in the eval results, format)
    ("pass@1", "pass@1", "{:.3f}"),
    ("pass@k", None, "{:.3f}"),  # the largest k evaluated
    ("maj@k", None, "{:.3f}"),
    ("mean response tokens", "mean_response_tokens", "{:.1f}"),
    ("responses calling a tool", "tool_call_fraction", "{:.3f}"),
    ("sampled-token entropy (nats)", "mean_sampled_token_nll", "{:.3f}"),
)


def final_report(summary: dict) -> str:
    """A short before/after table of the held-out evaluation and where the outputs are."""
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    k = (after or before).get("samples", 1)
    lines = [f"{'held-out':<30}{'before':>10}{'after':>10}"]
    for label, key, fmt in REPORT_ROWS:
        if key is None:
            key = f"{label[:-1]}{k}"
            if key == "pass@1":
                continue  # one sample: the first row already says it
            label = key
        if key == "tool_call_fraction" and key not in before and key not in after:
            continue  # a single-turn run
        cells = [fmt.format(e[key]) if key in e else "-" for e in (before, after)]
        lines.append(f"{label:<30}{cells[0]:>10}{cells[1]:>10}")
    step_s = (summary.get("time/step") or {}).get("mean")
    if step_s is not None:
        lines.append(f"{'seconds per step (mean)':<30}{'':>10}{step_s:>10.2f}")
    run_dir = summary.get("run_dir", "")
    lines += [
        "",
        f"steps trained: {summary.get('final_step')}"
        + (f" (stopped by signal at {summary['stopped_at']})" if "stopped_at" in summary else ""),
        f"metrics:  {run_dir}/metrics.jsonl",
        f"plots:    {run_dir}/plots/",
        f"summary:  {run_dir}/summary.json",
    ]
    if summary.get("inspect_dir"):
        lines.append(f"tokens:   python -m cagrpo_ray.inspect {run_dir} --serve 8000")
    if summary.get("policy_dir"):
        lines.append(
            f"policy:   {summary['policy_dir']}  "
            f"(python -m cagrpo_ray.eval --model {summary['policy_dir']} ...)"
        )
    return "\n".join(lines)
