"""The `env:` config section: environments and runners from a config, and bad values refused
naming the key before any work."""

from __future__ import annotations

import pytest

from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.envs import env_from_config, runner_from_config
from jaxrl_llm.envs.calculator import CalculatorEnv
from jaxrl_llm.envs.countdown_game import CountdownGame
from jaxrl_llm.tasks.registry import task_from_config
from tests.envs.helpers import qwen_tokenizer


def test_single_turn_by_default():
    config = load_config(None)
    assert config.env.name is None and env_from_config(config, None) is None


def test_calculator_from_config():
    config = load_config(None, ["data.task=gsm8k", "env.name=calculator", "env.max_turns=3",
                                "env.timeout_s=5", "env.workers=2", "generate.max_new_tokens=300"])
    env = env_from_config(config, task_from_config(config))
    assert isinstance(env, CalculatorEnv) and env.max_turns == 3 and env.task.name == "gsm8k"
    runner = runner_from_config(config, env, qwen_tokenizer())
    assert (runner.max_turns, runner.timeout_s, runner.workers, runner.max_episode_tokens,
            runner.max_observation_tokens) == (3, 5.0, 2, 300, 1024)
    assert runner.renderer.native_tools


def test_countdown_game_options():
    config = load_config(None, ["data.task=countdown", "env.name=countdown_game"])
    assert isinstance(env_from_config(config, task_from_config(config)), CountdownGame)


@pytest.mark.parametrize(("overrides", "message"), [
    (["env.name=python"], "env.name=python runs model-written code"),
    (["env.workers=0"], "env.workers"),
    (["env.timeout_s=-1"], "env.timeout_s"),
    (["env.turns=3"], "did you mean 'env.max_turns'"),
])
def test_bad_values_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    (["env.name=abacus"], "env.name='abacus' / env.options: .*unknown environment 'abacus'; "
     "known: calculator, countdown_game, python"),
    (["env.name=nowhere.envs:Env"], "cannot import module 'nowhere.envs'"),
    (["env.name=calculator", "env.tool_parser=json"], "env.tool_parser='json': .*unknown tool parser"),
    (["env.name=calculator", "env.options={colour: red}"], "unexpected keyword argument 'colour'"),
    (["env.name=countdown_game"], "plays the countdown task, not 'arithmetic'"),
    (["env.name=python", "env.python_tool=true", "env.timeout_s=5"],
     "env.timeout_s=5 must exceed the Python tool's timeout_s=10 × max_calls_per_turn=2"),
    (["env.name=builtins:dict"], "gave dict, not an Environment"),
])
def test_bad_environments_name_the_key(overrides, message):
    config = load_config(None, overrides)
    with pytest.raises(ConfigError, match=message):
        env_from_config(config, task_from_config(config))


def test_a_template_the_deltas_cannot_use_names_the_keys():
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    config = load_config(None, ["env.name=calculator", "data.chat_template=true"])
    env = env_from_config(config, task_from_config(config))
    with pytest.raises(ConfigError, match="env.name='calculator' with data.chat_template=True: "
                       ".*not a special token"):
        runner_from_config(config, env, qwen_tokenizer(template))
