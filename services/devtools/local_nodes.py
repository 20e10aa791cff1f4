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


def ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections and bind(0) (Linux: 32768-60999 unless set otherwise)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def _unbound(*ports: int) -> bool:
    """Whether none of `ports` is bound now on any interface of this machine."""
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                return False
    return True


_GIVEN: set[int] = set()  # the ports free_port handed out in this process: none is handed out twice


def free_port() -> int:
    """A TCP port nobody listens on now, for a listener that starts later (a Ray node's, a test's server). Drawn above
    the ephemeral range where there is room: a port from inside it (a probe socket bound to port 0) may go to any
    process's outgoing connection before the listener binds it, which then fails with EADDRINUSE. Never one this
    process handed out before: a node's ports are drawn together, before any of them listens, and `ray start`
    refuses two components on one port."""
    import random

    above = range(ephemeral_ports().stop, 65536)
    for _ in range(100) if len(above) >= 1000 else ():
        if (port := random.choice(above)) not in _GIVEN and _unbound(port):
            _GIVEN.add(port)
            return port
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            if (port := s.getsockname()[1]) not in _GIVEN:
                _GIVEN.add(port)
                return port
    raise RuntimeError("free_port: no port this process has not handed out already")


def why_no_private_mounts() -> str | None:
    """Why a node cannot get a private view of the filesystem here, or None."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "a node with a private view of the filesystem needs `unshare -m` as root"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"unshare -m is not allowed here: {probe.stderr.decode().strip()}"
    return None


def _ports(names: tuple[str, ...]) -> dict[str, int]:
    """A free port for each of these `ray start` options."""
    return {name: free_port() for name in names}


def _flags(ports: dict[str, int]) -> str:
    return " ".join(f"--{name}={port}" for name, port in ports.items())


def _resources(num_gpus: float | None, resources: dict | None) -> str:
    import json

    return (f"--num-gpus={num_gpus} " if num_gpus is not None else "") + \
        (f"--resources='{json.dumps(resources)}' " if resources else "")


def start_head(env: dict, temp: str, num_cpus: int, num_gpus: float | None = None,
               resources: dict | None = None, port: int | None = None, extra: str = "",
               tries: int = 3) -> tuple[subprocess.Popen, str]:
    """`ray start --head --block` (its dashboard on loopback, every port its own), up once `ray status` answers (a
    node started before would time out joining it); started again where its raylet timed out registering
    (`again_on_timeout`). -> (the process, with .temp and .ports; the GCS address)."""
    port = port or free_port()
    gcs = f"127.0.0.1:{port}"
    ports = _ports(("dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                    "runtime-env-agent-port", "ray-client-server-port", "metrics-export-port"))
    cmd = (f"exec {RAY} start --head --block --num-cpus={num_cpus} {_resources(num_gpus, resources)}{extra}"
           f"--dashboard-host=127.0.0.1 --temp-dir={temp} --port={port} "
           + _flags(ports))

    def start() -> subprocess.Popen:
        Path(temp).mkdir(exist_ok=True)
        said = Path(temp) / "ray-start.err"  # a file, not a pipe nobody reads while the head runs
        with open(said, "w") as err:
            head = subprocess.Popen(["bash", "-c", cmd], env=env, stdout=subprocess.DEVNULL, stderr=err)
        head.temp, head.ports = temp, ports  # its dashboard's (the Jobs API) and metrics' ports for the caller
        for _ in range(90):
            if head.poll() is not None:
                text = said.read_text()[-3000:]
                stop([head])
                raise NodeExited(f"the Ray head exited ({head.returncode}): {text}")
            if subprocess.run([*shlex.split(RAY), "status", f"--address={gcs}"], env=env,
                              capture_output=True).returncode == 0:
                return head
            time.sleep(1)
        stop([head])
        raise AssertionError("the Ray head did not answer `ray status` within 90 s")

    return again_on_timeout(start, tries), gcs


def start_autoscaling_head(env: dict, temp: str, head_cpus: int, worker_node_types: dict,
                           idle_timeout_minutes: float) -> tuple[subprocess.Popen, str]:
    """A head whose autoscaler starts and stops nodes of `worker_node_types` on this machine (Ray's fake multi-node
    provider, as ray.cluster_utils.AutoscalingCluster sets it up, without its `ray stop --force` of every Ray of the
    machine). -> (the process, the GCS address)."""
    import json
    import tempfile

    port = free_port()
    config = {  # the launcher config of Ray's fake_multi_node/example.yaml (not shipped in Ray's wheel)
        "cluster_name": "tandem_local", "head_node_type": "ray.head.default", "upscaling_speed": 1.0,
        "max_workers": sum(t.get("max_workers", 0) for t in worker_node_types.values()),
        "idle_timeout_minutes": idle_timeout_minutes,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": f"127.0.0.1:{port}"},
        "available_node_types": {**worker_node_types, "ray.head.default": {
            "resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0}},
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        **{k: [] for k in ("initialization_commands", "setup_commands", "head_setup_commands",
                           "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")}}
    fd, path = tempfile.mkstemp(suffix=".json")
    os.write(fd, json.dumps(config).encode())
    os.close(fd)
    env = dict(env, AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_FAKE_CLUSTER="1")
    return start_head(env, temp, head_cpus, port=port, extra=f"--autoscaling-config={path} ")


_BLOCKS: set[int] = set()  # the worker port blocks this process gave its nodes


def start_node(gcs: str, env: dict, resources: dict, num_cpus: int, hide: list[Path] = (),
               num_gpus: float | None = None) -> subprocess.Popen:
    """A node joined to the head at `gcs`; `hide`: paths it sees as empty directories (a tmpfs over each, in a mount
    namespace of its own). Its worker ports are a block of their own."""
    import random
    import tempfile

    # a block of its own between a head's default worker ports (10002-19999) and Linux's ephemeral range
    # (32768-60999): clear of free_port's ports for the node's other components (above that range) and of every
    # outgoing connection's
    low = next(b for b in random.sample(range(20000, 32700, 100), 127) if b not in _BLOCKS and _unbound(*range(b, b + 100)))
    _BLOCKS.add(low)
    temp = tempfile.mkdtemp(prefix="ray")  # its own: two nodes in one session directory share socket names
    ray_start = (f"exec {RAY} start --address={gcs} --block --num-cpus={num_cpus} --temp-dir={temp} "
                 f"{_resources(num_gpus, resources)}--min-worker-port={low} --max-worker-port={low + 99} "
                 + _flags(_ports(("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                           "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port"))))
    mounts = "".join(f"mount -t tmpfs none {p} && " for p in hide)
    node = subprocess.Popen((["unshare", "-m", "--propagation", "private"] if hide else []) +
                            ["bash", "-c", mounts + ray_start], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    node.temp = temp
    return node


class NodeExited(AssertionError):
    """A `ray start` process ended before its node joined; `timed_out` where its raylet did not register with the GCS
    within the 30 s Ray allows (a loaded machine: it may join when started again)."""

    def __init__(self, said: str):
        super().__init__(said)
        self.timed_out = "timed out during startup" in said


def wait_for_resource(gcs: str, env: dict, resource: str, count: int, procs: list[subprocess.Popen]) -> None:
    """Until `ray status` lists `count` of a custom resource (the nodes holding it have joined); `procs`: start_node's
    processes, whose stderr says why one exited (NodeExited)."""
    status = ""
    for _ in range(90):
        for p in procs:
            if p.poll() is not None:
                raise NodeExited(p.stderr.read()[-3000:])
        status = subprocess.run([*shlex.split(RAY), "status", f"--address={gcs}"], env=env, capture_output=True,
                                text=True).stdout
        if re.search(rf"/{count}\.0 {resource}\b", status):
            return
        time.sleep(1)
    raise AssertionError(f"{count} {resource} never listed by ray status:\n{status}")


def again_on_timeout(start, tries: int):
    """start(), and again (up to `tries` times in all) while it raises a NodeExited that timed out: Ray gives a
    raylet a fixed 30 s to register with the GCS, which a loaded machine can outlast (start stops what it started
    before raising)."""
    for _ in range(tries - 1):
        try:
            return start()
        except NodeExited as e:
            if not e.timed_out:
                raise
    return start()


def join_nodes(gcs: str, env: dict, resources: dict, num_cpus: int, count: int, hide: list[Path] = (),
               num_gpus: float | None = None, tries: int = 3) -> list[subprocess.Popen]:
    """`count` nodes started by start_node one after the other, each waited for until `ray status` lists it by the
    first of its `resources` (one of them, and nothing else, offering it): two raylets registering at once on a
    loaded machine can outlast Ray's 30 s; each started again where it timed out (`again_on_timeout`)."""
    name = next(iter(resources))
    nodes: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        node = start_node(gcs, env, resources, num_cpus, hide, num_gpus)
        try:
            wait_for_resource(gcs, env, name, int((len(nodes) + 1) * resources[name]), [node])
        except BaseException:
            stop([node])
            raise
        return node

    try:
        for _ in range(count):
            nodes.append(again_on_timeout(start, tries))
    except BaseException:
        stop(nodes)
        raise
    return nodes


def descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            kids.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def actor_pid(root_pid: int, cls: str) -> int | None:
    """The process of the newest `cls` actor below root_pid (a node's `ray start`: Ray titles an actor's process
    `ray::<class>`; one it killed may not have exited yet)."""
    started = {}
    for pid in descendants(root_pid):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(f"ray::{cls}".encode()):
                started[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        except OSError:
            pass
    return max(started, key=started.get) if started else None


def kill_node(pid: int) -> None:
    """SIGKILL a node's `ray start` (pid) and every process below it at once: a host fault (Ray's workers sit in
    process groups of their own, so the tree is walked rather than one group signalled)."""
    import signal

    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def naming(text: str) -> list[int]:
    """The processes whose command line contains `text` (but this one)."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes() and int(cmdline.parent.name) != os.getpid():
                out.append(int(cmdline.parent.name))
        except (OSError, ValueError):
            continue
    return out


def stop(procs: list[subprocess.Popen]) -> None:
    """`ray start --block` drains and stops what it started on SIGTERM; what outlives it (the nodes an autoscaler's
    fake provider started, which are not its children's to stop) is killed, and so is every process that names a
    node's temporary directory (what a `ray start` that failed had started and left behind)."""
    import signal

    tree = [d for p in procs for d in descendants(p.pid)] + [d for p in procs if getattr(p, "temp", "")
                                                              for d in naming(p.temp)]
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
        shutil.rmtree(getattr(p, "temp", ""), ignore_errors=True)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
