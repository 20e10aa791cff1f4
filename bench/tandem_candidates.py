"""Tandem as a benchmark candidate: the job built from a workload, run as `tandem run` runs it (embedded Ray, or two
Ray nodes of this machine), and measured per optimizer step from its metrics."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

from machine import T0, PeakPSS, cpu_busy_sampler, gpu_sampler
from workloads import REWARD, in_order, on_gpu

ROOT = Path(__file__).resolve().parents[1]
# Tandem's candidates: max_staleness, cluster.vllm_mode, model.fast_inference
# tandem_k2_colocate: two batches out while one trains (the engine's batch shared by twice the sequences)
# tandem_k4: the bound TRL's AsyncGRPOTrainer runs at by default (TRL_ASYNC_STALENESS), a row beside trl_async
TANDEM = {"tandem_k0": (0, "server", True), "tandem_k1": (1, "server", True), "tandem_k4": (4, "server", True),
          "tandem_k0_colocate": (0, "colocate", True), "tandem_k1_colocate": (1, "colocate", True),
          "tandem_k2_colocate": (2, "colocate", True),
          "tandem_k0_generate": (0, "server", False), "tandem_k1_generate": (1, "server", False)}
# the same job on two Ray nodes of this machine (run_tandem_nodes): max_staleness
TANDEM_NODES = {"tandem_k1_nodes": 1}
# Tandem's run goes one step past the measured ones, its time reported (end_step_s), not averaged in: the run's end is
# one step a run takes once, which over a few measured steps would weigh as one in four. Before the run-end hand-out
# (services/orchestrator/pipeline.py) the last batch at max_staleness >= 1 waited for the slowest completions of every
# prompt still out (the 1.5B long tail's last steps ran 13.6-21.3 s against 4-8 s before); kept so that results from
# before and after that change compare. TRL's trainers stop without waiting for what they have not trained.
END_STEPS = 1
KEYS = ("s_per_step", "gen_s_per_step", "train_s_per_step", "completions_per_s", "gen_tokens_per_s",
        "gpu_busy_frac", "peak_gpu_gib", "publish_latency_s")




def tandem_config(paths, wl, k, args, mode="server", vllm=True):
    """The workload as a Tandem job (max_staleness k, cluster.vllm_mode mode; vllm False: fast_inference
    false, transformers generate samples)."""
    from tandem.core.config import JobConfig

    gpu = on_gpu(args.workload)
    res = lambda g: {"num_cpus": 1, "num_gpus": g}
    return JobConfig.from_dict({
        "model": {"path": paths["model"], "dtype": wl["model"]["dtype"], "lora": wl["lora"],
                  "fast_inference": vllm, "gradient_checkpointing": wl.get("tandem_checkpointing", "auto"),
                  **{k: wl[k] for k in ("padding_free", "max_tokens_per_forward", "use_liger_kernel")
                     if k in wl}},  # else Tandem's defaults
        "data": {"path": paths["data"], "shuffle": not in_order(wl)}, "rewards": [REWARD],
        "generation": {"temperature": 1.0, "max_prompt_length": 64, "max_completion_length": wl["max_tokens"]},
        "batch": {"per_device_train_batch_size": wl["per_device"], "gradient_accumulation_steps": wl["ga"],
                  "num_generations": wl["num_generations"], "max_steps": wl["steps"] + wl["warmup"] + END_STEPS},
        "grpo": {"loss_type": "dapo", "beta": 0.0},
        "optimizer": {"learning_rate": wl["lr"], "lr_scheduler_type": "constant"},
        "cluster": {"num_rollout_workers": 1, "max_staleness": k, "vllm_mode": mode,
                    "rollout_resources": res(args.rollout_gpus if gpu else 0),
                    "learner_resources": res(args.learner_gpus if gpu else 0),
                    "vllm_gpu_memory_utilization": args.vllm_memory or "auto",
                    # each where the workload sets it, else Tandem's default
                    **{k: wl[k] for k in ("learner_sm_carveout", "vllm_merge_adapter", "rollout_prompts_in_flight",
                                          "rollout_oversample_prompts", "vllm_max_num_seqs", "inflight_updates",
                                          "inflight_kv", "max_token_lag") if k in wl}},
        # group_trace: what became of each group (bench/results keep it beside the run's JSON)
        "logging": {"output_dir": str(Path(args.dir) / f"run-k{k}"), "progress": False, "group_trace": True},
    })


def run_tandem(paths, wl, k, args, mode="server", vllm=True) -> dict:
    return measure_tandem(tandem_config(paths, wl, k, args, mode, vllm), wl, on_gpu(args.workload))


def run_tandem_nodes(paths, wl, k, args) -> dict:
    """The tandem_k{k} job with its learner on one Ray node (the head, a `learner` resource) and its rollout worker
    on another (a `rollout` resource), two `ray start` of this machine each offering its GPUs: the adapter goes
    from node to node through Ray's object transfer, as between two machines, not through one node's store."""
    import secrets
    import tempfile

    from tandem.services.devtools.local_nodes import join_nodes, start_head, stop

    gpus = 1 if on_gpu(args.workload) else None
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))  # the driver joins with it
    env = dict(os.environ)
    cpus = max((os.cpu_count() or 2) // 2, 1)
    head, gcs = start_head(env, tempfile.mkdtemp(prefix="ray"), cpus, gpus, {"learner": 1})
    node = None
    try:
        [node] = join_nodes(gcs, env, {"rollout": 1}, cpus, 1, num_gpus=gpus)
        cfg = tandem_config(paths, wl, k, args)
        c = cfg.cluster
        cfg = cfg.model_copy(update={"cluster": c.model_copy(update={
            "rollout_resources": c.rollout_resources.model_copy(update={"resources": {"rollout": 1}}),
            "learner_resources": c.learner_resources.model_copy(update={"resources": {"learner": 1}})})})
        return measure_tandem(cfg, wl, gpus is not None, address=gcs)
    finally:
        import ray

        ray.shutdown()
        stop([node, head] if node else [head])


def actor_nodes(ray, ctl) -> dict:
    """The Ray node ids of the job's learner ranks and rollout workers, asked of the actors through the controller."""
    def ask(self):
        import ray

        def node(a):
            return ray.get(a.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))
        return {"learner": [node(a) for a in self.learner.actors], "rollout": [node(w) for w in self.workers]}
    return ray.get(ctl.__ray_call__.remote(ask))


