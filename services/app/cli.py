"""`tandem`: plan | check | run | submit | scale | status | export | tiny-model."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from pathlib import Path

from tandem.core.config import JobConfig, JobConfigError, JobShape, with_absolute_paths
from tandem.core.plan import BatchPlan, arithmetic, table
from tandem.services.app.run import one_line


def load_shape(path: str, overrides: list[str]) -> JobShape:
    """The whole job file through the job schema, model/data/rewards optional: what plan, scale and
    status need, without the model or data on this machine."""
    return JobShape.from_yaml(path, overrides)


def load_plan(path: str, overrides: list[str]) -> BatchPlan:
    return BatchPlan.from_config(load_shape(path, overrides))


def cmd_plan(args) -> int:
    plan = load_plan(args.job, args.set)
    print("\n".join(arithmetic(plan)))
    print()
    print(table(plan, cycles=args.cycles))
    return 0


def cmd_check(args) -> int:
    from tandem.core.checks import (
        check_inputs,
        earlier_run,
        lora_target_error,
        raise_if,
        run_dir_in_use,
        this_machine_errors,
    )
    from tandem.core.compat import load_tokenizer
    from tandem.rollout.episodes import job_tool_schemas
    from tandem.services.orchestrator.data import prompt_table, read_dataset

    cfg = JobConfig.from_yaml(args.job, args.set)
    check_inputs(cfg, run_dir=False)  # an earlier run in output_dir is said below, not called invalid
    raise_if([lora_target_error(cfg)])  # what the learner and the engines would refuse once started
    tok = load_tokenizer(cfg.model.local_dir())  # the prompts tokenised as the controller will (prompt_table)
    schemas = job_tool_schemas(cfg, tok)
    for name in ("data", "eval"):  # what the controller refuses at the start
        sec = getattr(cfg, name)
        if sec.path is not None:
            prompt_table(read_dataset(f"{name}.path", sec.path, sec.name, sec.split), cfg, tok, schemas, sec.path)
    plan = BatchPlan.from_config(cfg)
    print(f"{args.job}: valid; model, data and {len(cfg.rewards)} reward function(s) found on this machine; "
          f"{plan.unique_prompts} prompts × {plan.num_generations} completions per generation cycle")
    for why in this_machine_errors(cfg):  # valid for a cluster that has what this machine lacks
        print(f"on this machine `tandem run` would refuse it: {why}")
    if (then := earlier_run(cfg)) is not None:
        used, out = run_dir_in_use(cfg), cfg.logging.output_dir
        print({"resume": f"{out} holds an earlier run ({used}): `tandem run` resumes it (checkpoint.resume: true)",
               "overwrite": f"{out} holds an earlier run ({used}): `tandem run` starts over there "
                            "(logging.overwrite_output_dir: true)",
               "refuse": f"{out} holds an earlier run ({used}): `tandem run` would refuse it as it is; set "
                         "checkpoint.resume: true to continue it, logging.overwrite_output_dir: true to start over, "
                         "or another logging.output_dir"}[then])
    return 0


def cmd_run(args) -> int:
    from tandem.core.checks import check_inputs
    from tandem.services.app.supervisor import SUPERVISED, supervise

    cfg = with_absolute_paths(JobConfig.from_yaml(args.job, args.set), os.getcwd())  # actors start elsewhere
    address = args.address or cfg.cluster.address
    if cfg.cluster.max_restarts > 0 and not os.environ.get(SUPERVISED):  # the driver as a child, restarted;
        return supervise([args.job, *(x for s in args.set for x in ("--set", s)),  # it checks the inputs
                          *(["--address", args.address] if args.address else [])], cfg.cluster.max_restarts)
    from tandem.services.app.run import hold_run_dirs, run_job

    with hold_run_dirs(cfg):  # before the checks: a running job's directory is named as such
        check_inputs(cfg)  # the driver sees the same files as every node (README: shared filesystem)
        return run_job(cfg, address=address)


def _inside(job: str, directory: str) -> str:
    """The job file's path relative to the uploaded directory (how the cluster finds it there)."""
    try:
        return str(Path(job).absolute().relative_to(Path(directory).absolute()))
    except ValueError:
        raise JobConfigError(f"job file {job!r}: not inside the uploaded directory {directory!r}; allowed: a job file "
                             "under the directory `tandem submit` runs in (or under --working-dir)") from None


