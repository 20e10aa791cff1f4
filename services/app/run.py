"""`tandem run`: embedded Ray (or --address), the actors, a progress bar, the plot."""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from tandem.core.adapter import ADAPTER_DIR
from tandem.core.errors import LearnerLost

# The embedded Ray's GCS address, in the run directory: `tandem scale` / `status` without --address find the job's
# own Ray by it. Ray's "auto" connects to any Ray on the machine when there are several (two embedded jobs, a
# `ray start` cluster beside one), and that one refuses this job's token or holds another job.
RAY_ADDRESS_FILE = "ray_address"


def start_ray(address: str | None, cfg):
    import ray

    from tandem.core.compat import init_local_ray, job_env_vars

    if ray.is_initialized():
        return ray
    env = {"env_vars": job_env_vars(os.getcwd())}
    if address:
        use_cluster_token()
        refuse_a_wrong_token(address)
        ray.init(address=address, runtime_env=env, log_to_driver=False)
    else:
        need = (cfg.cluster.num_rollout_workers * cfg.cluster.rollout_resources.num_cpus
                + cfg.cluster.num_processes * cfg.cluster.learner_resources.num_cpus)
        init_local_ray(max(int(need) + 1, os.cpu_count() or 1), runtime_env=env)
        recorded = Path(cfg.run_dir) / RAY_ADDRESS_FILE
        recorded.parent.mkdir(parents=True, exist_ok=True)
        recorded.write_text(ray.get_runtime_context().gcs_address)
        atexit.register(recorded.unlink, missing_ok=True)  # the embedded Ray ends with this process
    return ray


NAMESPACE = "tandem"
RESOURCE_WAIT_S = 60.0  # on a cluster: time for an autoscaler to add a node a request needs


def cluster_token() -> str | None:
    """The token of a token-authenticated Ray cluster this machine holds, where Ray keeps it:
    RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token (`ray get-auth-token`)."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return path.read_text().strip() or None if path.is_file() else None


def use_cluster_token() -> None:
    """Before ray.init joins a cluster: a token this machine holds turns Ray's token auth on (Ray itself
    only does when RAY_AUTH_MODE=token is exported, and then says "no cluster")."""
    if os.environ.get("RAY_AUTH_MODE") is None and cluster_token():
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()


def refuse_a_wrong_token(address: str) -> None:
    """A GCS at host:port that refuses this machine's token is named as such now: ray.init retries for 20 s,
    logging a warning a second, then reports no cluster at all. One GetClusterId call, Ray's own first call,
    with the token in the header Ray's clients send (AuthenticationTokenLoader.get_token_for_http_header)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    from tandem.core.config import JobConfigError

    if address in ("auto", "local") or "://" in address:
        return  # found by Ray itself, or Ray Client: nothing to ask here
    token = cluster_token()
    with grpc.insecure_channel(address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=5,
                metadata=[("authorization", f"Bearer {token}")] if token else [])
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                return  # not up yet, or not there: ray.init waits for it and says so
            held = "refused this machine's token" if token else "needs a token and this machine holds none"
            raise JobConfigError(f"the Ray cluster at {address} {held} ({e.details()}); allowed: its token in "
                                 "RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token "
                                 "(`ray get-auth-token` on the head)") from None


def controller_name(output_dir: str) -> str:
    """A running job's Controller is a named actor: `tandem scale` and `tandem status` find it by the
    job's run directory (two jobs cannot share one)."""
    from tandem.core.storage import is_uri

    return "controller:" + (output_dir.rstrip("/") if is_uri(output_dir) else str(Path(output_dir).resolve()))


