"""``implementation="windows"`` of ``gmm`` / ``tgmm`` (the CPU fallback's
default): whole chunks of each group's rows, then one tail window.

A tiled kernel runs one small dot per (row tile, group) visit, and a tile
that straddles a group boundary is computed once per group that owns rows
of it; on CPU, where every visit is a loop iteration around an XLA dot,
that measured 2-3x one dense matmul of the same FLOPs on MoE-like ragged
groups. Here the kernel loops over the local groups, and a group's rows
``[lo, hi)`` run as

* whole chunks of ``chunk`` rows (256, or all rows when fewer), in a loop:
  exactly the group's rows, so no mask, and big enough that an XLA:CPU dot
  runs at the dense dot's rate per row;
* then the rest, if any, as one *tail window*: the smallest multiple of a
  step (``chunk / 16`` rounded up to whole sublanes of 8) that holds it,
  moved back from the end of the array if it would run past it, chosen by
  a switch with one branch per size. Rows of the window outside the group
  are dropped from gmm's store and zeroed in both of tgmm's operands
  (other groups' rows may hold inf).

A group computes fewer than a step's rows more than it owns (at most 15),
the switch has at most 16 branches whatever ``m``, and no buffer holds
more than a chunk of rows. A window's buffers are scoped to its branch:
buffers that every branch saw would be carried (and copied) through each
of them. tgmm runs the tail first, so that a group of fewer rows than a
chunk (most of them) stores its one product with no zeros to add it to.

The TPU runs the tiled megablox kernels (``_kernels.py``,
``implementation="tiled"``); this one runs by default where the target is
not a TPU and no ``tiling`` is given, and wherever it is named.
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
from mpmd.kernels.grouped_matmul._checks import input_dtype
from mpmd.kernels.grouped_matmul._kernels import (
  EXISTING_OUT_INDEX,
  GmmConfig,
  TgmmConfig,
)
from mpmd.kernels.grouped_matmul._metadata import group_rows, row_mask

# Rows of a whole chunk. On XLA:CPU (jax 0.12, 2 cores, k=n=512) a dot of
# 256 rows takes about 1.25x the dense 1024-row dot's time per row, and one
# of 64-128 rows 1.1-1.7x; chunks of 512 rows measured no faster, and
# windows of up to two chunks (one dot for a group of 257-512 rows) no
# faster either, side by side, while the kernels took 1.4-1.5x as long to
# compile.
CHUNK = 256

# Tail window sizes per chunk: the tail computes fewer than chunk / TAILS
# rows it does not own (a sixteenth of a chunk), with one switch branch per
# size.
TAILS = 16

# Tail windows grow in steps of at least this many rows (a full chunk's
# step). Each size is a switch branch holding its own dots, and XLA:CPU's
# compile time grows with the branches (a gmm of 128 rows and 32 groups,
# jax 0.12: about 8 s to trace, lower and compile with 16 sizes, 5 s with
# 8), while the rows a tail computes twice cost little below a chunk.
MIN_STEP = 16


class Schedule(NamedTuple):
  """The static part of the schedule for ``m`` rows."""

  chunk: int  # rows of a whole chunk
  tails: tuple[int, ...]  # tail window sizes, increasing; the last is chunk


def schedule(m: int) -> Schedule:
  """The chunk and tail window sizes for ``m`` rows.

  Example:
    >>> schedule(1024).chunk, schedule(1024).tails[:3]
    (256, (16, 32, 48))
    >>> schedule(40)
    Schedule(chunk=40, tails=(16, 32, 40))
  """
  chunk = min(CHUNK, m)
  # Whole sublanes, at most TAILS sizes, at least MIN_STEP rows apart.
  step = max(8 * -(-chunk // (8 * TAILS)), MIN_STEP)
  return Schedule(chunk, (*range(step, chunk, step), chunk))


class Group(NamedTuple):
  """Per local group: its rows, whole chunks and tail window."""

  lo: jax.Array  # (num_local,) int32: first row of the group
  hi: jax.Array  # (num_local,) int32: one past its last row (lo == hi: empty)
  chunks: jax.Array  # (num_local,) int32: whole chunks, from lo
  first: jax.Array  # (num_local,) int32: the first row after them
  # (num_local,) int32: index into the tail sizes; len(tails) for no tail.
  tail: jax.Array
  start: jax.Array  # (num_local,) int32: first row of the tail window


def group_windows(
  group_sizes: jax.Array,
  group_offset: jax.Array,
  num_local: int,
  m: int,
  plan: Schedule,
) -> Group:
  """Where each local group's whole chunks and tail window lie.

  Args:
    group_sizes: (num_groups,) int32, the rows of each group, in order.
    group_offset: () int32, the first local group.
    num_local: the local groups, ``group_offset`` on.
    m: rows of the array.
    plan: ``schedule(m)``.

  Returns:
    A ``Group`` of (num_local,) int32 arrays. The tail window of group ``g``
    holds ``plan.tails[tail[g]]`` rows from ``start[g]`` and contributes
    rows ``[first[g], hi[g])``.

  Example:
    >>> from mpmd.kernels.grouped_matmul import _windows as windows
    >>> sizes = jnp.array([300, 0, 20], jnp.int32)
    >>> g = windows.group_windows(sizes, jnp.int32(0), 3, 320,
    ...                           windows.schedule(320))
    >>> [int(x) for x in g.chunks], [int(x) for x in g.first]
    ([1, 0, 0], [256, 300, 300])

    Group 0's 44 remaining rows run in a window of 48 from row 256; group
    2's 20 rows in one of 32, moved back to end at row 320:

    >>> tails = windows.schedule(320).tails
    >>> [(tails[int(g.tail[i])], int(g.start[i])) for i in (0, 2)]
    [(48, 256), (32, 288)]
  """
  lo, hi = group_rows(group_sizes, group_offset, num_local, m)
  chunks = (hi - lo) // plan.chunk
  first = lo + chunks * plan.chunk  # the tail's first row
  tails = jnp.asarray(plan.tails, jnp.int32)
  tail = jnp.searchsorted(tails, hi - first, side="left").astype(jnp.int32)
  start = jnp.minimum(first, m - tails[jnp.minimum(tail, len(tails) - 1)])
  tail = jnp.where(hi > first, tail, len(tails))
  return Group(lo, hi, chunks, first, tail, start)


def _metadata(group_sizes, group_offset, num_local, m, plan) -> jax.Array:
  """The flat int32 metadata: ``Group``'s fields, ``num_local`` each."""
  fields = group_windows(group_sizes, group_offset, num_local, m, plan)
  return jnp.concatenate(fields).astype(jnp.int32)


