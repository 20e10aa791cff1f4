"""The controller's parts on their own, without Ray: prompt order, staleness, checkpoint bookkeeping,
the run log."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tandem.services.orchestrator.checkpointer import Checkpointer, complete_checkpoints
from tandem.services.orchestrator.group_buffer import GroupBuffer
from tandem.services.orchestrator.prompt_source import MAX_REWARD_RETRIES, PromptSource, PromptTable
from tandem.services.orchestrator.run_log import EXPORTED, RunLog, rollout_rates, sampling_times, series_name


def take(src, n):
    return [src.next() for _ in range(n)]


def test_each_epoch_is_a_seeded_permutation():
    a, b = PromptSource(50, seed=3), PromptSource(50, seed=3)
    first = take(a, 100)
    assert first == take(b, 100)  # seeded
    e0 = [i for i, e in first if e == 0]
    e1 = [i for i, e in first if e == 1]
    assert sorted(e0) == sorted(e1) == list(range(50)) and e0 != e1  # a new order each epoch
    assert e0 == np.random.default_rng(3).permutation(50).tolist()  # the same order as before this part
    assert [i for i, _ in take(PromptSource(5, 0, shuffle=False), 5)] == [0, 1, 2, 3, 4]


def test_the_epoch_order_is_computed_once():
    """O(1) per prompt: the permutation is drawn once per epoch, not once per prompt."""
    src = PromptSource(1000, seed=1)
    order = src.order(0)
    take(src, 500)
    assert src.order(0) is order


def test_requeued_prompts_go_first_and_retries_are_bounded():
    src = PromptSource(10, seed=0)
    got = take(src, 3)
    src.requeue(*got[2])
    src.requeue(*got[1], front=True)
    assert take(src, 2) == [got[1], got[2]]
    for _ in range(MAX_REWARD_RETRIES):
        assert src.retry(*got[0]) is True
        assert src.next() == got[0]
    assert src.retry(*got[0]) is False  # out of retries: the caller records it as failed
    assert not src.requeued


def test_state_round_trip_hands_out_pending_first_then_continues():
    a = PromptSource(20, seed=5)
    seen = take(a, 7)
    pending = seen[-2:]  # handed out, not trained
    b = PromptSource(20, seed=5)
    b.load(json.loads(json.dumps(a.state(pending))))
    assert take(b, 2) == pending
    assert take(b, 30) == take(a, 30)


def test_group_buffer_drops_only_groups_staler_than_k():
    buf = GroupBuffer(max_staleness=1)
    for v in (0, 1, 2, 2):
        buf.admit({"version": v, "index": v, "epoch": 0}, f"ref{v}")
    stale = buf.drop_stale(version=2)
    assert [m["version"] for m in stale] == [0] and len(buf) == 3
    assert [r for _, r in buf.take(2)] == ["ref1", "ref2"] and len(buf) == 1
    assert buf.pending() == [(2, 0)]
    assert GroupBuffer(0).drop_stale(0) == []


def test_a_batch_takes_the_oldest_versions_first_so_none_that_could_be_trained_goes_stale():
    """At max_staleness 1 a long group of version 1 comes back after three of version 2: the batch trained at version 2
    takes it (and the first of version 2), and the next batch, at version 3, drops nothing; in arrival order it was
    left behind and dropped."""
    buf = GroupBuffer(max_staleness=1)
    for i, v in enumerate((2, 2, 1, 2)):
        buf.admit({"version": v, "index": i, "epoch": 0, "group_id": i}, f"ref{i}")
    assert [r for _, r in buf.take(2)] == ["ref0", "ref2"]
    assert buf.drop_stale(version=3) == [] and buf.pending() == [(1, 0), (3, 0)]


def test_a_batch_is_taken_in_hand_out_order_whatever_order_its_groups_came_back_in():
    buf = GroupBuffer(max_staleness=0)
    for gid in (7, 5, 6, 9):
        buf.admit({"version": 0, "index": gid, "epoch": 0, "group_id": gid}, f"ref{gid}")
    assert [r for _, r in buf.take(3)] == ["ref5", "ref6", "ref7"] and [r for _, r in buf.take(1)] == ["ref9"]


class _Cfg:
    def __init__(self, root, save_steps=0, keep=2):
        self.checkpoint_dir = str(root)
        self.checkpoint = type("C", (), {"save_steps": save_steps, "save_total_limit": keep})()


def test_checkpointer_when_where_and_retention(tmp_path):
    ck = Checkpointer(_Cfg(tmp_path / "ck", save_steps=4, keep=2))
    assert [ck.due([s]) for s in (1, 3, 4, 8)] == [False, False, True, True]
    assert ck.due([5, 6, 7, 8]) and not ck.due([5, 6, 7])
    assert not Checkpointer(_Cfg(tmp_path / "x", save_steps=0)).due([4])
    for c in (1, 2, 3):
        d = tmp_path / "ck" / f"cycle-{c:06d}"
        (d / "state").mkdir(parents=True)
        (d / "tandem.json").write_text(json.dumps({"version": c, "steps": c, "controller": {
            p: {} for p in ("source", "progress", "record", "buffer", "failures", "counters")}}))
        (d / "rng_rank0.safetensors").write_bytes(b"")
    (tmp_path / "ck" / "cycle-000009.tmp").mkdir()  # half written: never resumed from
    (tmp_path / "ck" / "cycle-000008").mkdir()  # no tandem.json: incomplete
    assert ck.latest().name == "cycle-000003"
    ck.prune()
    assert [p.name for p in complete_checkpoints(tmp_path / "ck")] == ["cycle-000002", "cycle-000003"]
    assert ck.path(12).endswith("cycle-000012")


def test_run_log_appends_one_line_per_step(tmp_path):
    log = RunLog(tmp_path / "m.jsonl")
    log.write([{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.6, "learner/mfu": None}])
    log.write([{"step": 3, "reward": 0.7}])
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    names = [series_name(k) for k in EXPORTED]
    assert len(set(names)) == len(names) and all("/" not in n for n in names)
    assert Counter(n.startswith("tandem_") for n in names) == Counter({True: len(names)})


def test_prompt_items_carry_no_bookkeeping_in_the_columns():
    rows = [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]
    table = PromptTable(rows, [np.array([5]), np.array([6, 7])], "prompt")
    a, b = table.item(1, epoch=3), table.item(1, epoch=3)
    assert a.columns == {"answer": 2} and a.epoch == 3 and a.prompt == "b"  # the reward sees the row, no _epoch
    assert (a.group_id, b.group_id) == (0, 1)  # a fresh id per hand-out


def test_rollout_rates_divide_by_engine_busy_time_not_the_cycle():
    before = {"t": 10.0, "workers": {0: {"tokens": 1000, "busy_s": 5.0}, 1: {"tokens": 0, "busy_s": 0.0}}}
    after = {"t": 14.0, "workers": {0: {"tokens": 9000, "busy_s": 7.0}, 1: {"tokens": 3000, "busy_s": 1.0},
                                    2: {"tokens": 500, "busy_s": 0.5}}}  # worker 2 joined during the cycle
    r = rollout_rates(before, after)
    assert r["rollout/0/gen_tokens_per_s"] == 4000 and r["rollout/1/gen_tokens_per_s"] == 3000
    assert r["rollout/2/gen_tokens_per_s"] == 1000
    assert r["rollout/gen_tokens_per_s"] == 8000
    assert r["rollout/0/busy_frac"] == 0.5 and abs(r["rollout/busy_frac"] - (0.5 + 0.25 + 0.125) / 3) < 1e-12
    assert r["rollout_busy_s"] == 2.0
    idle = rollout_rates(before, {"t": 11.0, "workers": before["workers"]})
    assert idle["rollout/gen_tokens_per_s"] == 0.0 and idle["rollout/busy_frac"] == 0.0


def test_the_stale_waste_is_the_stopped_sequence_steps_over_those_and_the_finished_tokens():
    """Worker 0 finished groups of 3,000 tokens and stopped requests that ran 1,000 sequence steps in the cycle;
    worker 1 (a snapshot from before the counter existed) 1,000 tokens, none stopped: 1,000 of 5,000 went to waste."""
    before = {"t": 0.0, "workers": {0: {"tokens": 500, "busy_s": 1.0, "stale_sequence_steps": 200},
                                    1: {"tokens": 0, "busy_s": 0.0}}}
    after = {"t": 5.0, "workers": {0: {"tokens": 3500, "busy_s": 5.0, "stale_sequence_steps": 1200},
                                   1: {"tokens": 1000, "busy_s": 2.0}}}
    assert rollout_rates(before, after)["rollout/stale_waste_frac"] == pytest.approx(1000 / 5000)
    assert rollout_rates(after, after)["rollout/stale_waste_frac"] == 0.0  # nothing sampled: none wasted
    # groups of 600 tokens finished and were then dropped past the bound in the buffer: wasted as well
    dropped = rollout_rates(dict(before, dropped_tokens=100), dict(after, dropped_tokens=700))
    assert dropped["rollout/stale_waste_frac"] == pytest.approx((1000 + 600) / 5000)
    # dropped groups that finished in earlier cycles: the cycle's share is capped at the whole
    assert rollout_rates(before, dict(after, dropped_tokens=9000))["rollout/stale_waste_frac"] == 1.0
    assert "rollout/engine_steps_per_s" not in rollout_rates(before, after)  # no engine that counts its steps


def test_the_engines_step_rate_and_load_come_from_their_steps():
    """Worker 0 (streaming) made 500 steps in 4 s busy, carrying 3,000 finished tokens and 1,000 stopped sequence
    steps: 125 steps a second, 8 sequences a step; worker 1 (transformers, no steps) adds its tokens only."""
    before = {"t": 0.0, "workers": {0: {"tokens": 0, "busy_s": 1.0, "stale_sequence_steps": 0, "engine_steps": 100},
                                    1: {"tokens": 0, "busy_s": 0.0}}}
    after = {"t": 5.0, "workers": {0: {"tokens": 3000, "busy_s": 5.0, "stale_sequence_steps": 1000,
                                       "engine_steps": 600}, 1: {"tokens": 1000, "busy_s": 3.0}}}
    r = rollout_rates(before, after)
    assert r["rollout/engine_steps_per_s"] == pytest.approx(500 / 4)
    assert r["rollout/sequences_per_step"] == pytest.approx((3000 + 1000) / 500)


def test_sampling_times_are_a_groups_median_and_the_batch_from_first_hand_out_to_last_return():
    metas = [{"handed_out_at": 100.0, "returned_at": 104.0, "taken_at": 130.0},
             {"handed_out_at": 101.0, "returned_at": 103.0, "taken_at": 130.0},
             {"handed_out_at": 110.0, "returned_at": 127.0, "taken_at": 130.0},  # handed out later (sampled again)
             {"version": 3}]  # no times: left out
    t = sampling_times(metas)
    assert t["rollout/group_sampling_s"] == 4.0  # spans 4, 2, 17
    assert t["rollout/batch_sampling_s"] == 27.0  # 100 -> 127
    assert t["rollout/group_buffered_s"] == 26.0  # waits 26, 27, 3
    assert "rollout/group_buffered_s" not in sampling_times([dict(metas[0], taken_at=None)])  # not taken yet
    assert sampling_times([{"version": 3}]) == {} and sampling_times([]) == {}
    # the batch before was taken at 105: two of the three were out before it (sampled while it trained)
    assert sampling_times(metas, last_take=105.0)["rollout/sampled_ahead_frac"] == 2 / 3
    assert sampling_times(metas, last_take=100.0)["rollout/sampled_ahead_frac"] == 0.0  # out at the take: after it
    assert "rollout/sampled_ahead_frac" not in t  # the run's first batch (or a resume's): no take before it


def test_epoch_record_holds_every_use_once_in_bounded_space():
    from tandem.services.orchestrator.epoch_record import OPEN_EPOCHS, EpochRecord

    n = 1000
    r = EpochRecord(n)
    rng = np.random.default_rng(0)
    for e in range(10):
        for i in rng.permutation(n)[:700]:
            r.add(e, int(i))
    assert len(r) == 7000 and len(r.bits) == OPEN_EPOCHS  # closed epochs keep a count only
    i = next(i for e, i in r.pairs() if e == 9)
    with pytest.raises(RuntimeError, match=f"prompt {i} of epoch 9 was trained on twice"):
        r.add(9, i)
    st = json.loads(json.dumps(r.state()))
    assert len(json.dumps(st)) < 3 * OPEN_EPOCHS * (n // 8) * 4 // 3 + 500  # bits, base64: not a list per group
    again = EpochRecord(n)
    again.load(st)
    assert again.pairs() == r.pairs() and len(again) == len(r)
    with pytest.raises(ValueError, match="a record of 1000 rows for a dataset of 999"):
        EpochRecord(999).load(st)
    old = EpochRecord.from_pairs(n, [[0, 3, 1], [0, 4, 1], [1, 3, 2]])  # an older checkpoint's list
    assert old.pairs() == [(0, 3), (0, 4), (1, 3)]


def test_run_log_warns_once_when_no_group_varies_for_ten_steps(tmp_path, capsys):
    from tandem.services.orchestrator.run_log import FLAT_STEPS

    log = RunLog(tmp_path / "metrics.jsonl")
    log.write([{"step": s, "frac_reward_zero_std": 1.0} for s in range(1, FLAT_STEPS)])
    assert "warning" not in capsys.readouterr().out
    log.write([{"step": FLAT_STEPS, "frac_reward_zero_std": 1.0}, {"step": FLAT_STEPS + 1, "frac_reward_zero_std": 1.0}])
    out = capsys.readouterr().out
    assert out.count("warning") == 1 and f"for {FLAT_STEPS} steps in a row (to step {FLAT_STEPS})" in out
    log.write([{"step": 12, "frac_reward_zero_std": 0.5}] + [{"step": 13 + i, "frac_reward_zero_std": 1.0}
                                                              for i in range(FLAT_STEPS - 1)])
    assert "warning" not in capsys.readouterr().out  # a step with variance starts the count again


def comparable(v):
    """A part's attribute as plain data: a sub-part by its state, containers by their items."""
    import collections

    if hasattr(v, "state") and not isinstance(v, type):
        return comparable(v.state())
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, dict):
        return {str(k): comparable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, collections.deque)):
        return [comparable(x) for x in v]
    if hasattr(v, "__dict__") and not isinstance(v, (type, Path)):
        return comparable(vars(v))  # a part it holds (the source's table)
    return v


