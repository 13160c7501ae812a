"""Timing shared by the benchmarks: ratios measured side by side."""

import statistics
import time
from collections.abc import Callable

import jax


def time_interleaved(
  fns: dict[str, Callable[[], jax.Array]], rounds: int
) -> dict[str, float]:
  """Median seconds per call of each fn, timed round-robin.

  Rounds interleave the functions (a, b, c, a, b, c, ...) so that load from
  other processes hits every side alike; each is compiled and warmed first.
  """
  for fn in fns.values():
    jax.block_until_ready(fn())
  times: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(ts) for name, ts in times.items()}
