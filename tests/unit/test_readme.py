"""The job file reference (docs/job-file.md) is the one the code generates, and every spec parameter is in it; the README
stays a first screen: at most 300 lines (its benchmarks 60), each docs page it links there."""

from tandem.services.devtools.reference import markdown
from tests.helpers import ROOT

SPEC_NAMES = ["beta", "num_iterations", "epsilon", "epsilon_high", "delta", "importance_sampling_level",
              "reward_weights", "scale_rewards", "loss_type", "mask_truncated_completions",
              "vllm_importance_sampling_correction", "vllm_importance_sampling_cap", "dtype", "fast_inference",
              "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_prompt_length",
              "max_completion_length", "steps_per_generation", "per_device_train_batch_size",
              "gradient_accumulation_steps", "num_processes", "num_generations"]


def test_reference_in_docs():
    table = markdown()
    assert table in (ROOT / "docs" / "job-file.md").read_text()
    for name in SPEC_NAMES:
        assert f".{name}`" in table, name


def test_the_readme_is_a_first_screen_and_its_links_resolve():
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    benchmarks = readme.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    assert len(benchmarks.splitlines()) <= 60  # the latest lease per workload and the learning plot; the rest in docs/
    assert readme.index("## Two commands") < readme.index("## Quick start in Python") < 3000  # the first screen
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\((?!https?:|#)([^)#\s]+)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links {target}"
