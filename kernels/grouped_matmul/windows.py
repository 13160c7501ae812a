"""The CPU fallback's schedule of ``gmm`` / ``tgmm``: one dot per group.

A tiled kernel runs one small dot per (row tile, group) visit, and a tile
that straddles a group boundary is computed once per group that owns rows
of it; on CPU, where every visit is a loop iteration around an XLA dot,
that measured 2-3x one dense matmul of the same FLOPs on MoE-like ragged
groups. Here each group's rows ``[lo, hi)`` are covered by *one* window:
the smallest of a few static sizes (``window_sizes``: 8, 12, 16, 24, 32,
...; at most 1.5x the group's rows) that holds them, moved back from
the end of the array if it would run past it. The kernel loops over the
local groups and switches to the window size's branch, which copies the
window, runs one dot and keeps only the group's rows: rows of the window
outside the group are dropped from gmm's store and zeroed in both of
tgmm's operands (other groups' rows may hold inf). A window's buffers are
scoped to its branch: buffers that every branch saw would be carried (and
copied) through each of them.

The TPU keeps the tiled megablox kernels (``kernels.py``); this schedule
runs where the target is not a TPU and ``tiling=None``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mpmd import _jax
from mpmd.api import mpmd_map
from mpmd.kernels import _common
from mpmd.kernels.grouped_matmul.checks import input_dtype
from mpmd.kernels.grouped_matmul.kernels import (
  EXISTING_OUT_INDEX,
  GmmConfig,
  TgmmConfig,
)
from mpmd.kernels.grouped_matmul.metadata import group_rows, row_mask


def window_sizes(m: int) -> tuple[int, ...]:
  """Static window sizes for ``m`` rows: 2**j and 3 * 2**j from 8 up, and m.

  Consecutive sizes differ by at most 1.5x, so a group computes at most
  half again its rows (about a fifth more on average), with one compiled
  branch per size (15 for m=1024). Sizes 1.25x apart measured 5-10% faster
  in f32 and compiled twice as slowly.

  Example:
    >>> window_sizes(64)
    (8, 12, 16, 24, 32, 48, 64)
  """
  sizes = {m}
  size = 8
  while size < m:
    sizes.update(s for s in (size, size * 3 // 2) if s < m)
    size *= 2
  return tuple(sorted(sizes))


class _Windows(NamedTuple):
  """Per local group: its rows and the window that covers them."""

  lo: jax.Array  # (num_local,) int32: first row of the group
  hi: jax.Array  # (num_local,) int32: one past its last row (lo == hi: empty)
  # (num_local,) int32: index into window_sizes(m); len(window_sizes(m))
  # for an empty group.
  size: jax.Array
  start: jax.Array  # (num_local,) int32: first row of the window


def _windows(
  group_sizes: jax.Array, group_offset: jax.Array, num_local: int, m: int
) -> jax.Array:
  """The flat int32 metadata ``(lo, hi, size, start)``, ``num_local`` each."""
  lo, hi = group_rows(group_sizes, group_offset, num_local, m)
  sizes = jnp.asarray(window_sizes(m), jnp.int32)
  size = jnp.searchsorted(sizes, hi - lo, side="left").astype(jnp.int32)
  start = jnp.minimum(lo, m - sizes[size])
  # An empty group's size index is one past the window sizes.
  size = jnp.where(hi > lo, size, len(sizes))
  return jnp.concatenate([lo, hi, size, start]).astype(jnp.int32)


def _unpack(meta_ref, num_local: int, g) -> _Windows:
  return _Windows(*(meta_ref[i * num_local + g] for i in range(4)))


def _for_each_group(num_local: int, body) -> None:
  def step(g, carry):
    body(g)
    return carry

  lax.fori_loop(0, num_local, step, 0)


def _dot(x, w, contract_w: int, in_dtype):
  return lax.dot_general(
    x.astype(in_dtype),
    w.astype(in_dtype),
    (((1,), (contract_w,)), ((), ())),
    preferred_element_type=jnp.float32,
  )


def gmm_windows_call(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  existing_out: jax.Array | None,
  cfg: GmmConfig,
) -> jax.Array:
  """``gmm`` as one window dot per local group (see the module docstring);
  ``cfg.tiling`` and ``cfg.buffer_count`` are unused.

  The output starts as ``existing_out`` (zeros when None), so rows outside
  the local groups keep it; each group overwrites only its own rows.
  """
  m, k = lhs.shape
  num_local = rhs.shape[0]
  n = rhs.shape[1] if cfg.transpose_rhs else rhs.shape[2]
  out_dtype = cfg.preferred_element_type
  in_dtype = input_dtype(lhs, rhs)
  sizes = window_sizes(m)
  meta = _windows(group_sizes, group_offset, num_local, m)
  if existing_out is None:
    existing_out = jnp.zeros((m, n), out_dtype)
  varying = _common.varying_axes(lhs, rhs, group_sizes, group_offset)
  # The output is written in place of existing_out: their types must match.
  varying |= _common.varying_axes(existing_out)
  existing_out = _common.vary(existing_out, varying)

  def kernel(meta_hbm, lhs_ref, rhs_ref, _, out_ref, meta_ref, w):
    pltpu.sync_copy(meta_hbm, meta_ref)

    def group(g):
      win = _unpack(meta_ref, num_local, g)

      @_scoped(lambda rows: [((rows, k), lhs.dtype), ((rows, n), out_dtype)])
      def window(rows: int, x_win, y_win):
        rows_hbm = pl.ds(win.start, rows)
        pltpu.sync_copy(lhs_ref.at[rows_hbm], x_win)
        pltpu.sync_copy(out_ref.at[rows_hbm], y_win)
        part = _dot(x_win[...], w[...], 1 if cfg.transpose_rhs else 0, in_dtype)
        mask = row_mask(win.start, win.lo, win.hi, (rows, n), 0)
        y_win[...] = jnp.where(mask, part.astype(out_dtype), y_win[...])
        pltpu.sync_copy(y_win, out_ref.at[rows_hbm])

      @pl.when(win.lo < win.hi)
      def _():
        pltpu.sync_copy(rhs_ref.at[g], w)
        _switch(win.size, [functools.partial(window, s) for s in sizes])

    _for_each_group(num_local, group)

  w_shape = (n, k) if cfg.transpose_rhs else (k, n)
  call = mpmd_map(
    [(_common.single_core_mesh(), kernel)],
    out_types=_common.out_type((m, n), out_dtype, varying),
    input_output_aliases={EXISTING_OUT_INDEX: 0},
    scratch_types=[
      pltpu.SMEM(meta.shape, jnp.int32),
      pltpu.VMEM(w_shape, rhs.dtype),
    ],
    interpret=cfg.interpret,
    cost_estimate=_cost(lhs, rhs, m * k * n, m * n * out_dtype.itemsize * 2),
    name="gmm",
  )
  return call(meta, lhs, rhs, existing_out)


def tgmm_windows_call(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  existing_out: jax.Array | None,
  cfg: TgmmConfig,
) -> jax.Array:
  """``tgmm`` as one window dot per local group (see the module docstring):
  ``out[g] = lhs[:, window] @ rhs[window]`` with rows outside the group
  zeroed in both operands, plus ``existing_out[g]``."""
  k, m = lhs.shape
  n = rhs.shape[1]
  num_local = cfg.num_actual_groups
  out_dtype = cfg.preferred_element_type
  in_dtype = input_dtype(lhs, rhs)
  sizes = window_sizes(m)
  meta = _windows(group_sizes, group_offset, num_local, m)
  has_existing = existing_out is not None
  operands = [meta, lhs, rhs] + ([existing_out] if has_existing else [])

  def kernel(meta_hbm, lhs_ref, rhs_ref, *refs):
    *_, out_ref, meta_ref, o = refs
    pltpu.sync_copy(meta_hbm, meta_ref)

    def group(g):
      win = _unpack(meta_ref, num_local, g)
      in_group = functools.partial(row_mask, win.start, win.lo, win.hi)
      if has_existing:
        # out_ref starts as existing_out (aliased).
        pltpu.sync_copy(out_ref.at[g], o)

      @_scoped(lambda rows: [((k, rows), lhs.dtype), ((rows, n), rhs.dtype)])
      def window(rows: int, x, r):
        rows_hbm = pl.ds(win.start, rows)
        pltpu.sync_copy(lhs_ref.at[:, rows_hbm], x)
        pltpu.sync_copy(rhs_ref.at[rows_hbm], r)
        xs = jnp.where(in_group((k, rows), 1), x[...], _zero(lhs))
        rs = jnp.where(in_group((rows, n), 0), r[...], _zero(rhs))
        part = _dot(xs, rs, 0, in_dtype)
        if has_existing:
          part += o[...].astype(jnp.float32)
        o[...] = part.astype(out_dtype)

      def empty():
        if not has_existing:
          o[...] = jnp.zeros_like(o)

      # The last branch is the empty group's. The branches write o, stored
      # after the switch: a switch that updated the whole output would copy
      # it on jax 0.10.2 (see _switch), and a pl.when per size measured
      # slower than copying o there.
      lax.switch(
        win.size, [functools.partial(window, s) for s in sizes] + [empty]
      )
      pltpu.sync_copy(o, out_ref.at[g])

    _for_each_group(num_local, group)

  out_bytes = num_local * k * n * out_dtype.itemsize
  call = mpmd_map(
    [(_common.single_core_mesh(), kernel)],
    out_types=_common.out_type(
      (num_local, k, n), out_dtype, _common.varying_axes(*operands)
    ),
    input_output_aliases={EXISTING_OUT_INDEX: 0} if has_existing else {},
    scratch_types=[
      pltpu.SMEM(meta.shape, jnp.int32),
      pltpu.VMEM((k, n), out_dtype),
    ],
    interpret=cfg.interpret,
    cost_estimate=_cost(
      lhs, rhs, m * k * n, out_bytes * (2 if has_existing else 1)
    ),
    name="tgmm",
  )
  return call(*operands)


def _scoped(buffers):
  """Runs ``fn(arg)`` with VMEM buffers ``buffers(arg)`` (shape, dtype
  pairs) allocated for the call only: a window's buffers stay local to its
  switch branch."""

  def wrap(fn):
    def run(arg):
      scratch = [pltpu.VMEM(shape, dtype) for shape, dtype in buffers(arg)]
      pl.run_scoped(functools.partial(fn, arg), *scratch)

    return run

  return wrap


def _switch(index, branches) -> None:
  """Runs ``branches[index]()`` (no operands, refs closed over): one
  ``lax.switch``, or, where XLA would copy the buffers it updates
  (``_jax.SWITCH_COPIES_UPDATED_BUFFERS``), a ``pl.when`` per branch."""
  if not _jax.SWITCH_COPIES_UPDATED_BUFFERS:
    lax.switch(index, branches)
    return
  for i, branch in enumerate(branches):
    pl.when(index == i)(branch)


def _zero(x: jax.Array) -> jax.Array:
  return jnp.zeros((), x.dtype)


def _cost(lhs, rhs, macs: int, out_bytes: int) -> pl.CostEstimate:
  return pl.CostEstimate(
    flops=2 * macs,
    transcendentals=0,
    bytes_accessed=int(
      lhs.size * lhs.dtype.itemsize + rhs.size * rhs.dtype.itemsize + out_bytes
    ),
  )
