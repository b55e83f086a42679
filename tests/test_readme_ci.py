"""CI runs the README's set-up lines as written: `.ci/run` reads them from README.md.

The expected lines are found here independently (a regex over README.md), then compared with
what `.ci/readme_setup.py` extracts and with what `.ci/run --print` would run from a fresh clone
of a throw-away repository holding this checkout's README.md and `.ci/`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CI_RUN = ROOT / ".ci" / "run"
EXTRACT = ROOT / ".ci" / "readme_setup.py"


def readme_lines() -> list[str]:
    """The first ```bash block of README.md, by a regex (not the code under test)."""
    block = re.search(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    assert block is not None, "README.md has no ```bash block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def extract(readme: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXTRACT), str(readme)], capture_output=True,
                          text=True, timeout=60)


def test_readme_has_the_two_setup_lines() -> None:
    first, second = readme_lines()
    assert first.startswith("python3 -m venv .venv") and first.endswith("jaxrl-llm quickstart")
    assert "pip install -e ." in first
    # two pytest-xdist workers (in the test extra): the suite mostly waits on subprocesses
    assert "'.[test,tpu]'" in second and second.endswith("pytest -q -n 2")


def test_extraction_gives_exactly_the_readme_lines() -> None:
    result = extract(ROOT / "README.md")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == readme_lines()


@pytest.mark.parametrize(("body", "message"), [
    ("# title\n\nno code here\n", "no ```bash block"),
    ("```bash\nline one\n", "never closed"),
    ("```bash\none\ntwo\nthree\n```\n", "holds 3 non-blank lines, expected 2"),
])
def test_extraction_refuses_a_changed_readme(tmp_path: Path, body: str, message: str) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(body)
    result = extract(readme)
    assert result.returncode == 1
    assert message in result.stderr and str(readme) in result.stderr
    assert result.stdout == ""


def test_ci_run_does_not_retype_the_readme_lines() -> None:
    script = CI_RUN.read_text()
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert "readme_setup.py README.md" in code
    for line in readme_lines():
        assert line not in script
    for fragment in ("pip install", "jaxrl-llm quickstart", "run_dir="):
        assert fragment not in code, f".ci/run retypes {fragment!r}; it must come from README.md"
    assert 'pytest -q -n 2 -m "slow and not reliability"' in code and "ruff check ." in code
    assert "--reliability-report=RELIABILITY.md" in code and "git diff --exit-code" in code


def test_ci_run_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(CI_RUN)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert os.access(CI_RUN, os.X_OK), ".ci/run must be executable"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_ci_run_print_clones_and_reads_the_readme(tmp_path: Path) -> None:
    """`.ci/run --print` in a throw-away repository: it clones, reads the clone's README."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / ".ci", repo / ".ci")
    shutil.copy(ROOT / "README.md", repo / "README.md")
    env = {**os.environ, "GIT_AUTHOR_NAME": "ci", "GIT_AUTHOR_EMAIL": "ci@example.invalid",
           "GIT_COMMITTER_NAME": "ci", "GIT_COMMITTER_EMAIL": "ci@example.invalid",
           "TMPDIR": str(tmp_path)}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True, timeout=60)
    result = subprocess.run([str(repo / ".ci" / "run"), "--print"], capture_output=True,
                            text=True, env=env, stdin=subprocess.DEVNULL, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == readme_lines()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]  # --print removes its clone
