"""Where each role's actors land, by Ray's real scheduler: a Ray started with two (declared) GPUs on this
CPU machine places probes built by the rollout and learner actor classes, for the one-GPU placement the
benchmark runs and the two-GPU placements of the x2 machine, in the controller's order (learner ranks,
then rollout workers). Checks the GPU Ray gives each (and the CUDA_VISIBLE_DEVICES it sets), the
refusal of learner ranks packed onto one GPU, and the environment each role starts with."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration

SCRIPT = r'''
import json, os, sys
sys.path.insert(0, ROOT)
import ray
from tandem.core.checks import shared_gpu_error
from tandem.core.config import JobConfig
from tandem.learner.group import learner_actor_class
from tandem.rollout.worker import rollout_actor_class


class Probe:
    def __init__(self, rank=0):
        self.rank = rank

    def where(self):
        return {"rank": self.rank, "node": ray.get_runtime_context().get_node_id(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "env": {k: os.environ.get(k) for k in ("DS_ACCELERATOR", "VLLM_ENABLE_V1_MULTIPROCESSING",
                                                       "TORCHDYNAMO_DISABLE")}}


def placed(cluster, rollout_first=False):
    cfg = JobConfig.from_dict({"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "rewards": ["r.py:f"],
                               "cluster": cluster})
    roll = []
    if rollout_first:  # a GPU already taken (e.g. by another job): the ranks must share the other one
        roll = [rollout_actor_class(cfg, cls=Probe).remote() for _ in range(cfg.cluster.num_rollout_workers)]
        ray.get([a.where.remote() for a in roll])
    # in the controller's order: the learner ranks first, then the rollout workers
    learn = [learner_actor_class(cfg, Probe).remote(r) for r in range(cfg.cluster.num_processes)]
    roll = roll or [rollout_actor_class(cfg, cls=Probe).remote() for _ in range(cfg.cluster.num_rollout_workers)]
    out = {"learner": ray.get([a.where.remote() for a in learn]), "rollout": ray.get([a.where.remote() for a in roll])}
    out["error"] = shared_gpu_error(cfg, out["learner"])
    for a in roll + learn:
        ray.kill(a)
    return out


ray.init(address="local", num_cpus=8, num_gpus=2, include_dashboard=False, log_to_driver=False,
         configure_logging=False, _system_config={"prestart_worker_first_driver": False})  # no 8 idle workers
print(json.dumps({
    "one_gpu": placed({"rollout_resources": {"num_gpus": 0.4}, "learner_resources": {"num_gpus": 0.4}}),
    "x2_apart": placed({"rollout_resources": {"num_gpus": 1}, "learner_resources": {"num_gpus": 1}}),
    "x2_two_ranks": placed({"num_processes": 2, "learner_resources": {"num_gpus": 0.6},
                            "rollout_resources": {"num_gpus": 0.4}, "num_rollout_workers": 2}),
    "x2_packed": placed({"num_processes": 2, "learner_resources": {"num_gpus": 0.5},
                         "rollout_resources": {"num_gpus": 1}}, rollout_first=True),
    "cpu": placed({}),
}))
'''


def test_each_role_lands_on_the_gpus_its_resources_say():
    # the roles' environment is what their actor classes set, not what this test process holds
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "TORCHDYNAMO_DISABLE")}
    r = subprocess.run([sys.executable, "-c", f"ROOT = {str(ROOT)!r}\n" + SCRIPT], capture_output=True, env=env,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])

    def gpus(case, role):
        return [p["gpus"] for p in got[case][role]]
    # one GPU shared (0.4 + 0.4): both on the same device, each seeing it as its only one
    (rg,), (lg,) = gpus("one_gpu", "rollout"), gpus("one_gpu", "learner")
    assert len(rg) == 1 and rg == lg and got["one_gpu"]["rollout"][0]["cvd"] == rg[0]
    # the x2 machine, rollout and learner apart: one whole GPU each, different ones
    (rg,), (lg,) = gpus("x2_apart", "rollout"), gpus("x2_apart", "learner")
    assert len(rg) == len(lg) == 1 and rg != lg
    assert {got["x2_apart"]["rollout"][0]["cvd"], got["x2_apart"]["learner"][0]["cvd"]} == {"0", "1"}
    # two learner ranks, one per GPU (NCCL), each sharing its GPU with a rollout worker
    assert sorted(g[0] for g in gpus("x2_two_ranks", "learner")) == ["0", "1"], got["x2_two_ranks"]
    assert sorted(g[0] for g in gpus("x2_two_ranks", "rollout")) == ["0", "1"]
    assert got["x2_two_ranks"]["error"] is None
    # halves, one GPU left: Ray puts both ranks on it (it may also do so with both GPUs free: first fit);
    # the learner refuses that before NCCL would
    assert len({g[0] for g in gpus("x2_packed", "learner")}) == 1
    assert got["x2_packed"]["error"].startswith("cluster.learner_resources.num_gpus = 0.5 with cluster.num_processes"
                                                " = 2: Ray placed learner ranks 0 and 1 on the same GPU")
    assert all(got[c]["error"] is None for c in ("one_gpu", "x2_apart", "cpu"))
    # the environment each role starts with: DeepSpeed's accelerator, vLLM's in-process engine
    for case in ("one_gpu", "x2_apart"):
        assert all(p["env"]["DS_ACCELERATOR"] == "cuda" for p in got[case]["learner"])
        assert all(p["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and p["env"]["TORCHDYNAMO_DISABLE"] is None
                   for p in got[case]["rollout"])
    assert got["cpu"]["learner"][0]["env"]["DS_ACCELERATOR"] == "cpu" and got["cpu"]["learner"][0]["gpus"] == []
    assert got["cpu"]["rollout"][0]["env"]["TORCHDYNAMO_DISABLE"] == "1"
