"""The checker's race shadows kept as runs agree with arrays per element."""

import numpy as np
import pytest

from mpmd._lowering.check.shadow import NOBODY, Shadow

SIZE = 40


def _expanded(shadow: Shadow) -> tuple[np.ndarray, np.ndarray]:
  """The runs as arrays per element (without turning the shadow)."""
  comps = np.empty(SIZE, np.int64)
  times = np.empty(SIZE, np.int64)
  bounds = [*shadow.starts[1:], SIZE]
  for start, stop, c, t in zip(
    shadow.starts, bounds, shadow.comps, shadow.times, strict=True
  ):
    comps[start:stop] = c
    times[start:stop] = t
  return comps, times


@pytest.mark.parametrize("seed", range(8))
def test_runs_match_arrays_per_element(seed):
  rng = np.random.default_rng(seed)
  shadow = Shadow(SIZE)
  comps = np.full(SIZE, NOBODY, np.int64)
  times = np.zeros(SIZE, np.int64)
  for _ in range(200):
    start = int(rng.integers(SIZE))
    stop = int(rng.integers(start + 1, SIZE + 1))
    comp = int(rng.integers(3))
    clock = {c: int(rng.integers(4)) for c in range(3)}
    time = int(rng.integers(4))
    c, t = comps[start:stop], times[start:stop]
    # Anyone's access the clock does not cover, but this one's own.
    itself = (c == comp) & (t == time)
    covered = t <= [clock.get(x, 0) for x in c]
    want = bool(np.any((c != NOBODY) & ~covered & ~itself))
    assert shadow.unordered(start, stop, comp, time, clock) == want
    shadow.set(start, stop, comp, time)
    comps[start:stop], times[start:stop] = comp, time
    got_comps, got_times = _expanded(shadow)
    np.testing.assert_array_equal(got_comps, comps)
    np.testing.assert_array_equal(got_times, times)
    # Equal neighbours are merged: no two adjacent runs hold one access.
    pairs = list(zip(shadow.comps, shadow.times, strict=True))
    assert all(a != b for a, b in zip(pairs, pairs[1:], strict=False))
  arrays = shadow.as_arrays()
  np.testing.assert_array_equal(arrays[0], comps)
  np.testing.assert_array_equal(arrays[1], times)
