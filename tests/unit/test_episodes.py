"""Episodes on the engine loop with a scripted engine in place of vLLM (its replies written as text, tokenised by a
real tokenizer with a tool-calling chat template): the ids are the turns' ids and the template's tool ids back to
back, the mask and the log-probs mark the model's tokens, every way a tool call goes wrong ends as a counted error
message, the limits end episodes, a tool's wait never holds up another episode's turns, every turn of an episode
samples with its group's version. Real engines: tests/integration/test_episodes.py."""

import asyncio
import json
import threading
import time

import numpy as np
import pytest

from tandem.rollout.engine_loop import EngineLoop, LoadVersion, Request, Sample
from tandem.rollout.engines.base import Completion, Sampling
from tandem.rollout.episodes import (
    ENDINGS,
    EpisodeLimits,
    EpisodeRunner,
    EventLoopThread,
    TemplateError,
    ToolTurnTemplate,
    episode_metrics,
    episode_stats,
)
from tandem.services.devtools.tiny_model import CHATML, TOOL_CALL, TOOL_CALL_END, build_tokenizer
from tests.unit import test_engine_loop

G = 4


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512, tool_tokens=True)


def call(name, **arguments) -> str:
    return TOOL_CALL + json.dumps({"name": name, "arguments": arguments}) + TOOL_CALL_END


