"""Strict, CPU-only test configuration shared by every test.

8 simulated CPU devices for the collectives (set before any backend starts),
strict dtype promotion, rank promotion as an error, warnings as errors
(pyproject's filterwarnings).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

NUM_CPU_DEVICES = 8

jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rng(request):
  """A numpy Generator seeded from the test's name (stable, per test)."""
  import zlib

  import numpy as np

  return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def pytest_terminal_summary(terminalreporter):
  """CI prints the skip count: a skipped kernel test is a bug report."""
  skipped = len(terminalreporter.stats.get("skipped", []))
  terminalreporter.write_line(f"mpmd: {skipped} tests skipped")


# XLA:CPU JIT-compiles each fusion into pages of their own: a compiled
# kernel keeps a few hundred memory mappings until JAX's caches drop it.
# One process that runs the whole suite could reach the kernel's limit
# (vm.max_map_count, 65,530 by default), and XLA:CPU's compile then fails
# with "Failed to materialize symbols", and jaxlib 0.10.2 segfaults while
# reporting it (seen running upstream's megablox tests: 65,468 mappings).
# Past this many, the caches are cleared between tests.
MAX_MAPPINGS = 40_000


def _mappings() -> int:
  try:
    with open("/proc/self/maps", "rb") as maps:
      return sum(1 for _ in maps)
  except OSError:  # not Linux: no such limit to watch
    return 0


def pytest_runtest_teardown(item, nextitem):
  del item, nextitem
  if _mappings() > MAX_MAPPINGS:
    jax.clear_caches()