def _unpack(meta_ref, num_local: int, g) -> Group:
  fields = len(Group._fields)
  return Group(*(meta_ref[i * num_local + g] for i in range(fields)))


def _for_each(count, body) -> None:
  """``body(i)`` for ``i`` in ``range(count)`` (``count`` static or traced)."""

  def step(i, carry):
    body(i)
    return carry

  lax.fori_loop(0, count, step, 0)


def _dot(x, w, contract_w: int, in_dtype):
  return lax.dot_general(
    x.astype(in_dtype),
    w.astype(in_dtype),
    (((1,), (contract_w,)), ((), ())),
    preferred_element_type=jnp.float32,
  )


def _as_laid_out(*operands: jax.Array) -> tuple[jax.Array, ...]:
  """The operands as the kernel reads them, behind an optimization barrier
  where they hold 16-bit floats.

  Otherwise XLA:CPU folds a transpose that made an operand (tgmm of
  ``lhs.T`` inside a jit, as gmm's VJP calls it) into the dots of the
  windows the kernel slices from it, and its DotThunk cannot run a
  transposed bf16 x bf16 -> f32 dot (UNIMPLEMENTED). Behind the barrier
  the transpose is one copy, before the kernel. Where the CPU fallback
  holds such buffers as 16-bit words (jax 0.10.2, ``lowering/words.py``),
  XLA cannot fold through the bitcasts, and the copy would only cost
  time (gmm's bf16 VJP 1.15-1.2x).
  """
  if _jax.FLOAT16_DYNAMIC_OPS_CONVERT or not any(
    jnp.dtype(x.dtype).itemsize == 2 for x in operands
  ):
    return operands
  return tuple(lax.optimization_barrier(operands))


class _Windows(NamedTuple):
  """What a windows kernel body needs to know, fixed at trace time."""

  plan: Schedule  # ``schedule(m)``
  num_local: int
  k: int  # lhs columns (gmm) or rows (tgmm)
  n: int  # output columns
  lhs_dtype: jnp.dtype
  rhs_dtype: jnp.dtype
  in_dtype: jnp.dtype  # both operands meet in it (``input_dtype``)
  out_dtype: jnp.dtype
  contract_w: int  # gmm: the dimension of rhs[g] that meets lhs's columns
  has_existing: bool  # tgmm: existing_out is added


