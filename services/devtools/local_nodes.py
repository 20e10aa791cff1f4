"""Several Ray nodes on one machine, started as users start them (`ray start`), each with ports and a temporary
directory of its own; a node may run in a mount namespace of its own with an empty tmpfs over some paths
(`unshare -m`, as root), so that it does not see files another node wrote there, as a second machine would not.
The multi-node tests and the two-node GPU benchmark (bench/e2e.py) use them."""

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

BINDIR = os.path.dirname(sys.executable)
# the `ray` command: the script beside this Python, else Ray's CLI run by this Python (a machine where Ray's package
# was put on sys.path without its scripts, as the GPU machine's)
RAY = os.path.join(BINDIR, "ray") if os.path.exists(os.path.join(BINDIR, "ray")) else \
    f"{sys.executable} -m ray.scripts.scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def why_no_private_mounts() -> str | None:
    """Why a node cannot get a private view of the filesystem here, or None."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "a node with a private view of the filesystem needs `unshare -m` as root"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"unshare -m is not allowed here: {probe.stderr.decode().strip()}"
    return None


def _ports(names: tuple[str, ...]) -> str:
    return " ".join(f"--{name}={free_port()}" for name in names)


def _resources(num_gpus: float | None, resources: dict | None) -> str:
    import json

    return (f"--num-gpus={num_gpus} " if num_gpus is not None else "") + \
        (f"--resources='{json.dumps(resources)}' " if resources else "")


def start_head(env: dict, temp: str, num_cpus: int, num_gpus: float | None = None,
               resources: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`ray start --head --block` (its dashboard on loopback). -> (the process, the GCS address)."""
    port = free_port()
    cmd = (f"exec {RAY} start --head --block --num-cpus={num_cpus} {_resources(num_gpus, resources)}"
           "--dashboard-host=127.0.0.1 "
           f"--temp-dir={temp} --port={port} " + _ports(("dashboard-port", "dashboard-agent-listen-port",
                                                        "dashboard-agent-grpc-port", "runtime-env-agent-port",
                                                        "ray-client-server-port", "metrics-export-port")))
    head = subprocess.Popen(["bash", "-c", cmd], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    head.temp = temp
    gcs = f"127.0.0.1:{port}"
    for _ in range(90):  # up once `ray status` answers: a node started before would time out joining it
        assert head.poll() is None, "the Ray head exited"
        if subprocess.run([*shlex.split(RAY), "status", f"--address={gcs}"], env=env, capture_output=True).returncode == 0:
            return head, gcs
        time.sleep(1)
    raise AssertionError("the Ray head did not answer `ray status` within 90 s")


def start_node(gcs: str, env: dict, resources: dict, num_cpus: int, hide: list[Path] = (),
               num_gpus: float | None = None) -> subprocess.Popen:
    """A node joined to the head at `gcs`; `hide`: paths it sees as empty directories (a tmpfs over each, in a mount
    namespace of its own). Its worker ports are a block of their own."""
    import tempfile

    low = free_port() // 100 * 100 % 50000 + 10000
    temp = tempfile.mkdtemp(prefix="ray")  # its own: two nodes in one session directory share socket names
    ray_start = (f"exec {RAY} start --address={gcs} --block --num-cpus={num_cpus} --temp-dir={temp} "
                 f"{_resources(num_gpus, resources)}--min-worker-port={low} --max-worker-port={low + 99} "
                 + _ports(("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                           "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")))
    mounts = "".join(f"mount -t tmpfs none {p} && " for p in hide)
    node = subprocess.Popen((["unshare", "-m", "--propagation", "private"] if hide else []) +
                            ["bash", "-c", mounts + ray_start], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    node.temp = temp
    return node


def wait_for_resource(gcs: str, env: dict, resource: str, count: int, procs: list[subprocess.Popen]) -> None:
    """Until `ray status` lists `count` of a custom resource (the nodes holding it have joined)."""
    status = ""
    for _ in range(90):
        for p in procs:
            assert p.poll() is None, p.stderr.read()[-3000:]
        status = subprocess.run([*shlex.split(RAY), "status", f"--address={gcs}"], env=env, capture_output=True,
                                text=True).stdout
        if re.search(rf"/{count}\.0 {resource}\b", status):
            return
        time.sleep(1)
    raise AssertionError(f"{count} {resource} never listed by ray status:\n{status}")


def stop(procs: list[subprocess.Popen]) -> None:
    """`ray start --block` drains and stops what it started on SIGTERM."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
        shutil.rmtree(getattr(p, "temp", ""), ignore_errors=True)
