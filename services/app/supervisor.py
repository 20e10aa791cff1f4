"""`tandem run` keeps its driver alive as torchrun's elastic agent keeps its workers: the driver is a
child process, and when it dies of a signal nobody here sent (SIGKILL, the OOM killer) it is started
again with checkpoint.resume=true, at most cluster.max_restarts times. Its embedded Ray, controller,
learner and rollout workers die with it (Ray ties them to their driver), so the new driver finds the
run directory as the old one left it: the newest checkpoint is resumed, the later metrics lines cut.
Ctrl-C and SIGTERM here are passed on once (the driver saves a checkpoint and exits 130)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SUPERVISED = "TANDEM_SUPERVISED"  # set in the driver's environment: it runs the job itself


def _child_setup() -> None:
    """In the child: Ctrl-C's default (Python's KeyboardInterrupt) even where this process was started with SIGINT
    ignored (`nohup`, `cmd &` in a script), so the one SIGINT passed on stops the run; and SIGTERM when the supervisor
    dies (even by SIGKILL), so no driver is left orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the driver then outlives a killed supervisor
        pass


def supervise(argv: list[str], max_restarts: int, out=sys.stderr) -> int:
    """Runs `tandem run argv` as a child until it ends by itself; -> its exit status. First releases what an earlier
    run of this user left where its supervisor was killed too (SIGKILL: its own release below never ran), then, at the
    end, what this job's killed processes could not (release_orphan_semaphores)."""
    release_orphan_semaphores(0.0, settle_s=0.0)
    since = time.time()
    try:
        return _supervise(argv, max_restarts, out)
    finally:
        release_orphan_semaphores(since)


def release_orphan_semaphores(since: float, settle_s: float = 5.0) -> list[str]:
    """Unlinks the POSIX semaphores of multiprocessing (/dev/shm/sem.mp-*) made since `since` by this user that no
    live process maps any longer. A process pool's queues hold five; they are unlinked by their owner or by its
    resource tracker, and an actor killed with its children (SIGKILL, the OOM killer, Ray killing a dead actor's
    children) leaves them behind, one set per death. One still mapped is waited for up to settle_s (the job's actors
    ending after their driver). -> the names unlinked."""
    shm, uid, gone = Path("/dev/shm"), os.getuid(), []
    deadline = time.time() + settle_s
    while True:
        try:
            ours = {p.name for p in shm.glob("sem.mp-*") if (st := p.stat()).st_uid == uid and st.st_mtime >= since}
        except OSError:  # no /dev/shm (not Linux), or a name unlinked while listed
            return gone
        open_now = ours & mapped_names()
        for name in ours - open_now:
            with contextlib.suppress(OSError):
                (shm / name).unlink()
                gone.append(name)
        if not open_now or time.time() > deadline:
            return gone
        time.sleep(0.5)


def mapped_names() -> set[str]:
    """The names under /dev/shm that some process this user can read maps now."""
    out = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            out.update(line.rsplit("/", 1)[1] for line in maps.read_text().splitlines() if "/dev/shm/" in line)
    return out


def _supervise(argv: list[str], max_restarts: int, out) -> int:
    cmd = [sys.executable, "-m", "tandem.services.app.cli", "run", *argv]
    # unbuffered: a driver killed by SIGKILL leaves every line it printed (a pipe buffers 8 KB otherwise)
    env = dict(os.environ, **{SUPERVISED: "1", "PYTHONUNBUFFERED": "1"})
    restarts = 0
    while True:
        # its own session: a terminal's Ctrl-C reaches only us, and we pass on exactly one
        child = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_child_setup)
        sent = []

        def forward(signum, frame, child=child, sent=sent):
            if not sent:
                sent.append(signum)
                child.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                try:
                    rc = child.wait()
                    break
                except KeyboardInterrupt:  # a signal arrived between two handlers: pass it on, keep waiting
                    forward(signal.SIGINT, None)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        if rc >= 0 or sent:
            return rc if rc >= 0 else 128 - rc  # the shell's convention for a death by signal
        restarts += 1
        name = signal.Signals(-rc).name
        if restarts > max_restarts:
            print(f"tandem: the driver died of {name} {restarts} times (cluster.max_restarts = {max_restarts}); "
                  "stopping", file=out, flush=True)
            return 1
        print(f"tandem: the driver died of {name}; restart {restarts} of {max_restarts} from the newest "
              "checkpoint", file=out, flush=True)
        if "checkpoint.resume=true" not in cmd:
            cmd += ["--set", "checkpoint.resume=true"]
