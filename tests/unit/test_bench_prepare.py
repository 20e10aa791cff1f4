"""bench/e2e.py's prepare builds the workload's model in a child process: the run's driver (the process that then
samples the GPU, and starts Tandem or is TRL's trainer) imports no model code for it and, on a GPU
(bench/device/cuda_tests.sh), holds no CUDA context, which would count in the candidate's peak memory."""

import json
import subprocess
import sys

import torch

from tests.helpers import ROOT

DRIVER = """
import json, sys
from pathlib import Path
sys.path[:0] = [{bench!r}]
import workloads
wl = workloads.workload(workloads.WORKLOADS, "cpu", [])
paths = workloads.prepare(Path({work!r}), wl)
import torch
print(json.dumps({{"paths": paths, "transformers": "transformers" in sys.modules,
                  "cuda_context": torch.cuda.is_initialized()}}))
"""


def test_the_model_is_built_outside_the_driver(tmp_path):
    out = subprocess.run([sys.executable, "-c", DRIVER.format(bench=str(ROOT / "bench"), work=str(tmp_path))],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (2, 128)  # the "cpu" workload's shape, built
    assert len((tmp_path / "prompts.jsonl").read_text().splitlines()) > 0
    assert got["transformers"] is False  # the build's imports stayed in the child
    # on the GPU machine the build ran on "cuda", in the child: this process never opened a context
    assert got["cuda_context"] is False, f"CUDA available: {torch.cuda.is_available()}"
