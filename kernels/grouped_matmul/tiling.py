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


# On the CPU fallback every pipeline step is an XLA while-loop iteration with
# a fixed overhead, so whole K and N blocks (one dot per row tile) win; tm
# trades that overhead against the rows computed and masked away in tiles
# that straddle a group boundary (at most one tile per group).
# Measured (bf16, gmm time / dense matmul time, one interleaved run): for
# m=1024, k=n=512, 8 groups tm=64: 1.33, 128: 1.39, 256: 1.84; for m=4096,
# k=768, n=1024, 16 groups tm=128: 1.69, 256: 2.06. The rule below keeps the
# rows wasted in straddle tiles (< tm per group) below m / 2.
_CPU_TM_CANDIDATES = (512, 256, 128, 64, 32, 16, 8)


# Mosaic blocks span whole (8, 128) vreg tiles in their last two dimensions.
_TPU_SUBLANES = 8


def default_tiling(
  m: int, k: int, n: int, *, num_groups: int = 1, platform: str | None = None
) -> Tiling:
  """The tiling ``gmm``/``tgmm`` use when ``tiling=None``.

  Args:
    m: rows of ``lhs`` (the grouped dimension).
    k: contraction size of ``gmm`` (an output dimension of ``tgmm``).
    n: output columns.
    num_groups: number of groups; on CPU it bounds the rows wasted in tiles
      that straddle group boundaries.
    platform: ``"tpu"``, ``"cpu"``, ...; defaults to the current target (the
      abstract device of ``mpmd.tpu_target`` when cross-lowering, else the
      default backend).

  Returns:
    ``(tm, tk, tn)``, clipped to the problem and with ``tm`` dividing ``m``.

  Example:
    >>> default_tiling(1024, 512, 512, num_groups=8, platform="cpu")
    (64, 512, 512)
  """
  platform = targets.platform() if platform is None else platform
  if platform == "tpu":
    tm, tk, tn = _TPU_TILING
    return (_largest_divisor_tile(m, tm), min(tk, k), min(tn, n))
  for tm in _CPU_TM_CANDIDATES:
    if m % tm == 0 and 2 * tm * num_groups <= m:
      return (tm, k, n)
  return (_largest_divisor_tile(m, _CPU_TM_CANDIDATES[-1]), k, n)


def _largest_divisor_tile(m: int, tm: int) -> int:
  """The largest multiple of 8 that divides m and is <= tm, else m."""
  if m <= tm:
    return m
  for t in range(tm - tm % 8, 0, -8):
    if m % t == 0:
      return t
  return m


def resolve_tiling(
  name: str,
  tiling: Tiling | TilingFn | None,
  m: int,
  k: int,
  n: int,
  num_groups: int,
) -> Tiling:
  if tiling is None:
    return default_tiling(m, k, n, num_groups=num_groups)
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
  return max(d for d in range(1, tm + 1) if m % d == 0)
