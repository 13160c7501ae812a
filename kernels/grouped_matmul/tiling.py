"""Tile sizes of the grouped matmuls: per-platform defaults, user tilings
checked against the operands."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mpmd import targets

Tiling = tuple[int, int, int]


TilingFn = Callable[[int, int, int], Tiling | None]


# TPU default, megablox's: a (128, 128) f32 accumulator and two 128-wide
# operand blocks are small enough for every TPU generation's VMEM with double
# buffering, and 128 is the MXU / lane width.
_TPU_TILING: Tiling = (128, 128, 128)


# Mosaic blocks span whole (8, 128) vreg tiles in their last two dimensions.
_TPU_SUBLANES = 8


def default_tiling(
  m: int, k: int, n: int, *, platform: str | None = None
) -> Tiling | None:
  """The tiles of ``gmm``/``tgmm`` with ``tiling=None``, per platform.

  On TPU, megablox's tiles: what ``implementation="tiled"`` runs with on
  every platform. Elsewhere None: there the default implementation is
  ``"windows"``, which runs no tiles but, per group, a dot per whole chunk
  of its rows and one over a tail window
  (``mpmd.kernels.grouped_matmul._windows``).

  Args:
    m: rows of ``lhs`` (the grouped dimension).
    k: contraction size of ``gmm`` (an output dimension of ``tgmm``).
    n: output columns.
    platform: ``"tpu"``, ``"cpu"``, ...; defaults to the current target (the
      abstract device of ``mpmd.tpu_target`` when cross-lowering, else the
      default backend).

  Returns:
    ``(tm, tk, tn)``, clipped to the problem and with ``tm`` dividing ``m``;
    or None off TPU.

  Example:
    >>> default_tiling(1024, 512, 512, platform="tpu")
    (128, 128, 128)
    >>> default_tiling(1024, 512, 512, platform="cpu") is None
    True
  """
  platform = targets.platform() if platform is None else platform
  if platform != "tpu":
    return None
  tm, tk, tn = _TPU_TILING
  return (_largest_divisor_tile(m, tm), min(tk, k), min(tn, n))


def _largest_divisor_tile(m: int, tm: int) -> int:
  """The largest multiple of 8 that divides m and is <= tm, else m."""
  if m <= tm:
    return m
  for t in range(tm - tm % _TPU_SUBLANES, 0, -_TPU_SUBLANES):
    if m % t == 0:
      return t
  return m


def resolve_tiling(
  name: str,
  tiling: Tiling | TilingFn,
  m: int,
  k: int,
  n: int,
) -> Tiling:
  """A user's ``tiling`` (a tuple or a function) checked against the
  operands."""
  if callable(tiling):
    got = tiling(m, k, n)
    if got is None:
      raise ValueError(
        f"{name}: the 'tiling' function returned None for (m, k, n) = "
        f"({m}, {k}, {n}); return a (tm, tk, tn) tuple, or pass "
        "tiling=None for the default"
      )
    tiling = got
  if (
    not isinstance(tiling, tuple | list)
    or len(tiling) != 3
    or not all(isinstance(t, int | np.integer) for t in tiling)
  ):
    raise TypeError(
      f"{name}: expected 'tiling' to be a tuple (tm, tk, tn) of 3 ints, a "
      f"function (m, k, n) -> tiling, or None; got {tiling!r}"
    )
  tm, tk, tn = (int(t) for t in tiling)
  if min(tm, tk, tn) <= 0:
    raise ValueError(
      f"{name}: expected positive 'tiling' sizes, got {(tm, tk, tn)}"
    )
  # A tile larger than its dimension is the whole dimension.
  tm, tk, tn = min(tm, m), min(tk, k), min(tn, n)
  if m % tm:
    raise ValueError(
      f"{name}: expected the row tile tm={tm} of 'tiling' to divide m={m} "
      f"(K and N may be ragged, M may not); try tm={_divisor_hint(m, tm)}"
    )
  if targets.platform() == "tpu" and tm != m and tm % _TPU_SUBLANES:
    raise ValueError(
      f"{name}: expected the row tile tm={tm} of 'tiling' to be a multiple "
      f"of {_TPU_SUBLANES} (TPU sublanes) or all m={m} rows"
    )
  return tm, tk, tn


def _divisor_hint(m: int, tm: int) -> int:
  """A row tile that divides ``m`` and that a TPU takes too (a multiple of
  its sublanes, else all ``m`` rows): the largest up to ``tm``, else the
  smallest above."""
  fits = [d for d in range(_TPU_SUBLANES, m, _TPU_SUBLANES) if m % d == 0]
  below = [d for d in fits if d <= tm]
  return max(below) if below else min(fits, default=m)