def assert_round_trips(part, fresh, state=None):
    """fresh.load(part.state()) (through JSON, as a checkpoint) gives a part equal to `part` in every attribute
    but those it declares TRANSIENT: a part that gains state its state() leaves out fails here."""
    fresh.load(json.loads(json.dumps(part.state() if state is None else state)))
    skip = set(type(part).TRANSIENT)
    got = {k: comparable(v) for k, v in vars(fresh).items() if k not in skip}
    want = {k: comparable(v) for k, v in vars(part).items() if k not in skip}
    assert got == want


def test_every_part_that_holds_run_state_round_trips_through_its_state(tmp_path):
    from tandem.services.orchestrator.controller import Progress
    from tandem.services.orchestrator.epoch_record import TrainedRecord
    from tandem.services.orchestrator.failures import FailureLog

    def table():
        return PromptTable([{"prompt": f"p{i}", "a": i} for i in range(10)], [np.array([j], np.int32) for j in range(10)], "prompt")

    src = PromptSource(10, seed=1, table=table())
    for _ in range(13):
        src.next_item(0)
    src.requeue(3, 1)
    assert_round_trips(src, PromptSource(10, seed=1, table=table()))

    buf = GroupBuffer(1, rows=10, dynamic_sampling=True, max_prompts=8)
    buf.admit({"version": 0, "index": 1, "epoch": 0, "informative": False}, "r1")
    buf.take(0)  # its filler recorded as filtered
    buf.admit({"version": 0, "index": 7, "epoch": 0}, "r7")  # buffered: its prompt goes back to the source
    assert_round_trips(buf, GroupBuffer(1, rows=10, dynamic_sampling=True, max_prompts=8))
    buf.admit({"version": 0, "index": 2, "epoch": 0, "informative": False}, "r2")  # filler at the save
    again = GroupBuffer(1, rows=10, dynamic_sampling=True, max_prompts=8)
    again.load(json.loads(json.dumps(buf.state())))
    assert (0, 2) in again.filtered and (0, 1) in again.filtered  # the filler at the save: used, not trained

    rec = TrainedRecord(10)
    for i in (4, 5, 6):
        rec.add(0, i, version=i)
    assert_round_trips(rec, TrainedRecord(10))

    log = FailureLog(tmp_path / "f.jsonl", ["r.py:f"], unique_prompts=4, rows=10)
    log.reward_error(1, 0, "raised")
    log.no_reward(2, 0, "None")
    assert_round_trips(log, FailureLog(tmp_path / "f.jsonl", ["r.py:f"], unique_prompts=4, rows=10))

    p = Progress(cycle=3, version=3, total_cycles=9, total_steps=9, publish_latency_s=0.1)
    assert_round_trips(p, Progress(total_cycles=9, total_steps=9, publish_latency_s=0.1))


