"""The embedded Ray `tandem run` starts holds what one job on one machine needs, and nothing more."""

import ast
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration

SCRIPT = """
import os, subprocess, sys, psutil, ray
from tandem.core.config import JobConfig
from tandem.services.app.run import NAMESPACE, RAY_ADDRESS_FILE, controller_name, start_ray
cfg = JobConfig.from_dict({"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "rewards": ["r.py:f"]})
start_ray(None, cfg)
@ray.remote(num_cpus=0)
class Named:
    def pid(self):
        return os.getpid()
a = Named.options(name=controller_name(cfg.logging.output_dir), namespace=NAMESPACE).remote()
pid = ray.get(a.pid.remote())
cmds = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
recorded = open(os.path.join(cfg.logging.output_dir, RAY_ADDRESS_FILE)).read()
assert recorded == ray.get_runtime_context().gcs_address, recorded
# another process on this machine finds the job's actor by its run directory, as `tandem scale` / `status` do
other = subprocess.run([sys.executable, "-c", "import sys, ray; from tandem.services.app.run import connect_controller; "
                        "print(ray.get(connect_controller(sys.argv[1], None)[1].pid.remote()))",
                        cfg.logging.output_dir], capture_output=True, text=True)
print("PIDS", pid, other.stdout.strip().splitlines()[-1:], cmds)
print("OTHER", repr(other.stderr[-1500:]))
print("RECORDED", os.path.abspath(os.path.join(cfg.logging.output_dir, RAY_ADDRESS_FILE)))
ray.shutdown()
"""


def test_embedded_ray_starts_no_monitors_no_api_server_and_no_idle_workers(tmp_path, ray_session):
    """Its processes are GCS, the raylet, its two agents and the job's actors. Another process finds the job's
    actor through the address the run directory records, with another Ray running on the machine (the
    suite's, whose token is not this job's: Ray's address "auto" picked either, and failed on that one)."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("PIDS"))
    pid, found, cmds = line.split(" ", 3)[1:]
    found, cmds = ast.literal_eval(found), ast.literal_eval(cmds)
    binaries = sorted(c.split()[0].rsplit("/", 1)[-1] for c in cmds if not c.startswith("ray::"))
    assert binaries == ["gcs_server", "raylet"], binaries  # no monitor.py, log_monitor.py, dashboard.py
    # the raylet's two agents and the job's actor: no idle worker prestarted beside it
    assert sorted(c.split()[0] for c in cmds if c.startswith("ray::")) == \
        ["ray::DashboardAgent", "ray::Named", "ray::RuntimeEnvAgent"]
    assert found == [pid], next(x for x in out.stdout.splitlines() if x.startswith("OTHER"))
    recorded = next(x for x in out.stdout.splitlines() if x.startswith("RECORDED")).split(" ", 1)[1]
    assert not os.path.exists(recorded)  # gone with the process that held the embedded Ray