def _gmm_windows_kernel(p: _Windows):
  """The gmm program: per local group, its chunks, then its tail window."""
  k, n, out_dtype = p.k, p.n, p.out_dtype

  def kernel(meta_hbm, lhs_ref, rhs_ref, _, out_ref, meta_ref, w):
    pltpu.sync_copy(meta_hbm, meta_ref)

    def group(g):
      grp = _unpack(meta_ref, p.num_local, g)

      def part(start, rows: int, x_win):
        """The product of rows [start, start + rows), f32."""
        pltpu.sync_copy(lhs_ref.at[pl.ds(start, rows)], x_win)
        # Each row rounded as in a dot of many rows, whatever the window's
        # size: as the fused MoE kernel's tiles round it.
        return _common.rows_dot(
          x_win[...].astype(p.in_dtype),
          w[...].astype(p.in_dtype),
          p.contract_w,
          jnp.float32,
        )

      @_scoped(lambda rows: [((rows, k), p.lhs_dtype), ((rows, n), out_dtype)])
      def chunks(rows: int, x_win, y_win):
        def chunk(i):
          start = grp.lo + i * rows
          y_win[...] = part(start, rows, x_win).astype(out_dtype)
          pltpu.sync_copy(y_win, out_ref.at[pl.ds(start, rows)])

        _for_each(grp.chunks, chunk)

      @_scoped(lambda rows: [((rows, k), p.lhs_dtype), ((rows, n), out_dtype)])
      def tail(rows: int, x_win, y_win):
        window = pl.ds(grp.start, rows)
        pltpu.sync_copy(out_ref.at[window], y_win)
        mask = row_mask(grp.start, grp.first, grp.hi, (rows, n), 0)
        new = part(grp.start, rows, x_win).astype(out_dtype)
        y_win[...] = jnp.where(mask, new, y_win[...])
        pltpu.sync_copy(y_win, out_ref.at[window])

      @pl.when(grp.lo < grp.hi)
      def _():
        pltpu.sync_copy(rhs_ref.at[g], w)
        chunks(p.plan.chunk)
        _switch(grp.tail, [functools.partial(tail, s) for s in p.plan.tails])

    _for_each(p.num_local, group)

  return kernel


