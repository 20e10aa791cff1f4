"""End-to-end GRPO on one GPU (the GPU rollout benchmark): Tandem max_staleness 0 and 1, the
vLLM ceiling, TRL's GRPOTrainer in colocate mode and TRL's AsyncGRPOTrainer beside a vLLM server (trl_async);
the same model (Qwen2.5-0.5B's shape, vocabulary 151,936), data, reward, LoRA r=16, 32 prompts x 8 completions x up to 256 tokens per step, 20 steps after
2 warm-up steps. Each candidate runs in a process of its own (bench/e2e.py), one after the other.

  python3 bench/e2e_gpu.py [--candidates tandem_k0,tandem_k1,vllm_ceiling,trl_colocate,trl_async] [--out DIR]
      [--rollout-gpus 0.4 --learner-gpus 0.4 --vllm-memory S]   # placement (two GPUs: 1 / 1 / 0.85)
  python3 bench/e2e_gpu.py --table-only --out DIR   # the table of what DIR holds

A candidate named twice runs twice, in the order given, its second run's files named `NAME-2` (`--candidates
tandem_k1,trl_async,tandem_k1,trl_async`: each side's spread within one warm machine, where a peer's speed moves
from one machine to the next). `NAME:key=value[:key=value]` runs NAME with those workload settings added to the
call's `--set`, its files named `NAME_key-value` (`--candidates tandem_k1,tandem_k1:rollout_oversample_prompts=auto`:
a setting and the default in alternation within one call, the table's `--names` naming both; a value holding `,` or
`:` goes in `--set`).

`vllm_merged` (not in the default list): vLLM alone on the base weights without its LoRA layers, as an engine
serving merged weights runs (TRL's colocated one): beside `vllm_ceiling`, what the LoRA kernels cost.
"""

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_names(candidates: str) -> list[tuple[str, list[str], str]]:
    """(candidate, its own `--set` settings, the name its files take) for each in the comma-separated list: NAME, then
    NAME-2, NAME-3 where the same candidate with the same settings comes again; `NAME:k=v` is named `NAME_k-v`."""
    seen: dict[str, int] = {}
    out = []
    for spec in candidates.split(","):
        c, *sets = spec.split(":")
        if bad := [kv for kv in sets if "=" not in kv or not kv.split("=", 1)[0]]:
            raise SystemExit(f"--candidates: {spec!r}: each setting after NAME is key=value, not {bad[0]!r}")
        name = "_".join([c, *(re.sub(r"[^A-Za-z0-9._-]+", "-", kv.replace("=", "-", 1)) for kv in sets)])
        seen[name] = seen.get(name, 0) + 1
        out.append((c, sets, name if seen[name] == 1 else f"{name}-{seen[name]}"))
    return out


def quiet_machine(timeout: float = 60.0):
    """Until the previous candidate's processes are gone: Ray's (stopped) and whatever holds GPU memory.
    A ceiling measured while the last job's raylet and workers wind down reads low (18% apart, measured on one H200)."""
    subprocess.run([sys.executable, "-c", "import sys; from ray.scripts.scripts import cli; "
                    "sys.argv = ['ray', 'stop', '--force']; cli()"], capture_output=True, check=False)
    end = time.time() + timeout
    while time.time() < end:
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                           capture_output=True, text=True, check=False)
        if q.returncode != 0 or not q.stdout.strip():
            return
        time.sleep(1)
    print(f"quiet_machine: GPU processes still there after {timeout:.0f} s: {q.stdout.split()}", flush=True)

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--candidates", default="tandem_k0,tandem_k1,vllm_ceiling,trl_colocate,trl_async")
    ap.add_argument("--out", default="bench/results/e2e_gpu")
    ap.add_argument("--workload", default="gpu")
    ap.add_argument("--table-only", action="store_true")
    a, rest = ap.parse_known_args()
    if not a.table_only:
        for c, sets, name in run_names(a.candidates):
            quiet_machine()
            print(f"== {name}", flush=True)
            subprocess.run([sys.executable, str(HERE / "e2e.py"), "run", c, "--workload", a.workload,
                            "--json", f"{a.out}/{name}.json", *rest, *(["--set", *sets] if sets else [])],
                           check=False)
    subprocess.run([sys.executable, str(HERE / "e2e.py"), "table", a.out], check=True)
