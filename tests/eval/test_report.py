"""`jaxrl-llm report` renders PNGs and a Markdown summary from a recorded run directory."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from jaxrl_llm.cli import main as cli_main
from jaxrl_llm.eval import metrics as m


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG header (IHDR), independent of matplotlib."""
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def record_run(run_dir: Path) -> None:
    """A run as the trainer and evaluate write it: metrics.jsonl rows and two eval.json."""
    rng = np.random.default_rng(0)
    rows = []
    for step in range(10, 110, 10):
        rows.append({
            # The train step's names for the kernel metrics (loss/ prefix).
            "step": step, "loss": 1.0 / step, "accuracy": step / 200,
            "loss/log_ratio_mean_pos": 0.01 * step, "loss/log_ratio_mean_neg": -0.02 * step,
            "loss/clip_frac_pos_low": 0.1, "loss/clip_frac_neg_high": 0.3,
            "loss/effective_pos_fraction": 0.15, "loss/num_pos": 64,
        })
    (run_dir / "train").mkdir(parents=True)
    (run_dir / "train" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    for label, p, step in (("before", 0.2, 0), ("after", 0.4, 100)):
        answers = [[None if rng.random() < 0.1 else str(int(rng.random() < p)) for _ in range(8)]
                   for _ in range(30)]
        correct = [[a == "1" for a in row] for row in answers]
        summary = m.evaluation_summary(m.EvalSamples.from_answers(answers, correct),
                                       maj_k=[1, 2, 4], trials=20)
        summary.update(label=label, step=step)
        (run_dir / f"eval_{label}").mkdir()
        (run_dir / f"eval_{label}" / "eval.json").write_text(json.dumps(summary))


def test_report_writes_every_plot_and_links_them(tmp_path, capsys):
    run_dir = tmp_path / "run"
    record_run(run_dir)
    assert cli_main(["report", str(run_dir)]) == 0
    out = run_dir / "report"
    expected = ["accuracy", "loss", "logprob_drift", "clipped_fractions",
                "effective_positive_fraction", "pass_at_k", "cardinality", "proportions"]
    for stem in expected:
        png = out / f"{stem}.png"
        assert png.is_file(), stem
        assert png_size(png) == (640, 400)
    md = (out / "report.md").read_text()
    for stem in expected:
        assert f"]({stem}.png)" in md
    assert "| before | 30 × 8 |" in md and "| after | 30 × 8 |" in md
    assert str(out / "report.md") in capsys.readouterr().out


def test_report_names_missing_data_and_refuses_empty_runs(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    from jaxrl_llm.eval.report import write_report

    md = write_report(run_dir).read_text()
    assert "- pass@k vs k: no data in this run" in md
    assert (run_dir / "report" / "loss.png").is_file()
    assert not (run_dir / "report" / "clipped_fractions.png").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    import pytest

    with pytest.raises(FileNotFoundError, match="no metrics.jsonl or eval.json"):
        write_report(empty)
    (run_dir / "metrics.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: not a JSON line"):
        write_report(run_dir)


def test_sft_and_rl_steps_get_separate_panels_and_empty_series_no_legend_entry(tmp_path):
    """A quickstart-shaped run: SFT counts steps 0..400, RL counts its own 0..40. The report
    draws them side by side (not on one step axis), and a metric with no finite value (here
    all NaN in RL) has no line and no legend entry."""
    from jaxrl_llm.eval.plots import series_panels
    from jaxrl_llm.eval.report import collect_run

    run = tmp_path / "run"
    (run / "sft" / "run").mkdir(parents=True)
    (run / "iter_1" / "train").mkdir(parents=True)
    sft = [{"step": s, "loss": 5.0 / s} for s in range(100, 500, 100)]
    rl = [{"step": s, "loss": -0.01 * s, "loss/clip_frac_pos_high": float("nan")}
          for s in range(10, 50, 10)]
    (run / "sft" / "run" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in sft))
    # JSON has no NaN literal: Python's json writes and reads it as `NaN`, like the trainer's rows
    (run / "iter_1" / "train" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rl))
    rows, _ = collect_run(run)
    panels = series_panels(rows, [r"(^|/)loss$", r"clip"])
    assert list(panels) == ["sft", "rl"]
    assert panels["sft"] == {"sft/run/loss": [(s, 5.0 / s, None) for s in (100, 200, 300, 400)]}
    assert panels["rl"] == {"iter_1/train/loss": [(s, -0.01 * s, None) for s in (10, 20, 30, 40)]}
    assert series_panels(rows, [r"clip"]) == {}  # nothing finite to draw: no figure at all
    assert cli_main(["report", str(run)]) == 0
    assert png_size(run / "report" / "loss.png") == (1024, 400)  # two panels side by side
    assert not (run / "report" / "clipped_fractions.png").exists()
    md = (run / "report" / "report.md").read_text()
    assert "- Clipped fractions: no data in this run" in md


def test_online_rows_are_plotted_against_rounds_with_integer_ticks(tmp_path):
    """Issue 55 item 16: an online run's `step` is its round (its rows carry `round_updates`):
    the x axis says so, and three rounds get whole-number ticks, not 1.25, 1.5, ...; a trainer's
    rows stay optimizer steps."""
    from jaxrl_llm.eval.plots import series_figure
    from jaxrl_llm.eval.report import SERIES, collect_run

    run = tmp_path / "run"
    run.mkdir()
    online = [{"step": r, "updates": 2 * r, "round_updates": 2, "pipeline/lag_mean": 0.5 * r,
               "pipeline/lag_max": 1.0 * r, "loss": 1.0 / r} for r in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in online))
    rows, _ = collect_run(run)
    patterns = {stem: p for stem, _, _, p in SERIES}
    trained = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    for data, stem, unit in ((rows, "pipeline_lag", "online round"), (rows, "loss", "online round"),
                             (trained, "loss", "optimizer step")):
        fig = series_figure(data, patterns[stem], title=stem, ylabel="y")
        ax = fig.axes[0]
        fig.canvas.draw()
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ax.get_xlabel() == unit, stem
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert cli_main(["report", str(run)]) == 0
    assert (run / "report" / "pipeline_lag.png").is_file()
