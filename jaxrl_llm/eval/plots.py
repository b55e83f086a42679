"""PNG plots of a run (matplotlib, Agg backend): the figures the papers draw.

Each function takes plain data (rows of the metrics JSONL, `eval.json` dicts) and writes one
PNG, returning its path, or None when the run has nothing to draw for it.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping, Sequence

import matplotlib
from etils import epath

matplotlib.use("Agg")  # headless: no display on training hosts
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from jaxrl_llm.core.atomic import atomic_write_bytes
from jaxrl_llm.core.paths import PathLike, as_path

FIGSIZE = (6.4, 4.0)
DPI = 100


def _save(fig: plt.Figure, path: PathLike) -> epath.Path:
    path = as_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    png = io.BytesIO()  # through bytes: the path may be remote (gs://), which matplotlib can't open
    fig.savefig(png, format="png", dpi=DPI)
    plt.close(fig)
    atomic_write_bytes(path, png.getvalue())
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


PHASE_TITLES = {"sft": "SFT warm start", "rl": "RL"}


def series_points(
    rows: Sequence[Mapping[str, object]], key: str, se_suffix: str = "_se"
) -> list[tuple[float, float, float | None]]:
    """(step, value, se or None) of one metric, finite values only."""
    points = []
    for r in rows:
        value, step = r.get(key), r.get("step")
        if not isinstance(value, int | float) or isinstance(value, bool) or step is None:
            continue
        if not math.isfinite(value):
            continue
        se = r.get(key + se_suffix)
        points.append((step, value, se if isinstance(se, int | float) and math.isfinite(se) else None))
    return points  # type: ignore[return-value]


def series_panels(
    rows: Sequence[Mapping[str, object]], patterns: Sequence[str], se_suffix: str = "_se"
) -> dict[str, dict[str, list[tuple[float, float, float | None]]]]:
    """{phase: {metric: points}} for the metrics matching `patterns`.

    Rows carry a `phase` ("sft" or "rl", set by the report from the file they came from); SFT
    and RL steps count from 0 separately, so they get separate panels instead of one axis.
    Metrics with no finite value in a phase are left out, so no legend entry is empty.
    """
    keys = [k for k in matching_keys(rows, patterns) if not k.endswith(se_suffix)]
    panels: dict[str, dict[str, list[tuple[float, float, float | None]]]] = {}
    for phase in dict.fromkeys(str(r.get("phase", "")) for r in rows):
        phase_rows = [r for r in rows if str(r.get("phase", "")) == phase]
        series = {k: pts for k in keys if (pts := series_points(phase_rows, k, se_suffix))}
        if series:
            panels[phase] = series
    return dict(sorted(panels.items(), key=lambda kv: kv[0] != "sft"))  # SFT first: it ran first


def _label(key: str, phase: str) -> str:
    """A legend label without the directory prefix its phase already names (sft/run/loss)."""
    if phase == "sft" and key.startswith("sft"):
        return key.split("/", 2)[-1] if key.count("/") >= 2 else key
    return key


# The online loop's rows (every placement, `online/`) carry this column; their `step` is the
# round, not the optimizer step.
ROUND_COLUMN = re.compile(r"(^|/)round_updates$")


def step_unit(rows: Sequence[Mapping[str, object]]) -> str:
    """What `step` counts in these rows: "online round" or "optimizer step"."""
    online = any(ROUND_COLUMN.search(key) for row in rows for key in row)
    return "online round" if online else "optimizer step"


def series_plot(
    rows: Sequence[Mapping[str, object]],
    patterns: Sequence[str],
    path: epath.Path,
    *,
    title: str,
    ylabel: str,
    se_suffix: str = "_se",
) -> epath.Path | None:
    """`series_figure`'s figure as a PNG at `path`; None when nothing matches."""
    fig = series_figure(rows, patterns, title=title, ylabel=ylabel, se_suffix=se_suffix)
    return None if fig is None else _save(fig, path)


def series_figure(
    rows: Sequence[Mapping[str, object]],
    patterns: Sequence[str],
    *,
    title: str,
    ylabel: str,
    se_suffix: str = "_se",
) -> plt.Figure | None:
    """Each metric matching `patterns` against `step` (optimizer steps, or an online run's
    rounds: `step_unit`; integer ticks), one panel per phase (SFT, RL) when a run has both;
    `<key>_se` columns draw 2-SE bands."""
    panels = series_panels(rows, patterns, se_suffix)
    if not panels:
        return None
    width = FIGSIZE[0] * (1 if len(panels) == 1 else 1.6)
    # y not shared: SFT's and RL's losses live on different scales
    fig, axes = plt.subplots(1, len(panels), figsize=(width, FIGSIZE[1]), squeeze=False)
    for ax, (phase, series) in zip(axes[0], panels.items()):
        for key, points in series.items():
            steps = [p[0] for p in points]
            values = [p[1] for p in points]
            (line,) = ax.plot(steps, values, marker="." if len(points) < 50 else None,
                              label=_label(key, phase))
            if all(p[2] is not None for p in points):
                lo = [v - 2 * se for _, v, se in points]  # type: ignore[operator]
                hi = [v + 2 * se for _, v, se in points]  # type: ignore[operator]
                ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
        phase_name = PHASE_TITLES.get(phase)
        unit = step_unit([r for r in rows if str(r.get("phase", "")) == phase])
        ax.set_xlabel(f"{phase_name} {unit}" if phase_name else unit)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and rounds are counts
        if len(panels) > 1:
            ax.set_title(phase_name or phase, fontsize="medium")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    return fig


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
