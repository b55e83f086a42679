"""PNG plots of a run (matplotlib, Agg backend): the figures the papers draw.

Each function takes plain data (rows of the metrics JSONL, `eval.json` dicts) and writes one
PNG, returning its path, or None when the run has nothing to draw for it.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence

import matplotlib
from etils import epath

matplotlib.use("Agg")  # headless: no display on training hosts
import matplotlib.pyplot as plt

from jaxrl_llm.paths import PathLike, as_path

FIGSIZE = (6.4, 4.0)
DPI = 100


def _save(fig: plt.Figure, path: PathLike) -> epath.Path:
    path = as_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    png = io.BytesIO()  # through bytes: the path may be remote (gs://), which matplotlib can't open
    fig.savefig(png, format="png", dpi=DPI)
    plt.close(fig)
    path.write_bytes(png.getvalue())
    return path


def matching_keys(rows: Sequence[Mapping[str, object]], patterns: Sequence[str]) -> list[str]:
    """Numeric metric names (besides `step`) matching any regex, in first-seen order."""
    regexes = [re.compile(p) for p in patterns]
    keys: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if key == "step" or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if any(r.search(key) for r in regexes):
                keys.setdefault(key, None)
    return list(keys)


def series_plot(
    rows: Sequence[Mapping[str, object]],
    patterns: Sequence[str],
    path: epath.Path,
    *,
    title: str,
    ylabel: str,
    se_suffix: str = "_se",
) -> epath.Path | None:
    """Each metric matching `patterns` against `step`; `<key>_se` columns draw 2-SE bands."""
    keys = [k for k in matching_keys(rows, patterns) if not k.endswith(se_suffix)]
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for key in keys:
        points = [(r["step"], r[key], r.get(key + se_suffix)) for r in rows
                  if key in r and "step" in r]
        if not points:
            continue
        steps = [p[0] for p in points]
        values = [p[1] for p in points]
        (line,) = ax.plot(steps, values, marker="." if len(points) < 50 else None, label=key)
        if all(isinstance(p[2], int | float) for p in points):
            lo = [v - 2 * se for _, v, se in points]
            hi = [v + 2 * se for _, v, se in points]
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def pass_at_k_plot(evals: Mapping[str, Mapping[str, object]], path: epath.Path) -> epath.Path | None:
    """pass@k against k (log-x) for each evaluation, with maj@K points and 2-SE error bars."""
    usable = {label: e for label, e in evals.items() if e.get("pass_at_k")}
    if not usable:
        return None
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for label, e in usable.items():
        curve = e["pass_at_k"]
        ks = sorted(int(k) for k in curve)  # type: ignore[union-attr]
        (line,) = ax.plot(ks, [curve[str(k)] for k in ks], marker="o", ms=3,  # type: ignore[index]
                          label=f"{label} pass@k")
        maj = e.get("maj_at_k") or {}
        if maj:
            mk = sorted(int(k) for k in maj)  # type: ignore[union-attr]
            means = [maj[str(k)]["mean"] for k in mk]  # type: ignore[index]
            bars = [maj[str(k)].get("error_bar") or 0.0 for k in mk]  # type: ignore[index]
            ax.errorbar(mk, means, yerr=bars, fmt="s--", ms=4, capsize=3,
                        color=line.get_color(), alpha=0.7, label=f"{label} maj@K (±2 SE)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("pass@k and maj@K")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def cardinality_plot(evals: Mapping[str, Mapping[str, object]], path: epath.Path) -> epath.Path | None:
    """Questions per number of correct samples (TOPR arXiv:2503.14286 Fig. 4), one bar group per evaluation."""
    usable = {label: e["cardinality"] for label, e in evals.items() if e.get("cardinality")}
    if not usable:
        return None
    fig, ax = plt.subplots(figsize=FIGSIZE)
    width = 0.8 / len(usable)
    for i, (label, hist) in enumerate(usable.items()):
        xs = [c + (i - (len(usable) - 1) / 2) * width for c in range(len(hist))]  # type: ignore[arg-type]
        ax.bar(xs, hist, width=width, label=label)  # type: ignore[arg-type]
    ax.set_xlabel("number of correct samples")
    ax.set_ylabel("questions")
    ax.set_title("Correct-answer cardinality")
    ax.legend(fontsize="small")
    return _save(fig, path)


def proportions_plot(evals: Mapping[str, Mapping[str, object]], path: epath.Path) -> epath.Path | None:
    """Stacked correct / incorrect / invalid fractions per evaluation (TOPR Fig. 3)."""
    usable = {label: e["proportions"] for label, e in evals.items() if e.get("proportions")}
    if not usable:
        return None
    fig, ax = plt.subplots(figsize=FIGSIZE)
    labels = list(usable)
    bottom = [0.0] * len(labels)
    for part, color in (("correct", "tab:green"), ("incorrect", "tab:gray"),
                        ("invalid", "tab:red")):
        values = [usable[label][part] for label in labels]  # type: ignore[index]
        ax.bar(labels, values, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylim(0, 1)
    ax.set_ylabel("fraction of completions")
    ax.set_title("Correct / incorrect / invalid")
    ax.legend(fontsize="small")
    return _save(fig, path)
