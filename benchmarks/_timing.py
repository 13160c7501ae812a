"""Timing shared by the benchmarks: ratios measured side by side."""

import random
import statistics
import time
from collections.abc import Callable

import jax


def time_rounds(
  fns: dict[str, Callable[[], jax.Array]],
  rounds: int,
  clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
  """Seconds per call of each fn in each round, timed round-robin by
  ``clock`` (wall time; ``time.process_time``: the process's CPU time).

  Rounds interleave the functions so that load from other processes hits
  every side alike; each is compiled and warmed first. Each round runs them
  in a new order (seeded, so runs repeat it): in a fixed order, a function
  inherits the caches its predecessor left, and two calls of the same
  program measured 3-4% apart by their place in the round.
  """
  for fn in fns.values():
    jax.block_until_ready(fn())
  times: dict[str, list[float]] = {name: [] for name in fns}
  order = list(fns)
  shuffle = random.Random(0).shuffle
  for _ in range(rounds):
    shuffle(order)
    for name in order:
      start = clock()
      jax.block_until_ready(fns[name]())
      times[name].append(clock() - start)
  return times


def time_interleaved(
  fns: dict[str, Callable[[], jax.Array]], rounds: int
) -> dict[str, float]:
  """Median seconds per call of each fn, timed round-robin (``time_rounds``)."""
  times = time_rounds(fns, rounds)
  return {name: statistics.median(ts) for name, ts in times.items()}


def ratio_spread(
  ours: list[float], reference: list[float]
) -> tuple[float, float]:
  """The lowest and highest ratio of one round's times (ours / reference,
  timed next to each other)."""
  ratios = [a / b for a, b in zip(ours, reference, strict=True)]
  return min(ratios), max(ratios)


def paired_ratio(ours: list[float], reference: list[float]) -> float:
  """The median of each round's ratio (ours / reference, timed next to each
  other): where the machine slows down for a stretch of rounds, both sides
  of a pair slow down together, and the ratio of medians can mix a slow
  median with a fast one."""
  return statistics.median(a / b for a, b in zip(ours, reference, strict=True))
