"""Child processes that run user code a rollout worker must survive: reward functions (`reward_timeout_s`) and tools
(`tool_isolation: process`). Spawned, so the engine's threads and CUDA stay out of them; a call that hangs or kills
its process costs the pool (restarted at the next call), never the worker."""

from __future__ import annotations

import gc
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from typing import Callable


class ChildPool:
    """A restartable ProcessPoolExecutor. `current()` -> (pool, generation); a caller whose call broke the pool or
    ran past its limit calls `restart(generation)`: the processes are killed (a hung call never returns) and the next
    `current()` makes a fresh pool. Two callers restarting one generation restart it once."""

    def __init__(self, processes: int, initializer: Callable, initargs: tuple):
        self.n, self._init, self._args = max(1, processes), initializer, initargs
        self._lock = threading.Lock()
        self._gen, self._pool = 0, None

    @property
    def generation(self) -> int:
        with self._lock:
            return self._gen

    def current(self) -> tuple[ProcessPoolExecutor, int]:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.n, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=self._init, initargs=self._args)
            return self._pool, self._gen

    def start(self) -> None:
        """The children spawn now (their imports run beside the engine's start), not at the first call."""
        self.current()[0].submit(int)

    def restart(self, gen: int) -> None:
        with self._lock:
            if self._gen != gen or self._pool is None:
                return  # another call restarted it already
            self._kill(self._pool)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool, self._gen = None, self._gen + 1

    def close(self) -> None:
        """The children stopped and the pool's queues released now: their POSIX semaphores are unlinked when the
        queues are collected, and an actor killed right after its shutdown never gets there (each left one sem.mp-*
        in /dev/shm per queue lock)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return
        self._kill(pool)  # a call still running is abandoned with the worker
        pool.shutdown(wait=True, cancel_futures=True)
        del pool
        gc.collect()

    @staticmethod
    def _kill(pool: ProcessPoolExecutor) -> None:
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.kill()
