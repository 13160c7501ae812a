"""Kernel-side building blocks: the launch, output types, tile buffers, the
double-buffered local matmul through VMEM, adding arrived partial sums,
remote copies."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mpmd.api import mpmd_map
from mpmd.kernels import _common
from mpmd.kernels.collective_matmul._ring import Ring
from mpmd.types import Interpret

# The barrier semaphore handshake of every kernel here uses this collective id.
_COLLECTIVE_ID = 0


def launch(
  body: Callable[..., None],
  *,
  out_types: tuple[jax.ShapeDtypeStruct, ...],
  scratch_types: tuple[Any, ...],
  collective: bool,
  interpret: Interpret,
  name: str,
  flops: int,
  bytes_accessed: int,
  transcendentals: int = 0,
) -> Callable[..., Any]:
  return mpmd_map(
    [(_common.single_core_mesh(), _common.traced_in_x32(body))],
    out_types=out_types,
    scratch_types=scratch_types,
    compiler_params=pltpu.CompilerParams(
      collective_id=_COLLECTIVE_ID if collective else None,
    ),
    interpret=interpret,
    cost_estimate=pl.CostEstimate(
      flops=flops,
      transcendentals=transcendentals,
      bytes_accessed=bytes_accessed,
    ),
    name=name,
  )


def out_type(
  shape: tuple[int, ...], dtype: Any, operands: Sequence[jax.Array], ring: Ring
) -> jax.ShapeDtypeStruct:
  """An output type for ``jax.shard_map(..., check_vma=True)``.

  Outputs vary over the mesh axes the operands vary over, and over the ring's
  axes: even the all-gather matmul's copies on the ring's devices agree only
  up to rounding (each device sums the shards in its own order).
  """
  varying = _common.varying_axes(*operands)
  if varying:  # check_vma=True: every manual axis is tracked
    varying |= frozenset(ring.axes)
  return _common.out_type(shape, dtype, varying)


class TileBuffers(NamedTuple):
  """VMEM scratch of one local matmul pipeline (see ``matmul``)."""

  lhs: Any  # (2, block_n, block_k) in dtype
  rhs: Any  # (2, block_k, block_m) in dtype
  acc: Any  # (block_n, block_m) f32
  out: Any  # (block_n, block_m) in the output dtype
  extra: Any  # (block_n, block_m) f32: the addend of `add`
  lhs_sems: Any  # DMA (2,)
  rhs_sems: Any  # DMA (2,)

  @staticmethod
  def scratch_types(dtype, out_dtype, bn: int, bk: int, bm: int):
    return TileBuffers(
      lhs=pltpu.VMEM((2, bn, bk), dtype),
      rhs=pltpu.VMEM((2, bk, bm), dtype),
      acc=pltpu.VMEM((bn, bm), jnp.float32),
      out=pltpu.VMEM((bn, bm), out_dtype),
      extra=pltpu.VMEM((bn, bm), jnp.float32),
      lhs_sems=pltpu.SemaphoreType.DMA((2,)),
      rhs_sems=pltpu.SemaphoreType.DMA((2,)),
    )

  def named(self) -> dict[str, Any]:
    return {f"tile_{f}": v for f, v in self._asdict().items()}

  @staticmethod
  def from_named(named: dict[str, Any]) -> TileBuffers:
    return TileBuffers(**{f: named[f"tile_{f}"] for f in TileBuffers._fields})


def dot_precision(dtype) -> lax.Precision:
  # f32 operands get full f32 products (the default may use bf16 passes on
  # TPU); bf16 products are exact in f32 anyway.
  if jnp.dtype(dtype) == jnp.float32:
    return lax.Precision.HIGHEST
  return lax.Precision.DEFAULT


def matmul(
  bufs: TileBuffers,
  lhs: Any,
  rhs: Any,
  dst: Any,
  *,
  rows: tuple[Any, int],
  lhs_cols: Any,
  rhs_rows: Any,
  cols: tuple[Any, int],
  k: int,
  init: Any | None,
  acc: Any | None = None,
) -> None:
  """``dst = init + lhs[rows, lhs_cols:+k] @ rhs[rhs_rows:+k, cols]``.

  ``lhs``/``rhs``/``dst``/``init`` are HBM refs; ``rows``/``cols`` are
  ``(start, size)`` pairs (start may be traced) selecting the region of
  ``lhs`` rows / ``rhs`` columns, and the same region's shape is written to
  ``dst[0:size_rows, 0:size_cols]`` (``dst`` and ``init`` are region-sized).
  ``init=None`` means zero. Tiles stream through VMEM, the next pair of
  operand tiles loading while the current pair multiplies. ``dst=None``
  leaves a one-tile region's result in ``acc`` (VMEM, f32; default: the
  buffers' accumulator).
  """
  _, bn, bk = bufs.lhs.shape
  _, _, bm = bufs.rhs.shape
  row0, nrows = rows
  col0, ncols = cols
  nk = k // bk
  ni, nj = nrows // bn, ncols // bm
  num_tiles = ni * nj * nk
  precision = dot_precision(bufs.lhs.dtype)
  acc = bufs.acc if acc is None else acc
  assert dst is not None or ni * nj == 1, "only one tile stays on chip"
  walk = _TileWalk(bufs, lhs, rhs, row0, col0, lhs_cols, rhs_rows, nk, nj)

  for c in walk.copies(0, 0):
    c.start()

  def tile(t, carry):
    slot = lax.rem(t, 2)
    i, j, kk = walk.coords(t)

    @pl.when(t + 1 < num_tiles)
    def _():
      for c in walk.copies(t + 1, 1 - slot):
        c.start()

    dst_tile = (pl.ds(i * bn, bn), pl.ds(j * bm, bm))

    if init is not None:

      @pl.when(kk == 0)
      def _():
        pltpu.sync_copy(init.at[dst_tile], acc)

    for c in walk.copies(t, slot):
      c.wait()
    product = jnp.dot(
      bufs.lhs[slot],
      bufs.rhs[slot],
      preferred_element_type=jnp.float32,
      precision=precision,
    )
    _accumulate(acc, product, kk, first_sets=init is None)
    if dst is not None:

      @pl.when(kk == nk - 1)
      def _():
        if dst.dtype == jnp.float32:
          pltpu.sync_copy(acc, dst.at[dst_tile])
        else:
          bufs.out[...] = acc[...].astype(bufs.out.dtype)
          pltpu.sync_copy(bufs.out, dst.at[dst_tile])

    return carry

  lax.fori_loop(0, num_tiles, tile, 0)


class _TileWalk(NamedTuple):
  """The tiles of one ``matmul`` region, row-major with K innermost, and
  the DMAs that load each one's operand tiles into a buffer slot."""

  bufs: TileBuffers
  lhs: Any
  rhs: Any
  row0: Any
  col0: Any
  lhs_cols: Any
  rhs_rows: Any
  nk: int  # K tiles
  nj: int  # column tiles

  def coords(self, t):
    kk = lax.rem(t, self.nk)
    ij = t // self.nk
    return ij // self.nj, lax.rem(ij, self.nj), kk

  def copies(self, t, slot):
    _, bn, bk = self.bufs.lhs.shape
    _, _, bm = self.bufs.rhs.shape
    i, j, kk = self.coords(t)
    lhs_copy = pltpu.make_async_copy(
      self.lhs.at[
        pl.ds(self.row0 + i * bn, bn), pl.ds(self.lhs_cols + kk * bk, bk)
      ],
      self.bufs.lhs.at[slot],
      self.bufs.lhs_sems.at[slot],
    )
    rhs_copy = pltpu.make_async_copy(
      self.rhs.at[
        pl.ds(self.rhs_rows + kk * bk, bk), pl.ds(self.col0 + j * bm, bm)
      ],
      self.bufs.rhs.at[slot],
      self.bufs.rhs_sems.at[slot],
    )
    return lhs_copy, rhs_copy


