"""End-to-end GRPO on this CPU: Tandem beside TRL's GRPOTrainer (transformers generate, its default) on the
tiny Qwen2 (2 layers, hidden 128), LoRA r=8 on q,k,v,o, 48-token completions, fp32; at 8 and 128
completions per step; memory as the PSS of each candidate's process tree.

  python3 bench/e2e_cpu.py [--out DIR]
"""

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CANDIDATES = ("tandem_k0", "tandem_k1", "tandem_k0_colocate", "tandem_k1_colocate", "tandem_k0_generate",
              "tandem_k1_generate", "trl")  # e2e.TANDEM says what each Tandem candidate sets

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/tandem-e2e-cpu")
    ap.add_argument("--sizes", default="1,16", help="prompts per step (x 8 completions)")
    a = ap.parse_args()
    for p in a.sizes.split(","):
        out = f"{a.out}/p{p}"
        for c in CANDIDATES:
            print(f"== {c}, {int(p) * 8} completions per step", flush=True)
            per = max(8, int(p) * 8)
            subprocess.run([sys.executable, str(HERE / "e2e.py"), "run", c, "--workload", "cpu", "--dir",
                            f"/tmp/tandem-e2e-cpu-work-{p}", "--json", f"{out}/{c}.json", "--set", f"prompts={p}",
                            "--set", f"per_device={per}"], check=False)
        subprocess.run([sys.executable, str(HERE / "e2e.py"), "table", out, "--names", ",".join(CANDIDATES),
                        "--peer", "trl"], check=True)