def test_a_part_whose_state_leaves_out_an_attribute_fails_the_round_trip():
    """The check above can fail: a PromptSource that forgot its position."""
    class Forgetful(PromptSource):
        def state(self, pending=()):
            return dict(super().state(pending), pos=0)

    src = Forgetful(10, seed=1)
    src.next()
    with pytest.raises(AssertionError):
        assert_round_trips(src, PromptSource(10, seed=1))


def test_a_checkpoint_of_the_flat_layout_loads_into_the_parts():
    from tandem.services.orchestrator.controller import parts_state
    from tandem.services.orchestrator.epoch_record import EpochRecord

    names = {"source", "progress", "record", "buffer", "failures"}
    trained = EpochRecord(10)
    trained.add(0, 3)
    flat = {"cursor": {"epoch": 0, "pos": 4, "requeued": [[1, 0]]}, "cycle": 2, "version": 2, "next_group_id": 9,
            "trained": trained.state(), "failed": [], "filtered": EpochRecord(10, "filtered").state(),
            "filler": [[0, 5, 1]], "counters": {"stale_dropped": 1}}
    st = parts_state(flat, 10)
    assert set(st) == names | {"counters"} and st["source"]["next_group_id"] == 9
    assert st["progress"] == {"cycle": 2, "version": 2} and st["record"]["trained"] == trained.state()
    f = EpochRecord(10, "filtered")
    f.load(st["buffer"]["filtered"])
    assert (0, 5) in f


