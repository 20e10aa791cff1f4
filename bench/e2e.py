"""End-to-end GRPO, side by side: Tandem (`tandem run`'s own controller, embedded Ray), the engine alone
(the rollout ceiling) and TRL's GRPOTrainer as its users run it, on one workload. The entry points
`e2e_gpu.py` / `e2e_cpu.py` fix the workload; this module builds it and runs one candidate per process:

  python3 bench/e2e.py run CANDIDATE --workload gpu|cpu --dir WORK --json OUT.json [--rollout-gpus ...]
  python3 bench/e2e.py table OUT_DIR --workload gpu|cpu   # the table from the candidates' JSON files

Every candidate samples the same prompts with the same model, LoRA, reward, batch and sampling. A
measured step is an optimizer step after the warm-up ones. GPU busy fraction and peak memory are
sampled from nvidia-smi every 0.2 s (the whole GPU: every process on it); on CPU the memory is the
PSS of the process tree (psutil), the driver, Ray's processes and its workers included.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from e2e_table import table, versions
from machine import T0, host_state  # noqa: F401 - T0: the launch, read when a run measures from it
from tandem_candidates import KEYS, TANDEM, TANDEM_NODES, run_tandem, run_tandem_nodes
from trl_candidates import run_trl, run_trl_async
from vllm_candidates import run_vllm
from workloads import WORKLOADS, keep_group_trace, prepare, use_this_checkout, workload, workload_dir


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("candidate", choices=list(TANDEM) + list(TANDEM_NODES) + ["vllm_ceiling", "vllm_merged",
                                                                               "trl_colocate", "trl", "trl_async"])
    r.add_argument("--workload", default="gpu", choices=list(WORKLOADS))
    r.add_argument("--dir", default="/tmp/tandem-e2e")
    r.add_argument("--json", required=True)
    r.add_argument("--rollout-gpus", type=float, default=0.4, help="Ray GPUs of the rollout worker")
    r.add_argument("--learner-gpus", type=float, default=0.4, help="Ray GPUs of the learner")
    r.add_argument("--vllm-memory", type=float, default=None,
                   help="vllm_gpu_memory_utilization of every candidate; default: Tandem's (auto), TRL's (0.3) for "
                        "TRL and the ceiling")
    r.add_argument("--set", action="extend", nargs="+", default=[], help="workload key=value ... (e.g. prompts=8)")
    t = sub.add_parser("table")
    t.add_argument("out_dir")
    t.add_argument("--names", default="tandem_k0,tandem_k1,tandem_k4,vllm_ceiling,vllm_merged,trl_colocate,trl_async")
    t.add_argument("--ceiling", default="vllm_ceiling")
    t.add_argument("--peer", default="trl_colocate")
    t.add_argument("--k0", type=Path, default=None,
                   help="a tandem_k0 JSON from another call of the same workload and card, for the efficiencies")
    t.add_argument("--from", dest="elsewhere", action="append", default=[], metavar="NAME=PATH",
                   help="a candidate's JSON from another call of the same workload and card kind (its row marked †)")
    a = ap.parse_args()
    if a.cmd == "table":
        text, c = table(Path(a.out_dir), a.names.split(","), a.ceiling, a.peer, a.k0,
                        dict(kv.split("=", 1) for kv in a.elsewhere))
        print(text)
        return
    a.dir, a.json = use_this_checkout(a.dir, a.json)
    wl = workload(WORKLOADS, a.workload, a.set)
    a.dir = str(Path(a.dir) / workload_dir(a.workload, wl))
    paths = prepare(Path(a.dir), wl)
    machine = host_state()
    if a.candidate in TANDEM:
        k, mode, vllm = TANDEM[a.candidate]
        res = run_tandem(paths, wl, k, a, mode, vllm)
        keep_group_trace(Path(a.dir) / f"run-k{k}", Path(a.json))
    elif a.candidate in TANDEM_NODES:
        res = run_tandem_nodes(paths, wl, TANDEM_NODES[a.candidate], a)
    elif a.candidate == "trl_async":
        res = run_trl_async(paths, wl, a)
    else:
        res = run_vllm(paths, wl, a, lora=a.candidate == "vllm_ceiling") if a.candidate.startswith("vllm_") \
            else run_trl(paths, wl, a)
    # under CUDA MPS (bench/device/with_mps.sh), the processes' kernels run side by side
    res.update(candidate=a.candidate, workload=a.workload, versions=versions(), wl=wl, host=machine,
               cuda_mps="CUDA_MPS_PIPE_DIRECTORY" in os.environ)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res.get(k) for k in KEYS + ("launch_to_first_step_s", "start_s", "pss_gb", "rollout_busy_frac",
                                                       "learner_mfu", "reward_first", "reward_last",
                                                       "peak_gpu_gib_by_process", "host")}), flush=True)


if __name__ == "__main__":
    main()
