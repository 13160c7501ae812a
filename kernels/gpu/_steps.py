"""Grids and steps of the GPU pipelines: grid checks, step counts, SMEM slot
counts, unravelled step indices, static-or-traced conditions."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
import numpy as np
from jax import lax
from typing_extensions import TypeIs

# A grid entry: a static size or a traced int32 scalar.
GridEntry = int | jax.Array


def check_grid(where: str, grid: Any) -> tuple[GridEntry, ...]:
  """Static entries as ints, traced ones as int32 scalars."""
  if isinstance(grid, (int, np.integer)) and not isinstance(grid, bool):
    grid = (grid,)
  if not isinstance(grid, (tuple, list)):
    raise TypeError(
      f"{where}: expected 'grid' as a tuple of ints or int32 scalars, got "
      f"{type(grid).__name__}"
    )
  checked: list[GridEntry] = []
  for g in grid:
    if isinstance(g, bool):
      raise TypeError(
        f"{where}: expected 'grid' entries as ints or int32 scalars, got "
        f"the bool {g}"
      )
    if isinstance(g, (int, np.integer)):
      if g <= 0:
        raise ValueError(
          f"{where}: expected 'grid' of positive ints, got {tuple(grid)} "
          "(upstream: All elements in the grid must be strictly positive)"
        )
      checked.append(int(g))
      continue
    dtype = getattr(g, "dtype", None)
    if (
      dtype is None
      or np.shape(g) != ()
      or not jnp.issubdtype(dtype, jnp.integer)
    ):
      raise TypeError(
        f"{where}: expected 'grid' entries as ints or integer scalars, got "
        f"{g!r}"
      )
    checked.append(lax.convert_element_type(g, jnp.int32))
  return tuple(checked)


def is_static(value: Any) -> TypeIs[int]:
  return isinstance(value, int)


def i32(value: GridEntry) -> jax.Array:
  return jnp.int32(value) if is_static(value) else value


def count_steps(grid: tuple[GridEntry, ...]) -> GridEntry:
  """The number of steps: an int for a static grid, else an int32 scalar."""
  if all(map(is_static, grid)):
    return math.prod(grid)
  return functools.reduce(lax.mul, map(i32, grid))


def slot_count(max_concurrent_steps: int, num_steps: GridEntry) -> int:
  # Fewer slots than steps in flight when a static grid is short: SMEM is
  # scarce. A traced grid may be long, so it gets every slot.
  if is_static(num_steps):
    return min(max_concurrent_steps, num_steps)
  return max_concurrent_steps


def unravel(step: jax.Array, grid: tuple[GridEntry, ...]):
  """Grid indices (row-major, int32) of the linear ``step``."""
  indices = []
  for size in reversed(grid):
    indices.append(lax.rem(step, i32(size)))
    step = lax.div(step, i32(size))
  return tuple(reversed(indices))


def any_steps(num_steps: GridEntry) -> bool | jax.Array:
  """Whether the grid has a step (always, for a static grid)."""
  return True if is_static(num_steps) else num_steps > 0


def when(condition: bool | jax.Array, fn: Callable[[], None]) -> None:
  """``pl.when`` that folds a static condition at trace time."""
  if isinstance(condition, (bool, np.bool_)):
    if condition:
      fn()
  else:
    pl.when(condition)(fn)


def run_once(where: str, compute_context, loop) -> Any:
  """Calls ``compute_context(run)``, checking that it runs ``loop`` once."""
  calls = []

  def run(init_carry):
    if calls:
      raise ValueError(
        f"{where}: compute_context must run the pipeline exactly once, got "
        "a second call"
      )
    calls.append(True)
    return loop(init_carry)

  compute_context(run)
  if not calls:
    raise ValueError(
      f"{where}: compute_context must run the pipeline exactly once, got no "
      "call"
    )
