"""The README's code runs as written: its Python example, and the commands
that CI runs (the test command CI reads from it)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
  return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_the_first_kernel_runs_and_prints_what_the_readme_says():
  [example] = _blocks("python")
  run = subprocess.run(
    [sys.executable, "-c", example],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.strip() == "[1. 2.]"


def test_the_readme_names_the_commands_ci_runs():
  commands = "\n".join(_blocks("bash"))
  assert "pip install -e '.[test]'" in commands
  assert "python -m pytest" in commands
  assert "python -m sphinx -W docs docs/_build" in commands
