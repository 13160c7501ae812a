"""Grouped matrix multiplication (``gmm``, ``tgmm``) on ``mpmd_map``.

The mixture-of-experts workhorse: rows of ``lhs`` are sorted by expert
("group"), ``group_sizes[i]`` rows belong to expert ``i``, and each group is
multiplied by its own expert weights. Semantics and arguments follow
megablox (``jax.experimental.pallas.ops.tpu.megablox``); the reference is
``jax.lax.ragged_dot``.

How the kernel works. ``mpmd_map`` has no automatic pipelining: its refs live
in HBM (``ANY``) and the body moves tiles itself. The wrapper turns
``group_sizes`` into a *visit list* (plain JAX, before the kernel): one entry
per (row tile, group) pair that has work, plus one entry for every row tile
that no local group touches, so that every output tile is written exactly
once per column strip and nothing is left uninitialised. The list is copied
into SMEM at the start of the kernel and drives ``pltpu.emit_pipeline``,
whose BlockSpec index maps read it to pick the lhs row tile and the rhs
expert of each step. Tiles that straddle a group boundary are visited once
per group and written under a row mask; consecutive visits of a tile keep
the output block in VMEM.

Ragged edges (K or N not a multiple of the tile) are not left to the
pipeline's out-of-bounds windows, which neither the CPU fallback nor the TPU
simulator can express: the arrays are split into a main part (whole tiles)
and a remainder strip, each a static, in-bounds view with its own block
shape. In ``gmm`` the K remainder is an extra input block accumulated on the
last K step; N remainders (and, in ``tgmm``, K remainders, which are output
dimensions there) run as a second pipeline over the strip.

Per-platform choices (``tiling=None`` and the pipeline depth) follow the
target: the abstract device of ``mpmd.tpu_target`` when cross-lowering,
else the default backend. On TPU: megablox's (128, 128, 128) tiles, two
buffers per operand. On the CPU fallback, where each pipeline step is a loop
iteration and each DMA a copy: whole K and N blocks and one buffer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mpmd import meshes, targets
from mpmd.api import mpmd_map
from mpmd.types import Interpret

__all__ = ["gmm", "tgmm", "default_tiling"]

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

_SUPPORTED_DTYPES = (
  jnp.dtype(jnp.float32),
  jnp.dtype(jnp.bfloat16),
  jnp.dtype(jnp.float16),
)


# ------------------------------------------------------------------- tiling


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


def _resolve_tiling(
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


# --------------------------------------------------------------- validation


def _check_array(name: str, arg: str, x: Any, rank: int, shape_doc: str):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(
      f"{name}: expected '{arg}' to be an array {shape_doc}, got "
      f"{type(x).__name__}"
    )
  if x.ndim != rank:
    raise ValueError(
      f"{name}: expected '{arg}' of rank {rank} {shape_doc}, got rank "
      f"{x.ndim} with shape {tuple(x.shape)}"
    )
  if any(d == 0 for d in x.shape):
    raise ValueError(
      f"{name}: expected '{arg}' {shape_doc} with no zero-sized "
      f"dimension, got shape {tuple(x.shape)}"
    )


def _check_float(name: str, arg: str, x: Any):
  if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
    raise TypeError(
      f"{name}: expected '{arg}' of dtype float32, bfloat16 or float16, "
      f"got {jnp.dtype(x.dtype).name}"
    )


def _check_group_sizes(name: str, group_sizes: Any):
  """Checks the type; a concrete array's sizes must be non-negative (traced
  ones cannot be checked: ``_group_rows`` says what they mean)."""
  _check_array(name, "group_sizes", group_sizes, 1, "(num_groups,)")
  if jnp.dtype(group_sizes.dtype) != jnp.int32:
    raise TypeError(
      f"{name}: expected 'group_sizes' of dtype int32, got "
      f"{jnp.dtype(group_sizes.dtype).name}"
    )
  if not isinstance(group_sizes, jax.Array | np.ndarray):
    return
  try:
    sizes = np.asarray(group_sizes)
  except (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
  ):
    return  # traced
  negative = np.flatnonzero(sizes < 0)
  if negative.size:
    i = int(negative[0])
    raise ValueError(
      f"{name}: expected non-negative 'group_sizes', got "
      f"group_sizes[{i}] = {int(sizes[i])}"
    )


def _check_group_offset(
  name: str, group_offset: Any, num_groups: int, num_local: int
) -> jax.Array:
  """The offset as an int32 scalar; a concrete one must keep the local
  groups ``[offset, offset + num_local)`` inside ``[0, num_groups)`` (a
  traced one cannot be checked: out of range, it is clamped)."""
  if group_offset is None:
    return jnp.zeros((), jnp.int32)
  if isinstance(group_offset, bool) or not (
    isinstance(group_offset, int | np.integer) or hasattr(group_offset, "dtype")
  ):
    raise TypeError(
      f"{name}: expected 'group_offset' to be an int32 scalar, got "
      f"{type(group_offset).__name__}"
    )
  if not isinstance(group_offset, int | np.integer):
    if jnp.dtype(group_offset.dtype) != jnp.int32:
      raise TypeError(
        f"{name}: expected 'group_offset' of dtype int32, got "
        f"{jnp.dtype(group_offset.dtype).name}"
      )
    if group_offset.shape not in ((), (1,)):
      raise ValueError(
        f"{name}: expected 'group_offset' of shape () (one int32), got "
        f"shape {tuple(group_offset.shape)}"
      )
  try:
    value = int(np.asarray(group_offset).reshape(()))
  except (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
  ):
    value = None  # traced: cannot be checked here
  if value is not None and not 0 <= value <= num_groups - num_local:
    raise ValueError(
      f"{name}: expected 'group_offset' in [0, {num_groups - num_local}] "
      f"(num_groups={num_groups} minus the {num_local} local groups), "
      f"got {value}"
    )
  return jnp.reshape(jnp.asarray(group_offset, jnp.int32), ())


def _check_out_dtype(name: str, preferred_element_type: Any) -> jnp.dtype:
  try:
    dtype = jnp.dtype(preferred_element_type)
  except TypeError:
    raise TypeError(
      f"{name}: expected 'preferred_element_type' to be a dtype, got "
      f"{preferred_element_type!r}"
    ) from None
  if dtype not in _SUPPORTED_DTYPES:
    raise TypeError(
      f"{name}: expected 'preferred_element_type' float32, bfloat16 or "
      f"float16, got {dtype.name}"
    )
  return dtype


def _check_existing_out(
  name: str, existing_out: Any, shape: tuple[int, ...], dtype: jnp.dtype
):
  if existing_out is None:
    return
  if not hasattr(existing_out, "shape") or not hasattr(existing_out, "dtype"):
    raise TypeError(
      f"{name}: expected 'existing_out' to be an array, got "
      f"{type(existing_out).__name__}"
    )
  if tuple(existing_out.shape) != shape:
    raise ValueError(
      f"{name}: expected 'existing_out' of shape {shape}, got "
      f"{tuple(existing_out.shape)}"
    )
  if jnp.dtype(existing_out.dtype) != dtype:
    raise TypeError(
      f"{name}: expected 'existing_out' of dtype {dtype.name} (the "
      f"preferred_element_type), got {jnp.dtype(existing_out.dtype).name}"
    )


def _input_dtype(lhs: jax.Array, rhs: jax.Array) -> jnp.dtype:
  # Mixed operands are multiplied in f32, as megablox does.
  if lhs.dtype == rhs.dtype:
    return jnp.dtype(lhs.dtype)
  return jnp.dtype(jnp.float32)


# ----------------------------------------------------------------- metadata


class _Strip(NamedTuple):
  """A static slice of one dimension, tiled by ``block``."""

  start: int
  size: int
  block: int


def _strips(size: int, block: int) -> tuple[_Strip, ...]:
  """Whole tiles first, then the ragged remainder as its own strip."""
  main = size // block * block
  strips = []
  if main:
    strips.append(_Strip(0, main, block))
  if size > main:
    strips.append(_Strip(main, size - main, size - main))
  return tuple(strips)


def _group_rows(
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


def _gmm_metadata(
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
  lo, hi = _group_rows(group_sizes, group_offset, num_local, m)
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


def _tgmm_metadata(
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
  lo, hi = _group_rows(group_sizes, group_offset, num_local, m)
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


def _row_mask(row0, lo, hi, shape, dim):
  rows = row0 + lax.broadcasted_iota(jnp.int32, shape, dim)
  return jnp.logical_and(rows >= lo, rows < hi)


def _out_type(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
  """The output type, varying over the manual mesh axes its operands vary
  over (needed inside ``jax.shard_map(..., check_vma=True)``)."""
  varying = frozenset().union(
    *(jax.typeof(x).manual_axis_type.varying for x in operands)
  )
  return jax.ShapeDtypeStruct(
    shape,
    dtype,
    manual_axis_type=jax.sharding.ManualAxisType(varying=varying),
  )


# Kernel operands are (metadata, lhs, rhs, existing_out): the output is
# written in place of existing_out.
_EXISTING_OUT_INDEX = 3


def _default_buffer_count() -> int:
  """Buffers per pipelined operand for the current target.

  On TPU two, so the DMA of step i+1 overlaps the matmul of step i. The CPU
  fallback runs DMAs as copies in program order, where a second buffer only
  adds a copy per step: one buffer measured ~20% faster on the benchmark.
  """
  return 2 if targets.platform() == "tpu" else 1


def _block_specs(buffer_count: int):
  """``pl.BlockSpec`` with this many buffers per operand."""

  def spec(block_shape, index_map):
    return pl.BlockSpec(
      block_shape,
      index_map,
      pipeline_mode=pl.Buffered(buffer_count=buffer_count),
    )

  return spec


def _mesh():
  return meshes.tensorcore_mesh("core", num_cores=1)


# ---------------------------------------------------------------------- gmm


class _GmmConfig(NamedTuple):
  """Static parameters of one gmm call (hashable: a custom_vjp closure key)."""

  tiling: Tiling
  preferred_element_type: jnp.dtype
  transpose_rhs: bool
  interpret: Interpret
  buffer_count: int


def _gmm_call(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  existing_out: jax.Array | None,
  cfg: _GmmConfig,
) -> jax.Array:
  m, k = lhs.shape
  num_local = rhs.shape[0]
  n = rhs.shape[1] if cfg.transpose_rhs else rhs.shape[2]
  tm, tk, tn = cfg.tiling
  out_dtype = cfg.preferred_element_type
  in_dtype = _input_dtype(lhs, rhs)
  meta, layout = _gmm_metadata(
    group_sizes, group_offset, m=m, tm=tm, num_local=num_local
  )
  k_main, k_rem = k // tk * tk, k % tk
  tiles_k = k_main // tk
  col_strips = _strips(n, tn)
  has_existing = existing_out is not None
  block_spec = _block_specs(cfg.buffer_count)

  def rhs_view(ref, k_slice, n_slice):
    if cfg.transpose_rhs:
      return ref.at[:, n_slice, k_slice]
    return ref.at[:, k_slice, n_slice]

  def rhs_block(bk, bn, kmap):
    # kmap(n_i, v, k_i) -> (expert, k block, n block)
    if cfg.transpose_rhs:
      return block_spec((None, bn, bk), lambda *idx: _swap_last(kmap(*idx)))
    return block_spec((None, bk, bn), kmap)

  def kernel(*refs):
    meta_hbm, lhs_hbm, rhs_hbm, *refs = refs
    existing_hbm = refs.pop(0) if has_existing else None
    out_hbm, meta_s, *accs = refs
    pltpu.sync_copy(meta_hbm, meta_s)
    num_visits = meta_s[0]

    def lhs_map(n_i, v, k_i):
      return meta_s[layout.tile + v], k_i

    def rhs_map(n_i, v, k_i):
      return meta_s[layout.group + v], k_i, n_i

    def rem_lhs_map(n_i, v, k_i):
      return meta_s[layout.tile + v], 0

    def rem_rhs_map(n_i, v, k_i):
      return meta_s[layout.group + v], 0, n_i

    def out_map(n_i, v, k_i):
      return meta_s[layout.tile + v], n_i

    def dot(x, w):
      contract = 1 if cfg.transpose_rhs else 0
      return lax.dot_general(
        x.astype(in_dtype),
        w.astype(in_dtype),
        (((1,), (contract,)), ((), ())),
        preferred_element_type=jnp.float32,
      )

    for strip, acc in zip(col_strips, accs, strict=True):
      n_slice = pl.ds(strip.start, strip.size)
      bn = strip.block

      def step(*blocks, acc=acc, bn=bn):
        lhs_b, rhs_b, *blocks = blocks
        if k_rem:
          lhs_rem_b, rhs_rem_b, *blocks = blocks
        existing_b = blocks.pop(0) if has_existing else None
        (out_b,) = blocks
        v, k_i = pl.program_id(1), pl.program_id(2)
        tile = meta_s[layout.tile + v]
        lo, hi = meta_s[layout.lo + v], meta_s[layout.hi + v]

        row0 = tile * tm
        # A visit whose group covers the whole tile overwrites it: no
        # initialisation and no row mask (on the CPU fallback each is a
        # full-tile copy per step).
        covers_tile = jnp.logical_and(lo <= row0, hi >= row0 + tm)
        first = meta_s[layout.first + v] == 1
        needs_init = jnp.logical_and(first, jnp.logical_not(covers_tile))

        @pl.when(jnp.logical_and(k_i == 0, needs_init))
        def _init_out():
          if has_existing:
            out_b[...] = existing_b[...]
          else:
            out_b[...] = jnp.zeros_like(out_b)

        def store(total):
          total = total.astype(out_dtype)

          @pl.when(covers_tile)
          def _():
            out_b[...] = total

          @pl.when(jnp.logical_not(covers_tile))
          def _():
            mask = _row_mask(row0, lo, hi, (tm, bn), 0)
            out_b[...] = jnp.where(mask, total, out_b[...])

        def remainder():
          if not k_rem:
            return 0.0
          return dot(lhs_rem_b[...], rhs_rem_b[...])

        @pl.when(lo < hi)
        def _work():
          part = dot(lhs_b[...], rhs_b[...])
          if tiles_k == 1:
            store(part + remainder())
            return

          @pl.when(k_i == 0)
          def _():
            acc[...] = part

          @pl.when(k_i > 0)
          def _():
            acc[...] += part

          @pl.when(k_i == tiles_k - 1)
          def _():
            store(acc[...] + remainder())

      in_specs = [
        block_spec((tm, tk), lhs_map),
        rhs_block(tk, bn, rhs_map),
      ]
      in_refs = [
        lhs_hbm.at[:, pl.ds(0, k_main)],
        rhs_view(rhs_hbm, pl.ds(0, k_main), n_slice),
      ]
      if k_rem:
        in_specs += [
          block_spec((tm, k_rem), rem_lhs_map),
          rhs_block(k_rem, bn, rem_rhs_map),
        ]
        in_refs += [
          lhs_hbm.at[:, pl.ds(k_main, k_rem)],
          rhs_view(rhs_hbm, pl.ds(k_main, k_rem), n_slice),
        ]
      if has_existing:
        in_specs.append(block_spec((tm, bn), out_map))
        in_refs.append(existing_hbm.at[:, n_slice])
      pltpu.emit_pipeline(
        step,
        grid=(strip.size // bn, num_visits, tiles_k),
        in_specs=in_specs,
        out_specs=[block_spec((tm, bn), out_map)],
      )(*in_refs, out_hbm.at[:, n_slice])

  scratch = [pltpu.SMEM((layout.length,), jnp.int32)]
  scratch += [pltpu.VMEM((tm, s.block), jnp.float32) for s in col_strips]
  operands = [meta, lhs, rhs] + ([existing_out] if has_existing else [])
  out_bytes = m * n * jnp.dtype(out_dtype).itemsize
  cost = pl.CostEstimate(
    flops=2 * m * k * n,
    transcendentals=0,
    bytes_accessed=int(
      lhs.size * lhs.dtype.itemsize * len(range(0, n, tn))
      + rhs.size * rhs.dtype.itemsize
      + out_bytes * (2 if has_existing else 1)
    ),
  )
  call = mpmd_map(
    [(_mesh(), kernel)],
    out_types=_out_type((m, n), out_dtype, *operands),
    input_output_aliases={_EXISTING_OUT_INDEX: 0} if has_existing else {},
    scratch_types=scratch,
    interpret=cfg.interpret,
    cost_estimate=cost,
    name="gmm",
  )
  return call(*operands)


def _swap_last(idx):
  *lead, a, b = idx
  return (*lead, b, a)


def _active_rows(
  group_sizes: jax.Array, group_offset: jax.Array, num_local: int, m: int
) -> jax.Array:
  """(m, 1) bool: rows that belong to one of the local groups."""
  lo, hi = _group_rows(group_sizes, group_offset, num_local, m)
  rows = lax.broadcasted_iota(jnp.int32, (m, 1), 0)
  return jnp.logical_and(rows >= lo[0], rows < hi[-1])


def _sum_over_new_axes(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
  """Sums a cotangent over the mesh axes it varies over and its primal not.

  Inside ``shard_map`` a replicated operand (e.g. lhs under expert sharding)
  meets per-device metadata; its cotangent is the sum of every device's
  contribution, which is what autodiff's transpose of the implicit
  broadcast (``pvary``) would give.
  """
  extra = (
    jax.typeof(cotangent).manual_axis_type.varying
    - jax.typeof(primal).manual_axis_type.varying
  )
  if not extra:
    return cotangent
  return lax.psum(cotangent, tuple(sorted(extra)))


@functools.cache
def _differentiable_gmm(cfg: _GmmConfig):
  """gmm with a custom VJP for one static configuration."""

  @jax.custom_vjp
  def f(lhs, rhs, group_sizes, group_offset, existing_out):
    return _gmm_call(lhs, rhs, group_sizes, group_offset, existing_out, cfg)

  def fwd(lhs, rhs, group_sizes, group_offset, existing_out):
    out = f(lhs, rhs, group_sizes, group_offset, existing_out)
    # A zero-size slice remembers existing_out's type (its varying mesh
    # axes) for free.
    existing_type = None if existing_out is None else existing_out[:0]
    return out, (lhs, rhs, group_sizes, group_offset, existing_type)

  def bwd(res, grad):
    lhs, rhs, group_sizes, group_offset, existing_type = res
    m = lhs.shape[0]
    num_local = rhs.shape[0]
    tm, tk, tn = cfg.tiling
    # d lhs = grad @ rhs^T per group: a gmm with K and N swapped.
    dlhs = _gmm_call(
      grad,
      rhs,
      group_sizes,
      group_offset,
      None,
      cfg._replace(
        tiling=(tm, tn, tk),
        preferred_element_type=jnp.dtype(lhs.dtype),
        transpose_rhs=not cfg.transpose_rhs,
      ),
    )
    # d rhs[g] = lhs[rows_g]^T @ grad[rows_g]: a tgmm over the local groups.
    drhs = _tgmm_call(
      lhs.T,
      grad,
      group_sizes,
      group_offset,
      None,
      _TgmmConfig(
        tiling=(tm, tk, tn),
        preferred_element_type=jnp.dtype(rhs.dtype),
        num_actual_groups=num_local,
        interpret=cfg.interpret,
        buffer_count=cfg.buffer_count,
      ),
    )
    if cfg.transpose_rhs:
      drhs = jnp.swapaxes(drhs, 1, 2)
    if existing_type is None:
      dexisting = None
    else:
      # existing_out survives only in rows outside the local groups.
      active = _active_rows(group_sizes, group_offset, num_local, m)
      dexisting = jnp.where(active, jnp.zeros((), grad.dtype), grad)
      dexisting = _sum_over_new_axes(dexisting, existing_type)
    dlhs = _sum_over_new_axes(dlhs, lhs)
    drhs = _sum_over_new_axes(drhs, rhs)
    return dlhs, drhs, None, None, dexisting

  f.defvjp(fwd, bwd)
  return f


def gmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  preferred_element_type: Any = jnp.float32,
  tiling: Tiling | TilingFn | None = None,
  group_offset: jax.Array | int | None = None,
  existing_out: jax.Array | None = None,
  transpose_rhs: bool = False,
  interpret: Interpret = None,
) -> jax.Array:
  """Grouped matmul: ``out[rows_i] = lhs[rows_i] @ rhs[i]`` for each group.

  Rows of ``lhs`` are sorted by group: group ``i`` owns rows
  ``sum(group_sizes[:i]) .. sum(group_sizes[:i+1])``. Rows past
  ``sum(group_sizes)``, and rows of groups outside the local shard, are zero
  (or keep ``existing_out``). Differentiable in ``lhs``, ``rhs`` and
  ``existing_out`` (custom VJP: d lhs by ``gmm`` with the transposed rhs,
  d rhs by ``tgmm``).

  Args:
    lhs: ``(m, k)`` float32, bfloat16 or float16.
    rhs: ``(num_local_groups, k, n)`` (``(num_local_groups, n, k)`` with
      ``transpose_rhs``), any supported float dtype; with expert sharding it
      holds only groups ``group_offset .. group_offset + num_local_groups``.
    group_sizes: ``(num_groups,)`` int32, non-negative (a concrete array is
      checked); ``num_groups >= num_local_groups``. As in
      ``jax.lax.ragged_dot``, rows past m of sizes that sum past m do not
      exist. A traced negative size cannot be checked: it makes the next
      groups' ranges overlap earlier ones, where ragged_dot adds the
      products of every group holding a row and gmm takes the first group.
    preferred_element_type: dtype of the output (float32, bfloat16, float16);
      accumulation is always float32.
    tiling: ``(tm, tk, tn)``; a function ``(m, k, n) -> (tm, tk, tn)``; or
      None for ``default_tiling`` of the target platform. ``tm`` must divide
      ``m``; K and N may be ragged (the remainders are separate strips).
    group_offset: int32 scalar: the first global group held by ``rhs``.
    existing_out: ``(m, n)`` of ``preferred_element_type``: rows outside the
      local groups keep these values (the result of other shards).
    transpose_rhs: ``rhs`` is given as ``(num_local_groups, n, k)``.
    interpret: passed to ``mpmd_map``: None runs natively on TPU and on the
      CPU fallback on CPU; True or ``pltpu.InterpretParams()`` forces the
      interpreters.

  Returns:
    ``(m, n)`` array of ``preferred_element_type``.

  Raises:
    TypeError: an argument of the wrong kind or dtype.
    ValueError: wrong ranks or shapes, mismatched K, a tiling that does not
      fit, negative (concrete) ``group_sizes``.

  Example:
    >>> lhs = jnp.ones((256, 64), jnp.float32)
    >>> rhs = jnp.ones((4, 64, 32), jnp.float32)
    >>> sizes = jnp.array([64, 0, 100, 60], jnp.int32)
    >>> gmm(lhs, rhs, sizes).shape
    (256, 32)
  """
  name = "gmm"
  _check_array(name, "lhs", lhs, 2, "(m, k)")
  rhs_doc = "(num_groups, n, k)" if transpose_rhs else "(num_groups, k, n)"
  _check_array(name, "rhs", rhs, 3, rhs_doc)
  _check_float(name, "lhs", lhs)
  _check_float(name, "rhs", rhs)
  _check_group_sizes(name, group_sizes)
  if not isinstance(transpose_rhs, bool | np.bool_):
    raise TypeError(
      f"{name}: expected 'transpose_rhs' to be a bool, got "
      f"{type(transpose_rhs).__name__}"
    )
  m, k = lhs.shape
  rhs_k = rhs.shape[2] if transpose_rhs else rhs.shape[1]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if rhs_k != k:
    raise ValueError(
      f"{name}: expected 'rhs' {rhs_doc} with k={k} (lhs is {(m, k)}), "
      f"got shape {tuple(rhs.shape)}"
      + (
        ""
        if transpose_rhs
        else "; for (num_groups, n, k) weights pass transpose_rhs=True"
      )
    )
  num_groups = group_sizes.shape[0]
  if rhs.shape[0] > num_groups:
    raise ValueError(
      f"{name}: expected 'rhs' to hold at most num_groups={num_groups} "
      f"groups (the length of 'group_sizes'), got {rhs.shape[0]}"
    )
  out_dtype = _check_out_dtype(name, preferred_element_type)
  offset = _check_group_offset(name, group_offset, num_groups, rhs.shape[0])
  _check_existing_out(name, existing_out, (m, n), out_dtype)
  cfg = _GmmConfig(
    tiling=_resolve_tiling(name, tiling, m, k, n, num_groups),
    preferred_element_type=out_dtype,
    transpose_rhs=bool(transpose_rhs),
    interpret=interpret,
    buffer_count=_default_buffer_count(),
  )
  return _jitted(_differentiable_gmm(cfg))(
    lhs, rhs, group_sizes, offset, existing_out
  )


@functools.cache
def _jitted(f):
  return jax.jit(f)


# --------------------------------------------------------------------- tgmm


class _TgmmConfig(NamedTuple):
  tiling: Tiling
  preferred_element_type: jnp.dtype
  num_actual_groups: int
  interpret: Interpret
  buffer_count: int


def _tgmm_call(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  existing_out: jax.Array | None,
  cfg: _TgmmConfig,
) -> jax.Array:
  k, m = lhs.shape
  n = rhs.shape[1]
  tm, tk, tn = cfg.tiling
  num_local = cfg.num_actual_groups
  out_dtype = cfg.preferred_element_type
  in_dtype = _input_dtype(lhs, rhs)
  meta, layout = _tgmm_metadata(
    group_sizes, group_offset, m=m, tm=tm, num_local=num_local
  )
  has_existing = existing_out is not None
  block_spec = _block_specs(cfg.buffer_count)
  strips = [(ks, ns) for ks in _strips(k, tk) for ns in _strips(n, tn)]

  def kernel(*refs):
    meta_hbm, lhs_hbm, rhs_hbm, *refs = refs
    existing_hbm = refs.pop(0) if has_existing else None
    out_hbm, meta_s, *accs = refs
    pltpu.sync_copy(meta_hbm, meta_s)
    num_visits = meta_s[0]

    def lhs_map(n_i, k_i, v):
      return k_i, meta_s[layout.tile + v]

    def rhs_map(n_i, k_i, v):
      return meta_s[layout.tile + v], n_i

    def out_map(n_i, k_i, v):
      return meta_s[layout.group + v], k_i, n_i

    for (ks, ns), acc in zip(strips, accs, strict=True):
      bk, bn = ks.block, ns.block

      def step(*blocks, acc=acc, bk=bk, bn=bn):
        lhs_b, rhs_b, *blocks = blocks
        existing_b = blocks.pop(0) if has_existing else None
        (out_b,) = blocks
        v = pl.program_id(2)
        tile = meta_s[layout.tile + v]
        lo, hi = meta_s[layout.lo + v], meta_s[layout.hi + v]

        row0 = tile * tm
        first = meta_s[layout.first + v] == 1
        covers_tile = jnp.logical_and(lo <= row0, hi >= row0 + tm)

        def accumulate(part):
          @pl.when(first)
          def _():
            acc[...] = part

          @pl.when(jnp.logical_not(first))
          def _():
            acc[...] += part

        def dot(x, w):
          return lax.dot_general(
            x.astype(in_dtype),
            w.astype(in_dtype),
            (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
          )

        @pl.when(hi <= lo)
        def _empty():
          @pl.when(first)
          def _():
            acc[...] = jnp.zeros_like(acc)

        @pl.when(jnp.logical_and(lo < hi, covers_tile))
        def _whole_tile():
          accumulate(dot(lhs_b[...], rhs_b[...]))

        @pl.when(jnp.logical_and(lo < hi, jnp.logical_not(covers_tile)))
        def _part_of_tile():
          # Both operands are masked: rows of other groups may hold inf.
          x, w = lhs_b[...], rhs_b[...]
          zero = jnp.zeros((), x.dtype)
          x = jnp.where(_row_mask(row0, lo, hi, (bk, tm), 1), x, zero)
          w = jnp.where(_row_mask(row0, lo, hi, (tm, bn), 0), w, zero)
          accumulate(dot(x, w))

        @pl.when(meta_s[layout.last + v] == 1)
        def _store():
          total = acc[...]
          if has_existing:
            total += existing_b[...].astype(jnp.float32)
          out_b[...] = total.astype(out_dtype)

      k_slice = pl.ds(ks.start, ks.size)
      n_slice = pl.ds(ns.start, ns.size)
      in_specs = [
        block_spec((bk, tm), lhs_map),
        block_spec((tm, bn), rhs_map),
      ]
      in_refs = [lhs_hbm.at[k_slice, :], rhs_hbm.at[:, n_slice]]
      if has_existing:
        in_specs.append(block_spec((None, bk, bn), out_map))
        in_refs.append(existing_hbm.at[:, k_slice, n_slice])
      pltpu.emit_pipeline(
        step,
        grid=(ns.size // bn, ks.size // bk, num_visits),
        in_specs=in_specs,
        out_specs=[block_spec((None, bk, bn), out_map)],
      )(*in_refs, out_hbm.at[:, k_slice, n_slice])

  scratch = [pltpu.SMEM((layout.length,), jnp.int32)]
  scratch += [
    pltpu.VMEM((ks.block, ns.block), jnp.float32) for ks, ns in strips
  ]
  operands = [meta, lhs, rhs] + ([existing_out] if has_existing else [])
  out_bytes = num_local * k * n * jnp.dtype(out_dtype).itemsize
  cost = pl.CostEstimate(
    flops=2 * m * k * n,
    transcendentals=0,
    bytes_accessed=int(
      lhs.size * lhs.dtype.itemsize * len(range(0, n, tn))
      + rhs.size * rhs.dtype.itemsize * len(range(0, k, tk))
      + out_bytes * (2 if has_existing else 1)
    ),
  )
  call = mpmd_map(
    [(_mesh(), kernel)],
    out_types=_out_type((num_local, k, n), out_dtype, *operands),
    input_output_aliases={_EXISTING_OUT_INDEX: 0} if has_existing else {},
    scratch_types=scratch,
    interpret=cfg.interpret,
    cost_estimate=cost,
    name="tgmm",
  )
  return call(*operands)


def tgmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  preferred_element_type: Any = jnp.float32,
  tiling: Tiling | TilingFn | None = None,
  group_offset: jax.Array | int | None = None,
  num_actual_groups: int | None = None,
  existing_out: jax.Array | None = None,
  interpret: Interpret = None,
) -> jax.Array:
  """Transposed grouped matmul: ``out[i] = lhs[:, rows_i] @ rhs[rows_i]``.

  The weight gradient of ``gmm``. Group ``i`` owns rows (of ``rhs``; columns
  of ``lhs``) ``sum(group_sizes[:i]) .. sum(group_sizes[:i+1])``; empty groups
  give zeros.

  Args:
    lhs: ``(k, m)`` float32, bfloat16 or float16 (e.g. activations, transposed).
    rhs: ``(m, n)`` float (e.g. output gradients).
    group_sizes: ``(num_groups,)`` int32, non-negative, as for ``gmm``: a
      concrete array is checked; rows past m do not exist; after a traced
      negative size, a row in several groups' ranges belongs to the first.
    preferred_element_type: output dtype; accumulation is float32.
    tiling: ``(tm, tk, tn)``, a function ``(m, k, n) -> tiling``, or None for
      ``default_tiling``; ``tm`` must divide ``m``, K and N may be ragged.
    group_offset: int32 scalar: the first group computed (expert sharding).
    num_actual_groups: groups computed, from ``group_offset``; defaults to
      all ``num_groups``.
    existing_out: ``(num_actual_groups, k, n)`` of
      ``preferred_element_type``, added to the result.
    interpret: as for ``gmm``.

  Returns:
    ``(num_actual_groups, k, n)`` array of ``preferred_element_type``.

  Raises:
    TypeError: an argument of the wrong kind or dtype.
    ValueError: wrong ranks or shapes, mismatched M, a tiling that does not
      fit, ``num_actual_groups`` out of range, negative (concrete)
      ``group_sizes``.

  Example:
    >>> lhs = jnp.ones((64, 256), jnp.float32)
    >>> rhs = jnp.ones((256, 32), jnp.float32)
    >>> sizes = jnp.array([64, 0, 100, 60], jnp.int32)
    >>> tgmm(lhs, rhs, sizes).shape
    (4, 64, 32)
  """
  name = "tgmm"
  _check_array(name, "lhs", lhs, 2, "(k, m)")
  _check_array(name, "rhs", rhs, 2, "(m, n)")
  _check_float(name, "lhs", lhs)
  _check_float(name, "rhs", rhs)
  _check_group_sizes(name, group_sizes)
  k, m = lhs.shape
  n = rhs.shape[1]
  if rhs.shape[0] != m:
    raise ValueError(
      f"{name}: expected 'rhs' (m, n) with m={m} rows (lhs is {(k, m)}), "
      f"got shape {tuple(rhs.shape)}"
    )
  num_groups = group_sizes.shape[0]
  if num_actual_groups is None:
    num_actual_groups = num_groups
  if not isinstance(num_actual_groups, int | np.integer) or isinstance(
    num_actual_groups, bool
  ):
    raise TypeError(
      f"{name}: expected 'num_actual_groups' to be an int, got "
      f"{type(num_actual_groups).__name__}"
    )
  if not 1 <= num_actual_groups <= num_groups:
    raise ValueError(
      f"{name}: expected 'num_actual_groups' in [1, {num_groups}] "
      f"(num_groups), got {num_actual_groups}"
    )
  out_dtype = _check_out_dtype(name, preferred_element_type)
  offset = _check_group_offset(
    name, group_offset, num_groups, int(num_actual_groups)
  )
  _check_existing_out(
    name, existing_out, (int(num_actual_groups), k, n), out_dtype
  )
  cfg = _TgmmConfig(
    tiling=_resolve_tiling(name, tiling, m, k, n, num_groups),
    preferred_element_type=out_dtype,
    num_actual_groups=int(num_actual_groups),
    interpret=interpret,
    buffer_count=_default_buffer_count(),
  )
  return _jitted_tgmm(cfg)(lhs, rhs, group_sizes, offset, existing_out)


@functools.cache
def _jitted_tgmm(cfg: _TgmmConfig):
  return jax.jit(functools.partial(_tgmm_call, cfg=cfg))
