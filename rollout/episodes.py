"""Multi-turn episodes on a rollout worker: a model turn, its tool calls run, their results appended through the
chat template, the next turn, until a turn without a call, the iteration limit or the token budget.

The ids sent to the learner are the ids the sampler conditioned on, turn after turn, never text tokenised again:
a model turn's ids as sampled (its EOS included), then the tool messages' ids as the chat template renders them
after an assistant turn (TRL's `_get_tool_suffix_ids`: a short conversation rendered with and without the tool
messages, cut at the assistant turn's EOS). That is exact only where the template is prefix-preserving: rendering
more messages leaves the ids of the earlier ones as they were, and an assistant turn ends with the EOS the model
samples. `ToolTurnTemplate.check` tests both once, at the worker's setup, and refuses the model otherwise (verl's
tokenization sanity check and TRL's patched templates guard the same trap).

Each episode is a coroutine: its turns wait on the engine loop without a thread, its tools run concurrently with
every other episode's turns and tools (a group's episodes share one event loop in the calling thread; groups run
in the worker's call threads). A training group's episodes in flight (`live`: the engine loop's in-flight mode) sample
every turn on the newest version, each token keeping the version that sampled it (a publish lands mid-turn or between
two turns, as it does in a single-turn request); otherwise (an evaluation, `cluster.inflight_updates: false`) every
turn samples with its group's version (pinned)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tandem.core.config import JobConfigError
from tandem.core.errors import ToolError
from tandem.rollout.engine_loop import Release, Request, Sample
from tandem.rollout.engines.base import Completion, Sampling
from tandem.rollout.rewards import RewardError, reward_value
from tandem.rollout.tools import SYNC_THREADS, TOOL_CALL_PARSERS, IsolatedTools, ToolResult, call_tools

ENDINGS = ("answer", "iterations", "budget")  # why an episode ended: a turn without a call, the limit, the budget


class TemplateError(JobConfigError):
    """The model's chat template cannot give exact ids for tool turns (refused as a bad job is: one line)."""


@dataclass(frozen=True)
class EpisodeLimits:
    budget: int  # max_completion_length: every token after the prompt, the model's and the tools' (TRL counts so)
    max_iterations: int | None  # max_tool_calling_iterations: tool rounds; None = until a turn without a call
    tool_timeout_s: float | None