def test_forwarded_learner_calls_run_inside_the_holders_context():
    """The colocated actor's learner calls run on the learner's CUDA stream: forward_learner_methods' `around`."""
    import contextlib

    from tandem.learner.group import LEARNER_METHODS, forward_learner_methods

    class Inner:
        def train(self, x):
            return ("trained", x, list(seen))

    seen = []

    class Holder:
        def __init__(self):
            self.inner = Inner()

        @contextlib.contextmanager
        def ctx(self):
            seen.append("in")
            yield
            seen.append("out")

    forward_learner_methods(Holder, holder="inner", prefix="learner_", around="ctx")
    assert all(hasattr(Holder, "learner_" + m) for m in LEARNER_METHODS)
    assert Holder().learner_train(3) == ("trained", 3, ["in"]) and seen == ["in", "out"]


def test_failed_prompts_are_said_on_the_terminal_a_few_at_a_time(tmp_path, monkeypatch):
    """Each prompt recorded as failed is one line for the terminal, at most SAY_BURST per SAY_EVERY_S; the ones held
    back are counted in the next line said, and every one is in the file."""
    from tandem.services.orchestrator.failures import FailureLog

    said, clock = [], [1000.0]
    log = FailureLog(tmp_path / "f.jsonl", ["r.py:f"], unique_prompts=4, rows=100, say=said.append)
    log.SAY_EVERY_S, log.SAY_BURST = 10.0, 2
    from tandem.services.orchestrator import failures

    monkeypatch.setattr(failures.time, "time", lambda: clock[0])
    for i in range(5):
        log.reward_error(i, 0, f"raised on {i}")
    clock[0] += 11
    log.reward_error(5, 0, "raised on 5")
    monkeypatch.undo()
    assert said[0] == "tandem: dataset row 0 (epoch 0) not trained on, reward_error: raised on 0"
    assert len(said) == 3 and "row 1 " in said[1]
    assert "row 5 " in said[2] and "(and 3 more before it, in " in said[2]
    assert len((tmp_path / "f.jsonl").read_text().splitlines()) == 6


