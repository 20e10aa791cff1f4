"""`environment: module:Class`, TRL's environment_factory shape, with the scripted engine of test_episodes: one
instance per episode, `reset(**row)` whose text joins the last user message, its public methods as the episode's
tools (with the instance's state), `get_reward()` as one more reward column of weight 1, and the refusals."""

import json

import numpy as np
import pytest

from tandem.rollout.episodes import EnvironmentResetError, Environments
from tandem.services.devtools.tiny_model import build_tokenizer
from tests.unit.test_episodes import call, episodes


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512, tool_tokens=True)

ENV = '''
class Vault:
    """Guess the code: each episode has its own."""

    opened = 0

    def reset(self, prompt, code, **kw):
        self.code, self.tries = int(code), 0
        return f" (you have 3 tries)"

    def guess(self, n: int) -> str:
        """Tries a code.

        Args:
            n: the code to try
        """
        self.tries += 1
        return "open" if n == self.code else ("higher" if n < self.code else "lower")

    def get_reward(self) -> float:
        return 1.0 / self.tries if self.tries else 0.0

    def _private(self):
        return 0


class Broken:
    def reset(self, **kw):
        raise RuntimeError("no vault today")


class NoReset:
    def guess(self, n: int) -> str:
        """Tries.

        Args:
            n: a code
        """
        return ""


class Undocumented:
    def reset(self, **kw):
        return None

    def guess(self, n):
        return ""
'''


@pytest.fixture
def env_file(tmp_path):
    p = tmp_path / "vault.py"
    p.write_text(ENV)
    return p


def test_one_instance_per_episode_its_methods_the_tools_its_reward_a_column(env_file):
    envs = Environments.load(f"{env_file}:Vault")
    assert envs.tool_names == ["guess"] and envs.has_reward
    row = {"prompt": [{"role": "user", "content": "open the vault"}], "code": 7}
    made, observations = envs.make(3, row, index=4)
    assert len({id(e) for e in made}) == 3 and observations == [" (you have 3 tries)"] * 3
    assert made[0].code == 7
    tools = envs.tools(made[1])
    assert tools["guess"](5) == "higher" and tools["guess"](7) == "open"
    assert made[1].tries == 2 and made[0].tries == 0  # state per episode
    assert np.allclose(envs.rewards(made, 4), [0.0, 0.5, 0.0])
    assert envs.prompt_with(row["prompt"], " (you have 3 tries)") == [
        {"role": "user", "content": "open the vault (you have 3 tries)"}]
    assert row["prompt"][0]["content"] == "open the vault"  # the row is left as it was


def test_refusals_name_the_class_and_what_is_wrong(env_file):
    with pytest.raises(EnvironmentResetError, match=r"environment .*:Broken: reset\(\) of dataset row 9 raised "
                                                r"RuntimeError: no vault today"):
        Environments.load(f"{env_file}:Broken").make(2, {"prompt": "x"}, index=9)
    with pytest.raises(ValueError, match=r"environment = .*:NoReset: needs a reset\(\*\*row\) method"):
        Environments.load(f"{env_file}:NoReset")
    with pytest.raises(ValueError, match=r"environment = .*:Undocumented: tool method 'guess': "):
        Environments.load(f"{env_file}:Undocumented")


def test_an_episode_calls_its_own_instances_methods(env_file, tok):
    """Through the engine loop: the model guesses 5 then 7 (scripted); each episode's own Vault answers."""
    envs = Environments.load(f"{env_file}:Vault")
    made, _ = envs.make(2, {"prompt": "x", "code": 7}, index=0)

    def script(text, i):
        rounds = text.count("<|im_start|>tool")
        return call("guess", n=5) if rounds == 0 else (call("guess", n=7) if rounds == 1 else "done")
    eps, *_ = episodes(tok, script, n=2, tools_per_episode=[envs.tools(e) for e in made])
    assert [m["content"] for m in eps[0].messages if m["role"] == "tool"] == ["higher", "open"]
    assert [e.tries for e in made] == [2, 2] and np.allclose(envs.rewards(made, 0), [0.5, 0.5])
    assert json.dumps(eps[0].messages)  # plain data for the reward functions


