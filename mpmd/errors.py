"""The errors a launch raises on the CPU fallback, where hardware would fail.

Each is an ``mpmd.LaunchError``, itself a ``jax.errors.JaxRuntimeError``, so
code that catches JAX's runtime errors keeps working. How they reach the
caller through XLA is in ``lowering/errors.py`` (``typed_errors``).
"""

import jax


class LaunchError(jax.errors.JaxRuntimeError):
  """A launch failed on the CPU fallback the way it would fail on hardware.

  Attributes:
    schedule: on the checking executor, the schedule string under which it
      failed (``mpmd.replay(f, *args, schedule=error.schedule)`` runs that
      schedule again); None elsewhere.
  """

  schedule: str | None = None


class DeadlockError(LaunchError):
  """A simulated program waited longer than the deadlock timeout."""


class RaceError(LaunchError):
  """A simulator's race detector saw two programs race on a buffer."""


class OutOfBoundsError(LaunchError, IndexError):
  """A DMA's window reached past its buffer (hardware would fault).

  Also an ``IndexError``, as the simulators' own out-of-bounds reports are.
  A window fixed in the kernel fails when the kernel is traced, with a
  ``StaticOutOfBoundsError``.
  """


class StaticOutOfBoundsError(OutOfBoundsError, ValueError):
  """A window fixed in the kernel leaves its Ref: found when the kernel is
  traced. Also a ``ValueError``, as JAX's own indexing check reports it."""


class UninitializedError(LaunchError):
  """A program read memory that nothing wrote (uninitialised scratch or
  output, or the window of a DMA that has not landed yet)."""


class DebugCheckError(LaunchError):
  """A kernel's ``pl.debug_check`` failed while ``pl.enable_debug_checks``
  was on (Mosaic lowers such a check to an assertion on hardware; with the
  setting off it is no check at all, on every path)."""


class LeftoverError(LaunchError):
  """A launch (or a ``run_scoped`` scope) ended with work outstanding: a
  semaphore not back to zero, or a DMA nobody waited for."""


class NondeterminismError(LaunchError):
  """The outputs depend on the schedule: two schedules of the same launch,
  with the same inputs, returned different bytes."""