def test_a_group_past_the_bound_is_sampled_again_once_then_recorded_whether_stopped_or_dropped(job_files, tmp_path):
    """The intake's two stale paths, a worker's RolloutFailure with stale_version (stopped mid-sampling) and a
    buffered group past the bound (back too late), count as one: the prompt is held for the next publish, once in its
    epoch; the second time it is recorded as not trained (reason stale), said with what to change, and not held
    again; in the next epoch it starts afresh."""
    from tandem.core.config import JobConfig
    from tandem.core.protocol import PromptItem, RolloutFailure, group_meta
    from tandem.services.orchestrator.failures import FailureLog
    from tandem.services.orchestrator.intake import Intake

    said, counters = [], Counter()
    intake = Intake(JobConfig.from_dict({**job_files, "cluster": {"max_staleness": 1}}),
                    PromptSource(10, 0, shuffle=False), GroupBuffer(1, 10),
                    FailureLog(tmp_path / "f.jsonl", ["r.py:f"], unique_prompts=2, rows=10, say=said.append),
                    RunLog(tmp_path / "metrics.jsonl", group_trace=True), counters)
    V = 3  # the version served
    item = PromptItem(group_id=9, index=4, prompt_ids=np.array([1, 2], np.int32), prompt="p")
    stopped = group_meta(RolloutFailure(9, 4, "stopped", stale_version=1))
    intake.accept(item, stopped, None, V, all_taken=False)  # row 4 stopped: handed out again
    intake.buffer.admit({"index": 5, "epoch": 0, "version": 1, "tokens": 40}, object())  # row 5 back too late: again
    intake.buffer.admit({"index": 6, "epoch": 0, "version": 2}, object())  # within the bound
    intake.drop_stale(V)
    assert list(intake.source.held) == [(4, 0, 3), (5, 0, 3)] and not intake.source.requeued  # held at version 3
    assert intake.buffer.pending() == [(6, 0)] and said == [] and intake.failures.failed == []
    intake.buffer.admit({"index": 4, "epoch": 0, "version": 1, "tokens": 30}, object())  # row 4 again, too late: recorded
    intake.drop_stale(V)
    intake.accept(PromptItem(10, 5, np.array([1], np.int32), "p"), stopped, None, V, all_taken=False)  # row 5 again, stopped: recorded
    assert list(intake.source.held) == [(4, 0, 3), (5, 0, 3)] and not intake.source.requeued
    assert counters == {"stale_stopped": 2, "stale_dropped": 2, "stale_failed": 2, "stale_dropped_tokens": 70}
    assert [(f["index"], f["epoch"], f["reason"]) for f in intake.failures.failed] == [(4, 0, "stale"), (5, 0, "stale")]
    assert said[0] == ("tandem: dataset row 4 (epoch 0) not trained on, stale: its group went past the staleness "
                       "bound a second time, 2 policy versions behind (cluster.max_staleness = 1): it takes longer to "
                       "sample and score than 2 cycles; sampled afresh in epoch 1; allowed: a larger "
                       "cluster.max_staleness, or a smaller generation.max_completion_length")
    intake.accept(PromptItem(11, 4, np.array([1], np.int32), "p", epoch=1), stopped, None, V, all_taken=False)  # the next epoch: afresh
    assert list(intake.source.held)[-1] == (4, 1, 3) and len(intake.failures.failed) == 2
    intake.log.flush_groups()  # logging.group_trace: each stop and drop, in order, with the version served then
    trace = [json.loads(x) for x in (tmp_path / "group_trace.jsonl").read_text().splitlines()]
    assert [(g["event"], g["index"], g["epoch"], g["version"], g["served"], g.get("tokens")) for g in trace] == [
        ("stopped", 4, 0, 1, 3, None), ("dropped", 5, 0, 1, 3, 40), ("dropped", 4, 0, 1, 3, 30),
        ("stopped", 5, 0, 1, 3, None), ("stopped", 4, 1, 1, 3, None)]
    assert intake.source.next(3) == (0, 0)  # the served version: still held
    assert [intake.source.next(4) for _ in range(3)] == [(4, 0), (5, 0), (4, 1)]  # a newer one: first


