"""Batch plan: the spec's four examples (example 3 corrected), several processes, num_iterations."""

import re
import subprocess
import sys

import pytest

from tandem.core.plan import BatchPlan, table
from tests.helpers import ROOT

# docs/grpo.md §3 table: (per_device, GA, steps_per_gen, num_gen) -> cycle A batches, optimizer steps after
SPEC = {
    1: ((3, 2, 4, 3), ["[0,0,0]", "[1,1,1]", "[2,2,2]", "[3,3,3]"], [1, 3]),
    2: ((3, 4, 4, 3), ["[0,0,0]", "[1,1,1]", "[2,2,2]", "[3,3,3]"], [3]),
    3: ((3, 4, 4, 4), ["[0,0,0]", "[0,1,1]", "[1,1,2]", "[2,2,2]"], [3]),
    4: ((6, 2, 2, 3), ["[0,0,0,1,1,1]", "[2,2,2,3,3,3]"], [1]),
}


def parse_cycles(text):
    """{cycle letter: [(step, batch, has_optimizer_step)]} from the printed table."""
    cycles, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"generation cycle (\w)", line)
        if m:
            cur = cycles.setdefault(m.group(1), [])
        m = re.match(r"\| (\d+) \| (\[[\d,]+\]) \| (.*) \|$", line)
        if m and cur is not None:
            cur.append((int(m.group(1)), m.group(2), "optimizer step" in m.group(3)))
    return cycles


@pytest.mark.parametrize("example", [1, 2, 3, 4])
def test_cli_prints_spec_table(example):
    (per, ga, spg, g), batches, opt_after = SPEC[example]
    out = subprocess.run(
        [sys.executable, "-m", "tandem.services.app.cli", "plan", str(ROOT / f"examples/plan/seed-example-{example}.yaml")],
        capture_output=True, text=True, check=True,
    ).stdout
    assert f"effective_batch_size = steps_per_generation × num_processes × per_device_train_batch_size = " \
           f"{spg} × 1 × {per} = {spg * per}" in out
    cycles = parse_cycles(out)
    a = cycles["A"]
    assert [b for _, b, _ in a] == batches
    assert [s for s, _, o in a if o] == opt_after
    # cycle B continues the prompt numbering after cycle A's unique_prompts
    up = spg * per // g
    shift = [("[" + ",".join(str(int(x) + up) for x in b.strip("[]").split(",")) + "]") for b in batches]
    assert [b for _, b, _ in cycles["B"]] == shift


def test_two_processes_split_contiguously():
    p = BatchPlan(per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=2,
                  num_generations=4, num_processes=2)
    assert p.effective_batch_size == 8 and p.unique_prompts == 2
    cyc = p.cycle()
    assert [list(r) for r in cyc[0].rows] == [[0, 1], [2, 3]]
    assert [list(r) for r in cyc[1].rows] == [[4, 5], [6, 7]]
    assert [m.optimizer_step for m in cyc] == [False, True]
    # every sample of the generation batch is used exactly once per iteration
    used = sorted(i for m in cyc for r in m.rows for i in r)
    assert used == list(range(8))
    assert "| 0 | [0,0] | [0,0] |" in table(p)
    assert "| 1 | [1,1] | [1,1] |" in table(p)


def test_num_iterations_replays_cycle():
    p = BatchPlan(per_device_train_batch_size=3, gradient_accumulation_steps=2, steps_per_generation=4,
                  num_generations=3, num_iterations=2)
    cyc = p.cycle()
    assert len(cyc) == 8 and p.optimizer_steps_per_cycle == 4
    assert [list(m.rows[0]) for m in cyc[4:]] == [list(m.rows[0]) for m in cyc[:4]]
    assert [m.iteration for m in cyc] == [0] * 4 + [1] * 4
    assert [m.index for m in cyc if m.optimizer_step] == [1, 3, 5, 7]
    assert len(p.optimizer_steps()) == 4 and all(len(s) == 2 for s in p.optimizer_steps())


def test_num_iterations_with_ga_spanning_iterations():
    # steps_per_generation 2, GA 4, mu 2: one optimizer step over both passes
    p = BatchPlan(per_device_train_batch_size=4, gradient_accumulation_steps=4, steps_per_generation=2,
                  num_generations=4, num_iterations=2)
    assert [m.optimizer_step for m in p.cycle()] == [False, False, False, True]


def test_plan_refuses_bad_arithmetic():
    with pytest.raises(ValueError):
        BatchPlan(per_device_train_batch_size=5, gradient_accumulation_steps=1, steps_per_generation=1,
                  num_generations=3)
    with pytest.raises(ValueError):
        BatchPlan(per_device_train_batch_size=3, gradient_accumulation_steps=2, steps_per_generation=3,
                  num_generations=3)


def test_cli_plan_error_names_field(tmp_path):
    p = tmp_path / "j.yaml"
    p.write_text("batch: {per_device_train_batch_size: 5, num_generations: 3}\n")
    r = subprocess.run([sys.executable, "-m", "tandem.services.app.cli", "plan", str(p)], capture_output=True, text=True)
    assert r.returncode == 2 and "batch.num_generations = 3" in r.stderr


def test_a_runs_cycles_come_from_max_steps_or_from_its_epochs():
    """One formula for the controller and the trainer's state: ceil(max_steps / optimizer steps per cycle) when
    max_steps > 0, else epochs × rows over the prompts a cycle takes (at least one)."""
    plan = BatchPlan(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=4,
                     num_generations=4)  # 8 prompts and 2 optimizer steps a cycle
    assert plan.total_cycles(max_steps=5, num_train_epochs=3, rows=100) == 3
    assert plan.total_cycles(max_steps=-1, num_train_epochs=2, rows=20) == 5
    assert plan.total_cycles(max_steps=-1, num_train_epochs=0.1, rows=20) == 1