def start_controller(ray, cfg, resource_wait_s: float = 0.0, out=None, datasets: dict | None = None):
    """The Controller actor, named after the run directory; two threads, so that `scale` and `status`
    are answered while a cycle runs. resource_wait_s: how long a request no node has may wait for an
    autoscaler (0 on the embedded Ray: no node will join it); meanwhile what it waits for is printed every
    WAIT_REPORT_S. datasets: rows given from Python, as Ray references (GRPOTrainer), the controller reads."""
    from tandem.core.config import JobConfigError
    from tandem.services.orchestrator.controller import Controller

    out = out or sys.stdout  # looked up now: a caller may have redirected it
    name = controller_name(cfg.logging.output_dir)
    if not name_is_free(ray, name):
        raise JobConfigError(f"logging.output_dir = {cfg.logging.output_dir!r}: a job writing there is already "
                             "running on this Ray cluster; allowed: a run directory no running job uses")
    # on this driver's node (the head, under `tandem submit`), never on a rollout node that may be lost: the
    # controller owns every group's object and the job's state
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    ctl = ray.remote(num_cpus=0, max_concurrency=2)(Controller).options(
        name=name, namespace=NAMESPACE, scheduling_strategy=here).remote(cfg, datasets)
    try:  # waited for: a threaded actor does not keep its calls in order
        wait_reporting(ray, cfg, ctl.setup.remote(resource_wait_s, own_process=True), resource_wait_s, out, ctl)
    except Exception:
        stop_controller(ray, ctl)  # what its setup started (engines, reward processes) goes first
        raise
    except BaseException:
        ray.kill(ctl)  # frees the name (an interrupted setup still holds the controller: no shutdown call)
        raise
    return ctl


def stop_controller(ray, ctl) -> None:
    """A controller's actors stopped in order (engines first: their shared memory, reward processes and adapter
    files go with them; a killed actor leaves those behind), then the controller itself, whose name is freed."""
    with contextlib.suppress(Exception):  # a dead controller has nothing left to stop
        ray.get(ctl.shutdown.remote(), timeout=60)
    ray.kill(ctl)


WAIT_REPORT_S = 10.0


def wait_reporting(ray, cfg, ref, wait_s: float, out, ctl=None) -> None:
    """ray.get(ref) of the controller's setup; every WAIT_REPORT_S while a role's request fits no node (the
    setup waits up to wait_s for an autoscaler to add one), one line saying what it waits for, and the lines the
    controller said meanwhile (how far it has tokenised a large dataset)."""
    from tandem.core.checks import resource_errors

    t0 = time.time()
    while not ray.wait([ref], timeout=WAIT_REPORT_S)[0]:
        if ctl is not None:
            try:  # a threaded actor: answered while its setup runs
                for line in ray.get(ctl.__ray_call__.remote(taken_notices), timeout=10):
                    print(line, file=out, flush=True)
            except Exception:  # noqa: BLE001,S110 - busy or gone: the setup's own result says which
                pass
        if errors := resource_errors(cfg, ray.nodes()):
            print(f"tandem: waiting for a node ({time.time() - t0:.0f} s of {wait_s:.0f}): " + "; ".join(errors),
                  file=out, flush=True)
    ray.get(ref)


def taken_notices(_controller) -> list[str]:
    """In the controller's process: the lines it said since they were last taken."""
    from tandem.services.orchestrator.controller import notices

    return notices()


def name_is_free(ray, name: str, patience_s: float = 60.0) -> bool:
    """No live controller holds `name`. One that is dying (its driver was killed a moment ago: Ray
    kills a driver's actors once it notices) is waited for, up to patience_s."""
    end = time.time() + patience_s
    while True:
        try:
            held = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return True
        try:
            ray.get(held.status.remote(), timeout=10)
            return False  # it answers: a running job
        except ray.exceptions.GetTimeoutError:
            return False  # alive but busy: a running job all the same
        except ray.exceptions.RayActorError:
            if time.time() > end:
                return False
            time.sleep(0.5)


def connect_controller(output_dir: str, address: str | None):
    """The Controller of the job running with this run directory, on the cluster at `address` (None: the
    embedded Ray the run directory records, else the one on this machine)."""
    import ray

    from tandem.core.config import JobConfigError
    from tandem.core.storage import local_run_dir

    if not ray.is_initialized():
        use_cluster_token()
        recorded = local_run_dir(output_dir) / RAY_ADDRESS_FILE
        address = address or (recorded.read_text().strip() if recorded.is_file() else None)
        if address:
            refuse_a_wrong_token(address)
        try:
            ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
        except ray.exceptions.AuthenticationError as e:
            raise JobConfigError(f"the Ray cluster at {address or 'this machine'} refused this machine's token "
                                 f"({str(e).splitlines()[0]}); allowed: its token in RAY_AUTH_TOKEN, the file "
                                 "RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token") from None
        except ConnectionError as e:
            raise JobConfigError(f"no Ray cluster at {address or 'this machine'} ({e})") from None
    try:
        return ray, ray.get_actor(controller_name(output_dir), namespace=NAMESPACE)
    except ValueError:
        raise JobConfigError(f"no running job writes to {output_dir!r} on the Ray cluster at "
                             f"{address or 'this machine'}") from None


