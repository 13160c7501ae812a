"""Helpers for kernel authors' test suites.

``assert_schedule_independent`` fails a test when any explored schedule of
a function's launches fails. To send every launch of a test run through
the checking executor with a schedule of its own, set ``MPMD_CHECK`` in the
environment (``MPMD_CHECK=random:0 python -m pytest``): each call of each
launch then runs a random schedule derived from that seed, and a failure
names the schedule that reproduces it.
"""

from collections.abc import Callable
from typing import Any

from mpmd import checking


def assert_schedule_independent(
  f: Callable[..., Any], *args, schedules: int = 20, seed: int = 0, **kwargs
) -> checking.Report:
  """Explores ``schedules`` schedules of ``f(*args, **kwargs)``'s launches
  and raises ``AssertionError`` listing every failure (deadlocks, races,
  uninitialised reads, leftovers, out-of-bounds accesses, outputs that
  depend on the schedule), each with a schedule for ``mpmd.replay``.

  Example (a kernel that signals a semaphore nobody waits for)::

    >>> def kernel(x_hbm, o_hbm, sem):
    ...   pltpu.sync_copy(x_hbm, o_hbm)
    ...   pl.semaphore_signal(sem, 1)
    >>> f = mpmd.mpmd_map(
    ...     [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    ...     jax.ShapeDtypeStruct((8, 128), jnp.float32),
    ...     scratch_types=[pltpu.SemaphoreType.REGULAR])
    >>> mpmd.testing.assert_schedule_independent(
    ...     f, jnp.ones((8, 128), jnp.float32), schedules=2)
    Traceback (most recent call last):
    AssertionError: ... leftover ...
  """
  report = checking.explore(f, *args, schedules=schedules, seed=seed, **kwargs)
  if report.failures:
    raise AssertionError(
      f"{getattr(f, '__name__', f)} depends on the schedule: {report}"
    )
  return report
