"""The four folders are only importable under `tandem.`; `kernels` stays Hugging Face's name."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("name", ["kernels", "services", "learner", "rollout"])
def test_folder_not_top_level(name, tmp_path):
    code = f"import {name}, sys; print(getattr(sys.modules['{name}'], '__file__', None))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    if r.returncode == 0:  # some other installed package of that name is fine, ours is not
        assert "/tandem" not in r.stdout and "/work/" not in r.stdout, r.stdout
    else:
        assert "ModuleNotFoundError" in r.stderr


def test_config_is_light():
    """Configs and wire types import no heavy library (prime-rl's rule)."""
    code = ("import sys, tandem.core.config, tandem.core.plan, tandem.core.protocol; "
            "print(sorted(m for m in ('torch', 'ray', 'vllm', 'deepspeed', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"
