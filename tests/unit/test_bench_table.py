"""The GPU benchmark's derived figures (bench/e2e.py): pipeline_efficiency in seconds and in trained tokens, and the
table's ratios against the asynchronous peer, each against the arithmetic written out here."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import bench_script


def script_fixture(name: str):
    """A fixture named `name`: bench/<name>.py loaded as a module, once per test module."""
    return pytest.fixture(scope="module", name=name)(lambda: bench_script(name))


e2e_table, machine, workloads, tandem_candidates, trl_candidates, e2e_gpu = map(script_fixture, (
    "e2e_table", "machine", "workloads", "tandem_candidates", "trl_candidates", "e2e_gpu"))


# A synchronous run: 10 s a step, of which 8 s waiting for generation and 2 s training; 5,000 completion tokens
# trained a second, so 50,000 a step, made in 8 s of generation alone (6,250 a second).
K0 = {"s_per_step": 10.0, "generate_wait_s": 8.0, "train_s_per_step": 2.0, "gen_tokens_per_s": 5000.0,
      "completions_per_s": 12.8}
# An asynchronous one that steps in 6 s but trains shorter completions: 6,000 tokens a second.
K1 = {"s_per_step": 6.0, "gen_tokens_per_s": 6000.0, "completions_per_s": 21.3, "stale_stopped": 12,
      "stale_dropped": None, "stale_failed": 3}
PEER = {"s_per_step": 9.0, "gen_tokens_per_s": 3000.0, "completions_per_s": 14.2}


def test_pipeline_efficiency_in_seconds_and_in_tokens(e2e_table):
    assert e2e_table.pipeline_efficiency(K1, K0) == pytest.approx(6.0 / 8.0)
    # tokens: the synchronous engine alone made 50,000 / 8 = 6,250 a second; the candidate trains 6,000 a second
    assert e2e_table.pipeline_efficiency_tokens(K1, K0) == pytest.approx(6250 / 6000)
    # the synchronous run against itself reads the same either way (its tokens are its own mix)
    assert e2e_table.pipeline_efficiency_tokens(K0, K0) == pytest.approx(e2e_table.pipeline_efficiency(K0, K0)) \
        == pytest.approx(10.0 / 8.0)
    # training the larger: the bound is the training alone
    slow_learner = dict(K0, generate_wait_s=1.0, train_s_per_step=4.0)
    assert e2e_table.pipeline_efficiency(K1, slow_learner) == pytest.approx(6.0 / 4.0)
    assert e2e_table.pipeline_efficiency_tokens(K1, slow_learner) == pytest.approx(50000 / 4.0 / 6000)


def test_no_efficiency_without_a_synchronous_run_or_tokens(e2e_table):
    assert e2e_table.pipeline_efficiency(K1, None) is None
    assert e2e_table.pipeline_efficiency_tokens(K1, None) is None
    assert e2e_table.pipeline_efficiency_tokens(dict(K1, gen_tokens_per_s=None), K0) is None
    assert e2e_table.pipeline_efficiency_tokens(K1, dict(K0, gen_tokens_per_s=None)) is None


def test_the_table_shows_both_ratios_against_the_asynchronous_peer(e2e_table, tmp_path):
    for name, run in {"tandem_k0": K0, "tandem_k1": K1, "trl_async": PEER}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    text, runs = e2e_table.table(tmp_path, ["tandem_k0", "tandem_k1", "trl_async"], None, "trl_colocate")
    head, rule, *rows = text.splitlines()
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert len(cols) == rule.count("---")
    row = dict(zip(cols, [c.strip() for c in rows[1].strip("|").split("|")]))
    assert row["candidate"] == "tandem_k1"
    assert row["× trl_async"] == f"{21.3 / 14.2:.2f}"
    assert row["tok × trl_async"] == f"{6000 / 3000:.2f}"
    assert row["pipeline efficiency"] == f"{6.0 / 8.0:.2f}"
    assert row["(by tokens)"] == f"{6250 / 6000:.2f}"
    assert row["stale stopped / dropped / failed"] == "12 / 0 / 3"  # a counter that never moved: 0
    peer = dict(zip(cols, [c.strip() for c in rows[2].strip("|").split("|")]))
    assert peer["candidate"] == "trl_async" and peer["stale stopped / dropped / failed"] == "—"
    assert e2e_table.stale_counts({"stale_dropped": 6}) == "— / 6 / —"  # a JSON recorded before the other two counts
    assert e2e_table.stale_counts({**K1, "stale_waste_frac": 0.375}) == "12 / 0 / 3 (38% of the engine)"
    assert runs["tandem_k1"]["pipeline_efficiency_tokens"] == pytest.approx(6250 / 6000)


def test_the_efficiencies_read_a_synchronous_run_from_another_call(e2e_table, tmp_path):
    """--k0: the k=0 run of another call (the same workload and card), where this call's directory has none."""
    lease, other = tmp_path / "lease", tmp_path / "other"
    lease.mkdir(), other.mkdir()
    for name, run in {"tandem_k1": K1, "trl_async": PEER}.items():
        (lease / f"{name}.json").write_text(json.dumps(run))
    (other / "tandem_k0.json").write_text(json.dumps(dict(K0, generate_wait_s=5.0)))
    _, alone = e2e_table.table(lease, ["tandem_k1", "trl_async"], None, "trl_colocate")
    assert alone["tandem_k1"]["pipeline_efficiency"] is None
    _, read = e2e_table.table(lease, ["tandem_k1", "trl_async"], None, "trl_colocate", other / "tandem_k0.json")
    assert read["tandem_k1"]["pipeline_efficiency"] == pytest.approx(6.0 / 5.0)  # that run's generation, not K0's
    assert read["tandem_k1"]["pipeline_efficiency_tokens"] == pytest.approx(50000 / 5.0 / 6000)
    assert "tandem_k0" not in read


