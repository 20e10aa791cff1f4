"""Helpers shared by the unit and integration tests (a package: no sys.path edits)."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bench_script(name: str):
    """bench/<name>.py loaded as a module (the scripts are run, not imported: bench/ is no package). A script that
    puts bench/ first on sys.path for its own imports leaves sys.path as it was."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    sys.path.insert(0, str(ROOT / "bench"))  # the script's own modules (bench/workloads.py, ...)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = path
    return mod


def make_job(tmp_path, model_path, rewards, **sections):
    """A validated JobConfig for integration tests (data file written beside it)."""
    from tandem.core.config import JobConfig

    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"prompt": f"{a} + {a}", "answer": 2 * a}) + "\n" for a in range(16)))
    d = {"model": {"path": model_path, "dtype": "float32", "lora": {"r": 8, "lora_alpha": 16}},
         "data": {"path": str(data)}, "rewards": rewards,
         "generation": {"max_prompt_length": 64, "max_completion_length": 16},
         "batch": {"num_generations": 4, "per_device_train_batch_size": 4}}
    for k, v in sections.items():
        if isinstance(v, dict):
            d.setdefault(k, {}).update(v)
        else:
            d[k] = v
    return JobConfig.from_dict(d)


def unmapped_semaphores() -> set[str]:
    """The POSIX semaphores multiprocessing made (/dev/shm/sem.mp-*) that no live process maps: left behind by one
    that ended without unlinking them."""
    import os
    from pathlib import Path

    from tandem.services.app.supervisor import mapped_names

    shm = Path("/dev/shm")
    names = {n for n in os.listdir(shm) if n.startswith("sem.mp-")} if shm.is_dir() else set()
    return names - mapped_names()


def run_job_script(module: str, *args: str, timeout: float = 400) -> tuple[dict, list[str]]:
    """`python -m module args...` (a job on a Ray cluster of its own, one Ray per process), which prints one
    `RESULT {json}` line. -> (that JSON, the `tandem: ` lines it said)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    # from "tandem: " on: a line Ray's log thread wrote without its end may sit before it on the same line
    said = [ln[ln.index("tandem: "):] for ln in p.stderr.splitlines() + p.stdout.splitlines() if "tandem: " in ln]
    result = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert p.returncode == 0 and result, p.stderr[-4000:]
    return json.loads(result[len("RESULT "):]), said
