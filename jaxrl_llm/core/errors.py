"""The project's errors for bad configuration and bad model files, importable without the
configuration schema (`jaxrl-llm` exits 2 on either, printing the message, no traceback).

Library packages (data, models, parallel, generate) raise `ConfigError` for a bad value they
were given; importing it from here keeps them independent of `jaxrl_llm.config`, which
re-exports it.
"""

from __future__ import annotations

__all__ = ["ConfigError", "ModelFileError"]


class ConfigError(ValueError):
    """A configuration problem, with the key and source it came from in the message."""


class ModelFileError(ValueError):
    """A model, checkpoint or tokenizer file that cannot be used as given (an unsupported
    architecture or quantisation, a missing or misshapen tensor, a tokenizer that does not fit
    the model): the message names the file and the field or tensor. The CLI exits 2 on it."""
