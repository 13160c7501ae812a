"""The checker's random walk draws numpy's numbers (``schedule.Draws``):
the same picks as ``rng.integers(n)``, call by call, so that a schedule
string names the same run as before and on every numpy."""

import numpy as np
import pytest

from mpmd._lowering.check import schedule


@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
def test_draws_match_numpy_integers(seed):
  numpy_rng = np.random.default_rng(seed)
  draws = schedule.Draws(np.random.default_rng(seed))
  sizes = np.random.default_rng(seed + 1).integers(1, 40, size=3000).tolist()
  # Ranges where Lemire's method rejects often, and the full 32 bits.
  sizes += [2**32, 2**31 + 1, 3 * 2**30, 2**32 - 1, 1, 2] * 40
  got = [draws.below(n) for n in sizes]
  want = [int(numpy_rng.integers(n)) for n in sizes]
  assert got == want


def test_random_walk_picks_as_before():
  options = [("p", 0), ("p", 1), ("d", 0)]
  walk = schedule.parse("random:3").strategy(launch=2)
  rng = np.random.default_rng(schedule.mix(3, 2))
  for step in range(500):
    some = options[: 1 + step % 3]
    want = some[int(rng.integers(len(some)))]
    assert walk.choose(step, some, some[0]) == want
