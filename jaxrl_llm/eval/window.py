"""Compatibility re-export: the logging window lives in `train/window.py` (the trainer uses it,
and `train` imports nothing of `eval`)."""

from jaxrl_llm.train.window import COUNT_PREFIXES, COUNT_SUFFIXES, MetricWindow, is_count_metric

__all__ = ["COUNT_PREFIXES", "COUNT_SUFFIXES", "MetricWindow", "is_count_metric"]
