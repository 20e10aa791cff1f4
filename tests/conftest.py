import json
import os
import sys
from pathlib import Path

import pytest

# Kernels run through Triton's interpreter on CPU (must be set before triton is imported).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture
def job_files(tmp_path):
    """A minimal valid job's referenced files: model dir, data, reward module. Returns the job dict."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"p{i}", "answer": i}) for i in range(8)) + "\n")
    rew = tmp_path / "rew.py"
    rew.write_text("def r1(completions, **kw):\n    return [1.0] * len(completions)\n"
                   "def r2(completions, **kw):\n    return [0.0] * len(completions)\n")
    return {
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"path": str(data)},
        "rewards": [f"{rew}:r1"],
    }
