"""Every example runs on CPU and prints its own correctness check."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_and_checks_itself(path):
  run = subprocess.run(
    [sys.executable, str(path)],
    capture_output=True,
    text=True,
    timeout=600,
  )
  # Each example asserts its result against plain JAX (non-zero exit on a
  # mismatch) and prints FAIL for a lowering that did not happen.
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.strip() and "FAIL" not in run.stdout, run.stdout
