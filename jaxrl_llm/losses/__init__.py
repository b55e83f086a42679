"""Pure-functional loss kernels: arrays in, `LossOutput(total, weight, metrics)` out.

Nothing here imports a model, does I/O or touches another part of the package
(docs/kernels.md lists every loss with its formula and paper reference). Importing the
package imports no JAX (the config reads the registry's options): `LossOutput` and
`finite_or_raise` load `losses.types` on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LossOutput", "finite_or_raise"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from jaxrl_llm.losses import types

        return getattr(types, name)
    raise AttributeError(f"module 'jaxrl_llm.losses' has no attribute {name!r}")
