"""Who accessed each element of a buffer last: the race checks' shadows.

Per element a shadow holds the last accessor (a vector-clock component, or
``NOBODY``) and the tick of its clock at that access. Kernels access
windows of consecutive elements (a tile, a row range, a slot), so a shadow
keeps *runs*: ``[start, stop)`` ranges of elements that share their last
access, a handful per buffer, which a window checks and overwrites in a few
Python steps where arrays per element cost numpy passes over every element.
The first access that is not such a window (a masked one, a gather) turns
the shadow into arrays per element for good (``arrays``), which answer
every access (the executor's original, element-wise checks).
"""

import bisect

import numpy as np

# No access yet.
NOBODY = -1


class Shadow:
  """The last access of each of ``size`` elements (see the module
  docstring): runs while every access has been a window, else arrays.

  Example: after ``set(0, 8, 3, 1)`` and ``set(2, 4, 5, 2)`` on a shadow of
  10 elements the runs are ``[0, 2) -> (3, 1)``, ``[2, 4) -> (5, 2)``,
  ``[4, 8) -> (3, 1)`` and ``[8, 10) -> (NOBODY, 0)``.
  """

  __slots__ = ("size", "starts", "comps", "times", "arrays")

  def __init__(self, size: int):
    self.size = size
    # Run k covers [starts[k], starts[k + 1]) (the last one up to size).
    self.starts = [0]
    self.comps = [NOBODY]
    self.times = [0]
    self.arrays: tuple[np.ndarray, np.ndarray] | None = None

  def as_arrays(self) -> tuple[np.ndarray, np.ndarray]:
    """(accessors, ticks) per element, int64 arrays of ``size``; from now
    on the shadow is these arrays (callers update them in place)."""
    if self.arrays is None:
      comps = np.empty(self.size, np.int64)
      times = np.empty(self.size, np.int64)
      bounds = [*self.starts[1:], self.size]
      for start, stop, c, t in zip(
        self.starts, bounds, self.comps, self.times, strict=True
      ):
        comps[start:stop] = c
        times[start:stop] = t
      self.arrays = (comps, times)
      self.starts = self.comps = self.times = []
    return self.arrays

  def unordered(
    self, start: int, stop: int, comp: int, time: int, clock
  ) -> bool:
    """Whether an element of ``[start, stop)`` (a non-empty range; runs
    only) was last accessed, by another access than ``comp``'s at
    ``time``, at a tick that ``clock`` does not cover."""
    starts, comps, times = self.starts, self.comps, self.times
    k = bisect.bisect_right(starts, start) - 1
    end = len(starts)
    while k < end and starts[k] < stop:
      c, t = comps[k], times[k]
      if c != NOBODY and t > clock.get(c, 0) and (c != comp or t != time):
        return True
      k += 1
    return False

  def set(self, start: int, stop: int, comp: int, time: int) -> None:
    """Records an access of ``comp`` at ``time`` to ``[start, stop)`` (a
    non-empty range; runs only), merging equal neighbours."""
    starts, comps, times = self.starts, self.comps, self.times
    first = bisect.bisect_right(starts, start) - 1  # holds start
    last = bisect.bisect_right(starts, stop - 1) - 1  # holds stop - 1
    new_starts, new_comps, new_times = [start], [comp], [time]
    end = starts[last + 1] if last + 1 < len(starts) else self.size
    if stop < end:  # the rest of the last run keeps its access
      new_starts.append(stop)
      new_comps.append(comps[last])
      new_times.append(times[last])
    lo = first + 1 if starts[first] < start else first
    starts[lo : last + 1] = new_starts
    comps[lo : last + 1] = new_comps
    times[lo : last + 1] = new_times
    # Merge the new run with equal neighbours (a program filling a buffer
    # window by window between two synchronisations leaves one run).
    if lo + 1 < len(starts) and (comps[lo + 1], times[lo + 1]) == (comp, time):
      del starts[lo + 1], comps[lo + 1], times[lo + 1]
    if lo > 0 and (comps[lo - 1], times[lo - 1]) == (comp, time):
      del starts[lo], comps[lo], times[lo]
