"""`make demo`: tandem run on the demo job, plus wall time and peak memory of the whole run."""

from __future__ import annotations

import sys
import threading
import time


def main(job: str) -> int:
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
    rc = run_job(JobConfig.from_yaml(job))
    stop.set()
    print(f"demo: wall {time.time() - t0:.0f} s, peak memory of the run {peak[0] / 2**30:.2f} GiB "
          f"(system-wide increase over the {base / 2**30:.1f} GiB in use before it)")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
