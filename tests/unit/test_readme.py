"""The README's job file reference is the one the code generates, and every spec parameter is in it."""

from tandem.services.devtools.reference import markdown
from tests.helpers import ROOT

SPEC_NAMES = ["beta", "num_iterations", "epsilon", "epsilon_high", "delta", "importance_sampling_level",
              "reward_weights", "scale_rewards", "loss_type", "mask_truncated_completions",
              "vllm_importance_sampling_correction", "vllm_importance_sampling_cap", "dtype", "fast_inference",
              "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_prompt_length",
              "max_completion_length", "steps_per_generation", "per_device_train_batch_size",
              "gradient_accumulation_steps", "num_processes", "num_generations"]


def test_reference_in_readme():
    readme = (ROOT / "README.md").read_text()
    table = markdown()
    assert table in readme
    for name in SPEC_NAMES:
        assert f".{name}`" in table, name