def cmd_submit(args) -> int:
    import shutil

    from tandem.services.app.run import submit_job
    from tandem.services.app.upload import plan_job_upload, plan_upload

    cfg = JobConfig.from_yaml(args.job, args.set)  # the schema only: the files and CUDA are the cluster's
    for field, d in (("logging.output_dir", cfg.logging.output_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if d is not None and not os.path.isabs(d) and "://" not in d:
            raise JobConfigError(f"{field} = {d!r}: relative; under `tandem submit` the run would write into Ray's "
                                 "temporary copy of the uploaded directory on the head, which Ray deletes when the "
                                 "cluster stops; allowed: a storage URI every node reaches (s3://bucket/run, "
                                 "gs://...), or an absolute path on a filesystem every node mounts")
    upload, job = None, args.job
    if args.working_dir:  # the whole directory, spelled out: scanned, credentials held back
        upload = plan_upload(args.working_dir, args.allow)
        job = _inside(args.job, args.working_dir)
    elif args.working_dir is None:  # what the job names, nothing else
        job = _inside(args.job, ".")
        upload = plan_job_upload(job, cfg, args.include, args.allow)
    if upload is not None:
        print("\n".join(upload.lines()))
    if args.dry_run:
        print(f"{args.job}: valid; --dry-run: nothing sent")
        return 0
    stage = upload.stage() if upload is not None else None
    try:
        client, job_id = submit_job(job, args.set, args.address, stage,
                                    source_dir=str(upload.root) if upload is not None else None)
    except TimeoutError as e:
        print(f"tandem submit: the Jobs API at {args.address or 'this machine'} did not take the job: {e}",
              file=sys.stderr)
        return 1
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
    where = f" --address {args.address}" if args.address else ""
    print(f"submitted {job_id}: follow with `ray job logs -f {job_id}{where}`, stop with "
          f"`ray job stop {job_id}{where}`; `tandem status {args.job}` on a machine of the cluster")
    return follow_job(client, job_id) if args.wait else watch_start(client, job_id)


def follow_job(client, job_id: str) -> int:
    """`tandem submit --wait`: the job's log printed as it comes, then its end. -> 0 where it succeeded, else 1."""
    import asyncio

    async def follow():
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)
    asyncio.run(follow())
    status = client.get_job_status(job_id)
    for _ in range(30):  # the log closes as the job ends; its status may follow a moment later
        if status.is_terminal():
            break
        time.sleep(1)
        status = client.get_job_status(job_id)
    print(f"job {job_id}: {status}")
    return 0 if str(status) == "SUCCEEDED" else 1


def watch_start(client, job_id: str, patience_s: float = 300.0) -> int:
    """A detached submission followed until the job has started training (its checks passed on the cluster: the
    run directory writable there, the model and data found) or has failed: a job refused on the cluster is said here
    with its reason, not only in its log. -> 0, or 1 where the job failed."""
    from tandem.services.app.run import STARTED

    give_up = time.time() + patience_s
    while time.time() < give_up:
        status = client.get_job_status(job_id)
        logs = client.get_job_logs(job_id)
        if started := next((ln for ln in logs.splitlines() if ln.startswith(STARTED)), None):
            print(started)
            return 0
        if status.is_terminal():
            said = [ln for ln in logs.splitlines() if ln.startswith("tandem: ")] or logs.strip().splitlines()[-1:]
            print(f"job {job_id}: {status}" + (f": {said[-1]}" if said else ""), file=sys.stderr)
            return 0 if str(status) == "SUCCEEDED" else 1
        time.sleep(1)
    print(f"job {job_id}: not started after {patience_s:.0f} s (waiting for resources?); it goes on: follow its log")
    return 0


def output_dir_of(path: str, overrides: list[str]) -> str:
    """A job file's run directory (all `scale` and `status` need: the running job is found by it)."""
    return load_shape(path, overrides).logging.output_dir


def worker_count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"num_rollout_workers = {text!r}; allowed a whole number >= 1")
    return int(text)


def cmd_scale(args) -> int:
    from tandem.services.app.run import connect_controller

    ray, ctl = connect_controller(output_dir_of(args.job, args.set), args.address)
    st = ray.get(ctl.scale.remote(args.workers))
    print(f"rollout workers: {st['workers']} now, {st['target_workers']} from the next generate call "
          "(new ones start with the current adapter; removed ones finish their prompts first)")
    return 0


def cmd_status(args) -> int:
    from tandem.services.app.run import connect_controller

    ray, ctl = connect_controller(output_dir_of(args.job, args.set), args.address)
    try:  # the controller answers from its second thread, even mid-cycle; a wedged one must not hold us
        st = ray.get(ctl.status.remote(), timeout=30)
    except ray.exceptions.GetTimeoutError:
        print(f"tandem status: the job writing to {output_dir_of(args.job, args.set)!r} did not answer within 30 s",
              file=sys.stderr)
        return 1
    print(f"cycle {st['cycle']}/{st['total_cycles']}, policy version {st['version']}, rollout workers "
          f"{st['workers']} (target {st['target_workers']}; {st['serving']} serving, {st['workers'] - st['serving']} "
          f"starting), prompts in flight {st['in_flight']}, "
          f"groups buffered {st['buffered']}")
    if st["counters"]:
        print("counts: " + ", ".join(f"{k} {v}" for k, v in sorted(st["counters"].items())))
    return 0


def cmd_export(args) -> int:
    from tandem.services.app.export import export_merged

    dst = export_merged(args.source, args.merged, args.dtype, args.base)
    print(f"wrote a merged transformers model to {dst} (load with AutoModelForCausalLM.from_pretrained or vLLM)")
    return 0