CYCLE_KEYS = ("step", "generate_wait_s", "train_s", "publish_s", "cycle_s", "rollout_busy_s", "rollout/batch_sampling_s",
              "rollout/group_sampling_s", "rollout/group_buffered_s", "rollout/sampled_ahead_frac",
              "learner/time/forwards_s",
              "prompts_in_flight", "queue_depth", "count/batches_trained_ahead", "count/burst_waits", "count/stale_dropped",
              "count/stale_stopped", "count/stale_failed", "count/stale_dropped_tokens", "rollout/stale_waste_frac",
              "rollout/engine_steps_per_s", "rollout/sequences_per_step",
              # what the batch trained and how far behind it was: which of the two k >= 1 regimes a cycle is in
              "completion_length", "completion_length_max", "staleness_hist")


def rollout_snapshot(ray, ctl) -> dict:
    """The controller's snapshot of its serving rollout workers' stats (services/orchestrator/run_log.py
    rollout_rates): {"t", "workers": {worker: stats}}."""
    return ray.get(ctl.__ray_call__.remote(lambda self: self._rollout_stats()))


def engine_start_s(ray, ctl) -> list:
    """Each serving rollout worker's engine build, in seconds (its stats)."""
    return [s["engine_start_s"] for s in rollout_snapshot(ray, ctl)["workers"].values()]