def submit_job(job: str, overrides: list[str], address: str | None, working_dir: str | None,
               patience_s: float = 180.0, source_dir: str | None = None) -> tuple:
    """`tandem run` of this job file as a Ray job (Jobs API of the cluster's dashboard at `address`;
    None: RAY_ADDRESS or this machine). working_dir (services/app/upload.py stages what is sent) is uploaded and
    becomes the job's working directory, so the job file and its relative paths must lie inside it. A head that has just
    started may refuse (no job agent yet) or not answer a submission: it is retried under one
    submission id (so never started twice) for up to patience_s. -> (client, job id)"""
    import uuid

    from ray.job_submission import JobSubmissionClient

    entry = ["python", "-m", "tandem.services.app.cli", "run", job, "--address", "auto"]
    runtime_env = {"working_dir": working_dir} if working_dir else None
    if runtime_env and source_dir:  # what the run records names the user's files, not Ray's copy (storage.as_named)
        runtime_env["env_vars"] = {"TANDEM_SOURCE_DIR": str(Path(source_dir).absolute())}
    for item in overrides:
        entry += ["--set", item]
    token = cluster_token()  # sent as Ray's own clients send it; ignored by a cluster without token auth
    client = JobSubmissionClient(address, headers={"authorization": f"Bearer {token}"} if token else None)
    job_id = f"tandem-{uuid.uuid4().hex[:12]}"
    give_up = time.time() + patience_s
    while True:
        try:
            answered_within(lambda: client.submit_job(
                entrypoint=shlex.join(entry), submission_id=job_id, metadata={"tandem_job": job},
                runtime_env=runtime_env), 30.0)
            return client, job_id
        except (RuntimeError, TimeoutError) as e:
            if "already exists" in str(e):  # an earlier attempt got through after all
                return client, job_id
            if not ("No available agent" in str(e) or isinstance(e, TimeoutError)) or time.time() > give_up:
                raise
            time.sleep(1)