def _accumulate(acc, product, kk, *, first_sets: bool) -> None:
  """``acc += product``; where ``first_sets``, the first K tile sets the
  accumulator instead (no zeroing pass)."""
  if not first_sets:
    acc[...] += product
    return

  @pl.when(kk == 0)
  def _():
    acc[...] = product

  @pl.when(kk > 0)
  def _():
    acc[...] += product


def matmul_whole(bufs: TileBuffers, lhs: Any, rhs: Any, dst: Any) -> None:
  """``dst = lhs @ rhs`` over whole HBM refs (``matmul`` of every row and
  column, the whole contraction)."""
  (n, k), (_, m) = lhs.shape, rhs.shape
  matmul(
    bufs,
    lhs,
    rhs,
    dst,
    rows=(0, n),
    lhs_cols=0,
    rhs_rows=0,
    cols=(0, m),
    k=k,
    init=None,
  )


def add(bufs: TileBuffers, a: Any, b: Any, dst: Any) -> None:
  """``dst = a + b`` over region-sized f32 HBM refs, tile by tile."""
  add_all(bufs, (a, b), dst)


def add_all(bufs: Any, sources: Sequence[Any], dst: Any) -> None:
  """``dst = sources[0] + sources[1] + ...`` (summed in that order) over
  region-sized f32 HBM refs, tile by tile through ``bufs``' VMEM ``acc``,
  ``extra`` (f32) and ``out`` (``dst``'s dtype) tiles (a ``TileBuffers`` or
  ``direct.SumBuffers``)."""
  bn, bm = bufs.acc.shape
  nrows, ncols = dst.shape
  ni, nj = nrows // bn, ncols // bm
  first, *rest = sources

  def tile(t, carry):
    i, j = t // nj, lax.rem(t, nj)
    region = (pl.ds(i * bn, bn), pl.ds(j * bm, bm))
    pltpu.sync_copy(first.at[region], bufs.acc)
    for source in rest:
      pltpu.sync_copy(source.at[region], bufs.extra)
      bufs.acc[...] += bufs.extra[...]
    if dst.dtype == jnp.float32:
      pltpu.sync_copy(bufs.acc, dst.at[region])
    else:
      bufs.out[...] = bufs.acc[...].astype(dst.dtype)
      pltpu.sync_copy(bufs.out, dst.at[region])
    return carry

  lax.fori_loop(0, ni * nj, tile, 0)


def add_to_held(bufs: TileBuffers, held: Any, b: Any, dst: Any | None) -> None:
  """``dst = held + b``: ``held`` a one-tile f32 region in VMEM (see
  ``matmul(dst=None)``), ``b`` and ``dst`` HBM refs of its shape;
  ``dst=None`` adds in place."""
  pltpu.sync_copy(b, bufs.extra)
  if dst is None or dst.dtype == jnp.float32:
    held[...] += bufs.extra[...]
    if dst is not None:
      pltpu.sync_copy(held, dst)
  else:
    bufs.out[...] = (held[...] + bufs.extra[...]).astype(dst.dtype)
    pltpu.sync_copy(bufs.out, dst)


def remote_copy(src: Any, dst: Any, send_sem: Any, recv_sem: Any, device_id):
  return pltpu.make_async_remote_copy(
    src, dst, send_sem, recv_sem, device_id=device_id
  )


def named_refs(refs, num_inputs: int, names: Sequence[str]):
  inputs = refs[:num_inputs]
  named = dict(zip(names, refs[num_inputs:], strict=True))
  return inputs, named