def test_episodes_from_their_own_prompts_sample_on_one_version(tok):
    """Prompts that differ (reset texts): one request each, the later pinned to the version the first started on,
    each episode continuing from its own prompt."""
    import numpy as np

    p1 = np.asarray(tok("what is 1 ?", add_special_tokens=False)["input_ids"], dtype=np.int32)
    p2 = np.asarray(tok("what is 22 ?", add_special_tokens=False)["input_ids"], dtype=np.int32)
    seen = []

    def script(text, i):
        seen.append(text)
        return "ok"
    eps, engine, loop, version = episodes(tok, script, n=2, prompts=[p1, p2], version=3)
    assert version == 3 and [a for _, a, _, n in engine.added] == [3, 3] and all(n == 1 for *_, n in engine.added)
    assert seen == ["what is 1 ?", "what is 22 ?"] and [e.turns for e in eps] == [1, 1]
    loop.stop()


def test_the_job_file_checks_and_weighs_the_environment(env_file, job_files, tmp_path):
    from tandem.core.checks import environment_errors
    from tandem.core.config import JobConfig

    with pytest.raises(Exception, match="environment = 'Vault': expected 'module:Class'"):
        JobConfig.from_dict({**job_files, "environment": "Vault"})
    t = tmp_path / "t.py"
    t.write_text('def guess(n: int) -> str:\n    """Guesses.\n\n    Args:\n        n: a code\n    """\n    return ""\n')
    cfg = JobConfig.from_dict({**job_files, "tools": [f"{t}:guess"], "environment": f"{env_file}:Vault",
                               "grpo": {"reward_weights": [0.5]}})
    assert environment_errors(cfg) == [f"environment = '{env_file}:Vault': its method 'guess' has the name of a "
                                       "function in tools; the model calls tools by name, so each needs its own"]
    assert cfg.column_weights() == [0.5, 1.0]
    assert JobConfig.from_dict({**job_files, "environment": f"{env_file}:Vault"}).column_weights() == [1.0, 1.0]
    assert JobConfig.from_dict(job_files).column_weights() is None
    bad = JobConfig.from_dict({**job_files, "environment": f"{env_file}:NoReset"})
    assert environment_errors(bad) == [f"environment = {env_file}:NoReset: needs a reset(**row) method (TRL's "
                                       "environment_factory shape)"]


@pytest.mark.parametrize("value,said", [(float("nan"), r"is nan; rewards must be finite"),
                                        (float("inf"), r"is inf; rewards must be finite"),
                                        ("0.5", r"is '0.5' \(str\); expected a number or None"),
                                        (RuntimeError("no score"), r"raised RuntimeError: no score")])
def test_get_reward_is_checked_as_a_reward_functions_values_are(tmp_path, value, said):
    """NaN, inf, a non-number or an error from get_reward fail that prompt naming the environment, the row and the
    sample; None is no reward for that sample, as a reward function's None."""
    from tandem.rollout.rewards import RewardError

    p = tmp_path / "scored.py"
    p.write_text("class Scored:\n    value = None\n    def reset(self, **kw):\n        return None\n"
                 "    def get_reward(self):\n        if isinstance(self.value, Exception):\n"
                 "            raise self.value\n        return self.value\n")
    envs = Environments.load(f"{p}:Scored")
    made, _ = envs.make(3, {"prompt": "x"}, index=5)
    made[0].value, made[2].value = 1.0, 0.25
    assert np.allclose(envs.rewards(made, 5), [1.0, np.nan, 0.25], equal_nan=True)
    made[1].value = value
    with pytest.raises(RewardError, match=rf"environment {p}:Scored: get_reward\(\) on dataset row 5, sample 1 {said}"):
        envs.rewards(made, 5)
