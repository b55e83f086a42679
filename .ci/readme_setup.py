"""Print the README's set-up commands, one per line: the lines of its first ```bash block.

`.ci/run` runs exactly these lines (never a retyped copy), so CI tests what a new user
copies. Usage: `python3 .ci/readme_setup.py [README.md]`. Exits 1, naming the file and the
fix, when the block is missing, unclosed, or does not hold exactly `EXPECTED` commands.
Standard library only: it runs before any virtual environment exists.
"""

from __future__ import annotations

import sys
from pathlib import Path

EXPECTED = 2  # line 1: install + quickstart; line 2: test install + pytest
FENCE = "```bash"


def setup_commands(readme_text: str, *, source: str = "README.md") -> list[str]:
    """The non-blank lines of the first ```bash block of `readme_text`."""
    lines = readme_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == FENCE), None)
    if start is None:
        raise ValueError(f"{source}: no {FENCE} block; the set-up commands must open the "
                         f"README in a {FENCE} fenced block")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() == "```"), None)
    if end is None:
        raise ValueError(f"{source}:{start + 1}: the {FENCE} block is never closed with ```")
    commands = [line.strip() for line in lines[start + 1:end] if line.strip()]
    if len(commands) != EXPECTED:
        raise ValueError(
            f"{source}:{start + 1}: the first {FENCE} block holds {len(commands)} non-blank "
            f"lines, expected {EXPECTED} (the install-and-quickstart line and the test line); "
            "keep comments and other commands out of it"
        )
    return commands


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "README.md"
    try:
        commands = setup_commands(path.read_text(encoding="utf-8"), source=str(path))
    except (OSError, ValueError) as err:
        print(f"readme_setup: {err}", file=sys.stderr)
        return 1
    print("\n".join(commands))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
