"""Experiment trackers beside metrics.jsonl (`logging.report_to`, TRL's name): TensorBoard event files,
a Weights & Biases run, an MLflow run. Each receives every metrics line the run log writes (numbers only,
at its optimizer step). metrics.jsonl stays the record; a resumed run continues the same W&B and MLflow
runs (their ids are kept in <output_dir>/trackers.json)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


def scalars(line: dict) -> dict[str, float]:
    """The plottable numbers of a metrics line (not its step and time, not histograms or flags)."""
    return {k: float(v) for k, v in line.items()
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


class TensorBoard:
    """Event files under <output_dir>/runs (transformers' logging_dir), written with TensorBoard's own
    event writer: what torch's SummaryWriter does, without importing torch into the controller."""

    def __init__(self, out: Path, name: str, config: dict, ids: dict):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.dir = out / "runs" / name
        self.w = EventFileWriter(str(self.dir))

    def log(self, line: dict) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        vals = [Summary.Value(tag=k, simple_value=v) for k, v in scalars(line).items()]
        self.w.add_event(Event(wall_time=line.get("time", time.time()), step=int(line["step"]),
                               summary=Summary(value=vals)))
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class WandB:
    """A W&B run in <output_dir>/wandb: offline (synced later with `wandb sync`) unless WANDB_MODE says
    otherwise or WANDB_API_KEY is set; project WANDB_PROJECT or 'tandem'."""

    def __init__(self, out: Path, name: str, config: dict, ids: dict):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "tandem"), name=name, dir=str(out),
                              mode=mode, config=config, id=ids.get("wandb"), resume="allow")
        ids["wandb"] = self.run.id

    def log(self, line: dict) -> None:
        self.run.log(scalars(line), step=int(line["step"]))

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # finish() only informs the service; its last records reach the run file at teardown


class MLflow:
    """An MLflow run at MLFLOW_TRACKING_URI (e.g. a server or sqlite:///mlflow.db), or else a file store in
    <output_dir>/mlruns (`mlflow ui --backend-store-uri <output_dir>/mlruns`); experiment
    MLFLOW_EXPERIMENT_NAME or 'tandem'."""

    def __init__(self, out: Path, name: str, config: dict, ids: dict):
        from mlflow import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # MLflow 3 keeps its file store working behind this flag (it recommends sqlite:///...)
            uri = (out / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "tandem")
        exp = self.client.get_experiment_by_name(exp_name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(exp_name)
        if ids.get("mlflow"):
            self.run_id = ids["mlflow"]
        else:
            self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            from mlflow.entities import Param

            flat = _flatten(config)
            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:500]) for k, v in flat.items()])
        ids["mlflow"] = self.run_id

    def log(self, line: dict) -> None:
        from mlflow.entities import Metric

        ts, step = int(line.get("time", time.time()) * 1000), int(line["step"])
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ts, step) for k, v in scalars(line).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


BACKENDS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Trackers:
    """The trackers of `logging.report_to`, started together; one that fails to log is reported once
    and dropped (metrics.jsonl is the record)."""

    def __init__(self, cfg):
        out = Path(cfg.run_dir)
        self.ids_path = out / "trackers.json"
        ids = json.loads(self.ids_path.read_text()) if self.ids_path.is_file() else {}
        name = cfg.logging.run_name or out.resolve().name
        config = cfg.model_dump(mode="json")
        self.active = {n: BACKENDS[n](out, name, config, ids) for n in cfg.logging.report_to}
        if self.active:
            self.ids_path.write_text(json.dumps(ids))

    def log(self, lines: list[dict]) -> None:
        for n, t in list(self.active.items()):
            try:
                for line in lines:
                    t.log(line)
            except Exception as e:  # noqa: BLE001 - a tracker's outage must not stop training
                print(f"tandem: report_to {n!r} failed and is off for this run: {e}", flush=True)
                self.active.pop(n)

    def close(self) -> None:
        for t in self.active.values():
            try:
                t.close()
            except Exception:  # noqa: BLE001 - best effort at the end
                pass
        self.active = {}