def test_the_group_trace_is_written_with_each_steps_metrics_and_only_when_asked(tmp_path):
    """logging.group_trace off (the default): no file; on: the groups' lines land with the step's metrics line."""
    off, on = RunLog(tmp_path / "a" / "metrics.jsonl"), RunLog(tmp_path / "b" / "metrics.jsonl", group_trace=True)
    for log in (off, on):
        log.path.parent.mkdir()
        log.group("returned", 2, 7, 0, 1, tokens=12)
        assert not (log.path.parent / "group_trace.jsonl").exists()  # held until the step is written
        log.write([{"step": 1}])
    assert not (tmp_path / "a" / "group_trace.jsonl").exists()
    (line,) = [json.loads(x) for x in (tmp_path / "b" / "group_trace.jsonl").read_text().splitlines()]
    assert {k: line[k] for k in ("event", "served", "index", "epoch", "version", "tokens")} == {
        "event": "returned", "served": 2, "index": 7, "epoch": 0, "version": 1, "tokens": 12}
    on.write([{"step": 2}])
    assert len((tmp_path / "b" / "group_trace.jsonl").read_text().splitlines()) == 1  # nothing twice


def test_prompts_stopped_past_the_bound_do_not_come_to_fill_the_engine(job_files, tmp_path):
    """A model of the long tail at max_staleness 1: each cycle the engine holds 32 prompts, those of the long rows
    (every 8th) are always stopped past the bound, the others are trained. Each long row is handed out at most twice
    in its epoch, and the engine's share of long rows stays near their share of the data; handed out again every time
    (first in the queue) they came to fill the engine within a few cycles."""
    from tandem.core.config import JobConfig
    from tandem.core.protocol import PromptItem, RolloutFailure, group_meta
    from tandem.services.orchestrator.failures import FailureLog
    from tandem.services.orchestrator.intake import Intake

    source, counters = PromptSource(800, seed=2), Counter()
    failures = FailureLog(tmp_path / "f.jsonl", ["r.py:f"], unique_prompts=16, rows=800)
    intake = Intake(JobConfig.from_dict({**job_files, "cluster": {"max_staleness": 1}}), source, GroupBuffer(1, 800),
                    failures, RunLog(tmp_path / "metrics.jsonl"), counters)
    handed, shares = Counter(), []
    for cycle in range(20):
        version = 5 + cycle  # each cycle publishes one
        engine = [source.next(version) for _ in range(32)]
        handed.update(engine)
        long_rows = [(i, e) for i, e in engine if i % 8 == 0]
        shares.append(len(long_rows) / len(engine))
        for i, e in long_rows:
            intake.accept(PromptItem(cycle, i, np.array([1], np.int32), "p", epoch=e),
                          group_meta(RolloutFailure(cycle, i, "stopped", stale_version=3)), None, version, False)
    assert max(handed[p] for p in handed if p[0] % 8 == 0) == 2 and np.mean(shares[10:]) < 0.3, shares
    twice = sorted(p for p in handed if handed[p] == 2)
    assert sorted((f["index"], f["epoch"]) for f in failures.failed) == twice and len(twice) > 20
    assert counters["stale_failed"] == len(twice)


