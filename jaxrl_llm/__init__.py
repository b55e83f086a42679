"""jaxrl_llm: off-policy reinforcement-learning fine-tuning of LLMs in JAX/Flax.

Sub-packages follow the flow generate -> reward -> score -> curate -> train -> export -> evaluate
(see docs/architecture.md). `losses` is pure math and imports nothing else from the package;
`commands` holds the thin `jaxrl-llm <stage>` modules over the library packages.
"""

__version__ = "0.1.0"
