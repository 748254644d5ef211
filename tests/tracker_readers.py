"""What each tracker wrote, read back with that tracker's own library: W&B's offline run file
(its `Record` protobuf messages), MLflow's `MlflowClient`, TensorBoard's `EventAccumulator`.

Each reader returns `(history, params, summary)`: history {step: {key: value}}, the run's
parameters {dotted key: value}, and the summary values {key: value}.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

WANDB_HEADER = b":W&B\xe1\xbe\x00"  # ident, magic 0xBEE1, version 0
LOG_BLOCK = 32768  # the LevelDB log format W&B's transaction log is written in
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """Every `wandb_internal_pb2.Record` of a `.wandb` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[: len(WANDB_HEADER)] == WANDB_HEADER, f"{path}: not a W&B transaction log"
    pos, pending, records = len(WANDB_HEADER), b"", []
    while pos + 7 <= len(data):
        if LOG_BLOCK - pos % LOG_BLOCK < 7:  # a block's tail too short for a header: padding
            pos += LOG_BLOCK - pos % LOG_BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):
            break  # zero padding at the end, or a record still being written
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def finished_wandb_records(path: Path, timeout_s: float = 60) -> list:
    """The records of a finished run's file. `run.finish()` returns once W&B's service has the
    run's exit, but the service writes the file on its own schedule: wait until the exit
    record is on disk (under load this took a moment after `finish()` returned)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout_s} s"
        time.sleep(0.2)


def read_wandb(run_dir: Path) -> tuple[dict, dict, dict]:
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history: dict = {}
    params: dict = {}
    summary: dict = {}
    for record in finished_wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            params.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            params.pop("_wandb", None)  # W&B's own bookkeeping
        elif kind == "history":
            row = {_item_key(i): json.loads(i.value_json) for i in record.history.item}
            step = row.pop("_step")
            history[step] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "summary":
            for u in record.summary.update:
                key = _item_key(u)
                if not key.startswith("_"):
                    summary[key] = json.loads(u.value_json)
    return history, params, summary


def read_mlflow(run_dir: Path, keys: list[str]) -> tuple[dict, dict, dict]:
    """`keys`: the metric names to read (MLflow's names: `eval/pass_at_1`)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FINISHED", run.info.status
    history: dict = {}
    for key in keys:
        for metric in client.get_metric_history(run.info.run_id, key):
            history.setdefault(metric.step, {})[key] = metric.value
    return history, dict(run.data.params), dict(run.data.metrics)


def read_tensorboard(run_dir: Path) -> tuple[dict, dict, dict]:
    """Scalars of the event files; the hparams plugin's parameters; the summary values are the
    scalars the hparams session logged, at step 0 (learner steps start at 1)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    history: dict = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            history.setdefault(event.step, {})[tag] = event.value
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    params = {}
    for key, value in start.hparams.items():
        kind = value.WhichOneof("kind")
        params[key] = getattr(value, kind)
    return history, params, history.pop(0, {})