class ScriptedEngine(test_engine_loop.ScriptedEngine):
    """test_engine_loop's scripted engine (its adapters), but each request finishes in one step with
    `script(text of its ids, key)` as its reply (cut at the request's max_tokens), log-prob -0.5 per token.
    Records (time, adapter, max_tokens, n) and the sampling of every request."""

    def __init__(self, tok, script):
        super().__init__()
        self.tok, self.script = tok, script
        self.pending: dict = {}
        self.added: list[tuple] = []
        self.samplings: list[Sampling] = []

    def add(self, key, ids, sampling, adapter=None):
        self.added.append((time.monotonic(), adapter, sampling.max_tokens, sampling.n))
        self.samplings.append(sampling)
        self.pending[key] = (self.tok.decode(ids), sampling)

    def step(self):
        time.sleep(0.002)
        done = []
        for key, (text, s) in list(self.pending.items()):
            comps = []
            for i in range(s.n):
                ids = self.tok(self.script(text, i), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                cut = ids[: s.max_tokens]
                comps.append(Completion(np.array(cut, np.int32), np.full(len(cut), -0.5, np.float32),
                                        len(cut) == len(ids)))
            done.append((key, comps))
            del self.pending[key]
        return done


async def slow_add(a: int, b: int) -> int:
    """Adds, slowly.

    Args:
        a: first
        b: second
    """
    await asyncio.sleep(1.0)
    return a + b


def add(a: int, b: int) -> int:
    """Adds.

    Args:
        a: first
        b: second
    """
    return a + b


def broken(x: int) -> int:
    """Raises.

    Args:
        x: anything
    """
    raise ZeroDivisionError("no luck")


def hangs() -> str:
    """Sleeps past any limit."""
    time.sleep(3)
    return "late"


TOOLS = {f.__name__: f for f in (add, slow_add, broken, hangs)}


def episodes(tok, script, *, budget=200, max_iterations=None, timeout=0.5, n=G, version=0, tools=TOOLS,
             before=None, tools_per_episode=None, prompts=None):
    """The group of one prompt through a real engine loop and the scripted engine -> (episodes, engine, loop,
    prompt). tools_per_episode / prompts: through EpisodeRunner.group (the worker's way), which samples the first
    turns itself; else the first turn here, then EpisodeRunner.run (so that `before` may publish in between)."""
    engine = ScriptedEngine(tok, script)
    loop = EngineLoop(lora=True)
    threading.Thread(target=loop.run, args=(engine,), daemon=True).start()
    if version:
        cmd = LoadVersion(version, {})
        loop.submit(cmd)
        cmd.done.wait(5)
    sampling = Sampling(n=n, max_tokens=budget, temperature=0.7, top_k=5)
    runner = EpisodeRunner(tok, ToolTurnTemplate(tok, "tiny"), tools,
                           EpisodeLimits(budget, max_iterations, timeout), loop.submit)
    prompt = np.asarray(tok.apply_chat_template([{"role": "user", "content": "what is 2 + 3 ?"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    events = EventLoopThread()
    try:
        if tools_per_episode is not None or prompts is not None:
            eps, v, _ = events.run(runner.group(prompts or [prompt], sampling, 0, tools_per_episode))
            return eps, engine, loop, v
        first = Request(prompt, sampling)
        loop.submit(Sample(first, hold=n))
        assert first.done.wait(5)
        if before:
            before(loop)
        eps = events.run(runner.run(first.result, prompt, first.version, sampling))
    finally:
        events.close()
    return eps, engine, loop, prompt


def two_turns(text, i):
    """A tool call, then the answer it read."""
    return call("add", a=2, b=3) if "<|im_start|>tool" not in text else text.rsplit("tool\n", 1)[1].split("<")[0]


def test_ids_are_the_turns_back_to_back_and_the_template_renders_the_same(tok):
    eps, engine, loop, prompt = episodes(tok, two_turns)
    tmpl = ToolTurnTemplate(tok, "tiny")
    turn1 = tok(call("add", a=2, b=3), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    suffix = tmpl.suffix_ids([{"role": "tool", "name": "add", "content": "5"}])
    turn2 = tok("5", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for e in eps:
        assert e.ids == turn1 + suffix + turn2
        assert e.mask == [True] * len(turn1) + [False] * len(suffix) + [True] * len(turn2)
        assert e.logprobs == [-0.5] * len(turn1) + [0.0] * len(suffix) + [-0.5] * len(turn2)
        assert (e.turns, e.tool_calls, e.tool_failures, e.ended, e.eos) == (2, 1, 0, "answer", True)
        assert [m["role"] for m in e.messages] == ["assistant", "tool", "assistant"]
        assert e.messages[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
        assert e.messages[-1]["content"] == "5"
        # what the template renders for the whole conversation is what was sampled on (prefix-preserving)
        conv = [{"role": "user", "content": "what is 2 + 3 ?"}, {"role": "assistant", "content": "",
                "tool_calls": e.messages[0]["tool_calls"]}, e.messages[1], e.messages[2]]
        rendered = tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
        assert list(prompt) + e.ids == rendered[: len(prompt) + len(e.ids)]
        c = e.completion()
        assert c.tokens.tolist() == e.ids and c.eos
    # the second turn was sampled on exactly the concatenated ids, one completion each, in the budget left
    later = engine.added[1:]
    assert len(later) == G and all(n == 1 and mt == 200 - len(turn1) - len(suffix) for _, _, mt, n in later)
    assert all(s.temperature == 0.7 and s.top_k == 5 for s in engine.samplings)  # every turn sampled as the first
    loop.stop()


@pytest.mark.parametrize("reply, failures, error", [
    (call("broken", x=1), 1, "broken raised ZeroDivisionError: no luck"),
    (call("hangs"), 1, "hangs: no result within 0.5 s"),
    (call("nope", q=1), 1, "unknown tool 'nope'"),
    (call("add", a=1), 1, "add: missing a required argument: 'b'"),
    (TOOL_CALL + '{"name": "add", "arguments": {"a": 1,, }' + TOOL_CALL_END, 1, "tool call is not valid JSON"),
    (TOOL_CALL + '{"name": "add"', 1, "tool call not closed"),
    (call("add", a=1, b=2) + call("broken", x=0), 1, "broken raised"),
])
def test_a_tool_call_that_goes_wrong_is_an_error_message_and_a_counted_failure(tok, reply, failures, error):
    eps, *_ = episodes(tok, lambda text, i: reply if "<|im_start|>tool" not in text else "done", n=2)
    for e in eps:
        assert e.ended == "answer" and e.turns == 2 and e.tool_failures == failures
        tool_msgs = [m for m in e.messages if m["role"] == "tool"]
        assert len(tool_msgs) == e.tool_calls >= 1
        assert any(error in m["content"] for m in tool_msgs), tool_msgs
        assert all("error" in json.loads(m["content"]) for m in tool_msgs if error.split()[0] in m["content"])
        assert e.messages[-1]["content"] == "done"


def test_the_iteration_limit_and_the_budget_end_an_episode_that_never_stops_calling(tok):
    always = lambda text, i: call("add", a=1, b=1)  # noqa: E731
    eps, *_ = episodes(tok, always, max_iterations=2, n=2)
    assert all(e.ended == "iterations" and e.turns == 3 and e.tool_calls == 2 for e in eps)
    eps, engine, *_ = episodes(tok, always, budget=120, n=2)  # no limit: the budget ends it
    assert all(e.ended == "budget" for e in eps)
    assert all(len(e.ids) <= 120 for e in eps)
    assert all(mt >= 1 for _, _, mt, _ in engine.added)
    # a turn cut by the budget mid-way is not run, and is not an EOS
    eps, *_ = episodes(tok, lambda text, i: call("add", a=1, b=1) * (1 if "tool" not in text else 40), budget=80, n=1)
    assert eps[0].ended == "budget" and not eps[0].eos and len(eps[0].ids) == 80 and eps[0].tool_calls == 1


def test_a_tool_that_waits_holds_up_no_other_episode(tok):
    """Episode 0 calls a tool that sleeps 1 s; the others take three quick tool rounds meanwhile: their turns are
    sampled while the slow tool sleeps (they finish long before it returns)."""
    def script(text, i):
        rounds = text.count("<|im_start|>tool")
        if rounds == 0:
            return call("slow_add", a=1, b=2) if i == 0 else call("add", a=1, b=2)
        return call("add", a=rounds, b=1) if rounds < 3 and "slow" not in text else "ok"
    t0 = time.monotonic()
    eps, engine, *_ = episodes(tok, script, timeout=5)
    assert [e.turns for e in eps] == [2, 4, 4, 4]
    quick = [t - t0 for t, _, _, n in engine.added if n == 1]
    assert len(quick) == 1 + 3 * 3 and sorted(quick)[-2] < 0.8  # every quick turn sampled within the slow call
    assert time.monotonic() - t0 >= 1.0


def test_every_turn_samples_with_the_groups_version_and_each_episode_releases_it(tok):
    """A new version published after the first turn: the later turns still sample with the group's (pinned),
    and the version is kept loaded until the last episode releases it."""
    def publish(loop):
        cmd = LoadVersion(2, {})
        loop.submit(cmd)
        assert cmd.done.wait(5)
    eps, engine, loop, _ = episodes(tok, two_turns, version=1, before=publish)
    assert [a for _, a, _, _ in engine.added] == [1] * (1 + G)
    time.sleep(0.05)
    assert loop._holds[1] == 0
    cmd = LoadVersion(3, {})
    loop.submit(cmd)
    assert cmd.done.wait(5)
    assert engine.adapter_versions == [3]  # 1 and 2 dropped once nothing holds them
    loop.stop()


def test_a_template_that_is_not_prefix_preserving_is_refused_naming_the_model(tok):
    plain = build_tokenizer(512)  # ChatML without tool calls: renders a tool turn, prefix-preserving
    ToolTurnTemplate(plain, "plain").check()
    drifts = build_tokenizer(512)
    # a template that renders an assistant turn differently once a tool message follows (as templates that strip
    # earlier reasoning do)
    drifts.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                            "{% if m['role'] == 'assistant' and not loop.last %}[hidden]{% else %}{{ m['content'] }}"
                            "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                            "{% endif %}")
    with pytest.raises(TemplateError, match="model 'org/drifty'.*not prefix-preserving"):
        ToolTurnTemplate(drifts, "org/drifty").check()
    no_eos = build_tokenizer(512)
    no_eos.chat_template = CHATML.replace("<|im_end|>", "<|endoftext|>")
    with pytest.raises(TemplateError, match="model 'org/noeos'.*does not end an assistant turn with the EOS"):
        ToolTurnTemplate(no_eos, "org/noeos").check()


def test_metrics_of_a_batch_of_episodes(tok):
    eps, *_ = episodes(tok, lambda text, i: call("add", a=1, b=1) if i % 2 == 0 and "tool" not in text else
                       (call("broken", x=1) if i == 3 and "tool" not in text else "x"), max_iterations=1)
    stats = episode_stats(eps)
    assert stats["turns"] == [2, 1, 2, 2] and stats["tool_calls"] == [1, 0, 1, 1]
    assert stats["ended"] == [ENDINGS.index("answer")] * 4
    m = episode_metrics([stats, None, stats])
    assert m["tools/call_frequency"] == pytest.approx(3 / 4)
    assert m["tools/failure_frequency"] == pytest.approx(1 / 3)
    assert m["episodes/turns_mean"] == pytest.approx(7 / 4) and m["episodes/turns_max"] == 2
    assert m["episodes/ended_by_iterations"] == 0.0 and m["episodes/ended_by_budget"] == 0.0
    assert episode_metrics([None, None]) == {}


def test_the_rollout_worker_has_no_coroutine_method():
    """Ray makes an actor class with a coroutine method an asyncio actor, whose calls share one thread: publishing
    then waits behind a rollout that waits for the publish (the deadlock the first calculator run hit)."""
    import inspect

    from tandem.rollout.worker import RolloutWorker

    assert [n for n, _ in inspect.getmembers(RolloutWorker, inspect.iscoroutinefunction)] == []


# ------------------------------------------------------------------------------------------- the job file

def test_tool_fields_checks_and_trl_names(job_files, tmp_path):
    """tools are module:function specs, each imported with its schema and a name of its own; TRL's
    max_tool_calling_iterations maps; a job with tools needs chat prompts."""
    from tandem.core.checks import tool_errors
    from tandem.core.config import JobConfig, JobConfigError
    from tandem.rollout.prompts import PromptError, tokenize_prompt

    t = tmp_path / "tools.py"
    t.write_text('def add(a: int, b: int) -> int:\n    """Adds.\n\n    Args:\n        a: x\n        b: y\n    """\n'
                 "    return a + b\n\ndef bare(a):\n    return a\n")
    with pytest.raises(Exception, match=r"tools\[0\] = 'nocolon': expected 'module:function'"):
        JobConfig.from_dict({**job_files, "tools": ["nocolon"]})
    cfg = JobConfig.from_dict({**job_files, "tools": [f"{t}:add", f"{t}:bare", f"{t}:add", f"{t}:nope"]})
    errors = tool_errors(cfg)
    assert len(errors) == 3
    assert errors[0].startswith(f"tools[1] = '{t}:bare': ") and "docstring" in errors[0]
    assert errors[1] == (f"tools[2] = '{t}:add': a tool named 'add' is already tools[0]; the model calls tools by "
                         "name, so each needs its own")
    assert errors[2].startswith(f"tools[3] = '{t}:nope': ") and "no function 'nope'" in errors[2]
    assert JobConfig.from_trl({"max_tool_calling_iterations": 3}, **job_files).generation.max_tool_calling_iterations == 3
    assert JobConfig.from_dict(job_files).generation.max_tool_calling_iterations is None
    with pytest.raises(PromptError, match="dataset row 4: a job with tools needs chat prompts"):
        tokenize_prompt(build_tokenizer(512, True), "2 + 2", max_prompt_length=64, truncate=False, row=4,
                        tools=[{"type": "function", "function": {"name": "add"}}])
    with pytest.raises(JobConfigError):  # the template refusal is one line, as a bad job is
        raise TemplateError("x")


def test_overwrite_keeps_the_jobs_model_and_full_fine_tuning_may_not_write_over_it(job_files, tmp_path):
    """Examples keep their model at <output_dir>/model: starting over there removes the earlier run's record, never
    the model; a full fine-tuning run, which writes its trained model to <output_dir>/model, is refused there."""
    from tandem.core.checks import run_dir_error
    from tandem.core.config import JobConfig
    from tandem.services.orchestrator.checkpointer import clear_run_dir

    out = tmp_path / "run"
    (out / "model").mkdir(parents=True)
    (out / "model" / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "adapter").mkdir()
    job = {**job_files, "model": {**job_files["model"], "path": str(out / "model")},
           "logging": {"output_dir": str(out), "overwrite_output_dir": True}}
    cfg = JobConfig.from_dict(job)
    clear_run_dir(cfg)
    assert (out / "model" / "config.json").is_file()
    assert not (out / "metrics.jsonl").exists() and not (out / "adapter").exists()
    full = JobConfig.from_dict({**job, "model": {**job["model"], "lora": None}})
    assert "is <output_dir>/model, where a full fine-tuning run writes its trained model" in run_dir_error(full)
    assert run_dir_error(cfg) is None


def test_calls_whose_replies_do_not_fit_are_counted_and_a_huge_reply_is_cut_before_it_is_rendered(tok):
    """Calls that raised and whose error replies overflow the budget still count as calls and failures; a 10 MB reply
    is cut to what could fit before the template renders it, so the episode ends at once, its call counted."""
    def shout(n: int) -> str:
        """A very long reply.

        Args:
            n: characters
        """
        return "A" * n

    many = lambda text, i: "".join(call("broken", x="1") for _ in range(5)) if "tool" not in text else "done"  # noqa: E731
    turn = len(tok(many("", 0))["input_ids"])
    eps, *_ = episodes(tok, many, budget=turn + 20, n=1)  # the turn fits; its five error replies do not
    assert eps[0].eos and eps[0].ended == "budget" and eps[0].tool_calls == 5 and eps[0].tool_failures == 5
    t0 = time.time()
    eps, *_ = episodes(tok, lambda text, i: call("shout", n=10_000_000) if "tool" not in text else "done", budget=120,
                       n=1, tools={**TOOLS, "shout": shout})
    assert time.time() - t0 < 5 and eps[0].ended == "budget" and eps[0].tool_calls == 1 and eps[0].tool_s < 5
