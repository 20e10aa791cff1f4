"""logging.report_to with the real trackers, read back with each one's own reader: TensorBoard's event
accumulator, W&B's offline run file (the records `wandb sync` uploads), MLflow's client on its file
store. A resumed run continues the same W&B and MLflow runs."""

import glob
import json
import os

import pytest

from tandem.core.config import JobConfig
from tandem.services.orchestrator.run_log import RunLog
from tandem.services.orchestrator.trackers import Trackers

pytestmark = pytest.mark.integration

LINES = [{"step": s, "reward": 0.1 * s, "loss": 1.0 / s, "count/groups": 4 * s, "staleness_hist": {"0": 4}}
         for s in (1, 2, 3)]


def cfg_for(job_files, tmp_path, report_to):
    return JobConfig.from_dict({**job_files, "logging": {"output_dir": str(tmp_path / "run"), "report_to": report_to,
                                                         "run_name": "t1"}})


def write(cfg, lines):
    log = RunLog(tmp := __import__("pathlib").Path(cfg.logging.output_dir) / "metrics.jsonl")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    log.trackers = Trackers(cfg)
    log.write(lines)
    log.trackers.close()


def test_tensorboard_event_files_hold_every_step(job_files, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = cfg_for(job_files, tmp_path, "tensorboard")
    write(cfg, LINES)
    ea = EventAccumulator(str(tmp_path / "run" / "runs" / "t1"))
    ea.Reload()
    assert sorted(ea.Tags()["scalars"]) == ["count/groups", "loss", "reward"]  # no histogram dict
    assert [(e.step, round(e.value, 6)) for e in ea.Scalars("reward")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [e.value for e in ea.Scalars("count/groups")] == [4, 8, 12]


def leveldb_log_records(path: str) -> list[bytes]:
    """The records of W&B's transaction log (LevelDB's log format behind a 7-byte ':W&B' header: 32 KiB
    blocks of chunks, each a 7-byte header (crc32, length, type) then data), read independently of wandb."""
    import struct

    raw = open(path, "rb").read()
    assert raw[:4] == b":W&B", raw[:7]
    out, buf, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        buf += raw[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # FULL or LAST
            out.append(buf)
            buf = b""
    return out


def wandb_history(run_file: str) -> list[dict]:
    from wandb.proto import wandb_internal_pb2

    rows = []
    for data in leveldb_log_records(run_file):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            rows.append({it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in rec.history.item})
    return rows


def test_wandb_offline_run_holds_the_history_and_resume_continues_it(job_files, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for k in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(k, raising=False)  # no network configured: offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = cfg_for(job_files, tmp_path, ["wandb"])
    write(cfg, LINES[:2])
    write(cfg, LINES[2:])  # a resumed run: the same run id
    ids = json.loads((tmp_path / "run" / "trackers.json").read_text())
    runs = sorted(glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / f"run-{ids['wandb']}.wandb")))
    assert len(runs) == 2  # one offline file per process, one run id
    hist = [h for f in runs for h in wandb_history(f)]
    assert [(h["_step"], h["reward"]) for h in hist] == [(1, 0.1), (2, 0.2), (3, pytest.approx(0.3))]
    assert "staleness_hist" not in hist[0] and hist[1]["count/groups"] == 8


def test_mlflow_file_store_holds_every_step_and_resume_continues_the_run(job_files, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = cfg_for(job_files, tmp_path, "mlflow")
    write(cfg, LINES[:1])
    write(cfg, LINES[1:])
    run_id = json.loads((tmp_path / "run" / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").as_uri())  # MLflow's own file store reader
    hist = client.get_metric_history(run_id, "reward")
    assert sorted((m.step, round(m.value, 6)) for m in hist) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    run = client.get_run(run_id)
    assert run.info.run_name == "t1" and run.data.params["logging.run_name"] == "t1"
    assert os.path.isdir(tmp_path / "run" / "mlruns")
