"""bench/group_trace.py reads a run's group_trace.jsonl: batches in order, why each dropped group was dropped, and
the bursts of groups that came back together."""

import pytest

from tests.helpers import bench_script

gt = bench_script("group_trace")


def line(event, t, index, version, **more):
    return {"time": t, "event": event, "served": 0, "index": index, "epoch": 0, "version": version, **more}


TRACE = [
    line("returned", 1.00, 1, 0, tokens=10, returned_at=1.00, handed_out_at=0.5),
    line("returned", 1.01, 2, 0, tokens=30, returned_at=1.01, handed_out_at=0.5),
    line("returned", 1.02, 3, 0, tokens=50, returned_at=1.02),  # a burst of three, one more than the batch took
    line("returned", 2.00, 4, 1, tokens=20, returned_at=2.00, handed_out_at=0.8),
    line("trained", 3.0, 1, 0, cycle=1, tokens=10, taken_at=1.02),
    line("trained", 3.0, 2, 0, cycle=1, tokens=30, taken_at=1.02),
    line("returned", 3.50, 5, 0, tokens=70, returned_at=3.50),  # version 0, back after the take that was its last
    # max_staleness 0: the next collect drops the version-0 groups left, before its take
    line("dropped", 3.9, 3, 0, tokens=50, returned_at=1.02),
    line("dropped", 3.9, 5, 0, tokens=70, returned_at=3.50),
    line("trained", 5.0, 4, 1, cycle=2, tokens=20, taken_at=4.0),
]


def test_batches_are_in_cycle_order_with_their_versions_and_tokens():
    bs = gt.batches(TRACE)
    assert [(b["cycle"], b["taken_at"], b["groups"], dict(b["versions"]), b["tokens"]) for b in bs] == [
        (1, 1.02, 2, {0: 2}, 40), (2, 4.0, 1, {1: 1}, 20)]
    assert bs[0]["sampling_s"] == pytest.approx([0.5, 0.51]) and bs[1]["sampling_s"] == pytest.approx([1.2])


def test_a_dropped_group_is_left_at_a_take_or_back_after_it():
    (why, ms), (why2, ms2) = sorted(gt.drops(TRACE), key=lambda d: d[0])
    assert (why, why2, ms2) == ("back after its take", "left at a take", None) and ms == pytest.approx(2480)


def test_groups_back_together_are_one_burst():
    assert gt.bursts(TRACE) == [3]
    report = gt.report(TRACE)
    assert "| 1 | 0.02 | 2 | 0: 2 | 20 | 0.51 / 0.51 |" in report  # taken at: seconds from the trace's first line
    assert "dropped: back after its take 1, left at a take 1 (ms after the take: [2480])" in report  # 3.50 - 1.02


def test_each_prompt_is_told_by_what_became_of_it():
    trace = TRACE + [
        line("stopped", 6.0, 6, 1, handed_out_at=1.0),  # past the bound, sampled again, past it again: recorded
        line("stopped", 9.0, 6, 2, handed_out_at=6.5),
        line("stopped", 6.0, 7, 1, handed_out_at=2.0),  # past the bound once, then trained
        line("trained", 9.5, 7, 2, cycle=3, tokens=5, taken_at=9.0),
        line("left", 10.0, 8, 3, handed_out_at=9.2),  # stopped by the run's last take
    ]
    assert gt.prompt_outcomes(trace) == {"trained at the first try": 3, "trained after being sampled again": 1,
                                         "past the bound twice": 1, "left at the run's end": 1,
                                         "past the bound once, out at the end": 2}
    assert gt.stopped_after(trace) == pytest.approx([5.0, 2.5, 4.0])
    report = gt.report(trace)
    assert "past the bound twice 1" in report and "stopped after (s, from hand-out): median 4.0, min 2.5, max 5.0" in report


def test_the_groups_in_flight_at_a_take_are_told_by_their_fate():
    trace = [
        line("returned", 1.0, 1, 0, tokens=10, handed_out_at=0.0, returned_at=1.0),
        line("returned", 1.5, 2, 0, tokens=10, handed_out_at=0.0, returned_at=1.5),
        line("trained", 3.0, 1, 0, cycle=1, tokens=10, taken_at=1.2),  # in flight at 1.2: prompts 2, 3 and 4
        line("stopped", 4.0, 3, 0, handed_out_at=0.0),  # held its place through the take, then stopped
        line("returned", 4.5, 5, 1, tokens=10, handed_out_at=3.1, returned_at=4.5),  # out after the take
        line("left", 6.0, 4, 0, handed_out_at=0.5),
        line("trained", 6.0, 2, 0, cycle=2, tokens=10, taken_at=5.0),
        line("trained", 6.0, 5, 1, cycle=2, tokens=10, taken_at=5.0),
    ]
    assert gt.in_flight_at_takes(trace) == [(1, {"trained": 1, "stopped": 1, "left": 1}), (2, {"left": 1})]
    bs = gt.batches(trace)
    assert "handed_after_last_take" not in bs[0] and bs[1]["handed_after_last_take"] == 1  # prompt 5, not prompt 2
    assert "| 2 | 4.00 | 2 | 0: 1, 1: 1 | 10 | 1.45 / 1.50 | 1 | left 1 |" in gt.report(trace)
