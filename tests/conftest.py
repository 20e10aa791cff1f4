import json
import os

import pytest

# Kernels run through Triton's interpreter on CPU (must be set before triton is imported).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")



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
    items.sort(key=lambda it: it.get_closest_marker("integration") is not None)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from tandem.rollout.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", layers=2, hidden=64, vocab=512, seed=0))


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory):
    from tandem.rollout.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tied") / "model", layers=1, hidden=64, vocab=512, seed=1,
                                tie_word_embeddings=True))


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")), configure_logging=False)
    yield ray
    ray.shutdown()
