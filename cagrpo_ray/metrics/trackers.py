"""Experiment trackers beside `metrics.jsonl`: Weights & Biases, MLflow and TensorBoard.

`metrics.loggers` names them; each gets, through its own library (the `track` extra):

- every learner step's scalars at that step, the same record `metrics.jsonl` gets (values
  that are not finite are left out, as the JSONL writes them as null);
- the resolved config as the run's parameters (flattened to dotted keys: `algorithm.lr`);
- the final held-out table (`eval_before/*`, `eval_after/*`, `final_step`) as summary values.

Where each writes, under the run directory unless the config says otherwise:

- wandb: `wandb/offline-run-*/` (`metrics.wandb_mode: offline`, the default); upload later with
  `wandb sync runs/<name>/wandb/offline-run-*`;
- mlflow: `mlruns/`, a local file store (`metrics.mlflow_tracking_uri` names a server instead);
  `mlflow ui --backend-store-uri runs/<name>/mlruns`;
- tensorboard: `tensorboard/`, event files; `tensorboard --logdir runs/<name>/tensorboard`.

Nothing contacts the network unless asked: W&B runs offline and MLflow's telemetry is off
unless the config or the environment say otherwise. A tracker that cannot start (its library
missing, a bad URI) raises `TrackerError` before training starts; one that fails later is
reported in the log, closed, and named in `summary.json` (`tracker_errors`), and the run goes on
with the others: the JSONL stays the record.
"""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import time
from pathlib import Path

from cagrpo_ray.errors import UserError

log = logging.getLogger("cagrpo_ray")

EXTRA_HINT = "pip install -e '.[track]' (make setup installs it)"
SUMMARY_SECTIONS = ("eval_before", "eval_after")  # the held-out table's two columns


class TrackerError(UserError, RuntimeError):
    """A tracker named in `metrics.loggers` cannot start; the message says which and why."""


def flatten(tree: dict, prefix: str = "") -> dict:
    """`{"algorithm": {"lr": 1e-6}}` -> `{"algorithm.lr": 1e-6}`; lists and None stay values."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def finite_scalars(record: dict) -> dict[str, float]:
    """The record's finite int/float values (bools excluded), `step` left out."""
    return {
        k: v
        for k, v in record.items()
        if k != "step"
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(float(v))
    }


def summary_values(summary: dict) -> dict[str, float]:
    """The final held-out table as flat scalars: `eval_after/pass@1`, ..., `final_step`."""
    values: dict[str, float] = {}
    for section in SUMMARY_SECTIONS:
        table = summary.get(section) or {}
        values.update({f"{section}/{k}": v for k, v in finite_scalars(table).items()})
    if isinstance(summary.get("final_step"), int):
        values["final_step"] = summary["final_step"]
    return values


class WandbTracker:
    """A W&B run; offline by default, written under `<run_dir>/wandb/`."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, project: str, mode: str, config: dict):
        try:
            import wandb
        except ImportError as exc:
            raise TrackerError(f"metrics.loggers 'wandb': {exc}; {EXTRA_HINT}") from None
        # the same id for a resumed run, so that its steps continue the one W&B run
        id_file = run_dir / "wandb" / "run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id)
        settings = wandb.Settings(
            mode=mode,
            console="off",  # the project's console stays as it is (cagrpo_ray/console.py)
            x_disable_stats=True,  # no system-metrics sampler process beside the driver
            disable_git=True,
            silent=True,
        )
        self.run = wandb.init(
            project=project,
            name=run_name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
            settings=settings,
        )

    def log(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def finish(self, values: dict) -> None:
        self.run.summary.update(values)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


MLFLOW_KEY = re.compile(r"[^\w\-. /]")  # MLflow's allowed key characters; others are replaced


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts: `eval/pass@1` -> `eval/pass_at_1` (as verl writes it)."""
    return MLFLOW_KEY.sub("_", key.replace("@", "_at_"))


