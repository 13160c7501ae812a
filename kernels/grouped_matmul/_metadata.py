"""Group metadata as plain JAX, computed before the kernel: column strips,
the rows each group owns, and the visit lists that drive the pipelines."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class _Strip(NamedTuple):
  """A static slice of one dimension, tiled by ``block``."""

  start: int
  size: int
  block: int


def split_strips(size: int, block: int) -> tuple[_Strip, ...]:
  """Whole tiles first, then the ragged remainder as its own strip."""
  main = size // block * block
  strips = []
  if main:
    strips.append(_Strip(0, main, block))
  if size > main:
    strips.append(_Strip(main, size - main, size - main))
  return tuple(strips)


def group_rows(
  group_sizes: jax.Array, group_offset: jax.Array, num_local: int, m: int
) -> tuple[jax.Array, jax.Array]:
  """[lo, hi) rows of the local groups ``offset .. offset + num_local``.

  As in ``jax.lax.ragged_dot``, group ``i`` is the rows of
  ``[sum(sizes[:i]), sum(sizes[:i+1]))`` that exist (``< m``). Traced sizes
  cannot be checked, and after a negative one these ranges overlap, where
  ragged_dot adds the products of every group holding a row: here a row
  belongs to the first group holding it, so that groups stay disjoint and
  in order (what the visit lists need), and equal ragged_dot's wherever its
  groups do not overlap.
  """
  ends = jnp.clip(
    lax.cummax(jnp.cumsum(group_sizes, dtype=jnp.int32), axis=0), 0, m
  )
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  lo = lax.dynamic_slice_in_dim(starts, group_offset, num_local)
  hi = lax.dynamic_slice_in_dim(ends, group_offset, num_local)
  return lo, hi


class _GmmMeta(NamedTuple):
  """Offsets of the fields packed into the flat SMEM metadata array."""

  size: int  # visits the arrays can hold (a static bound)

  @property
  def tile(self):  # row tile of the visit
    return 1

  @property
  def group(self):  # local group (rhs expert) of the visit
    return 1 + self.size

  @property
  def lo(self):  # first row of the visit's group (lo == hi: no work)
    return 1 + 2 * self.size

  @property
  def hi(self):
    return 1 + 3 * self.size

  @property
  def first(self):  # 1 on the first visit of a row tile (gmm) or group
    return 1 + 4 * self.size

  @property
  def last(self):  # 1 on the last visit of a group (tgmm)
    return 1 + 5 * self.size

  @property
  def length(self):
    return 1 + 6 * self.size


def gmm_metadata(
  group_sizes: jax.Array,
  group_offset: jax.Array,
  *,
  m: int,
  tm: int,
  num_local: int,
) -> tuple[jax.Array, _GmmMeta]:
  """Visit list for ``gmm``: (tile, group) pairs plus untouched tiles.

  The local groups cover one contiguous row range; their tiles are visited
  group by group (a tile straddling a boundary once per group, consecutively)
  and the tiles before and after that range once each with no work, so each
  output tile is initialised (zeros or ``existing_out``) exactly once.
  Element 0 is the number of visits; the rest is laid out by ``_GmmMeta``.
  """
  tiles_m = m // tm
  # Straddle tiles add at most one visit per group boundary.
  layout = _GmmMeta(size=tiles_m + num_local - 1)
  lo, hi = group_rows(group_sizes, group_offset, num_local, m)
  nonempty = hi > lo
  first_tile = lo // tm
  count = jnp.where(nonempty, (hi - 1) // tm - first_tile + 1, 0)
  cum = jnp.cumsum(count, dtype=jnp.int32)
  group_visits = cum[-1]
  has_rows = hi[-1] > lo[0]
  t0 = jnp.where(has_rows, lo[0] // tm, tiles_m)
  t1 = jnp.where(has_rows, (hi[-1] - 1) // tm, tiles_m - 1)
  num_visits = t0 + group_visits + (tiles_m - 1 - t1)

  v = jnp.arange(layout.size, dtype=jnp.int32)
  u = v - t0
  j = jnp.searchsorted(cum, u, side="right").astype(jnp.int32)
  j = jnp.clip(j, 0, num_local - 1)
  before = v < t0
  working = jnp.logical_and(u >= 0, u < group_visits)
  tile = jnp.where(
    before,
    v,
    jnp.where(
      working, first_tile[j] + u - (cum[j] - count[j]), t1 + 1 + u - cum[-1]
    ),
  )
  tile = jnp.clip(tile, 0, tiles_m - 1)
  # Visits without work still name an expert (its block is fetched and
  # unused); the neighbouring one avoids refetching a different block.
  group = jnp.where(before, 0, jnp.where(working, j, num_local - 1))
  row_lo = jnp.where(working, lo[j], 0)
  row_hi = jnp.where(working, hi[j], 0)
  prev_tile = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tile[:-1]])
  first = (tile != prev_tile).astype(jnp.int32)
  last = jnp.zeros_like(first)
  meta = jnp.concatenate(
    [num_visits[None], tile, group, row_lo, row_hi, first, last]
  )
  return meta.astype(jnp.int32), layout


def tgmm_metadata(
  group_sizes: jax.Array,
  group_offset: jax.Array,
  *,
  m: int,
  tm: int,
  num_local: int,
) -> tuple[jax.Array, _GmmMeta]:
  """Visit list for ``tgmm``: every local group, its row tiles in order.

  An empty group gets one visit with no work, so its output block is
  written (zeros, or ``existing_out``).
  """
  tiles_m = m // tm
  layout = _GmmMeta(size=tiles_m + num_local)
  lo, hi = group_rows(group_sizes, group_offset, num_local, m)
  nonempty = hi > lo
  first_tile = jnp.minimum(lo // tm, tiles_m - 1)
  count = jnp.where(nonempty, (hi - 1) // tm - first_tile + 1, 1)
  cum = jnp.cumsum(count, dtype=jnp.int32)

  v = jnp.arange(layout.size, dtype=jnp.int32)
  j = jnp.searchsorted(cum, v, side="right").astype(jnp.int32)
  j = jnp.clip(j, 0, num_local - 1)
  start = cum[j] - count[j]
  tile = jnp.clip(first_tile[j] + v - start, 0, tiles_m - 1)
  row_lo = jnp.where(nonempty[j], lo[j], 0)
  row_hi = jnp.where(nonempty[j], hi[j], 0)
  first = (v == start).astype(jnp.int32)
  last = (v == cum[j] - 1).astype(jnp.int32)
  meta = jnp.concatenate([cum[-1:], tile, j, row_lo, row_hi, first, last])
  return meta.astype(jnp.int32), layout


def row_mask(row0, lo, hi, shape, dim):
  rows = row0 + lax.broadcasted_iota(jnp.int32, shape, dim)
  return jnp.logical_and(rows >= lo, rows < hi)
