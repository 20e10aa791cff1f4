"""What `tool_isolation: process` costs per tool call against `thread` (the default): the call path the episode
loop uses (`call_tools`), a tool that returns at once, one that computes for ~5 ms, and one with a 20 kB reply;
one call at a time (latency) and 32 at once (as many episodes of a cycle call tools together).

    .venv/bin/python bench/tool_isolation.py
"""

import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tandem.core.loader import load_function
from tandem.rollout.tools import IsolatedTools, ToolCall, call_tools

TOOLS = '''
def echo(x: int) -> int:
    """Returns x.

    Args:
        x: a number
    """
    return x


def work(n: int) -> int:
    """Sums squares (about 5 ms of Python for n = 100000).

    Args:
        n: how many
    """
    return sum(i * i for i in range(n))


def big(n: int) -> str:
    """A long reply.

    Args:
        n: characters
    """
    return "y" * n
'''
CASES = {"echo": ("echo", {"x": 1}), "5 ms of Python": ("work", {"n": 100_000}), "20 kB reply": ("big", {"n": 20_000})}


def timed(tools, name, args, concurrent: int, rounds: int) -> float:
    """Median seconds per turn of `concurrent` calls."""
    async def turn():
        t0 = time.perf_counter()
        results = await call_tools([ToolCall(name, args)] * concurrent, tools, 60.0)
        assert not any(r.failed for r in results), results[0].content
        return time.perf_counter() - t0

    async def all_rounds():
        return [await turn() for _ in range(rounds)]

    return statistics.median(asyncio.run(all_rounds())[2:])


def main():
    with tempfile.TemporaryDirectory() as d:
        mod = Path(d) / "bench_tools.py"
        mod.write_text(TOOLS)
        specs = [f"{mod}:{n}" for n in ("echo", "work", "big")]
        plain = {fn.__name__: fn for fn in map(load_function, specs)}
        processes = min(4, os.cpu_count() or 1) if len(sys.argv) < 2 else int(sys.argv[1])
        iso = IsolatedTools(specs, processes=max(2, processes))
        t0 = time.perf_counter()
        iso.start()
        asyncio.run(call_tools([ToolCall("echo", {"x": 0})], iso.wrap(plain), 60.0))
        start_s = time.perf_counter() - t0
        isolated = iso.wrap(plain)
        rows = []
        for label, (name, args) in CASES.items():
            for concurrent, rounds in ((1, 40), (32, 12)):
                th = timed(plain, name, args, concurrent, rounds)
                pr = timed(isolated, name, args, concurrent, rounds)
                rows.append((label, concurrent, th * 1e3, pr * 1e3))
        iso.close()
    print(f"tool calls through call_tools, thread vs process ({max(2, processes)} child processes), "
          f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(f"process pool start + first call: {start_s:.2f} s (once per rollout worker, beside its engine's start)")
    print("| tool | calls at once | thread ms/turn | process ms/turn | process ÷ thread |")
    print("| --- | --: | --: | --: | --: |")
    for label, n, th, pr in rows:
        print(f"| {label} | {n} | {th:.2f} | {pr:.2f} | {pr / th:.2f} |")


if __name__ == "__main__":
    main()
