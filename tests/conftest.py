import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Kernels run through Triton's interpreter on CPU (must be set before triton is imported).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# The Hub, offline, in a cache of this session's own (the Hub-name tests fill it; Ray's processes inherit it):
# set before huggingface_hub and datasets are imported, which read them once.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="tandem-hf-")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], ignore_errors=True)
os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"



@pytest.fixture
def job_files(tmp_path):
    """A minimal valid job's referenced files: model dir, data, reward module. Returns the job dict."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"p{i}", "answer": i}) for i in range(8)) + "\n")
    rew = tmp_path / "rew.py"
    rew.write_text("def r1(completions, **kw):\n    return [1.0] * len(completions)\n"
                   "def r2(completions, **kw):\n    return [0.0] * len(completions)\n")
    return {
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"path": str(data)},
        "rewards": [f"{rew}:r1"],
    }


def pytest_collection_modifyitems(config, items):
    # Integration tests after the fast unit tests, so a broken unit shows up in seconds.
    # The tests of the `ray start` head last, together and `alone` (make test runs those by themselves): they bound
    # how soon a SIGTERM saves and a wrong token is named, and the head's processes stay up until the session ends.
    def uses_head(it) -> bool:
        return "ray_head" in getattr(it, "fixturenames", ())

    for it in filter(uses_head, items):
        it.add_marker(pytest.mark.alone)
    items.sort(key=lambda it: (it.get_closest_marker("integration") is not None, uses_head(it)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from tandem.services.devtools.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", layers=2, hidden=64, vocab=512, seed=0))


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory):
    from tandem.services.devtools.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tied") / "model", layers=1, hidden=64, vocab=512, seed=1,
                                tie_word_embeddings=True))


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    import ray

    from tandem.core.compat import init_local_ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    init_local_ray(8, _temp_dir=str(tmp_path_factory.mktemp("ray")))  # the embedded Ray `tandem run` starts
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_head():
    """A second Ray cluster, started as users start one (`ray start --head`, token-authenticated, its
    dashboard on loopback), shared by the tests that need a real cluster. Every port its own: the
    suite's Ray already holds the defaults (a job head talking to the other cluster's agent on 52365
    never answered). -> {url (Jobs API), gcs (address for --address), metrics_port, token, pid, temp (its --temp-dir)}."""
    import secrets
    import sys
    import tempfile
    import time
    import urllib.error
    import urllib.request

    from tandem.services.devtools.local_nodes import start_head, stop

    token = secrets.token_hex(32)
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ["PATH"], RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=token,
               RAY_metrics_report_interval_ms="500")  # the exported series follow each step within a second
    # a short --temp-dir: Ray's socket paths must stay under 108 bytes
    head, gcs = start_head(env, tempfile.mkdtemp(prefix="ray"), num_cpus=6)
    url = f"http://127.0.0.1:{head.ports['dashboard-port']}"
    try:
        for _ in range(120):
            assert head.poll() is None, "the Ray head exited"
            try:
                urllib.request.urlopen(f"{url}/api/jobs/", timeout=5)
                raise AssertionError("the Jobs API answered a request without the token")
            except urllib.error.HTTPError as e:
                assert e.code == 401, e  # up, and refusing strangers
                break
            except OSError:  # not up yet
                time.sleep(1)
        yield {"url": url, "gcs": gcs, "metrics_port": head.ports["metrics-export-port"],
               "token": token, "pid": head.pid, "temp": head.temp}
    finally:
        stop([head])  # ray start --block drains, then stops what it started


@pytest.fixture(scope="session")
def hub_cache():
    """The session's Hugging Face cache filled as huggingface_hub and datasets leave it after a download: the model
    `tandem-test/tiny` at two revisions (main, and the branch `v2`: another seed), and the dataset
    `tandem-test/arith` (configuration `plain`, splits train and test) prepared by datasets' own json builder.
    -> {"model": id, "main": commit, "v2": commit, "dataset": id}."""
    import datasets
    from datasets.packaged_modules.json.json import Json
    from huggingface_hub import constants

    from tandem.services.devtools.tiny_model import build_tiny_model

    repo = Path(constants.HF_HUB_CACHE) / "models--tandem-test--tiny"
    commits = {"main": "1" * 40, "v2": "2" * 40}
    for seed, (ref, commit) in enumerate(commits.items()):
        build_tiny_model(repo / "snapshots" / commit, layers=1, hidden=64, vocab=512, seed=seed)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    src = Path(tempfile.mkdtemp(prefix="tandem-arith-"))
    for split, n in (("train", 16), ("test", 4)):
        (src / f"{split}.jsonl").write_text("".join(json.dumps({"question": f"{a} + {a}", "answer": 2 * a}) + "\n"
                                                    for a in range(n)))
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    builder = Json(cache_dir=str(cache), dataset_name="arith", config_name="plain",
                   data_files={s: str(src / f"{s}.jsonl") for s in ("train", "test")})
    builder.download_and_prepare()
    # where load_dataset("tandem-test/arith", "plain") puts it: <namespace>___<name>/<config>/<version>/<commit>
    dst = cache / "tandem-test___arith" / "plain" / "0.0.0" / ("3" * 40)
    dst.parent.mkdir(parents=True)
    shutil.move(builder.cache_dir, dst)
    return {"model": "tandem-test/tiny", **commits, "dataset": "tandem-test/arith"}
