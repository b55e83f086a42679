"""Every figure in experiments/figures/ is drawn from the results its table reports.

A figure with a committed results file (experiments/results/STEM.json, written by the run that
drew it; experiments/redraw.py) is redrawn from it here: each drawn series must be a series of
the JSON (read here, independently of the plot code), every "seed N only" / "N seeds" label
must match the seeds the JSON holds, and the committed PNG must carry the SHA-256 of the JSON
(the stamp `redraw.draw` writes), so a figure and its results cannot be swapped independently.
A figure without one is listed in PENDING with the reason, so the gap is visible."""

from __future__ import annotations

import hashlib
import json
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from experiments import offline_epochs, redraw
from tests.experiments.test_smoke import EXPERIMENTS, run_smoke

FIGURES = EXPERIMENTS / "figures"
RESULTS = EXPERIMENTS / "results"

# figure → why it has no committed results file (experiments/README.md lists the same ones)
PENDING: dict[str, str] = {}  # none since 2026-11-28: every figure has its results
COMMITTED = sorted(p.stem for p in RESULTS.glob("*.json"))


def sha256_of(data: dict) -> str:
    """The digest of a results dict as JSON with sorted keys (written out here, not imported)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def png_text_chunks(path: Path) -> dict[str, str]:
    """tEXt chunks of a PNG, checking every chunk's CRC."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    out, i = {}, 8
    while i < len(data):
        (n,) = struct.unpack(">I", data[i:i + 4])
        kind, body = data[i + 4:i + 8], data[i + 8:i + 8 + n]
        (crc,) = struct.unpack(">I", data[i + 8 + n:i + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, (path, kind)
        if kind == b"tEXt":
            key, value = body.decode("latin-1").split("\0", 1)
            out[key] = value
        i += 12 + n
    return out


def numeric_lists(obj) -> list[np.ndarray]:
    """Every list of ≥ 2 numbers anywhere in the JSON, and the keys of every object keyed by
    ≥ 2 integers in their order (pass@k by k: {"1": …, "2": …} draws k = 1, 2, … on x)."""
    if isinstance(obj, dict):
        keys = [k.lstrip("-") for k in obj]
        own = ([np.asarray([int(k) for k in obj], dtype=np.float64)]
               if len(obj) >= 2 and all(k.isdigit() for k in keys) else [])
        return own + [a for v in obj.values() for a in numeric_lists(v)]
    if isinstance(obj, list):
        if len(obj) >= 2 and all(isinstance(x, int | float) and not isinstance(x, bool)
                                 for x in obj):
            return [np.asarray(obj, dtype=np.float64)]
        return [a for v in obj for a in numeric_lists(v)]
    return []


def categorical_ticks(ax) -> np.ndarray | None:
    """The x tick positions where the axis names categories (text labels, not numbers)."""
    labels = [t.get_text() for t in ax.get_xticklabels()]
    try:
        [float(t.replace("\u2212", "-")) for t in labels if t]
        return None
    except ValueError:
        return np.asarray(ax.get_xticks(), np.float64)


def drawn_series(fig) -> list[tuple[str, np.ndarray | None, np.ndarray]]:
    """(legend label, x, y) of every labelled line and error-bar series the figure drew; x is
    None where the points sit beside named categories (a method per tick), not on data."""
    def x_of(line, ticks: np.ndarray | None) -> np.ndarray | None:
        x = np.asarray(line.get_xdata(), np.float64)
        if ticks is not None and np.all(np.abs(x[:, None] - ticks[None]).min(1) < 0.5):
            return None
        return x

    out = []
    for ax in fig.axes:
        ticks = categorical_ticks(ax)
        for line in ax.get_lines():
            if not line.get_label().startswith("_") and len(line.get_xdata()) >= 2:
                out.append((line.get_label(), x_of(line, ticks), np.asarray(line.get_ydata(),
                                                                     np.float64)))
        for c in ax.containers:
            if type(c).__name__ == "ErrorbarContainer" and not c.get_label().startswith("_"):
                line = c.lines[0]
                out.append((c.get_label(), x_of(line, ticks), np.asarray(line.get_ydata(),
                                                                  np.float64)))
    return out


def figure_texts(fig) -> list[str]:
    texts = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]
    return [t for t in texts if t]


def seeds_by_label(experiment: str, results: dict) -> dict[str, list[int]]:
    """Label prefix → the seeds the JSON holds for it ('' = the whole figure)."""
    if experiment == "offline_epochs":  # each method's runs at its chosen lr
        return {m: sorted(int(s) for s in e["runs"][f"lr{e['best_lr']:g}"])
                for m, e in results["methods"].items()}
    seeds = results.get("config", {}).get("seeds")
    return {"": sorted(seeds)} if seeds else {}


def check_seed_labels(experiment: str, results: dict, fig) -> None:
    """Every 'seed N only' / 'N seeds' in a title, axis label, legend or series label states
    the seeds of the JSON: a method's own where the text starts with its name, else the one
    count every part of the figure shares."""
    expected = seeds_by_label(experiment, results)
    texts = figure_texts(fig) + [label for label, _, _ in drawn_series(fig)]
    for text in texts:
        for match in re.finditer(r"seed (\d+) only|(\d+) seeds", text):
            owners = [k for k in expected if k and text.startswith(k)]
            candidates = [expected[owners[0]]] if owners else list(expected.values())
            assert candidates, f"{text!r} states seeds the results do not record"
            want = {f"seed {s[0]} only" if len(s) == 1 else f"{len(s)} seeds"
                    for s in candidates}
            assert want == {match.group(0)}, (text, candidates)


def numeric_scalars(obj) -> set[float]:
    """Every number anywhere in the JSON (a reference line such as μ's is one of them)."""
    if isinstance(obj, dict):
        return {a for v in obj.values() for a in numeric_scalars(v)}
    if isinstance(obj, list):
        return {a for v in obj for a in numeric_scalars(v)}
    return {float(obj)} if isinstance(obj, int | float) and not isinstance(obj, bool) else set()


def check_drawn_from(results: dict, fig) -> None:
    series = drawn_series(fig)
    assert series, "the figure drew no labelled series"
    lists = numeric_lists(results)
    scalars = numeric_scalars(results)
    for label, x, y in series:
        if np.all(y == y[0]) and float(y[0]) in scalars:  # a horizontal reference line (axhline)
            continue
        for name, values in (("y", y), ("x", x)):
            if values is None:  # points beside named categories: only y is data
                continue
            # a series of the results, or (a panel that gathers one number per cell, such as
            # the staleness plot's final pass@1 per s) every point a number of the results
            assert any(a.shape == values.shape and np.array_equal(a, values) for a in lists) \
                or all(float(v) in scalars for v in values), \
                f"{label!r}: its {name} values are no series of the results"


def test_every_figure_has_committed_results_or_a_listed_reason():
    figures = {p.name for p in FIGURES.glob("*.png")}
    with_results = {f"{stem}.png" for stem in COMMITTED}
    assert with_results <= figures, f"results without a figure: {sorted(with_results - figures)}"
    assert not with_results & set(PENDING), \
        f"listed as pending but committed: {sorted(with_results & set(PENDING))}"
    assert set(PENDING) <= figures, f"PENDING names no figure: {sorted(set(PENDING) - figures)}"
    assert figures - with_results == set(PENDING), \
        f"figures with neither results nor a reason: {sorted(figures - with_results - set(PENDING))}"


def test_readme_lists_the_pending_figures():
    readme = (EXPERIMENTS / "README.md").read_text()
    section = readme[readme.index("## Figures and their results"):]
    section = section.split("\n## ")[0]
    for name in PENDING:
        assert f"`{name}`" in section, f"experiments/README.md does not list {name} as pending"
    for stem in COMMITTED:
        assert f"`results/{stem}.json`" in section, f"experiments/README.md omits {stem}.json"


@pytest.mark.parametrize("stem", COMMITTED)
def test_figure_is_drawn_from_its_committed_results(stem, tmp_path):
    path = RESULTS / f"{stem}.json"
    assert path.stat().st_size <= redraw.MAX_RESULTS_BYTES, f"{path}: strip per-step traces"
    data = json.loads(path.read_text())
    experiment = data.pop("experiment")
    digest = sha256_of(data)
    assert png_text_chunks(FIGURES / f"{stem}.png").get("results_sha256") == digest, \
        f"experiments/figures/{stem}.png was not drawn from {path} (redraw it)"
    png, fig = redraw.redraw(path, tmp_path)
    assert png_text_chunks(png)["results_sha256"] == digest
    check_drawn_from(data, fig)
    check_seed_labels(experiment, data, fig)


def _offline_entry(seeds: list[int], final: float) -> dict:
    rows = [{"step": 0, "pass_at_1": 0.3}, {"step": 16, "pass_at_1": final}]
    return {"best_lr": 1e-4, "runs": {"lr0.0001": {str(s): rows for s in seeds},
                                      "lr0.001": {"0": rows}},
            "steps": [0, 16, 32], "trained_steps": [16, 32], "clip_metric": "loss/clip_frac",
            "pass_at_1": {"mean": [0.3, 0.31, final], "se": [0.0, 0.01, 0.01]},
            "invalid": {"mean": [0.01, 0.02, 0.03], "se": [0.0, 0.0, 0.0]},
            "dataset_ess_fraction": {"mean": [1.0, 0.7, 0.5], "se": [0.0, 0.1, 0.1]},
            "clip_fraction": {"mean": [0.1, 0.2], "se": [0.0, 0.0]}}


def test_offline_epochs_seed_labels_follow_each_methods_runs(tmp_path):
    """A merged results.json where one method ran seed 0 only: the legend says so for it and
    '3 seeds' for the other; the axis names no single count."""
    results = {"config": {"seeds": [0, 1, 2]},
               "methods": {"topr": _offline_entry([0, 1, 2], 0.38),
                           "gspo": _offline_entry([0], 0.34)}}
    fig = offline_epochs.plot(results, tmp_path / "f.png")
    labels = {label for label, _, _ in drawn_series(fig)}
    assert {"topr (3 seeds, lr 0.0001)", "gspo (seed 0 only, lr 0.0001)"} <= labels
    assert fig.axes[0].get_ylabel() == "mean ± SE over each method's seeds (legend)"
    check_drawn_from(results, fig)
    check_seed_labels("offline_epochs", results, fig)
    results["methods"]["gspo"] = _offline_entry([0, 1, 2], 0.34)
    fig = offline_epochs.plot(results, tmp_path / "g.png")
    assert fig.axes[0].get_ylabel() == "mean ± SE, 3 seeds"
    # a label typed by hand instead of computed is caught
    fig.axes[0].get_lines()[0].set_label("topr (seed 0 only, lr 0.0001)")
    with pytest.raises(AssertionError):
        check_seed_labels("offline_epochs", results, fig)


def test_seed_label():
    assert redraw.seed_label([0]) == "seed 0 only"
    assert redraw.seed_label(["2", "0", "1"]) == "3 seeds"
    with pytest.raises(ValueError):
        redraw.seed_label([])


def test_smoke_run_commits_results_and_redraws_from_them(tmp_path):
    """pkpo_variance --smoke --results-dir D writes D/pkpo_variance.json (results.json plus the
    experiment's name), stamps its PNG with the digest, and `redraw.py` redraws it."""
    out = run_smoke("pkpo_variance.py", tmp_path, "--results-dir", str(tmp_path / "results"))
    committed = json.loads((tmp_path / "results" / "pkpo_variance.json").read_text())
    assert committed.pop("experiment") == "pkpo_variance"
    assert committed == json.loads((out / "results.json").read_text())
    digest = sha256_of(committed)
    assert png_text_chunks(out / "pkpo_variance.png")["results_sha256"] == digest
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "redraw.py"), "pkpo_variance",
                           "--results", str(tmp_path / "results" / "pkpo_variance.json"),
                           "--out", str(tmp_path / "redrawn")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png_text_chunks(tmp_path / "redrawn" / "pkpo_variance.png")["results_sha256"] == digest