def gmm_windows_call(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  existing_out: jax.Array | None,
  cfg: GmmConfig,
) -> jax.Array:
  """``gmm`` as whole chunks and a tail window per local group (see the
  module docstring); ``cfg.tiling`` and ``cfg.buffer_count`` are unused.

  The output starts as ``existing_out`` (zeros when None), so rows outside
  the local groups keep it; each group overwrites only its own rows.
  """
  m, k = lhs.shape
  num_local = rhs.shape[0]
  n = rhs.shape[1] if cfg.transpose_rhs else rhs.shape[2]
  out_dtype = cfg.preferred_element_type
  windows = _Windows(
    plan=schedule(m),
    num_local=num_local,
    k=k,
    n=n,
    lhs_dtype=lhs.dtype,
    rhs_dtype=rhs.dtype,
    in_dtype=input_dtype(lhs, rhs),
    out_dtype=out_dtype,
    contract_w=1 if cfg.transpose_rhs else 0,
    has_existing=True,  # always aliased (zeros when existing_out is None)
  )
  meta = _metadata(group_sizes, group_offset, num_local, m, windows.plan)
  if existing_out is None:
    existing_out = jnp.zeros((m, n), out_dtype)
  varying = _common.varying_axes(lhs, rhs, group_sizes, group_offset)
  # The output is written in place of existing_out: their types must match.
  varying |= _common.varying_axes(existing_out)
  existing_out = _common.vary(existing_out, varying)
  lhs, rhs = _as_laid_out(lhs, rhs)
  w_shape = (n, k) if cfg.transpose_rhs else (k, n)
  call = mpmd_map(
    [
      (
        _common.single_core_mesh(),
        _common.traced_in_x32(_gmm_windows_kernel(windows)),
      )
    ],
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


def _tgmm_windows_kernel(p: _Windows):
  """The tgmm program: per local group, its tail window, then its chunks."""
  k, n, out_dtype, in_dtype = p.k, p.n, p.out_dtype, p.in_dtype
  has_existing = p.has_existing

  def kernel(meta_hbm, lhs_ref, rhs_ref, *refs):
    # existing_out's input ref (aliased to the output) comes first.
    out_ref, meta_ref, acc, *o = refs[has_existing:]
    o = o[0] if o else acc  # the output's dtype
    pltpu.sync_copy(meta_hbm, meta_ref)

    def group(g):
      grp = _unpack(meta_ref, p.num_local, g)
      if has_existing:
        # out_ref starts as existing_out (aliased).
        pltpu.sync_copy(out_ref.at[g], o)

      def start_with(part):
        """acc = existing_out[g] + part (either may be absent)."""
        if has_existing:
          old = o[...].astype(jnp.float32)
          part = old if part is None else part + old
        acc[...] = jnp.zeros_like(acc) if part is None else part

      def product(x, r, rows_hbm):
        pltpu.sync_copy(lhs_ref.at[:, rows_hbm], x)
        pltpu.sync_copy(rhs_ref.at[rows_hbm], r)
        return x[...], r[...]

      def operand_windows(rows: int):
        return [((k, rows), p.lhs_dtype), ((rows, n), p.rhs_dtype)]

      # The tail first: most groups have no whole chunk, and then its
      # product is the result, with no zeros to add it to.
      @_scoped(operand_windows)
      def tail(rows: int, x, r):
        xs, rs = product(x, r, pl.ds(grp.start, rows))
        in_group = functools.partial(row_mask, grp.start, grp.first, grp.hi)
        xs = jnp.where(in_group((k, rows), 1), xs, _zero(p.lhs_dtype))
        rs = jnp.where(in_group((rows, n), 0), rs, _zero(p.rhs_dtype))
        start_with(_dot(xs, rs, 0, in_dtype))

      _switch(
        grp.tail,
        [functools.partial(tail, s) for s in p.plan.tails],
        otherwise=lambda: start_with(None),
      )

      @_scoped(operand_windows)
      def chunks(rows: int, x, r):
        def chunk(i):
          xs, rs = product(x, r, pl.ds(grp.lo + i * rows, rows))
          acc[...] += _dot(xs, rs, 0, in_dtype)

        _for_each(grp.chunks, chunk)

      chunks(p.plan.chunk)
      if o is acc:
        pltpu.sync_copy(acc, out_ref.at[g])
      else:
        o[...] = acc[...].astype(out_dtype)
        pltpu.sync_copy(o, out_ref.at[g])

    _for_each(p.num_local, group)

  return kernel


def tgmm_windows_call(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  existing_out: jax.Array | None,
  cfg: TgmmConfig,
) -> jax.Array:
  """``tgmm`` as whole chunks and a tail window per local group (see the
  module docstring): ``out[g] = sum over them of lhs[:, rows] @ rhs[rows]``
  in f32, the tail's rows outside the group zeroed in both operands, plus
  ``existing_out[g]``."""
  k, m = lhs.shape
  n = rhs.shape[1]
  num_local = cfg.num_actual_groups
  out_dtype = cfg.preferred_element_type
  has_existing = existing_out is not None
  windows = _Windows(
    plan=schedule(m),
    num_local=num_local,
    k=k,
    n=n,
    lhs_dtype=lhs.dtype,
    rhs_dtype=rhs.dtype,
    in_dtype=input_dtype(lhs, rhs),
    out_dtype=out_dtype,
    contract_w=0,
    has_existing=has_existing,
  )
  meta = _metadata(group_sizes, group_offset, num_local, m, windows.plan)
  lhs, rhs = _as_laid_out(lhs, rhs)
  operands = [meta, lhs, rhs] + ([existing_out] if has_existing else [])
  out_bytes = num_local * k * n * out_dtype.itemsize
  call = mpmd_map(
    [
      (
        _common.single_core_mesh(),
        _common.traced_in_x32(_tgmm_windows_kernel(windows)),
      )
    ],
    out_types=_common.out_type(
      (num_local, k, n), out_dtype, _common.varying_axes(*operands)
    ),
    input_output_aliases={EXISTING_OUT_INDEX: 0} if has_existing else {},
    scratch_types=[
      pltpu.SMEM(meta.shape, jnp.int32),
      pltpu.VMEM((k, n), jnp.float32),
    ]
    + ([] if out_dtype == jnp.float32 else [pltpu.VMEM((k, n), out_dtype)]),
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


def _switch(index, branches, otherwise=lambda: None) -> None:
  """Runs ``branches[index]()`` (no operands, refs closed over), or
  ``otherwise()`` where ``index == len(branches)``: one ``lax.switch``, or,
  where XLA would copy the buffers it updates
  (``_jax.SWITCH_COPIES_UPDATED_BUFFERS``), a ``pl.when`` per branch."""
  if not _jax.SWITCH_COPIES_UPDATED_BUFFERS:
    lax.switch(index, [*branches, otherwise])
    return
  for i, branch in enumerate(branches):
    pl.when(index == i)(branch)
  pl.when(index == len(branches))(otherwise)


def _zero(dtype) -> jax.Array:
  return jnp.zeros((), dtype)


def _cost(lhs, rhs, macs: int, out_bytes: int) -> pl.CostEstimate:
  return pl.CostEstimate(
    flops=2 * macs,
    transcendentals=0,
    bytes_accessed=int(
      lhs.size * lhs.dtype.itemsize + rhs.size * rhs.dtype.itemsize + out_bytes
    ),
  )