def test_a_peer_from_another_call_is_a_marked_row(e2e_table, tmp_path):
    """--from trl_async=PATH: the peer of another call (the same workload and card kind), its row and the ratios
    against it marked as spanning two calls."""
    lease, other = tmp_path / "lease", tmp_path / "other"
    lease.mkdir(), other.mkdir()
    (lease / "tandem_k1.json").write_text(json.dumps(K1))
    (other / "trl_async.json").write_text(json.dumps(dict(PEER, completions_per_s=7.1)))
    text, runs = e2e_table.table(lease, ["tandem_k1", "trl_async"], None, "trl_colocate",
                           elsewhere={"trl_async": other / "trl_async.json"})
    head, _, k1, peer, note = text.splitlines()
    cols = [c.strip() for c in head.strip("|").split("|")]
    row = dict(zip(cols, [c.strip() for c in k1.strip("|").split("|")]))
    assert row["candidate"] == "tandem_k1" and row["× trl_async"] == f"{21.3 / 7.1:.2f}"  # that run's, not PEER's
    assert peer.startswith("| trl_async † |") and note == f"† trl_async: {other / 'trl_async.json'}"
    assert runs["trl_async"]["completions_per_s"] == 7.1


def test_where_the_gpu_peak_goes_names_each_process_by_its_role(machine):
    assert machine.gpu_process("12345, 20480\n") == (12345, 20480.0)
    assert machine.gpu_process("12345, [N/A]") is None and machine.gpu_process("") is None
    assert machine.gpu_process("pid, used_gpu_memory [MiB]") is None
    assert machine.role_of("ray::RolloutWorker.generate") == "RolloutWorker"
    assert machine.role_of("ray::LearnerActor") == "LearnerActor"
    assert machine.role_of("VLLM::EngineCore") == "VLLM::EngineCore"
    assert machine.role_of("") == ""  # a process not yet exec'd: the sampler reads it again a second later
    assert machine.role_of("/usr/bin/python3 -m vllm.entrypoints.cli.main serve /m") == "python3"
    assert machine.role_of("/usr/bin/python3 bench/e2e.py run trl_async") == "python3 e2e.py"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # a live process, read through /proc once its command line is there (it is empty for a moment at its start)
        cmdline = Path(f"/proc/{child.pid}/cmdline")
        deadline = time.time() + 10
        while not cmdline.read_bytes() and time.time() < deadline:
            time.sleep(0.01)
        assert machine.process_role(child.pid) == Path(sys.executable).name
    finally:
        child.kill()
        child.wait()
    assert machine.process_role(2 ** 22 + 1) == "?"  # above any pid_max: not there


