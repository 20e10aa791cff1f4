"""Multi-turn tools without an engine: the Hermes/Qwen tool-call parser, and the runner that calls a turn's tools
concurrently within a time limit, every failure an error message to the model and a counted failure."""

import asyncio
import json
import threading
import time

import pytest

from tandem.rollout.tools import TOOL_CALL_PARSERS, ToolCall, call_tools, tool_schemas
from tests.helpers import unmapped_semaphores

parse = TOOL_CALL_PARSERS["hermes"]().parse


def test_calls_are_read_in_order_and_what_cannot_be_read_is_named():
    text = ('I will look. <tool_call>\n{"name": "search", "arguments": {"q": "GRPO"}}\n</tool_call> and '
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
            '<tool_call>["add"]</tool_call><tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"q": "cut by the bud')
    turn = parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [("search", {"q": "GRPO"}), ("add", {"a": 1, "b": 2})]
    assert len(turn.errors) == 4
    assert turn.errors[0].startswith("tool call is not valid JSON (")
    assert 'needs {"name"' in turn.errors[1] and "arguments must be a JSON object" in turn.errors[2]
    assert turn.errors[3] == "tool call not closed with </tool_call>"
    assert parse("no call here").calls == [] and parse("no call here").errors == []


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def broken(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise ValueError(f"cannot use {x}")


async def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "late"


def test_each_failure_is_a_message_to_the_model_and_the_rest_run():
    tools = {"add": add, "broken": broken, "slow": slow}
    calls = [ToolCall("add", {"a": 2, "b": 3}), ToolCall("broken", {"x": "it"}), ToolCall("slow", {"seconds": 30}),
             ToolCall("nope", {}), ToolCall("add", {"a": 1})]
    t0 = time.monotonic()
    got = asyncio.run(call_tools(calls, tools, timeout_s=0.5))
    assert time.monotonic() - t0 < 10  # the 30 s tool was abandoned at its limit
    assert [r.failed for r in got] == [False, True, True, True, True]
    assert got[0].content == "5"
    errors = [json.loads(r.content)["error"] for r in got[1:]]
    assert errors[0] == "broken raised ValueError: cannot use it"
    assert errors[1] == "slow: no result within 0.5 s"
    assert errors[2].startswith("unknown tool 'nope'; the tools are ['add', 'broken', 'slow']")
    assert errors[3].startswith("add: missing a required argument: 'b'")


def test_the_calls_of_one_turn_run_at_once():
    """Two tools that each wait for the other to have started: they finish only if they run concurrently (run one
    after the other, the first would time out)."""
    started = {"sync": threading.Event(), "async": threading.Event()}

    def sync_side() -> str:
        """Waits for the other side."""
        started["sync"].set()
        return "ok" if started["async"].wait(5) else "alone"

    async def async_side() -> str:
        """Waits for the other side."""
        started["async"].set()
        for _ in range(500):
            if started["sync"].is_set():
                return "ok"
            await asyncio.sleep(0.01)
        return "alone"

    got = asyncio.run(call_tools([ToolCall("a", {}), ToolCall("b", {})], {"a": sync_side, "b": async_side}, 10))
    assert [r.content for r in got] == ["ok", "ok"]


def test_the_schema_comes_from_hints_and_docstring():
    schema = tool_schemas([add])[0]
    assert schema["function"]["name"] == "add" and schema["function"]["description"] == "Add two numbers."
    assert schema["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first"}


def test_sync_calls_past_their_limit_are_counted_and_a_call_that_would_only_queue_fails_named():
    """A hung sync tool's thread runs on after its time limit: with every thread taken by such calls, the next sync
    call fails at once saying why, an async one still
    runs, and once the hung calls end the threads serve again."""
    from tandem.rollout import tools as tools_module

    release = threading.Event()

    def hang(x: int) -> int:
        """Waits.

        Args:
            x: ignored
        """
        release.wait(30)
        return x

    async def quick(x: int) -> int:
        """Returns x.

        Args:
            x: the value
        """
        return x

    from tandem.rollout.episodes import EventLoopThread

    saved = tools_module.SYNC_THREADS
    tools_module.SYNC_THREADS = tools_module.SyncToolThreads(2)
    loop = EventLoopThread()  # the worker's loop: it outlives each call, as the abandoned threads do
    try:
        hung = loop.run(call_tools([ToolCall("hang", {"x": 1}), ToolCall("hang", {"x": 2})], {"hang": hang}, 0.2))
        assert all(r.failed and "no result within 0.2 s" in r.content for r in hung)
        assert tools_module.SYNC_THREADS.running == 2  # abandoned, still running
        t0 = time.time()
        out = loop.run(call_tools([ToolCall("add", {"a": 1, "b": 2}), ToolCall("quick", {"x": 7})],
                                  {"add": add, "quick": quick}, 5.0))
        assert time.time() - t0 < 1.0
        assert out[0].failed and "add: not run: all 2 tool threads of this worker still run earlier calls" in \
            json.loads(out[0].content)["error"]
        assert not out[1].failed and out[1].content == "7"
        release.set()
        for _ in range(100):
            if tools_module.SYNC_THREADS.running == 0:
                break
            time.sleep(0.05)
        again = loop.run(call_tools([ToolCall("add", {"a": 1, "b": 2})], {"add": add}, 5.0))
        assert not again[0].failed and again[0].content == "3"
    finally:
        release.set()
        tools_module.SYNC_THREADS = saved
        loop.close()


def test_a_long_reply_is_cut_to_what_could_fit_and_the_cut_is_said():
    from tandem.rollout.episodes import capped

    assert capped("short", 100) == "short"
    cut = capped("x" * 10_000_000, 4096)
    assert cut.startswith("x" * 4096) and cut.endswith("[cut: the reply is 10,000,000 characters, the first 4,096 "
                                                      "shown]") and len(cut) < 4200


ISOLATED_TOOLS = '''
import os, time


def double(x: int) -> int:
    """Twice x.

    Args:
        x: a number
    """
    return 2 * x


def die(code: int) -> str:
    """Ends its process at once.

    Args:
        code: the exit status
    """
    os._exit(code)


def hang(pid_file: str) -> str:
    """Writes its process id, then never returns.

    Args:
        pid_file: where the id goes
    """
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    return "never"


async def later(text: str) -> dict:
    """An async tool.

    Args:
        text: echoed
    """
    return {"echo": text}
'''


@pytest.mark.alone  # what it finds in /dev/shm is every process's: no other test beside it
def test_process_isolated_tools_survive_a_tool_that_kills_its_process_and_stop_a_hung_one(tmp_path):
    """tool_isolation: process: a tool that calls os._exit fails its own call (the model reads why) and the next call
    runs; a call past its time limit is stopped with its process (a thread could only be abandoned); schemas and
    replies are those of the tools run in the worker; closing leaves no semaphore in /dev/shm."""
    import os

    from tandem.core.loader import load_function
    from tandem.rollout.tools import IsolatedTools

    mod = tmp_path / "risky.py"
    mod.write_text(ISOLATED_TOOLS)
    specs = [f"{mod}:{n}" for n in ("double", "die", "hang", "later")]
    plain = {fn.__name__: fn for fn in map(load_function, specs)}
    before = unmapped_semaphores()
    iso = IsolatedTools(specs, processes=2)
    iso.start()
    try:
        tools = iso.wrap(plain)
        assert tool_schemas(list(tools.values())) == tool_schemas(list(plain.values()))

        def turn(*calls, timeout=20.0):
            return asyncio.run(call_tools([ToolCall(n, a) for n, a in calls], tools, timeout))

        ok = turn(("double", {"x": 3}), ("later", {"text": "x"}))
        assert [(r.content, r.failed) for r in ok] == [("6", False), (json.dumps({"echo": "x"}), False)]
        died, after = turn(("die", {"code": 3})), turn(("double", {"x": 2}))
        assert died[0].failed and "the process running die died" in json.loads(died[0].content)["error"]
        assert [(r.content, r.failed) for r in after] == [("4", False)]
        pid_file = tmp_path / "pid"
        t0 = time.monotonic()
        hung = turn(("hang", {"pid_file": str(pid_file)}), timeout=3.0)
        assert hung[0].failed and "no result within 3 s" in hung[0].content and time.monotonic() - t0 < 10
        pid = int(pid_file.read_text())
        for _ in range(50):  # killed by the restart; reaped by the pool's shutdown
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the hung tool's process {pid} still runs")
        assert [(r.content, r.failed) for r in turn(("double", {"x": 5}))] == [("10", False)]
    finally:
        iso.close()
    assert unmapped_semaphores() <= before


def test_process_isolation_is_refused_with_an_environment():
    import pytest

    from tandem.core.config import JobConfig

    with pytest.raises(ValueError, match="tool_isolation = 'process' with environment = 'env.py:Game': an environment"):
        JobConfig.model_validate({"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "rewards": ["r.py:f"],
                                  "environment": "env.py:Game", "tool_isolation": "process"})