class MlflowTracker:
    """An MLflow run in the experiment `project`, through `MlflowClient` (no global state)."""

    name = "mlflow"
    MAX_PARAM_CHARS = 6000  # MLflow's limit on a parameter's value

    def __init__(self, run_dir: Path, run_name: str, project: str, uri: str | None, config: dict):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        if uri is None:
            # the file store is in "maintenance mode" in MLflow 3 but is the one store that
            # needs no database driver (mlflow-skinny has none) and no server
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise TrackerError(f"metrics.loggers 'mlflow': {exc}; {EXTRA_HINT}") from None
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(project)
        )
        id_file = run_dir / "mlflow_run_id"
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            id_file.write_text(self.run_id)
            params = [Param(k, str(v)[: self.MAX_PARAM_CHARS]) for k, v in config.items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, scalars: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def finish(self, values: dict) -> None:
        self.log(int(values.get("final_step", 0)), values)

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class TensorBoardTracker:
    """Event files under `<run_dir>/tensorboard/` (torch's SummaryWriter; values as float32,
    the event format's scalar)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, config: dict, first_step: int):
        try:
            import tensorboard  # noqa: F401  (SummaryWriter needs it; say so before training)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise TrackerError(f"metrics.loggers 'tensorboard': {exc}; {EXTRA_HINT}") from None
        self.logdir = run_dir / "tensorboard"
        self.config = {k: v if isinstance(v, int | float | str | bool) else str(v)
                       for k, v in config.items()}  # fmt: skip
        # a resumed run drops what an earlier attempt logged after its checkpoint's step
        self.writer = SummaryWriter(
            str(self.logdir), purge_step=first_step + 1 if first_step else None
        )

    def log(self, step: int, scalars: dict) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, values: dict) -> None:
        # the hparams plugin's session: the config as parameters, the held-out table as metrics
        self.writer.add_hparams(self.config, values, run_name=".")

    def close(self, failed: bool) -> None:
        self.writer.close()


class Trackers:
    """The trackers of `metrics.loggers`, started together; each call goes to every one that
    has not failed."""

    def __init__(self, trackers: list):
        self.trackers = trackers
        self.errors: dict[str, str] = {}

    @classmethod
    def start(cls, config, run_dir: Path, resume: bool = False) -> Trackers:
        """Start every tracker in `config.metrics.loggers`; raises `TrackerError` (having
        closed those already started) when one cannot start. A resumed run continues the same
        W&B and MLflow runs; TensorBoard drops what came after the checkpoint's step."""
        m = config.metrics
        latest = run_dir / "checkpoints" / "latest"  # Trainer.save_checkpoint's pointer
        first_step = (
            int(latest.read_text().strip().removeprefix("step_"))
            if resume and latest.exists()
            else 0
        )
        params = flatten(config.model_dump(mode="json"))
        started: list = []
        try:
            for name in dict.fromkeys(m.loggers):  # each once, in the order given
                try:
                    if name == "wandb":
                        tracker = WandbTracker(
                            run_dir, config.run.name, m.tracker_project, m.wandb_mode, params
                        )
                    elif name == "mlflow":
                        tracker = MlflowTracker(
                            run_dir, config.run.name, m.tracker_project,
                            m.mlflow_tracking_uri, params,
                        )  # fmt: skip
                    else:
                        tracker = TensorBoardTracker(run_dir, params, first_step)
                except TrackerError:
                    raise
                except Exception as exc:
                    raise TrackerError(
                        f"metrics.loggers {name!r} could not start: {type(exc).__name__}: {exc}"
                    ) from exc
                started.append(tracker)
                log.info("tracker %s started", name)
        except TrackerError:
            cls(started).close(failed=True)
            raise
        return cls(started)

    def _each(self, what: str, *args) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, what)(*args)
            except Exception as exc:  # the JSONL stays the record; the others go on
                message = f"{type(exc).__name__}: {exc}"
                log.error("tracker %s failed (%s); it is closed, the run goes on", tracker.name,
                          message)  # fmt: skip
                self.errors[tracker.name] = message
                self.trackers.remove(tracker)
                try:
                    tracker.close(failed=True)
                except Exception:  # already failing: its first error is the one reported
                    pass

    def log(self, step: int, record: dict) -> None:
        """One learner step: the finite scalars of the record `metrics.jsonl` got."""
        scalars = finite_scalars(record)
        if scalars:
            self._each("log", step, scalars)

    def finish(self, summary: dict) -> dict:
        """The final held-out table as summary values, then close; returns `summary` with
        `tracker_errors` ({tracker: error}) when one failed during the run."""
        self._each("finish", summary_values(summary))
        self.close()
        return {**summary, "tracker_errors": self.errors} if self.errors else summary

    def close(self, failed: bool = False) -> None:
        self._each("close", failed)
        self.trackers = []