@dataclass
class Episode:
    """One completion of a group, turn by turn: ids after the prompt, which of them the model sampled, the
    sampler's log-probs (0.0 on tool tokens, as TRL and verl fill them), the messages reward functions read."""

    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the version that sampled each token (tools: their turn's)
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    tool_s: float = 0.0
    ended: str = "answer"
    eos: bool = True  # the last turn ended with EOS (False: cut by the budget)

    def add_turn(self, c: Completion, message: dict, version: int) -> None:
        """A model turn sampled on `version` (its tokens' own where it crossed a publish: c.versions)."""
        self.ids += [int(t) for t in c.tokens]
        self.mask += [True] * len(c.tokens)
        self.logprobs += [float(x) for x in c.logprobs]
        self.versions += [version] * len(c.tokens) if c.versions is None else [int(v) for v in c.versions]
        self.messages.append(message)
        self.turns += 1
        self.eos = bool(c.eos)

    def count_tools(self, messages: list[dict], results: list[ToolResult], failures: int) -> None:
        """A round of calls counted, whatever becomes of their replies (a reply past the budget is rolled back)."""
        self.tool_calls += len(messages)
        self.tool_failures += failures
        self.tool_s += sum(r.seconds for r in results)

    def add_tools(self, suffix: list[int], messages: list[dict]) -> None:
        self.ids += suffix
        self.mask += [False] * len(suffix)
        self.logprobs += [0.0] * len(suffix)
        self.versions += self.versions[-1:] * len(suffix)
        self.messages += messages

    def after(self, lead: list[int]) -> None:
        """Context before the episode's first turn (its own prompt's ids past the group's): not the model's."""
        self.ids, self.mask = list(lead) + self.ids, [False] * len(lead) + self.mask
        self.logprobs = [0.0] * len(lead) + self.logprobs
        self.versions = self.versions[:1] * len(lead) + self.versions

    def completion(self) -> Completion:
        return Completion(np.asarray(self.ids, dtype=np.int32), np.asarray(self.logprobs, dtype=np.float32), self.eos,
                          np.asarray(self.mask, dtype=bool), np.asarray(self.versions, dtype=np.int32))


class ToolTurnTemplate:
    """The ids the chat template puts after a model turn that called tools: the tool messages and the next
    assistant header."""

    def __init__(self, tokenizer, model: str):
        self.tok, self.model = tokenizer, model

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _turn(self, name: str, content: str = "") -> list[dict]:
        call = {"type": "function", "function": {"name": name, "arguments": {}}}
        return [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": content, "tool_calls": [call]}]

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        head = self._turn(tool_messages[0]["name"])
        prefix = self._cut_at_eos(self._render(head, False))
        full = self._render(head + tool_messages, True)
        if full[: len(prefix)] != prefix:
            raise TemplateError(self._not_prefix_preserving())
        return full[len(prefix):]

    def _cut_at_eos(self, ids: list[int]) -> list[int]:
        eos = self.tok.eos_token_id
        last = max((i for i, t in enumerate(ids) if t == eos), default=None)
        if last is None:
            raise TemplateError(f"model {self.model!r}: its chat template does not end an assistant turn with the EOS "
                                f"token {self.tok.eos_token!r}; a tool turn's ids would not be the ids the model "
                                "samples. Use a template that does (TRL ships patched training templates)")
        return ids[: last + 1]

    def _not_prefix_preserving(self) -> str:
        return (f"model {self.model!r}: its chat template is not prefix-preserving for tool turns (rendering the "
                "conversation with the tool messages changes the ids of the turns before them), so the ids sent to "
                "the learner would drift from the ids sampled; use a template that is (TRL ships patched training "
                "templates; verl's tokenization sanity check refuses the same)")

    def check(self) -> None:
        """Refuses a template that cannot give exact ids: the assistant turn must end with EOS, the tool messages'
        rendering must leave the earlier ids as they were, and the tool's content must appear in its ids."""
        probe = "tandem-probe-result"
        suffix = self.suffix_ids([{"role": "tool", "name": "probe", "content": probe}])
        text = self.tok.decode(suffix)
        if probe not in text:
            raise TemplateError(f"model {self.model!r}: its chat template does not render tool messages (a tool "
                                f"result rendered as {text!r})")
        head = self._turn("probe", "some text")
        first = self._cut_at_eos(self._render(head, False))
        two = self._render(head + [{"role": "tool", "name": "probe", "content": probe},
                                   {"role": "assistant", "content": "more"}], False)
        if two[: len(first)] != first:
            raise TemplateError(self._not_prefix_preserving())


class EpisodeRunner:
    """Runs the G episodes of a group from their first turns (sampled together, one request of n = G):
    `await runner.run(first_turns, prompt_ids, version, sampling)` -> G Episodes, every later turn sampled as the
    first (the same sampling parameters, n = 1, the budget left) on the same version, or on the newest where `live`
    (in flight); `submit` hands the engine loop a command."""

    def __init__(self, tokenizer, template: ToolTurnTemplate, tools: dict[str, Callable], limits: EpisodeLimits,
                 submit: Callable, parser: str = "hermes", isolated: IsolatedTools | None = None):
        self.tok, self.template, self.tools, self.limits, self.submit = tokenizer, template, tools, limits, submit
        self.parser = TOOL_CALL_PARSERS[parser]()
        self.isolated = isolated  # the child processes `tools` run in (tool_isolation: process), closed with the runner

    def close(self) -> None:
        if self.isolated is not None:
            self.isolated.close()

    async def group(self, prompts: list[np.ndarray], sampling: Sampling, min_version: int = 0,
                    tools: list[dict] | None = None, live: bool = False) -> tuple[list[Episode], int, float]:
        """The n = sampling.n episodes of one prompt -> (episodes, the version the first turn started on, when
        sampling began). prompts: one (every episode begins from it: one request of n) or n (an environment's reset
        text made them differ: n requests of one); tools: each episode's own (an environment's methods), else the
        runner's. Pinned (not live): every turn on the first turn's version, held once per episode until it ends.
        live: a training group's turns in flight, each on the newest version (a training request, held by nothing)."""
        n = sampling.n
        one = sampling if len(prompts) == 1 else dataclasses.replace(sampling, n=1)
        reqs = [Request(prompts[0], one, min_version, stoppable=live)]
        self.submit(Sample(reqs[0], hold=0 if live else n))  # pinned: the first turn holds the version per episode
        if len(prompts) > 1:
            if not live:
                await started(reqs[0])
            reqs += [Request(p, one, min_version, stoppable=live, pin=None if live else reqs[0].version)
                     for p in prompts[1:]]
            for r in reqs[1:]:
                self.submit(Sample(r))
        await asyncio.gather(*(finished(r) for r in reqs))
        error = next((r.error for r in reqs if r.error is not None), None)
        if error is not None:
            for _ in range(reqs[0].hold):  # the episodes that will not run give the version back
                self.submit(Release(reqs[0].version))
            raise error
        first = [(c, reqs[0].version) for c in reqs[0].result] if len(reqs) == 1 else [
            (r.result[0], r.version) for r in reqs]
        run = functools.partial(self.episode, live=True) if live else self._released
        eps = await asyncio.gather(*(run(c, prompts[i % len(prompts)], v, sampling, tools[i] if tools else self.tools)
                                     for i, (c, v) in enumerate(first)))
        return list(eps), reqs[0].version, reqs[0].submitted

    async def run(self, first: list[Completion], prompt_ids: np.ndarray, version: int, sampling: Sampling
                  ) -> list[Episode]:
        """Episodes from first turns sampled already, pinned (each releases the version when it ends: the first turn
        held it once per episode)."""
        return list(await asyncio.gather(*(self._released(c, prompt_ids, version, sampling, self.tools)
                                           for c in first)))

    async def _released(self, first: Completion, prompt_ids: np.ndarray, version: int, sampling: Sampling,
                        tools: dict) -> Episode:
        try:
            return await self.episode(first, prompt_ids, version, sampling, tools)
        finally:
            self.submit(Release(version))

    async def episode(self, turn: Completion, prompt_ids: np.ndarray, version: int, sampling: Sampling,
                      tools: dict | None = None, live: bool = False) -> Episode:
        """One episode from its first turn, sampled on `version`; its later turns pinned to it, or live."""
        ep, lim, rounds, tools = Episode(), self.limits, 0, self.tools if tools is None else tools
        prompt = [int(t) for t in prompt_ids]
        while True:
            text = self.tok.decode([int(t) for t in turn.tokens], skip_special_tokens=True)
            parsed = self.parser.parse(text)
            ep.add_turn(turn, assistant_message(text, parsed.calls), version)
            if not turn.eos:
                ep.ended = "budget"  # cut mid-turn: whatever it began is not run
                return ep
            if not (parsed.calls or parsed.errors):
                ep.ended = "answer"
                return ep
            if lim.max_iterations is not None and rounds >= lim.max_iterations:
                ep.ended = "iterations"
                return ep
            results = await call_tools(parsed.calls, tools, lim.tool_timeout_s)
            room = lim.budget - len(ep.ids)  # tokens left: a reply longer than that many characters cannot fit
            messages = [{"role": "tool", "name": r.name, "content": capped(r.content, room * CHARS_PER_TOKEN)}
                        for r in results]
            messages += [{"role": "tool", "name": "invalid_tool_call", "content": json.dumps({"error": e})}
                         for e in parsed.errors]
            ep.count_tools(messages, results, sum(r.failed for r in results) + len(parsed.errors))
            # rendered in a thread: the tokenizer's time on a long reply is not every other episode's wait
            suffix = await asyncio.to_thread(self.template.suffix_ids, messages)
            if len(ep.ids) + len(suffix) >= lim.budget:  # no room for the results and a next turn: rolled back (TRL)
                ep.ended = "budget"
                return ep
            ep.add_tools(suffix, messages)
            rounds += 1
            turn, version = await self._next_turn(prompt + ep.ids, dataclasses.replace(
                sampling, n=1, max_tokens=min(sampling.max_tokens, lim.budget) - len(ep.ids)), version, live)

    async def _next_turn(self, ids: list[int], sampling: Sampling, version: int, live: bool
                         ) -> tuple[Completion, int]:
        """The next turn -> (it, the version it started on): pinned to `version`, or live on the newest."""
        req = Request(np.asarray(ids, dtype=np.int32), sampling, stoppable=live, pin=None if live else version)
        self.submit(Sample(req))
        await finished(req)
        if req.error is not None:
            raise req.error
        return req.result[0], req.version


CHARS_PER_TOKEN = 16  # a cap in characters safely above any tokenizer's: what is cut could never have fit


def capped(content: str, limit: int) -> str:
    """A tool's reply cut to `limit` characters, the cut said to the model (TRL rolls a reply past the budget back
    whole; tokenising megabytes first would stall every episode of the worker)."""
    if len(content) <= limit:
        return content
    return content[:limit] + f"... [cut: the reply is {len(content):,} characters, the first {limit:,} shown]"


class EventLoopThread:
    """The worker's one event loop for episodes, every group's, in a thread of its own: `run(coroutine)` from any
    call thread waits for its result. Sync tools run in the loop's thread pool, `tool_threads` at once (asyncio's
    default, min(32, cores + 4), would queue a cycle's calls on a small machine)."""

    def __init__(self, tool_threads: int = SYNC_THREADS.n):
        self.loop = asyncio.new_event_loop()
        # SYNC_THREADS lets at most tool_threads sync tool calls run here (a call that would only queue fails,
        # named); the 4 more keep rendering tool turns (EpisodeRunner.episode) going while every tool thread hangs
        self.loop.set_default_executor(ThreadPoolExecutor(tool_threads + 4, thread_name_prefix="tool"))
        self._thread = threading.Thread(target=self.loop.run_forever, name="episodes", daemon=True)
        self._thread.start()

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def assistant_message(text: str, calls) -> dict:
    """A model turn as reward functions read it (TRL's parsed assistant message: its tool calls apart)."""
    m = {"role": "assistant", "content": text}
    if calls:
        m["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]
    return m


async def started(req: Request) -> None:
    """Until the engine loop has chosen the request's version (or it failed): within one engine turn."""
    while not (req.started or req.done.is_set()):
        await asyncio.sleep(0.001)


async def finished(req: Request) -> None:
    """Waits for a request without a thread: the engine loop's thread wakes this event loop."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def wake():
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
    req.when_done(wake)
    await fut


def episode_stats(episodes: list[Episode]) -> dict:
    """What the controller's metrics read about a group's episodes (small: it travels in the group's meta)."""
    return {"turns": [e.turns for e in episodes], "tool_calls": [e.tool_calls for e in episodes],
            "tool_failures": [e.tool_failures for e in episodes], "tool_s": float(sum(e.tool_s for e in episodes)),
            "ended": [ENDINGS.index(e.ended) for e in episodes]}


def job_tool_schemas(cfg, tokenizer) -> list[dict] | None:
    """The JSON schemas of a job's tools for the prompts' chat template, once the model's template is known to give
    exact tool-turn ids (refused otherwise, naming the model); None for a job without tools."""
    if not (cfg.tools or cfg.environment):
        return None
    from tandem.core.loader import load_function
    from tandem.rollout.tools import tool_schemas

    ToolTurnTemplate(tokenizer, cfg.model.local_dir()).check()
    env = Environments.load(cfg.environment).schemas() if cfg.environment else []
    return tool_schemas([load_function(spec) for spec in cfg.tools or []]) + env


def episode_metrics(stats: list[dict]) -> dict:
    """A trained batch's episodes (each group's `episode_stats`) -> metrics: TRL's tools/call_frequency (calls per
    episode) and tools/failure_frequency (failed calls per call), turns per episode, failures per episode, seconds in
    tools, and the share of episodes the iteration limit or the budget ended. {} for single-turn groups."""
    stats = [s for s in stats if s]
    if not stats:
        return {}
    cat = {k: np.concatenate([np.asarray(s[k], dtype=np.float64) for s in stats])
           for k in ("turns", "tool_calls", "tool_failures", "ended")}
    n, calls = len(cat["turns"]), cat["tool_calls"].sum()
    return {"episodes/turns_mean": float(cat["turns"].mean()), "episodes/turns_max": int(cat["turns"].max()),
            "tools/call_frequency": float(calls / n),
            "tools/failure_frequency": float(cat["tool_failures"].sum() / calls) if calls else 0.0,
            "tools/failures_per_episode": float(cat["tool_failures"].sum() / n),
            "tools/time_s": float(sum(s["tool_s"] for s in stats)),
            "episodes/ended_by_iterations": float((cat["ended"] == ENDINGS.index("iterations")).mean()),
            "episodes/ended_by_budget": float((cat["ended"] == ENDINGS.index("budget")).mean())}


class EnvironmentResetError(ToolError):
    """An environment's reset raised: that prompt fails as a reward function's failure does (retried once)."""


class Environments:
    """The job's `environment: module:Class` (TRL's environment_factory): one instance per episode, made with no
    arguments; `reset(**row)` -> None or text that joins the last user message; its public methods (not reset,
    not get_reward) are the episode's tools, bound to its instance; `get_reward()`, where defined, is one more
    reward column, of weight 1 (TRL adds it the same way)."""

    def __init__(self, cls, spec: str, tool_names: list[str]):
        self.cls, self.spec, self.tool_names = cls, spec, tool_names
        self.has_reward = callable(getattr(cls, "get_reward", None))

    @classmethod
    def load(cls, spec: str) -> Environments:
        from tandem.core.checks import load_environment

        env_cls, names = load_environment(spec)
        return cls(env_cls, spec, names)

    def schemas(self) -> list[dict]:
        from tandem.rollout.tools import tool_schemas

        probe = self.cls()
        return tool_schemas([getattr(probe, n) for n in self.tool_names])

    def make(self, n: int, row: dict, index: int) -> tuple[list, list[str | None]]:
        """n instances, each reset with the dataset row -> (instances, what each reset returned)."""
        made, observations = [], []
        for _ in range(n):
            env = self.cls()
            try:
                obs = env.reset(**row)
            except Exception as e:  # noqa: BLE001 - that prompt's failure, named
                raise EnvironmentResetError(f"environment {self.spec}: reset() of dataset row {index} raised "
                                        f"{type(e).__name__}: {e}") from e
            made.append(env)
            observations.append(obs if isinstance(obs, str) else None)
        return made, observations

    def tools(self, env) -> dict:
        return {n: getattr(env, n) for n in self.tool_names}

    def rewards(self, envs, index: int) -> np.ndarray:
        """float32 [n]: get_reward() of each instance, checked as a reward function's values are (None: NaN, no
        reward for that sample; NaN, inf or a non-number: RewardError); NaN without one (the column counts for
        nothing). `index`: the dataset row, for the error."""
        if not self.has_reward:
            return np.full(len(envs), np.nan, dtype=np.float32)
        out = np.empty(len(envs), dtype=np.float32)
        for i, e in enumerate(envs):
            where = f"environment {self.spec}: get_reward() on dataset row {index}, sample {i}"
            try:
                v = e.get_reward()
            except Exception as err:  # noqa: BLE001 - that prompt's failure, named
                raise RewardError(f"{where} raised {type(err).__name__}: {err}") from err
            out[i] = reward_value(v, where)
        return out

    @staticmethod
    def prompt_with(prompt: list[dict], observation: str) -> list[dict]:
        """The prompt with reset's text after the last message's content (a copy: the row stays as it was)."""
        return prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]

