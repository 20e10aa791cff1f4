"""Tools for multi-turn episodes: the tool-call parser of a chat format (a named, swappable part) and the runner
that calls a turn's tools concurrently, each within a time limit, off the engine's thread.

A tool is a plain function or coroutine function with type hints and a docstring, as TRL's `tools=` takes them
(its JSON schema, transformers' `get_json_schema`, goes into the chat template's tool section). Whatever goes
wrong in a call (malformed call JSON, an unknown tool, bad arguments, an exception, the time limit) becomes an
error message to the model and a counted failure, never an exception out of the episode: TRL and verl answer
`{"error": ...}` the same way."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import threading
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable

from tandem.rollout.child_pool import ChildPool


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ParsedTurn:
    """A model turn read for tool calls: the calls, and the error message of each call that could not be read."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class HermesToolCalls:
    """Qwen2.5 / Hermes: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the turn's
    text (Qwen's chat template writes them so, and TRL and verl's `format: hermes` read them so)."""

    name = "hermes"
    BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)

    def parse(self, text: str) -> ParsedTurn:
        out = ParsedTurn()
        for m in self.BLOCK.finditer(text):
            body, closed = m.group(1).strip(), bool(m.group(2))
            if not closed:
                out.errors.append("tool call not closed with </tool_call>")
                continue
            try:
                call = json.loads(body)
            except json.JSONDecodeError as e:
                out.errors.append(f"tool call is not valid JSON ({e.msg} at character {e.pos})")
                continue
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                out.errors.append('tool call needs {"name": <string>, "arguments": {...}}')
                continue
            args = call.get("arguments", {})
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass
            if not isinstance(args, dict):
                out.errors.append(f"tool call {call['name']!r}: arguments must be a JSON object")
                continue
            out.calls.append(ToolCall(call["name"], args))
        return out


TOOL_CALL_PARSERS = {HermesToolCalls.name: HermesToolCalls}


@dataclass
class ToolResult:
    name: str
    content: str  # what the model reads: the tool's result as text, or {"error": ...}
    failed: bool
    seconds: float


class SyncToolThreads:
    """The threads sync tools run on (the episode loop's pool, tandem.rollout.episodes.EventLoopThread): a call past
    its time limit is abandoned but its thread runs on, so the calls still running are counted, and a call that would
    only queue behind them fails at once, saying so, instead of timing out in the queue."""

    def __init__(self, n: int = 64):
        self.n, self.running, self._lock = n, 0, threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.running >= self.n:
                return False
            self.running += 1
            return True

    def run(self, fn: Callable, kwargs: dict):
        try:
            return fn(**kwargs)
        finally:
            with self._lock:
                self.running -= 1


SYNC_THREADS = SyncToolThreads()


async def call_tools(calls: list[ToolCall], tools: dict[str, Callable], timeout_s: float | None) -> list[ToolResult]:
    """Every call of one turn at once (a sync tool in a thread, a coroutine awaited), each within timeout_s;
    -> one result per call, in the calls' order. A sync tool past its limit is abandoned, not stopped: its
    thread runs on (Python cannot stop a thread), so a tool that may hang should be async or bound itself."""
    return list(await asyncio.gather(*(_call(c, tools, timeout_s) for c in calls)))


async def _call(call: ToolCall, tools: dict[str, Callable], timeout_s: float | None) -> ToolResult:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    fn = tools.get(call.name)
    if fn is None:
        return ToolResult(call.name, _error(f"unknown tool {call.name!r}; the tools are {sorted(tools)}"), True, 0.0)
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as e:
        return ToolResult(call.name, _error(f"{call.name}: {e}"), True, 0.0)
    if inspect.iscoroutinefunction(fn):
        work = fn(**call.arguments)
    elif SYNC_THREADS.take():
        work = asyncio.to_thread(SYNC_THREADS.run, fn, call.arguments)
    else:
        return ToolResult(call.name, _error(
            f"{call.name}: not run: all {SYNC_THREADS.n} tool threads of this worker still run earlier calls (a sync "
            "tool past its time limit runs on; make a tool that may hang async, or bound it itself)"), True, 0.0)
    try:
        value = await asyncio.wait_for(work, timeout_s)
    except asyncio.TimeoutError:
        return ToolResult(call.name, _error(f"{call.name}: no result within {timeout_s:g} s"), True, loop.time() - t0)
    except Exception as e:  # noqa: BLE001 - the model reads it; the episode goes on
        return ToolResult(call.name, _error(f"{call.name} raised {type(e).__name__}: {e}"), True, loop.time() - t0)
    return ToolResult(call.name, as_text(value), False, loop.time() - t0)


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


class ToolProcessDied(RuntimeError):
    """The child process running a tool call died (tool_isolation: process): the call fails, the worker runs on."""


_CHILD_TOOLS: dict[str, Callable] = {}


def _child_tools(specs: list[str]) -> None:
    from tandem.core.loader import load_function

    _CHILD_TOOLS.update((fn.__name__, fn) for fn in map(load_function, specs))


def _child_call(name: str, kwargs: dict) -> str:
    value = _CHILD_TOOLS[name](**kwargs)
    return as_text(asyncio.run(value) if inspect.iscoroutine(value) else value)


class IsolatedTools:
    """The job's `tools:` run in child processes (`tool_isolation: process`), as `reward_timeout_s` runs rewards: a
    call that kills its process (os._exit, a crash) fails alone, the model reading the error, and the pool restarts;
    a call past tool_timeout_s is stopped with its process, where a thread could only be abandoned. `wrap` gives
    coroutine functions with each tool's name, signature and docstring (its schema unchanged), so call_tools runs
    them as it runs async tools. The cost per call: bench/tool_isolation.py."""

    def __init__(self, specs: list[str], processes: int = 2):
        self.pool = ChildPool(processes, _child_tools, (list(specs),))

    def start(self) -> None:
        self.pool.start()

    def close(self) -> None:
        self.pool.close()

    def wrap(self, tools: dict[str, Callable]) -> dict[str, Callable]:
        return {name: self._proxy(name, fn) for name, fn in tools.items()}

    def _proxy(self, name: str, fn: Callable) -> Callable:
        async def call(**kwargs):
            return await self.call(name, kwargs)

        return functools.update_wrapper(call, fn)

    async def call(self, name: str, kwargs: dict) -> str:
        for _ in range(2):
            pool, gen = self.pool.current()
            try:
                return await asyncio.wrap_future(pool.submit(_child_call, name, kwargs))
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # this call's time limit: its process is stopped
                    self.pool.restart(gen)
                    raise
                # else another call's restart dropped this one from the queue: a fresh try
            except BrokenProcessPool:
                by_other = self.pool.generation != gen
                self.pool.restart(gen)
                if not by_other:
                    raise ToolProcessDied(f"the process running {name} died (os._exit, a signal or a crash); the "
                                          "rollout worker runs on (tool_isolation: process)") from None
        raise ToolProcessDied(f"the processes running {name} were restarted twice while it waited (other calls "
                              "died or ran past tool_timeout_s)")


def _error(message: str) -> str:
    return json.dumps({"error": message})


def tool_schemas(tools: list[Callable]) -> list[dict[str, Any]]:
    """The JSON schema of each tool from its type hints and Google-style docstring, as TRL passes them to the chat
    template (transformers' get_json_schema; a tool without them is refused there, naming it)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(fn) for fn in tools]