@pytest.mark.alone  # it reads every process's CPU time: a test beside it would be one more busy process
def test_host_state_names_a_busy_process_outside_the_run_and_not_one_of_its_own(machine):
    spin = "import time\nend = time.time() + 20\nwhile time.time() < end: pass"
    # outside the run's tree: the shell exits at once, so the spinner's parent becomes init
    outside = subprocess.run(["sh", "-c", f"{sys.executable} -c '{spin}' > /dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True)
    stranger = int(outside.stdout.strip())
    own = subprocess.Popen([sys.executable, "-c", spin])  # the run's own child
    try:
        time.sleep(0.3)
        state = machine.host_state(sample_s=0.5)
    finally:
        own.kill()
        own.wait()
        subprocess.run(["kill", str(stranger)], check=False)
    busy = {int(name.rsplit("[", 1)[1].rstrip("]")): pct for name, pct in state["busy_processes"].items()}
    assert busy.get(stranger, 0) >= 50  # it spun the whole sample
    assert own.pid not in busy
    assert state["cpus"] >= 1 and state["load_1m"] >= 0


def test_a_candidate_named_twice_runs_twice_under_its_own_names(e2e_gpu):
    assert e2e_gpu.run_names("tandem_k1,trl_async,tandem_k1,trl_async,tandem_k1") == [
        ("tandem_k1", [], "tandem_k1"), ("trl_async", [], "trl_async"), ("tandem_k1", [], "tandem_k1-2"),
        ("trl_async", [], "trl_async-2"), ("tandem_k1", [], "tandem_k1-3")]


def test_a_candidate_with_settings_of_its_own_runs_them_under_a_name_that_says_them(e2e_gpu):
    """`tandem_k1:rollout_oversample_prompts=auto` beside `tandem_k1`: a setting and the default in alternation in one
    call, each run's files under its own name (letters, digits, `.`, `-` and `_` only: what the device returns)."""
    import re

    over = "tandem_k1:rollout_oversample_prompts=auto"
    runs = e2e_gpu.run_names(f"tandem_k1,{over},tandem_k1,{over}:steps=8,{over}")
    assert runs == [
        ("tandem_k1", [], "tandem_k1"),
        ("tandem_k1", ["rollout_oversample_prompts=auto"], "tandem_k1_rollout_oversample_prompts-auto"),
        ("tandem_k1", [], "tandem_k1-2"),
        ("tandem_k1", ["rollout_oversample_prompts=auto", "steps=8"],
         "tandem_k1_rollout_oversample_prompts-auto_steps-8"),
        ("tandem_k1", ["rollout_oversample_prompts=auto"], "tandem_k1_rollout_oversample_prompts-auto-2")]
    [(_, sets, name)] = e2e_gpu.run_names("tandem_k1:tandem_checkpointing=[true] /x")
    assert sets == ["tandem_checkpointing=[true] /x"] and re.fullmatch(r"[A-Za-z0-9._-]+", name), name
    with pytest.raises(SystemExit, match="key=value, not 'auto'"):
        e2e_gpu.run_names("tandem_k1:auto")


def test_cluster_settings_reach_the_job_from_the_command_line(workloads, tandem_candidates, tmp_path):
    """`--set rollout_prompts_in_flight=24` (a sweep of the engine's load at one staleness bound), the SM carve-out,
    over-sampling and the engine's sequence cap reach Tandem's job; without them the job keeps its defaults."""
    from types import SimpleNamespace

    args = SimpleNamespace(workload="cpu", rollout_gpus=1, learner_gpus=1, vllm_memory=None, dir=str(tmp_path))
    paths = {"model": str(tmp_path / "model"), "data": str(tmp_path / "data.jsonl")}
    wl = workloads.workload(workloads.WORKLOADS, "cpu", ["rollout_prompts_in_flight=24", "learner_sm_carveout=16",
                                             "rollout_oversample_prompts=16", "vllm_max_num_seqs=256",
                                             "inflight_updates=false", "inflight_kv=keep"])
    cluster = tandem_candidates.tandem_config(paths, wl, 1, args).cluster
    assert (cluster.rollout_prompts_in_flight, cluster.learner_sm_carveout, cluster.max_staleness) == (24, 16, 1)
    assert (cluster.rollout_oversample_prompts, cluster.vllm_max_num_seqs) == (16, 256)
    assert (cluster.inflight_updates, cluster.inflight_kv) == (False, "keep")
    default = tandem_candidates.tandem_config(paths, workloads.workload(workloads.WORKLOADS, "cpu", []), 1, args).cluster
    assert (default.rollout_prompts_in_flight, default.learner_sm_carveout) == (None, "auto")
    assert (default.rollout_oversample_prompts, default.vllm_max_num_seqs) == (0, None)
    assert (default.inflight_updates, default.inflight_kv) == (True, "recompute")


def test_trl_async_rows_carry_what_trl_logs_of_what_it_trained(trl_candidates):
    """The peer's row shows its waste, trained tokens and staleness where its log_history has them (TRL 1.16's keys
    as the 2026-12-07 lease's log shows them), and none where it does not."""
    logs = [{"batch/masked_token_frac": 0.05, "sample/trained_tokens_mean": 170.0, "sample/staleness_mean": 2.0,
             "sample/staleness_max": 2.0},
            {"batch/masked_token_frac": 0.04, "sample/trained_tokens_mean": 190.0, "sample/staleness_mean": 3.0,
             "sample/staleness_max": 4.0}]
    got = trl_candidates.trl_async_trained(logs)
    assert got["wasted_frac"] == pytest.approx(0.045) and got["trained_tokens_per_completion"] == pytest.approx(180)
    assert got["version_lag_mean"] == pytest.approx(2.5) and got["version_lag_max"] == 4.0
    assert set(trl_candidates.trl_async_trained([{"loss": 1.0}]).values()) == {None}