def test_a_prompt_past_the_bound_waits_for_the_next_publish_and_then_goes_first():
    """Held, not handed out while the version it went stale at serves (it would be sampled with the version about to
    be replaced); kept by a checkpoint first among the re-queued prompts (a resume publishes first); once a newer
    version serves, before every other prompt."""
    src = PromptSource(10, seed=0, shuffle=False)
    assert [src.next(2) for _ in range(3)] == [(0, 0), (1, 0), (2, 0)]
    src.requeue(7, 0)  # a reward retry
    assert src.went_stale(1, 0, version=2)
    assert src.next(2) == (7, 0) and src.next(2) == (3, 0)  # row 1 held: the queue goes on without it
    assert src.state()["requeued"] == [[1, 0]]
    src.requeue(8, 0)
    assert [src.next(3) for _ in range(3)] == [(1, 0), (8, 0), (4, 0)]  # version 3 serves: row 1 first
    assert not src.went_stale(1, 0, version=3) and not src.held and not src.requeued  # the second time: no chance


def test_stale_failures_stop_the_run_past_a_quarter_of_one_epoch_and_do_not_count_toward_other_failures(tmp_path):
    """A quarter of one epoch's rows past the bound twice is allowed (the long tail at a small bound), more stops the
    run naming the bound; epochs count apart, and stale records do not bring a reward failure's threshold closer."""
    from tandem.core.errors import TrainingError
    from tandem.services.orchestrator.failures import FailureLog

    log = FailureLog(tmp_path / "f.jsonl", ["r.py:f"], unique_prompts=2, rows=16)
    for epoch in range(3):
        for i in range(4):
            log.too_slow(i, epoch, lag=2, max_staleness=1)
    log.too_slow(3, 2, lag=2, max_staleness=1)  # a row recorded again (its count starts anew on resume): still 4 rows
    for i in range(4):
        log.reward_error(10 + i, 0, "boom")  # 4 of 16 rows: not yet past the threshold of reward errors
    with pytest.raises(TrainingError, match=r"5 prompts of epoch 2 went twice past "
                                            r"cluster.max_staleness = 1 .*allowed: a larger cluster.max_staleness"):
        log.too_slow(9, 2, lag=2, max_staleness=1)
    assert [json.loads(x)["reason"] for x in (tmp_path / "f.jsonl").read_text().splitlines()].count("stale") == 14
    # with prompts over-sampled, the refusal names them as a cause too (their groups not taken are stopped alike)
    over = FailureLog(tmp_path / "o.jsonl", ["r.py:f"], unique_prompts=2, rows=16)
    for i in range(4):
        over.too_slow(i, 0, lag=2, max_staleness=1, oversample=12)
    with pytest.raises(TrainingError, match=r"smaller generation.max_completion_length, or fewer "
                                            r"cluster.rollout_oversample_prompts \(12 here"):
        over.too_slow(4, 0, lag=2, max_staleness=1, oversample=12)


def test_wasted_frac_counts_every_token_sampled_and_not_trained_over_every_token_sampled():
    """rollout/wasted_frac against a count by hand: 300 trained-group tokens of which 30 masked as too old, 50 sequence
    steps stopped on two workers, 40 tokens dropped past the bound, 10 filtered: (50 + 40 + 10 + 30) / (50 + 40 + 10
    + 300). Nothing sampled yet is 0, never a division by zero."""
    from collections import Counter

    from tandem.services.orchestrator.run_log import wasted_frac

    c = Counter(trained_group_tokens=300, stale_masked_tokens=30, stale_dropped_tokens=40, filtered_tokens=10)
    stats = {"workers": {0: {"stale_sequence_steps": 20}, 1: {"stale_sequence_steps": 30}}}
    assert wasted_frac(c, stats) == pytest.approx(130 / 400)
    assert wasted_frac(Counter(), {"workers": {}}) == 0.0
    assert wasted_frac(Counter(trained_group_tokens=5), {"workers": {0: {}}}) == 0.0
