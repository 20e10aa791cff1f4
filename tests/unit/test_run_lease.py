"""One job per storage URI, from any node (tandem/core/storage.py RunLease), on a real pyarrow filesystem through a
file:// URI (the same calls an s3:// URI takes; tests/integration/test_storage.py runs the job itself on moto's S3)."""

import json
import subprocess
import sys
import threading
import time

import pytest

from tandem.core.config import JobConfigError
from tandem.core.storage import LEASE, RunLease, Store


def uri(tmp_path) -> str:
    return f"file://{tmp_path}/run"


def test_a_second_job_is_refused_naming_the_uri_and_the_holder_then_takes_it_once_released(tmp_path):
    a, b = RunLease(uri(tmp_path), settle_s=0.05), RunLease(uri(tmp_path), settle_s=0.05)
    a.acquire()
    with pytest.raises(JobConfigError) as e:
        b.acquire()
    msg = str(e.value)
    assert f"logging.output_dir = '{uri(tmp_path)}'" in msg and "another job is writing to it" in msg
    assert f"pid {a.me['pid']} on {a.me['host']}" in msg
    a.release()
    assert not Store(uri(tmp_path)).exists(LEASE)
    b.acquire()
    b.release()


def test_a_dead_process_on_this_host_frees_the_uri_at_once(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    b = RunLease(uri(tmp_path), settle_s=0.05)
    Store(uri(tmp_path)).write_bytes(LEASE, json.dumps(dict(b.me, id="x", pid=int(dead.stdout), beat=time.time()))
                                     .encode())
    b.acquire()  # its pid is gone: not held, whatever its heartbeat says
    assert Store(uri(tmp_path)).read_text(LEASE).count(b.me["id"]) == 1
    b.release()


def test_another_hosts_lease_holds_until_its_heartbeat_is_older_than_the_ttl(tmp_path):
    b = RunLease(uri(tmp_path), settle_s=0.05, ttl_s=60)
    other = dict(id="x", host="elsewhere", pid=1, since=time.time() - 500)
    store = Store(uri(tmp_path))
    store.write_bytes(LEASE, json.dumps(dict(other, beat=time.time() - 10)).encode())
    with pytest.raises(JobConfigError, match="pid 1 on elsewhere.*last heartbeat 10 s ago"):
        b.acquire()
    store.write_bytes(LEASE, json.dumps(dict(other, beat=time.time() - 61)).encode())
    b.acquire()
    b.release()


def test_of_two_jobs_starting_together_the_one_overwritten_refuses(tmp_path):
    """b writes its lease while a waits to read its own back: a refuses; b holds the URI."""
    a, b = RunLease(uri(tmp_path), settle_s=0.5), RunLease(uri(tmp_path), settle_s=0.05)
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(JobConfigError, a.acquire)))
    t.start()
    time.sleep(0.2)  # a has written and is settling
    b._write()  # b's write lands during a's wait (b read before a wrote: both saw no lease)
    b.acquire()  # b finds its own lease there and keeps it
    t.join()
    assert "another job took it at the same moment" in str(errors[0].value)
    assert json.loads(Store(uri(tmp_path)).read_bytes(LEASE))["id"] == b.me["id"]
    b.release()


def test_the_heartbeat_keeps_the_lease_fresh(tmp_path):
    a = RunLease(uri(tmp_path), settle_s=0.0, beat_s=0.05)
    a.acquire()
    first = json.loads(Store(uri(tmp_path)).read_bytes(LEASE))["beat"]
    time.sleep(0.3)
    assert json.loads(Store(uri(tmp_path)).read_bytes(LEASE))["beat"] > first
    a.release()
