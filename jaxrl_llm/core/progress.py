"""Progress of every long stage: a tqdm bar on a terminal, plain lines in a log.

tqdm redraws one line with carriage returns, which a log file or a CI console shows as one
ever-growing line (or nothing until the end). When stderr is not a terminal, `progress_bar`
returns a tqdm whose every refresh is a whole line ("generate: 16/64 prompts (25%) 0:41
elapsed, 2:03 left"), at most every `LINE_INTERVAL_S` seconds (`JAXRL_PROGRESS_INTERVAL_S`),
plus the last one. `set_status` shows where a long step is (a batch's decode step) between
counts, at the same rate.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tqdm.auto import tqdm

LINE_INTERVAL_S = 10.0  # a plain line at most this often (a terminal bar redraws at 10 Hz)
INTERVAL_ENV = "JAXRL_PROGRESS_INTERVAL_S"  # overrides it (0: a line at every update)


class LineProgress(tqdm):  # type: ignore[misc]
    """tqdm printing whole lines (for logs); the format keeps tqdm's own figures."""

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if self.disable:
            return True
        d = self.format_dict
        total = d["total"]
        done = f"{d['n']:g}/{total:g}" if total else f"{d['n']:g}"
        pct = f" ({100 * d['n'] / total:.0f}%)" if total else ""
        rate = d["rate"] or (d["n"] / d["elapsed"] if d["elapsed"] else 0)
        left = (f", {self.format_interval((total - d['n']) / rate)} left"
                if total and rate and d["n"] < total else "")
        extra = f" {d['postfix']}" if d.get("postfix") else ""
        self.fp.write(f"{self.desc}: {done} {self.unit}s{pct} "
                      f"{self.format_interval(d['elapsed'])} elapsed{left}{extra}\n")
        self.fp.flush()
        self.last_print_n = self.n
        return True

    def close(self) -> None:
        if not self.disable and self.last_print_n != self.n:
            self.display()  # the final count, once
            self.last_print_n = self.n
        self.disable = True
        super().close()


def set_status(bar: Any, text: str, *, now: bool = False) -> None:
    """Show `text` after the count, redrawn at the bar's own rate (or `now`): the elapsed time
    and the status move while the count waits for a long step."""
    bar.set_postfix_str(text, refresh=False)
    if not bar.disable and (now or bar._time() - bar.last_print_t >= bar.mininterval):
        bar.refresh()
        bar.last_print_t = bar._time()


def is_terminal(stream: Any = None) -> bool:
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return 0


def progress_bar(total: int | None = None, *, desc: str, unit: str, enabled: bool = True,
                 initial: int = 0) -> Any:
    """A tqdm bar (terminal) or a `LineProgress` (log) on stderr; disabled when not `enabled`."""
    if is_terminal():
        # A terminal that reports no size (some ptys: 0×0) would hide the bar: tqdm draws none
        # below the screen's last row. Give it one.
        sized = _columns() > 0
        return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, initial=initial,
                    dynamic_ncols=sized, ncols=None if sized else 100, nrows=None if sized else 24)
    interval = float(os.environ.get(INTERVAL_ENV, LINE_INTERVAL_S))
    return LineProgress(total=total, desc=desc, unit=unit, disable=not enabled, initial=initial,
                        mininterval=interval, miniters=1, file=sys.stderr)
