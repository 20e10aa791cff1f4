"""Where the rollout worker loses time against its own engine: one engine, one process, the same
batches (the end-to-end workload's model, prompts and sampling), driven four ways, then adapter
publishing timed by its parts.

  python3 bench/rollout.py --workload gpu|cpu [--reps 3] [--dir WORK]

- generate: `LLM.generate` with every prompt at once (the end-to-end benchmark's ceiling).
- engine_loop: the worker's engine calls (`add` every prompt, `step` until done) from the main thread.
- worker: the RolloutWorker itself (no Ray): one caller thread per prompt, as Ray's threaded actor runs
  `rollout`, scoring and packing included.
- worker_batch: the worker's `generate` (one call with every prompt).
- ray_worker: the worker as the job runs it, a threaded Ray actor in its own process, fed one
  `rollout` call per prompt from this process (what the controller does), groups fetched by ref.
Publishing: `set_adapter` end to end, `load_adapter` (vLLM's add_lora from the tensors) alone, and the
adapter's trip through Ray's serialization as torch tensors and as the WeightsPayload the learner sends.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import tandem_candidates  # noqa: E402
import workloads  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="gpu", choices=list(workloads.WORKLOADS))
    ap.add_argument("--dir", default="/tmp/tandem-rollout")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--vllm-memory", type=float, default=0.3)
    a = ap.parse_args()
    a.rollout_gpus = a.learner_gpus = 0.4 if a.workload == "gpu" else 0
    wl = dict(workloads.WORKLOADS[a.workload])
    P = wl["prompts"] if a.workload == "gpu" else 16
    wl["prompts"] = P
    paths = workloads.prepare(Path(a.dir), wl)
    cfg = tandem_candidates.tandem_config(paths, wl, 1, a)

    from transformers import AutoTokenizer

    from tandem.rollout.prompts import tokenize_prompt
    from tandem.rollout.worker import RolloutWorker
    from tandem.services.orchestrator.data import load_rows
    from tandem.services.orchestrator.prompt_source import PromptTable

    t = time.time()
    w = RolloutWorker(cfg, 0)
    w.setup()
    print(f"engine start {time.time() - t:.1f} s", flush=True)
    rows, tok = load_rows(cfg.data.path), AutoTokenizer.from_pretrained(cfg.model.path)
    table = PromptTable(rows, [tokenize_prompt(tok, r["prompt"], max_prompt_length=64, truncate=False, row=i)
                               for i, r in enumerate(rows)], "prompt")
    items = [table.item(i, 0) for i in range(P)]
    eng, sp = w.engine, w.sampling

    def tokens(groups):
        return sum(len(g.tokens) for g in groups)

    def c_generate():
        outs = eng.llm.generate([{"prompt_token_ids": it.prompt_ids.tolist()} for it in items], eng._params(sp),
                                use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    def c_engine_loop():
        for k, it in enumerate(items):
            eng.add(k, it.prompt_ids, sp)
        n, left = 0, len(items)
        while left:
            for _, comps in eng.step():
                n += sum(len(c.tokens) for c in comps)
                left -= 1
        return n

    def c_engine_loop_thread():
        box = []
        th = threading.Thread(target=lambda: box.append(c_engine_loop()))
        th.start()
        th.join()
        return box[0]

    def c_worker():
        out = [None] * P

        def call(i):
            out[i] = w.rollout(items[i])[1]
        th = [threading.Thread(target=call, args=(i,)) for i in range(P)]
        for x in th:
            x.start()
        for x in th:
            x.join()
        return tokens(out)

    def c_worker_batch():
        return tokens(w.generate(items))

    cands = {"generate": c_generate, "engine_loop": c_engine_loop,
             "engine_loop_thread": c_engine_loop_thread, "worker": c_worker, "worker_batch": c_worker_batch}
    res = {}
    for name, fn in cands.items():
        fn()  # warm-up
        runs = []
        for _ in range(a.reps):
            t = time.perf_counter()
            n = fn()
            runs.append((time.perf_counter() - t, n))
        s = statistics.median(r[0] for r in runs)
        res[name] = (s, sum(r[1] for r in runs) / sum(r[0] for r in runs))
        print(f"{name}: {s:.3f} s, {res[name][1]:.0f} tok/s", flush=True)

    # publishing: the learner's adapter state dict (random), as export_adapter hands it over
    import torch

    from tandem.learner.model import load_policy, trainable_state_dict

    model = load_policy(cfg)
    sd = {k: (v.detach().clone() + 0.01 * torch.randn_like(v)).to(getattr(torch, cfg.model.dtype))
          for k, v in trainable_state_dict(model).items()}
    import pickle

    from tandem.core.protocol import WeightsPayload, as_torch

    def trip(obj):  # what ray.put in the learner and the argument's fetch in the worker do
        bufs = []
        data = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
        return as_torch(pickle.loads(data, buffers=bufs))

    pub, load, wire_torch, wire_payload, busy = [], [], [], [], []
    for v in range(1, 2 + 2 * a.reps):
        t = time.perf_counter()
        w.set_adapter(v, sd)
        pub.append(time.perf_counter() - t)
        t = time.perf_counter()
        eng.load_adapter(100 + v, sd)
        load.append(time.perf_counter() - t)
        eng.drop_adapters([100 + v])
        t = time.perf_counter()
        trip(sd)
        wire_torch.append(time.perf_counter() - t)
        t = time.perf_counter()
        trip(WeightsPayload.from_torch(sd))
        wire_payload.append(time.perf_counter() - t)
    for v in range(50, 50 + a.reps):  # published while the engine generates a batch
        th = threading.Thread(target=c_worker)
        th.start()
        time.sleep(0.3)
        t = time.perf_counter()
        w.set_adapter(v, sd)
        busy.append(time.perf_counter() - t)
        th.join()
    base = res["generate"][1]
    print(f"\nworkload {a.workload}: {P} prompts x {wl['num_generations']} x up to {wl['max_tokens']} tokens, "
          f"{a.reps} reps (median s)\n")
    print("| candidate | s | tok/s | × generate |\n| --- | --- | --- | --- |")
    for name, (s, tps) in res.items():
        print(f"| {name} | {s:.3f} | {tps:.0f} | {tps / base:.2f} |")
    print(f"\n| publish | median s |\n| --- | --- |\n| set_adapter (idle engine) | {statistics.median(pub[1:]):.4f} |"
          f"\n| set_adapter (engine generating) | {statistics.median(busy):.4f} |"
          f"\n| load_adapter (add_lora from the tensors) | {statistics.median(load[1:]):.4f} |"
          f"\n| serialize + deserialize, torch tensors | {statistics.median(wire_torch[1:]):.4f} |"
          f"\n| serialize + deserialize, WeightsPayload | {statistics.median(wire_payload[1:]):.4f} |"
          f"\n| adapter tensors | {len(sd)}, {sum(t.numel() * t.element_size() for t in sd.values()) / 1e6:.1f} MB |")
    w.shutdown()
    for name, (s, tps) in ray_worker(cfg, items, a.reps).items():
        print(f"| {name} | {s:.3f} | {tps:.0f} | {tps / base:.2f} |")


class _TunedWorker:
    """The worker with two process knobs to try (Python's GIL switch interval, torch's CPU threads)."""

    def tune(self, switch_s: float, threads: int) -> dict:
        sys.setswitchinterval(switch_s)
        self.engine._set_num_threads(threads)
        import torch
        return {"switch": sys.getswitchinterval(), "threads": torch.get_num_threads()}


def ray_worker(cfg, items, reps) -> dict:
    import ray

    from tandem.rollout.worker import RolloutWorker, rollout_actor_class

    ray.init(num_cpus=4, num_gpus=1 if cfg.cluster.rollout_resources.num_gpus else 0, include_dashboard=False)
    w = rollout_actor_class(cfg, type("TunedWorker", (_TunedWorker, RolloutWorker), {})).remote(cfg, 0)
    ray.get(w.setup.remote())

    def once():
        refs = [w.rollout.options(num_returns=2).remote(it)[1] for it in items]
        return sum(len(g.tokens) for g in ray.get(refs))
    out = {}
    for name, knobs in {"ray_worker": None, "ray_worker switch 0.5 ms": (5e-4, 1),
                        "ray_worker 8 threads": (5e-3, 8)}.items():
        if knobs:
            print(name, ray.get(w.tune.remote(*knobs)), flush=True)
        once()
        runs = []
        for _ in range(reps):
            t = time.perf_counter()
            n = once()
            runs.append((time.perf_counter() - t, n))
        out[name] = statistics.median(r[0] for r in runs), sum(r[1] for r in runs) / sum(r[0] for r in runs)
        print(f"{name}: {out[name][0]:.3f} s", flush=True)
    ray.get(w.shutdown.remote())
    ray.shutdown()
    return out


if __name__ == "__main__":
    main()