def answered_within(fn, seconds: float):
    """fn() from a daemon thread, or TimeoutError (a blocked HTTP call cannot be interrupted, but it
    must not hold the command, nor the interpreter's exit, forever)."""
    import threading

    box = {}

    def call():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise TimeoutError(f"no answer within {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (what kill, systemd, Slurm and Kubernetes send) takes Ctrl-C's path: a checkpoint, then exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


LOCK_FILE = ".tandem.lock"
STARTED = "tandem: started"  # said once a job's checks passed and its actors serve (`tandem submit` waits for it)


@contextlib.contextmanager
def hold_run_dirs(cfg):
    """hold_run_dir for every directory the run writes: logging.output_dir (metrics, evaluation, the adapter) and
    checkpoint.dir where it lies outside it, every one checked writable before any is taken. Two jobs sharing any
    of them: the second is refused in one line naming the field."""
    from tandem.core.checks import unwritable
    from tandem.core.config import JobConfigError
    from tandem.core.storage import is_uri

    out = Path(cfg.logging.output_dir).absolute()
    dirs = [("logging.output_dir", cfg.logging.output_dir)]
    ck = cfg.checkpoint.dir
    if ck is not None and not is_uri(ck) and not Path(ck).absolute().is_relative_to(out):
        dirs.append(("checkpoint.dir", ck))
    for name, d in dirs:
        if why := unwritable(d, name):
            raise JobConfigError(why)
    if is_uri(ck) and ck.rstrip("/") != cfg.logging.output_dir.rstrip("/"):
        dirs.append(("checkpoint.dir", ck))
    with contextlib.ExitStack() as held:  # a storage URI: its staging directory on this node, and the URI's lease
        for name, d in dirs:  # (one job per URI, from whichever node: tandem/core/storage.py RunLease)
            if is_uri(d):
                held.enter_context(leased(d, name))
            if not is_uri(d) or d == cfg.logging.output_dir:
                held.enter_context(hold_run_dir(str(cfg.run_dir) if d == cfg.logging.output_dir else d, name))
        yield


@contextlib.contextmanager
def leased(location: str, name: str):
    from tandem.core.storage import RunLease

    lease = RunLease(location, name)
    lease.acquire()
    try:
        yield lease
    finally:
        lease.release()


@contextlib.contextmanager
def hold_run_dir(output_dir: str, name: str = "logging.output_dir"):
    """The directory for this driver alone while it runs: an flock on <dir>/.tandem.lock (released by the kernel when
    the process dies, so a restarted driver takes it again), the file removed when the run ends. A second `tandem run`
    into it is refused in one line, before it starts a Ray or clears the directory; so is a directory it cannot
    write."""
    import fcntl
    import socket

    from tandem.core.checks import unwritable
    from tandem.core.config import JobConfigError

    if why := unwritable(output_dir, name):
        raise JobConfigError(why)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    path = Path(output_dir) / LOCK_FILE
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            held_by = f.read().strip() or "its lock is held"
            f.close()
            raise JobConfigError(f"{name} = {output_dir!r}: a job is already running in it ({held_by}); allowed: "
                                 "another directory, or the same one once that job has ended (`tandem status` "
                                 "shows it)") from None
        try:  # the file we locked may have been removed by the run that held it before: take the one there now
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()
    try:
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        yield
    finally:
        path.unlink(missing_ok=True)  # while still held: a waiting run then sees a new file, not this one
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def run_job(cfg, address: str | None = None, out=None, datasets: dict | None = None, events=None) -> int:
    """The job to its end: 0, or 130 when interrupted (a checkpoint saved). events (GRPOTrainer's callbacks):
    `after_cycle(result) -> stop?` after each generation cycle; a stop ends the run as its last cycle would."""
    t_start = time.time()
    out = out or sys.stdout  # looked up now: a caller may have redirected it
    ray = start_ray(address, cfg)
    with sigterm_as_interrupt():  # after ray.init, whose core worker installs a SIGTERM handler of its own
        return _run_job(cfg, ray, address, out, t_start, datasets, events)


def _run_job(cfg, ray, address: str | None, out, t_start: float, datasets: dict | None = None, events=None) -> int:
    from tqdm import tqdm

    wait_s = RESOURCE_WAIT_S if address else 0.0
    ctl = None
    try:
        ctl = start_controller(ray, cfg, wait_s, out, datasets)  # stops what it started when it fails
        if cfg.checkpoint.resume:
            resume_job(ray, ctl, out, none=f"checkpoint.resume: no checkpoint to resume from in {cfg.checkpoint_dir}; "
                                          "starting at step 0")
        total, cycle0 = ray.get(ctl.__ray_call__.remote(lambda self: (self.total_cycles, self.cycle)))
        print(f"{STARTED} {cfg.logging.output_dir}: training, cycle {cycle0 + 1} of {total}", file=out, flush=True)
    except KeyboardInterrupt:  # nothing trained by this process yet: the actors go with it, the checkpoints stay
        print("\ninterrupted while starting: no step trained since the newest checkpoint; stopping", file=out)
        return 130
    except Exception:  # a refused resume: the actors stopped in order, nothing trained, nothing cut
        if ctl is not None:
            stop_controller(ray, ctl)
        raise
    bar = tqdm(total=total, initial=cycle0, desc="GRPO", unit="cycle", disable=not cfg.logging.progress, file=out)
    restarts = 0
    try:
        done = cycle0 >= total
        while not done:
            try:
                r = step_saying_why(ray, ctl, bar, out)  # saves when checkpoint.save_steps says so
            # the controller or the learner died; or the owner of an object in flight did: the learner's published
            # adapter, which a replacement rollout worker loads (vllm_mode colocate: worker 0 dies with the learner)
            except (ray.exceptions.RayActorError, ray.exceptions.OwnerDiedError, LearnerLost) as e:
                restarts += 1
                ctl = restart_job(ray, cfg, ctl, e, restarts, out, wait_s, datasets)
                bar.n = ray.get(ctl.__ray_call__.remote(lambda self: self.cycle))
                bar.refresh()
                continue
            for line in r.get("notices", ()):
                bar.write(line, file=out)
            s = r["steps"][-1]
            done = r["done"] or (events is not None and events.after_cycle(r))
            bar.set_postfix(reward=f"{s['reward']:.3f}", step_s=f"{s['cycle_s']:.2f}", v=r["version"])
            bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        return save_interrupted(ray, ctl, out)
    except Exception:  # the job's own error: its actors are stopped in order before the driver reports it
        bar.close()
        stop_controller(ray, ctl)
        raise
    bar.close()
    return finish_job(ray, cfg, ctl, out, t_start)


def finish_job(ray, cfg, ctl, out, t_start: float) -> int:
    """The run trained its steps: the final checkpoint and its artifact (checkpoint.save_final), the actors stopped,
    the summary printed. -> 0."""
    path, artifact = None, None
    if cfg.checkpoint.save_final:
        path = ray.get(ctl.save_checkpoint.remote())
        artifact = publish_artifact(path, cfg)
    stop_controller(ray, ctl)
    print_summary(cfg, out, path, artifact, t_start)
    return 0


def save_interrupted(ray, ctl, out) -> int:
    """Ctrl-C or SIGTERM during training: the cycle stops gathering (the save does not wait for its generation), a
    checkpoint is written, and the run exits 130."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the save short
    print("\ninterrupted: saving a checkpoint before stopping...", file=out)
    ray.get(ctl.interrupt.remote())
    path = ray.get(ctl.save_checkpoint.remote())
    print(f"checkpoint: {path} (resume with --set checkpoint.resume=true)", file=out)
    return 130


QUIET_S = 30.0  # a step this long without a line says, every QUIET_S, what the run waits on
NOTICE_S = 5.0  # what the controller says during a step (a worker not serving, an evaluation postponed) within this


def step_saying_why(ray, ctl, bar, out) -> dict:
    """One controller step; while it runs past QUIET_S, a line every QUIET_S of what it waits on (a slow reward
    function, hung tools, an engine still starting: the prompts out and what has failed so far), never minutes of
    silence."""
    ref = ctl.step.remote()
    t0 = said = time.time()
    while not ray.wait([ref], timeout=min(NOTICE_S, QUIET_S))[0]:
        try:  # a threaded actor: answered while the step runs
            for line in ray.get(ctl.__ray_call__.remote(taken_notices), timeout=10):  # said as it happens
                bar.write(line, file=out)
            if time.time() - said >= QUIET_S:
                said = time.time()
                bar.write(quiet_line(ray.get(ctl.status.remote(), timeout=10), said - t0), file=out)
        except Exception:  # noqa: BLE001,S112 - the controller busy or gone: the step's own result says which
            continue
    return ray.get(ref)


def quiet_line(st: dict, waited: float) -> str:
    c = st["counters"]
    failed = c.get("reward_failures", 0) + c.get("groups_no_reward", 0)
    n = min(st["cycle"] + 1, st["total_cycles"])  # the counter moves before the step's record is written
    return (f"tandem: cycle {n} of {st['total_cycles']}: {waited:.0f} s without a step; "
            f"{st['in_flight']} prompt(s) out (sampling, running tools or being scored), {st['buffered']} group(s) "
            f"back, {st['serving']} rollout worker(s) serving, {st['workers'] - st['serving']} starting"
            + (f"; {failed} prompt(s) failed so far (failed_prompts.jsonl)" if failed else ""))


def print_summary(cfg, out, path: str | None, artifact, t_start: float) -> None:
    """What the run did, from its record: the reward at the start and the end, the evaluations, the steps
    trained, where the metrics, the plot, the checkpoint and the artifact are."""
    from tandem.core.storage import Location, Store, is_uri
    from tandem.services.app.plot import plot_run, read_metrics

    here = Path(cfg.run_dir)
    png = plot_run(here / "metrics.jsonl", here / "reward.png")
    if is_uri(cfg.logging.output_dir):  # the other run files the controller copied as it wrote them
        Store(cfg.logging.output_dir).put_file(png, "reward.png")
        png = Location(cfg.logging.output_dir) / "reward.png"
    out_dir = Location(cfg.logging.output_dir)
    lines = read_metrics(here / "metrics.jsonl")
    rows = [r for r in lines if "reward" in r]  # training steps
    trained = max((r["step"] for r in rows), default=0)  # a line a crash cut is gone, its step trained all the same
    k = min(10, max(len(rows) // 2, 1))
    r0 = sum(r["reward"] for r in rows[:k]) / k
    r1 = sum(r["reward"] for r in rows[-k:]) / k
    print(f"reward: first {k} steps {r0:.3f} -> last {k} steps {r1:.3f} ({r1 - r0:+.3f})", file=out)
    evals = [(r["step"], r["eval/reward"]) for r in lines if "eval/reward" in r]
    if evals:
        shown = evals if len(evals) <= 6 else evals[:1] + evals[-5:]
        print("eval reward: " + ", ".join(f"step {s} {v:.3f}" for s, v in shown) +
              f"  (completions: {out_dir / 'eval'})", file=out)
    print(f"steps: {trained}" + (f" ({trained - len(rows)} without a metrics line: named above)" if len(rows) < trained
                                 else "") + f", wall: {time.time() - t_start:.0f} s", file=out)
    print(f"metrics: {out_dir / 'metrics.jsonl'}  plot: {png}  checkpoint: {path}", file=out)
    if artifact is not None and "://" in str(artifact):
        print(f"{artifact.name}: {artifact} (`tandem export {out_dir} --merged DIR` merges it into its base here)",
              file=out)
    elif artifact is not None and artifact.name == ADAPTER_DIR:
        print(f"adapter: {artifact} (PEFT format): PeftModel.from_pretrained(base, {str(artifact)!r}), vLLM "
              f"LoRARequest('tandem', 1, {str(artifact)!r}), or `tandem export {out_dir} --merged DIR`", file=out)
    elif artifact is not None:
        print(f"model: {artifact} (transformers): AutoModelForCausalLM.from_pretrained({str(artifact)!r})", file=out)


def root_cause(e: BaseException) -> BaseException:
    """The user's error inside Ray's wrappers (RayTaskError.cause, an actor's death cause)."""
    seen = set()
    while getattr(e, "cause", None) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.cause
    return e


def one_line(e: BaseException) -> str:
    """An error as the one line `tandem: ...` prints: its root cause's first line (a TandemError's says what failed
    and where), with the type of any other."""
    from tandem.core.errors import TandemError
    from tandem.core.protocol import ActorError

    c = root_cause(e)
    lines = [x for x in str(c).strip().splitlines() if x.strip()]
    msg = lines[0] if lines else ""
    return msg if isinstance(c, (TandemError, ActorError)) else f"{type(c).__name__}: {msg}"


def restart_job(ray, cfg, ctl, error, restarts: int, out, resource_wait_s: float = 0.0, datasets: dict | None = None):
    """A dead learner rank or controller: the job starts again from its newest complete checkpoint (the
    prompts after it are handed out again, their metrics lines cut), at most cluster.max_restarts times.
    The learner and the rollout workers are the controller's actors: they go with it. -> the new one."""
    from tandem.core.actor_names import death_cause
    from tandem.services.orchestrator.checkpointer import Checkpointer

    # a Ray actor error that reaches the driver is the controller's own death (the learner's comes as LearnerLost)
    reason = (f"the controller actor lost ({death_cause(error)})" if isinstance(error, ray.exceptions.RayActorError)
              else one_line(error)[:300])
    if restarts > cfg.cluster.max_restarts:
        raise RuntimeError(f"the job died {restarts} times (cluster.max_restarts = {cfg.cluster.max_restarts}); "
                           f"last: {reason}") from error
    newest = Checkpointer(cfg).latest()
    print(f"tandem: {reason}; restart {restarts} of {cfg.cluster.max_restarts} from "
          f"{newest if newest is not None else 'the start (no checkpoint yet)'}", file=out)
    stop_controller(ray, ctl)  # start_controller waits for its name to be free
    again = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": True})})
    ctl = start_controller(ray, again, resource_wait_s, out, datasets)
    resume_job(ray, ctl, out, none="resumed from checkpoint: none yet (step 0)")
    return ctl


def resume_job(ray, ctl, out, none: str) -> None:
    """The controller resumes; what it passed over (a checkpoint it skipped, with why and where it was set aside; a
    metrics line a crash cut) is named here, then the one resumed from, or `none`. A run whose checkpoints all fail
    raises (JobConfigError)."""
    resumed = ray.get(ctl.resume.remote())
    for note in ray.get(ctl.resume_notes.remote()):
        print(f"tandem: {note}", file=out)
    print(f"resumed from checkpoint: {resumed}" if resumed else none, file=out)


def publish_artifact(checkpoint: str, cfg):
    """The final checkpoint's adapter (or model), with the model's tokenizer files, also at `<output_dir>/adapter`
    (or `/model`), a path that does not change from run to run (either may be a storage URI). -> where it is (a Path
    where local)."""
    from tandem.core.storage import Location, Store, is_uri
    from tandem.services.orchestrator.trl_checkpoint import write_tokenizer_files

    src, out_dir = Store(checkpoint), cfg.logging.output_dir
    for name in (ADAPTER_DIR, "model"):
        if src.exists(name) and not src.is_file(name):
            src.copy_to(name, Store(out_dir), name)
            write_tokenizer_files(cfg, Store(out_dir), name)
            return Location(out_dir) / name if is_uri(out_dir) else Path(out_dir) / name
    return None
