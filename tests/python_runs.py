"""A Python program in a child process, for what could hang or poison this
one (a launch that fails inside XLA's runtime) or needs a fresh interpreter."""

import os
import subprocess
import sys

import pytest


def run_python(
  program: str, *, timeout: float, hang: str = "the program hung", cwd=None
) -> subprocess.CompletedProcess:
  """Runs ``program`` with this interpreter on CPU, output captured; past
  ``timeout`` seconds the test fails, saying ``hang``."""
  try:
    return subprocess.run(
      [sys.executable, "-c", program],
      capture_output=True,
      text=True,
      timeout=timeout,
      cwd=cwd,
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
      check=False,
    )
  except subprocess.TimeoutExpired:
    pytest.fail(f"{hang} (no result in {timeout} s)")