def measure_tandem(cfg, wl, gpu: bool, address: str | None = None) -> dict:
    """A Tandem job run as `tandem run` runs it (embedded Ray, or the cluster at `address`; its controller), timed
    after the warm-up steps and up to the run's end (END_STEPS). `start_s` says where the time to the first step
    went: the workload's preparation, the actors' start, the first (warm-up) step, each engine's build."""
    from tandem.services.app.run import start_controller, start_ray
    from tandem.services.orchestrator.run_log import rollout_rates

    t_enter = time.time()
    shutil.rmtree(cfg.logging.output_dir, ignore_errors=True)
    ray = start_ray(address, cfg)
    pss = PeakPSS() if not gpu else None
    ctl = start_controller(ray, cfg)
    placed = actor_nodes(ray, ctl)
    start_s = {"prepare": t_enter - T0, "actors": time.time() - t_enter}
    rows, first_step_s, stop, cpu, step_s = [], None, None, None, []
    for i in range(wl["warmup"] + wl["steps"]):
        if i == wl["warmup"]:
            stop, cpu, t_meas, engines = gpu_sampler(), cpu_busy_sampler(), time.time(), rollout_snapshot(ray, ctl)
        t_step = time.time()
        r = ray.get(ctl.step.remote())
        if first_step_s is None:
            first_step_s, start_s["first_step"] = time.time() - T0, time.time() - t_step
            start_s["engines"] = engine_start_s(ray, ctl)
        if i >= wl["warmup"]:
            rows += r["steps"]
            step_s.append(time.time() - t_step)
    wall = time.time() - t_meas
    # the engines over the measured steps: the share of their work stopped past the bound, their step rate and load
    engines = rollout_rates(engines, rollout_snapshot(ray, ctl))
    cores = cpu()
    gpu_stats = stop() if stop else {}
    end_step_s = []  # the run's end, past the measured steps (END_STEPS)
    for _ in range(cfg.batch.max_steps - wl["warmup"] - wl["steps"]):
        t_step = time.time()
        ray.get(ctl.step.remote())
        end_step_s.append(time.time() - t_step)
    ray.get(ctl.shutdown.remote())
    ray.kill(ctl)
    if address is None:
        ray.shutdown()
    def med(key, how=statistics.median):
        vals = [s[key] for s in rows if s.get(key) is not None]
        return how(vals) if vals else None
    top = lambda key: med(key, max)
    per_step = wall / len(rows)
    out = {
        "s_per_step": per_step, "s_per_step_median": statistics.median(step_s), "step_s": step_s,
        "end_step_s": end_step_s,
        "gen_s_per_step": med("rollout_busy_s"), "train_s_per_step": med("train_s"),
        "batch_sampling_s": med("rollout/batch_sampling_s"),  # a batch's groups, first hand-out to last return
        # a batch's share of groups handed out before the batch before it was taken: sampled beside that training
        "sampled_ahead_frac": med("rollout/sampled_ahead_frac"),
        "completions_per_s": wl["prompts"] * wl["num_generations"] * len(rows) / wall,
        # completion tokens trained a second, as the peers' rows count theirs (mean length x completions over the
        # wall); the engine's own per-cycle figure counts a group's tokens in the cycle it finishes, which at
        # max_staleness >= 1 is often a later cycle than the one whose busy time sampled them
        "gen_tokens_per_s": sum(s["completion_length"] for s in rows if s.get("completion_length") is not None)
        * wl["prompts"] * wl["num_generations"] / wall,
        "engine_cycle_tokens_per_s": med("rollout/gen_tokens_per_s"),
        "publish_latency_s": med("publish_latency_s"), "generate_wait_s": med("generate_wait_s"),
        "cycle_s_median": med("cycle_s"), "batches_trained_ahead": top("count/batches_trained_ahead"),
        # since the run's start: groups dropped past max_staleness when they came back, groups stopped mid-sampling
        # for it, and prompts recorded as not trained after their second time (docs/grpo.md §6)
        "stale_dropped": top("count/stale_dropped"), "stale_stopped": top("count/stale_stopped"),
        "stale_failed": top("count/stale_failed"),
        "burst_waits": top("count/burst_waits"),  # polls a take waited for the rest of a burst of groups coming back
        # over the measured steps: the share of the engines' sequence steps that went to groups stopped past the
        # bound, their steps a second of busy time, the sequences a step carried (None: an engine without steps)
        "stale_waste_frac": engines["rollout/stale_waste_frac"],
        # what was trained, not only sampled (docs/grpo.md §6): the run's share of sampled tokens no training took (at
        # its last measured step), each trained token's version lag, sequences updated in flight, prompts never trained,
        # and the tokens the loss saw per completion trained
        "wasted_frac": rows[-1].get("rollout/wasted_frac"), "version_lag_mean": med("rollout/version_lag"),
        "version_lag_max": top("rollout/version_lag_max"),
        "inflight_updated": sum(s.get("rollout/inflight_updated", 0) for s in rows),
        "prompts_never_trained": top("rollout/prompts_never_trained"),
        "trained_tokens_per_completion": (sum(s["rollout/trained_tokens"] for s in rows) /
                                          (wl["prompts"] * wl["num_generations"] * len(rows))
                                          if all("rollout/trained_tokens" in s for s in rows) else None),
        "engine_steps_per_s": engines.get("rollout/engine_steps_per_s"),
        "sequences_per_step": engines.get("rollout/sequences_per_step"),
        # at a step's record, the most prompts in the engines and the most out (in them or finished, not yet trained)
        "prompts_in_flight_max": top("prompts_in_flight"), "prompts_out_max": top("queue_depth"),
        "rollout_busy_frac": med("rollout/busy_frac"), "learner_mfu": med("learner/mfu"),
        "learner_tokens_per_s": med("learner/tokens_per_s"), "launch_to_first_step_s": first_step_s,
        "start_s": start_s,
        "cores_busy": sum(c > 50 for c in cores), "reward_first": rows[0]["reward"], "reward_last": rows[-1]["reward"],
        "turns_per_episode": med("episodes/turns_mean"), "tool_calls_per_episode": med("tools/call_frequency"),
        "completion_length_p50": med("completion_length_p50"), "completion_length_p95": med("completion_length_p95"),
        # the learner's layout as its defaults chose it (model.max_tokens_per_forward, checkpointing, Liger, the SMs
        # it left to a colocated engine)
        "forwards_per_step": med("learner/forwards_per_step"),
        "max_tokens_per_forward": med("learner/max_tokens_per_forward"),
        "gradient_checkpointing": med("learner/gradient_checkpointing"), "liger_kernel": med("learner/liger_kernel"),
        "sm_carveout": med("learner/sm_carveout"),
        # the learner process's own peaks (torch's allocator; colocated, the engine's tensors too) beside nvidia-smi's
        "learner_peak_allocated_gib": top("learner/peak_allocated_gib"),
        "learner_peak_reserved_gib": top("learner/peak_reserved_gib"),
        "learner_outside_allocator_gib": top("learner/outside_allocator_gib"),  # CUDA context, NCCL, workspaces
        "engine_shared_gib": med("learner/engine_shared_gib"),  # colocated: frozen weights read from the engine's
        "learner_nodes": placed["learner"], "rollout_nodes": placed["rollout"],
        **{f"learner_{p}_s": med(f"learner/time/{p}_s") for p in ("prepare", "forwards", "finish")},
        # each measured step's split, where a mean hides a long step (which stage it was, what was out)
        "cycles": [{k: r.get(k) for k in CYCLE_KEYS} for r in rows],
    }
    out.update({k2: v for k2, v in gpu_stats.items()})
    if pss is not None:
        out["pss_gb"] = pss.stop()
    return out


