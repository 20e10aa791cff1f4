"""What the benchmarks read off the machine while a candidate runs: the GPU's busy fraction and memory by process
(nvidia-smi), the host's load before a run, the PSS of a run's process tree and its CPU time."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

T0 = time.time()  # launch: "launch to first step" counts from here

def gpu_sampler():
    """(stop() -> {busy_frac, peak_gib, peak GiB by process}) from nvidia-smi every 0.2 s (the processes' every
    second), or None without one."""
    try:
        p = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                              "-lms", "200"], stdout=subprocess.PIPE, text=True)
        apps = subprocess.Popen(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits",
                                 "-lms", "1000"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except FileNotFoundError:
        return None
    util, mem, by_process = [], [], {}

    def read():
        for line in p.stdout:
            try:
                u, m = (float(x) for x in line.split(",")[:2])
            except ValueError:
                continue
            util.append(u)
            mem.append(m)

    def read_apps():
        for line in apps.stdout:
            if (seen := gpu_process(line)) and (role := process_role(seen[0])):  # "": not yet exec'd
                name = f"{role} [{seen[0]}]"
                by_process[name] = max(by_process.get(name, 0.0), seen[1])
    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=read_apps, daemon=True).start()

    def stop():
        p.terminate()
        apps.terminate()
        # utilization.gpu: the share of each sample period with a kernel running; its mean is the busy fraction
        return {"gpu_busy_frac": (sum(util) / len(util) / 100) if util else None,
                "peak_gpu_gib": (max(mem) / 1024) if mem else None,
                # where the peak goes: each process's own peak (their sum can exceed the whole's: not all at once)
                "peak_gpu_gib_by_process": {k: v / 1024 for k, v in sorted(by_process.items())} or None}
    return stop


def gpu_process(line: str) -> tuple[int, float] | None:
    """(pid, MiB) from one line of `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`;
    None for anything else (a header, a blank, "[N/A]" where the driver does not say)."""
    try:
        pid, mib = (x.strip() for x in line.split(","))
        return int(pid), float(mib)
    except ValueError:
        return None


def process_role(pid: int) -> str:
    """A GPU process by what it runs: Ray's title for an actor (`ray::RolloutWorker.generate` -> `RolloutWorker`),
    else the program (vLLM's engine core by its own title) and its script's name; "?" where /proc does not show it
    (another pid namespace)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return role_of(" ".join(a.decode(errors="replace") for a in argv if a))


def role_of(cmdline: str) -> str:
    """The role in a process's command line (process_role); "" for an empty one."""
    first = cmdline.split(" ")[0] if cmdline else ""
    if first.startswith("ray::"):
        return first[5:].split(".")[0] or "ray"
    words = cmdline.split()
    script = next((Path(w).name for w in words[1:] if w.endswith(".py")), None)
    return f"{Path(first).name} {script}" if script else Path(first).name


def host_state(sample_s: float = 1.0, busy_pct: float = 10.0) -> dict:
    """The machine a candidate starts on: its CPU, its load, and every process outside this one's tree that kept a
    core at least `busy_pct` percent busy over `sample_s` seconds, by role. A peer whose trainer is bound by the host's
    work around its kernels runs at the machine's pace: TRL's step at the 1.5B long tail moved from 9.9 to 6.1 s
    between two H100 leases while Tandem's stayed (bench/results/e2e_gpu_scale.md), so each run says what it ran on."""
    import psutil

    me = psutil.Process()
    mine = {me.pid} | {c.pid for c in me.children(recursive=True)}
    others = [p for p in psutil.process_iter() if p.pid not in mine]
    for p in others:
        try:
            p.cpu_percent(None)  # the first call starts the process's count
        except psutil.Error:
            pass
    time.sleep(sample_s)
    busy = {}
    for p in others:
        try:
            pct = p.cpu_percent(None)
        except psutil.Error:
            continue
        if pct >= busy_pct:
            busy[f"{process_role(p.pid)} [{p.pid}]"] = round(pct)
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), None) if Path("/proc/cpuinfo").is_file() else None
    return {"cpu_model": model, "cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2),
            "busy_processes": busy}


def tree_pss_gb() -> float:
    import psutil

    total = 0
    procs = [psutil.Process()] + psutil.Process().children(recursive=True)
    for pr in procs:
        try:
            total += pr.memory_full_info().pss
        except (psutil.Error, AttributeError):
            pass
    return total / 1e9


class PeakPSS:
    def __init__(self):
        self.peak, self._stop = 0.0, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss_gb())
            time.sleep(0.5)

    def stop(self) -> float:
        self._stop.set()
        return self.peak


def cpu_busy_sampler():
    import psutil

    psutil.cpu_percent(percpu=True)
    return lambda: psutil.cpu_percent(percpu=True)


