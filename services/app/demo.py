"""`make demo`: tandem run on the demo job, plus wall time and peak memory of the whole run. `--readme FILE` also puts
what it printed into FILE's demo block (the fenced block after its DEMO_MARK line): the sample output a reader sees
is the current code's, never typed."""

from __future__ import annotations

import io
import re
import sys
import threading
import time
from pathlib import Path

DEMO_MARK = "<!-- the demo's output, written by: python -m tandem.services.app.demo examples/sevens.yaml --readme README.md -->"
SUMMARY = ("reward:", "eval reward:", "steps:", "metrics:", "adapter:", "model:", "demo:")


class Tee(io.TextIOBase):
    """Writes through to `out` and keeps the lines written."""

    def __init__(self, out):
        self.out, self.text = out, []

    def write(self, s: str) -> int:
        self.text.append(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


def main(job: str, readme: str | None = None) -> int:
    import psutil

    from tandem.core.config import JobConfig
    from tandem.services.app.run import run_job

    base = psutil.virtual_memory().used
    peak = [0]
    stop = threading.Event()

    def sample():  # system-wide: the driver, Ray, the rollout worker and the learner together
        while not stop.is_set():
            peak[0] = max(peak[0], psutil.virtual_memory().used - base)
            time.sleep(0.25)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.time()
    out = Tee(sys.stdout)
    rc = run_job(JobConfig.from_yaml(job), out=out)
    stop.set()
    print(f"demo: wall {time.time() - t0:.0f} s, peak memory of the run {peak[0] / 2**30:.2f} GiB "
          f"(system-wide increase over the {base / 2**30:.1f} GiB in use before it)", file=out)
    if readme and rc == 0:
        write_sample(Path(readme), [x for x in "".join(out.text).splitlines() if x.startswith(SUMMARY)])
    return rc


def write_sample(readme: Path, lines: list[str]) -> None:
    """The fenced block after DEMO_MARK replaced by `lines`."""
    text = readme.read_text()
    if DEMO_MARK not in text:
        raise ValueError(f"{readme}: no line {DEMO_MARK!r} to put the demo's output after")
    pattern = re.compile(re.escape(DEMO_MARK) + r"\n```\n.*?\n```", re.S)
    readme.write_text(pattern.sub(lambda m: DEMO_MARK + "\n```\n" + "\n".join(lines) + "\n```", text, count=1))


if __name__ == "__main__":
    args = sys.argv[1:]
    target = args[args.index("--readme") + 1] if "--readme" in args else None
    sys.exit(main(args[0], target))
