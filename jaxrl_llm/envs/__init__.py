"""Multi-turn, tool-using episodes on the host (docs/environments.md): the environment protocol
(`base.py`), tools and their schemas (`tools.py`), tool-call parsers (`parsers.py`), token ids
of turns from the chat template (`render.py`), the episode runner every sampling backend calls
(`episodes.py`), the built-in environments (`calculator.py`, `countdown_game.py`,
`python_tool.py` over the sandbox of `sandbox.py` / `sandbox_child.py`) and the registry
(`registry.py`). No JAX here."""

from jaxrl_llm.envs.base import Environment, EnvResponse
from jaxrl_llm.envs.episodes import Episode, EpisodeRunner
from jaxrl_llm.envs.registry import (
    env_from_config,
    environment_names,
    get_environment,
    register_environment,
    runner_from_config,
)
from jaxrl_llm.envs.render import TurnRenderer
from jaxrl_llm.envs.tool_env import ToolEnvironment
from jaxrl_llm.envs.tools import Tool, ToolCallError, tool

__all__ = ["EnvResponse", "Environment", "Episode", "EpisodeRunner", "Tool", "ToolCallError",
           "ToolEnvironment", "TurnRenderer", "env_from_config", "environment_names",
           "get_environment", "register_environment", "runner_from_config", "tool"]