def cmd_tiny_model(args) -> int:
    from tandem.services.devtools.tiny_model import build_tiny_model

    build_tiny_model(args.dir, layers=args.layers, hidden=args.hidden, vocab=args.vocab, seed=args.seed,
                     tie_word_embeddings=args.tie)
    print(f"wrote a random-init Qwen2-shaped model and tokenizer to {args.dir}")
    return 0


def add_job_commands(sub) -> None:
    """run, submit, scale, status: the commands that start or reach a job."""
    sr = sub.add_parser("run", help="run a job (embedded Ray unless --address)")
    sr.add_argument("job")
    sr.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    sr.add_argument("--address", default=None, help="Ray cluster address to join")
    sr.set_defaults(fn=cmd_run)

    su = sub.add_parser("submit", help="run a job on a Ray cluster through its Jobs API (detached)")
    su.add_argument("job")
    su.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    su.add_argument("--address", default=None,
                    help="the cluster's dashboard, e.g. http://head:8265 (default: RAY_ADDRESS, else this machine)")
    su.add_argument("--working-dir", default=None,
                    help="upload this whole directory (scanned: credentials held back) as the job's working directory; "
                         "default: only what the job names, from here; '' uploads nothing")
    su.add_argument("--include", action="append", default=[], metavar="PATH",
                    help="upload this file or folder too (the default upload: only what the job names)")
    su.add_argument("--wait", action="store_true", help="print the job's log until it ends; exit 1 unless it succeeded")
    su.add_argument("--allow", action="append", default=[], metavar="PATH",
                    help="upload this file (or folder) even though it looks like a credential (as the list or the refusal names it)")
    su.add_argument("--dry-run", action="store_true",
                    help="validate the job file, print what would be uploaded and held back, send nothing")
    su.set_defaults(fn=cmd_submit)

    sc = sub.add_parser("scale", help="change the rollout worker count of a running job")
    sc.add_argument("job", help="the job file it was started with (the job is found by its run directory)")
    sc.add_argument("workers", type=worker_count, metavar="NUM_ROLLOUT_WORKERS")
    sc.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    sc.add_argument("--address", default=None, help="Ray cluster address (default: the one on this machine)")
    sc.set_defaults(fn=cmd_scale)

    ss = sub.add_parser("status", help="cycle, version and workers of a running job")
    ss.add_argument("job", help="the job file it was started with")
    ss.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ss.add_argument("--address", default=None, help="Ray cluster address (default: the one on this machine)")
    ss.set_defaults(fn=cmd_status)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description="Distributed GRPO training on Ray + vLLM + DeepSpeed")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("plan", help="print the batch arithmetic and the schedule of two generation cycles")
    sp.add_argument("job")
    sp.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    sp.add_argument("--cycles", type=int, default=2)
    sp.set_defaults(fn=cmd_plan)

    sk = sub.add_parser("check", help="validate a job file and check its model, data and rewards on this machine")
    sk.add_argument("job")
    sk.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    sk.set_defaults(fn=cmd_check)

    add_job_commands(sub)

    se = sub.add_parser("export", help="merge a run's (or a checkpoint's) adapter into its base model")
    se.add_argument("source", metavar="RUN_OR_CHECKPOINT")
    se.add_argument("--merged", required=True, metavar="DIR", help="where the merged model directory goes")
    se.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="dtype of the merged weights (default: the base model's)")
    se.add_argument("--base", default=None, metavar="MODEL",
                    help="the base model here, where the one the adapter records is not reachable from this machine")
    se.set_defaults(fn=cmd_export)

    st = sub.add_parser("tiny-model", help="write a tiny random-init model + local tokenizer")
    st.add_argument("dir")
    st.add_argument("--layers", type=int, default=2)
    st.add_argument("--hidden", type=int, default=64)
    st.add_argument("--vocab", type=int, default=512)
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--tie", action="store_true", help="tie lm_head to the embeddings")
    st.set_defaults(fn=cmd_tiny_model)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.simplefilter("default")
    try:
        return args.fn(args)
    except JobConfigError as e:  # also when raised inside an actor (Ray's error is both classes)
        print(f"tandem: {one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a run-time error: one line here, the traceback in a file
        print(f"tandem: {one_line(e)} (traceback: {write_error_log(args, e)})", file=sys.stderr)
        return 1


def write_error_log(args, e: BaseException) -> str:
    """The whole traceback (Ray's included) in <output_dir>/error.log when the command has a job, else a
    temporary file. -> its path."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(e))
    try:
        from tandem.core.storage import Store, is_uri, local_run_dir

        out = output_dir_of(args.job, args.set)
        path = local_run_dir(out) / "error.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if is_uri(out):
            with contextlib.suppress(OSError):  # the local copy is named either way
                Store(out).put_file(path, "error.log")
    except Exception:  # noqa: BLE001 - no job file, or a run directory this user cannot write
        path = Path(tempfile.mkstemp(prefix="tandem-error-", suffix=".log")[1])
        path.write_text(text)
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
