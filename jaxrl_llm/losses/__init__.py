"""Pure-functional loss kernels: arrays in, `LossOutput(total, weight, metrics)` out.

Nothing here imports a model, does I/O or touches another part of the package
(docs/kernels.md lists every loss with its formula and paper reference).
"""

from jaxrl_llm.losses.types import LossOutput, finite_or_raise

__all__ = ["LossOutput", "finite_or_raise"]
