"""`tandem`: plan | run | submit | scale | status | tiny-model."""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import yaml
from pydantic import ValidationError
from tandem.services.config import (
    BatchConfig,
    ClusterConfig,
    GRPOConfig,
    JobConfig,
    JobConfigError,
    apply_override,
    format_validation_error,
    resolve_batch,
)
from tandem.services.plan import BatchPlan, arithmetic, table


def read_job_file(path: str, overrides: list[str]) -> dict:
    """The job file as a dict with --set overrides applied, unvalidated (for commands that read only
    a part of it)."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise JobConfigError(f"job file {path!r}: {e.strerror}") from None
    for item in overrides:
        apply_override(data, item)
    return data


def load_plan(path: str, overrides: list[str]) -> BatchPlan:
    """Only the batch-shaping sections are read, so a plan needs no model or data on disk."""
    data = read_job_file(path, overrides)
    try:
        batch = BatchConfig.model_validate(data.get("batch", {}))
        grpo = GRPOConfig.model_validate({"num_iterations": data.get("grpo", {}).get("num_iterations", 1)})
        cluster = ClusterConfig.model_validate(data.get("cluster", {}))
        resolve_batch(batch, grpo.num_iterations, cluster.num_processes)
    except ValidationError as e:
        raise JobConfigError(format_validation_error(e)) from None
    except ValueError as e:
        raise JobConfigError(f"invalid job: {e}") from None
    return BatchPlan.from_sections(batch, cluster.num_processes, grpo.num_iterations)


def cmd_plan(args) -> int:
    plan = load_plan(args.job, args.set)
    print("\n".join(arithmetic(plan)))
    print()
    print(table(plan, cycles=args.cycles))
    return 0


def cmd_run(args) -> int:
    from tandem.services.run import run_job

    cfg = JobConfig.from_yaml(args.job, args.set)
    return run_job(cfg, address=args.address)


def cmd_submit(args) -> int:
    from tandem.services.run import submit_job

    JobConfig.from_yaml(args.job, args.set)  # a bad job file is refused here, not in the cluster's log
    try:
        client, job_id = submit_job(args.job, args.set, args.address, args.working_dir)
    except TimeoutError as e:
        print(f"tandem submit: the Jobs API at {args.address or 'this machine'} did not take the job: {e}",
              file=sys.stderr)
        return 1
    where = f" --address {args.address}" if args.address else ""
    print(f"submitted {job_id}: follow with `ray job logs -f {job_id}{where}`, stop with "
          f"`ray job stop {job_id}{where}`; `tandem status {args.job}` on a machine of the cluster")
    if not args.wait:
        return 0
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


def output_dir_of(path: str, overrides: list[str]) -> str:
    """A job file's run directory (all `scale` and `status` need: the running job is found by it)."""
    from tandem.services.config import LoggingConfig

    logging = read_job_file(path, overrides).get("logging") or {}
    return logging.get("output_dir") or LoggingConfig().output_dir


def worker_count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"num_rollout_workers = {text!r}; allowed a whole number >= 1")
    return int(text)


def cmd_scale(args) -> int:
    from tandem.services.run import connect_controller

    ray, ctl = connect_controller(output_dir_of(args.job, args.set), args.address)
    st = ray.get(ctl.scale.remote(args.workers))
    print(f"rollout workers: {st['workers']} now, {st['target_workers']} from the next generate call "
          "(new ones start with the current adapter; removed ones finish their prompts first)")
    return 0


def cmd_status(args) -> int:
    from tandem.services.run import connect_controller

    ray, ctl = connect_controller(output_dir_of(args.job, args.set), args.address)
    st = ray.get(ctl.status.remote())
    print(f"cycle {st['cycle']}/{st['total_cycles']}, policy version {st['version']}, rollout workers "
          f"{st['workers']} (target {st['target_workers']}), prompts in flight {st['in_flight']}, "
          f"groups buffered {st['buffered']}")
    if st["counters"]:
        print("counts: " + ", ".join(f"{k} {v}" for k, v in sorted(st["counters"].items())))
    return 0


def cmd_tiny_model(args) -> int:
    from tandem.rollout.tiny_model import build_tiny_model

    build_tiny_model(args.dir, layers=args.layers, hidden=args.hidden, vocab=args.vocab, seed=args.seed,
                     tie_word_embeddings=args.tie)
    print(f"wrote a random-init Qwen2-shaped model and tokenizer to {args.dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem", description="Distributed GRPO training on Ray + vLLM + DeepSpeed")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("plan", help="print the batch arithmetic and the schedule of two generation cycles")
    sp.add_argument("job")
    sp.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    sp.add_argument("--cycles", type=int, default=2)
    sp.set_defaults(fn=cmd_plan)

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
    su.add_argument("--working-dir", default=".",
                    help="uploaded and made the job's working directory (default: here); '' uploads nothing")
    su.add_argument("--wait", action="store_true", help="print the job's log until it ends; exit 1 unless it succeeded")
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

    st = sub.add_parser("tiny-model", help="write a tiny random-init model + local tokenizer")
    st.add_argument("dir")
    st.add_argument("--layers", type=int, default=2)
    st.add_argument("--hidden", type=int, default=64)
    st.add_argument("--vocab", type=int, default=512)
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--tie", action="store_true", help="tie lm_head to the embeddings")
    st.set_defaults(fn=cmd_tiny_model)

    args = p.parse_args(argv)
    warnings.simplefilter("default")
    try:
        return args.fn(args)
    except JobConfigError as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
