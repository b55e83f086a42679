"""The arrays of a `TrainState` that a checkpoint holds, and the state rebuilt from them.

Shared by the trainer (save, resume) and `checkpoint.restore_model` (export, evaluate); kept
apart from both so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STATE_FIELDS = ("step", "params", "opt_state", "model_state", "rng", "ref_params")


def state_items(state: Any) -> dict[str, Any]:
    """The arrays of a `TrainState` that a checkpoint holds (static fields are rebuilt)."""
    return {name: getattr(state, name) for name in STATE_FIELDS
            if getattr(state, name) is not None}


def with_items(state: Any, items: Mapping[str, Any]) -> Any:
    return state.replace(**dict(items))
