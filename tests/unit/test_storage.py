"""tandem.core.storage on file:// URIs (pyarrow's local filesystem behind the URI code path; the S3 API itself is
tests/integration/test_storage.py's)."""

import json

from tandem.core.storage import Location, RunMirror, Store, check_reachable, join, staging_dir
from tandem.services.orchestrator.checkpointer import Checkpointer, complete_checkpoints, readable


def test_a_mirror_copies_what_changed_and_pull_starts_the_stage_anew(tmp_path):
    uri = f"file://{tmp_path}/bucket/run"
    local = tmp_path / "stage"
    m = RunMirror(local, uri, skip=("checkpoints",))
    (local / "eval").mkdir(parents=True)
    (local / "metrics.jsonl").write_text('{"step": 1}\n')
    (local / "eval" / "step-000001.jsonl").write_text("{}\n")
    (local / "checkpoints").mkdir()
    (local / "checkpoints" / "x").write_text("never copied")
    (local / ".tandem.lock").write_text("this node's")
    (local / ".tandem-probe-1").write_text("a probe")
    assert sorted(m.push()) == ["eval/step-000001.jsonl", "metrics.jsonl"]
    assert m.push() == []  # nothing changed
    with open(local / "metrics.jsonl", "a") as f:
        f.write('{"step": 2}\n')
    assert m.push() == ["metrics.jsonl"]
    store = Store(uri)
    assert store.read_text("metrics.jsonl").count("step") == 2 and store.files() == sorted(
        ["eval/step-000001.jsonl", "metrics.jsonl"])
    (local / "stale.txt").write_text("from an earlier run on this node")
    again = RunMirror(local, uri, skip=("checkpoints",))
    again.pull()
    assert sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()) == \
        [".tandem.lock", "eval/step-000001.jsonl", "metrics.jsonl"]
    assert again.push() == []  # what was pulled is not sent back


def test_checkpoints_under_a_uri_are_complete_only_with_tandem_json_and_set_aside_by_copy(tmp_path):
    root = Location(f"file://{tmp_path}/bucket/ck")
    meta = {"version": 1, "steps": 2, "controller": {p: {} for p in
                                                    ("source", "progress", "record", "buffer", "failures",
                                                     "counters")}}
    for name in ("cycle-000002", "cycle-000004"):
        s = Store(root / name)
        s.write_bytes("state/x.txt", b"")
        s.write_bytes("rng_rank0.safetensors", b"x")
    Store(root / "cycle-000002").write_bytes("tandem.json", json.dumps(meta).encode())
    Store(root / "cycle-000006").write_bytes("rng_rank0.safetensors", b"x")  # a copy cut short: no tandem.json
    assert [c.name for c in complete_checkpoints(root)] == ["cycle-000002"]
    assert readable(root / "cycle-000002") is None
    Store(root / "cycle-000004").write_bytes("tandem.json", b'{"version": 4, "ste')
    assert "cycle-000004/tandem.json" in readable(root / "cycle-000004")

    class Cfg:
        checkpoint_dir = str(root)
        checkpoint = type("C", (), {"save_steps": 2, "save_total_limit": 1})()
    ck = Checkpointer(Cfg())
    assert ck.latest() == root / "cycle-000002" and ck.path(8) == root / "cycle-000008"
    aside = Checkpointer.set_aside(root / "cycle-000004")
    assert aside == root / "cycle-000004.refused" and not Store(root / "cycle-000004").exists()
    assert Store(aside).is_file("state/x.txt")  # copied whole, then deleted
    Store(root / "cycle-000008").write_bytes("tandem.json", json.dumps(meta).encode())
    ck.prune()  # save_total_limit 1: the older complete one goes
    assert [c.name for c in complete_checkpoints(root)] == ["cycle-000008"]


def test_locations_and_staging(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_STAGING_DIR", str(tmp_path))
    assert join("s3://b/run/", "checkpoints", "cycle-1") == "s3://b/run/checkpoints/cycle-1"
    assert Location("gs://b/run") / "adapter" == "gs://b/run/adapter" and Location("s3://b/run/").name == "run"
    assert staging_dir("s3://b/run") == staging_dir("s3://b/run") != staging_dir("s3://c/run")
    assert staging_dir("s3://b/run").parent == tmp_path and staging_dir("s3://b/run").name.startswith("run-")
    assert check_reachable(f"file://{tmp_path}/ok", "logging.output_dir") is None
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "run").write_text("a file where a directory should be")
    why = check_reachable(f"file://{tmp_path}/ro/run", "logging.output_dir")
    assert why.startswith(f"logging.output_dir = 'file://{tmp_path}/ro/run': this node cannot write there ("), why
