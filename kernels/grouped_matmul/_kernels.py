"""The ``gmm`` and ``tgmm`` kernels: block specs, kernel bodies, launches."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mpmd import targets
from mpmd.api import mpmd_map
from mpmd.kernels import _common
from mpmd.kernels.grouped_matmul._checks import input_dtype
from mpmd.kernels.grouped_matmul._metadata import (
  gmm_metadata,
  row_mask,
  split_strips,
  tgmm_metadata,
)
from mpmd.kernels.grouped_matmul.tiling import Tiling
from mpmd.types import Interpret

# Kernel operands are (metadata, lhs, rhs, existing_out): the output is
# written in place of existing_out.
EXISTING_OUT_INDEX = 3


def default_buffer_count() -> int:
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


class _KernelRefs(NamedTuple):
  """A grouped matmul kernel's refs, its metadata copied to SMEM."""

  lhs: Any  # HBM
  rhs: Any  # HBM
  existing: Any  # HBM, or None
  out: Any  # HBM
  meta: Any  # SMEM: the group metadata
  accs: list[Any]  # VMEM: one f32 accumulator per strip
  num_visits: jax.Array  # (tile, group) visits of this launch

  @classmethod
  def unpack(cls, refs, has_existing: bool) -> _KernelRefs:
    """Operands (metadata, lhs, rhs[, existing_out]), the output, scratch
    (metadata in SMEM, accumulators)."""
    meta_hbm, lhs, rhs, *refs = refs
    existing = refs.pop(0) if has_existing else None
    out, meta, *accs = refs
    pltpu.sync_copy(meta_hbm, meta)
    return cls(lhs, rhs, existing, out, meta, accs, meta[0])

  @staticmethod
  def names(has_existing: bool, num_accs: int) -> tuple[str, ...]:
    """The operands' names, in ``unpack``'s order (for messages)."""
    existing = ("existing_out",) if has_existing else ()
    accs = tuple(f"acc_{i}" for i in range(num_accs))
    return ("meta_hbm", "lhs", "rhs", *existing, "out", "meta", *accs)


class GmmConfig(NamedTuple):
  """Static parameters of one gmm call (hashable: a custom_vjp closure key)."""

  # None: implementation="windows" (``_windows.py``), which runs no tiles.
  tiling: Tiling | None
  preferred_element_type: jnp.dtype
  transpose_rhs: bool
  interpret: Interpret
  buffer_count: int


class _GmmPlan(NamedTuple):
  """What a gmm kernel body needs to know, fixed at trace time."""

  tiling: Tiling
  k_main: int  # K in whole tiles
  k_rem: int  # K beyond them: an extra input block on the last K step
  col_strips: tuple[Any, ...]  # ``split_strips(n, tn)``
  layout: Any  # the metadata layout (``gmm_metadata``)
  has_existing: bool
  transpose_rhs: bool
  in_dtype: jnp.dtype
  out_dtype: jnp.dtype
  buffer_count: int

  @property
  def tiles_k(self) -> int:
    return self.k_main // self.tiling[1]

  def dot(self, x, w):
    contract = 1 if self.transpose_rhs else 0
    return lax.dot_general(
      x.astype(self.in_dtype),
      w.astype(self.in_dtype),
      (((1,), (contract,)), ((), ())),
      preferred_element_type=jnp.float32,
    )

  def rhs_view(self, ref, k_slice, n_slice):
    if self.transpose_rhs:
      return ref.at[:, n_slice, k_slice]
    return ref.at[:, k_slice, n_slice]

  def rhs_block(self, bk, bn, kmap):
    # kmap(n_i, v, k_i) -> (expert, k block, n block)
    block_spec = _block_specs(self.buffer_count)
    if self.transpose_rhs:
      return block_spec((None, bn, bk), lambda *idx: _swap_last(kmap(*idx)))
    return block_spec((None, bk, bn), kmap)


def _gmm_step(plan: _GmmPlan, r: _KernelRefs, acc, bn: int):
  """The pipeline body of one column strip of ``bn``-wide blocks."""
  tm = plan.tiling[0]
  layout, tiles_k = plan.layout, plan.tiles_k

  def step(*blocks):
    lhs_b, rhs_b, *blocks = blocks
    if plan.k_rem:
      lhs_rem_b, rhs_rem_b, *blocks = blocks
    existing_b = blocks.pop(0) if plan.has_existing else None
    (out_b,) = blocks
    v, k_i = pl.program_id(1), pl.program_id(2)
    tile = r.meta[layout.tile + v]
    lo, hi = r.meta[layout.lo + v], r.meta[layout.hi + v]

    row0 = tile * tm
    # A visit whose group covers the whole tile overwrites it: no
    # initialisation and no row mask (on the CPU fallback each is a
    # full-tile copy per step).
    covers_tile = jnp.logical_and(lo <= row0, hi >= row0 + tm)
    first = r.meta[layout.first + v] == 1
    needs_init = jnp.logical_and(first, jnp.logical_not(covers_tile))

    @pl.when(jnp.logical_and(k_i == 0, needs_init))
    def _init_out():
      if existing_b is not None:
        out_b[...] = existing_b[...]
      else:
        out_b[...] = jnp.zeros_like(out_b)

    def store(total):
      total = total.astype(plan.out_dtype)

      @pl.when(covers_tile)
      def _():
        out_b[...] = total

      @pl.when(jnp.logical_not(covers_tile))
      def _():
        mask = row_mask(row0, lo, hi, (tm, bn), 0)
        out_b[...] = jnp.where(mask, total, out_b[...])

    def remainder():
      if not plan.k_rem:
        return 0.0
      return plan.dot(lhs_rem_b[...], rhs_rem_b[...])

    @pl.when(lo < hi)
    def _work():
      part = plan.dot(lhs_b[...], rhs_b[...])
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

  return step


def _gmm_kernel(plan: _GmmPlan):
  """The gmm program: one pipeline per column strip."""
  tm, tk, _ = plan.tiling
  k_main, k_rem, layout = plan.k_main, plan.k_rem, plan.layout
  block_spec = _block_specs(plan.buffer_count)

  names = _KernelRefs.names(plan.has_existing, len(plan.col_strips))

  @_common.operand_names(names)
  def kernel(*refs):
    r = _KernelRefs.unpack(refs, plan.has_existing)

    def lhs_map(n_i, v, k_i):
      return r.meta[layout.tile + v], k_i

    def rhs_map(n_i, v, k_i):
      return r.meta[layout.group + v], k_i, n_i

    def rem_lhs_map(n_i, v, k_i):
      return r.meta[layout.tile + v], 0

    def rem_rhs_map(n_i, v, k_i):
      return r.meta[layout.group + v], 0, n_i

    def out_map(n_i, v, k_i):
      return r.meta[layout.tile + v], n_i

    for strip, acc in zip(plan.col_strips, r.accs, strict=True):
      n_slice = pl.ds(strip.start, strip.size)
      bn = strip.block
      in_specs = [
        block_spec((tm, tk), lhs_map),
        plan.rhs_block(tk, bn, rhs_map),
      ]
      in_refs = [
        r.lhs.at[:, pl.ds(0, k_main)],
        plan.rhs_view(r.rhs, pl.ds(0, k_main), n_slice),
      ]
      if k_rem:
        in_specs += [
          block_spec((tm, k_rem), rem_lhs_map),
          plan.rhs_block(k_rem, bn, rem_rhs_map),
        ]
        in_refs += [
          r.lhs.at[:, pl.ds(k_main, k_rem)],
          plan.rhs_view(r.rhs, pl.ds(k_main, k_rem), n_slice),
        ]
      if plan.has_existing:
        in_specs.append(block_spec((tm, bn), out_map))
        in_refs.append(r.existing.at[:, n_slice])
      pltpu.emit_pipeline(
        _gmm_step(plan, r, acc, bn),
        grid=(strip.size // bn, r.num_visits, plan.tiles_k),
        in_specs=in_specs,
        out_specs=[block_spec((tm, bn), out_map)],
      )(*in_refs, r.out.at[:, n_slice])

  return kernel


def gmm_call(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  existing_out: jax.Array | None,
  cfg: GmmConfig,
) -> jax.Array:
  m, k = lhs.shape
  num_local = rhs.shape[0]
  n = rhs.shape[1] if cfg.transpose_rhs else rhs.shape[2]
  assert cfg.tiling is not None  # else the windows implementation runs
  tm, tk, tn = cfg.tiling
  out_dtype = cfg.preferred_element_type
  meta, layout = gmm_metadata(
    group_sizes, group_offset, m=m, tm=tm, num_local=num_local
  )
  has_existing = existing_out is not None
  plan = _GmmPlan(
    tiling=cfg.tiling,
    k_main=k // tk * tk,
    k_rem=k % tk,
    col_strips=split_strips(n, tn),
    layout=layout,
    has_existing=has_existing,
    transpose_rhs=cfg.transpose_rhs,
    in_dtype=input_dtype(lhs, rhs),
    out_dtype=out_dtype,
    buffer_count=cfg.buffer_count,
  )
  scratch = [pltpu.SMEM((layout.length,), jnp.int32)]
  scratch += [pltpu.VMEM((tm, s.block), jnp.float32) for s in plan.col_strips]
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
    [
      (
        _common.single_core_mesh(),
        _common.traced_in_x32(_gmm_kernel(plan)),
      )
    ],
    out_types=_common.out_type(
      (m, n), out_dtype, _common.varying_axes(*operands)
    ),
    input_output_aliases={EXISTING_OUT_INDEX: 0} if has_existing else {},
    scratch_types=scratch,
    interpret=cfg.interpret,
    cost_estimate=cost,
    name="gmm",
  )
  return call(*operands)


def _swap_last(idx):
  *lead, a, b = idx
  return (*lead, b, a)


class TgmmConfig(NamedTuple):
  tiling: Tiling | None  # as GmmConfig's
  preferred_element_type: jnp.dtype
  num_actual_groups: int
  interpret: Interpret
  buffer_count: int


class _TgmmPlan(NamedTuple):
  """What a tgmm kernel body needs to know, fixed at trace time."""

  tm: int
  strips: tuple[Any, ...]  # (K strip, N strip) pairs of ``split_strips``
  layout: Any  # the metadata layout (``tgmm_metadata``)
  has_existing: bool
  in_dtype: jnp.dtype
  out_dtype: jnp.dtype
  buffer_count: int


def _tgmm_step(plan: _TgmmPlan, r: _KernelRefs, acc, bk: int, bn: int):
  """The pipeline body of one (K strip, N strip) of ``bk`` x ``bn`` blocks."""
  tm, layout, in_dtype = plan.tm, plan.layout, plan.in_dtype

  def step(*blocks):
    lhs_b, rhs_b, *blocks = blocks
    existing_b = blocks.pop(0) if plan.has_existing else None
    (out_b,) = blocks
    v = pl.program_id(2)
    tile = r.meta[layout.tile + v]
    lo, hi = r.meta[layout.lo + v], r.meta[layout.hi + v]

    row0 = tile * tm
    first = r.meta[layout.first + v] == 1
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
      x = jnp.where(row_mask(row0, lo, hi, (bk, tm), 1), x, zero)
      w = jnp.where(row_mask(row0, lo, hi, (tm, bn), 0), w, zero)
      accumulate(dot(x, w))

    @pl.when(r.meta[layout.last + v] == 1)
    def _store():
      total = acc[...]
      if existing_b is not None:
        total += existing_b[...].astype(jnp.float32)
      out_b[...] = total.astype(plan.out_dtype)

  return step


def _tgmm_kernel(plan: _TgmmPlan):
  """The tgmm program: one pipeline per (K strip, N strip)."""
  tm, layout = plan.tm, plan.layout
  block_spec = _block_specs(plan.buffer_count)

  names = _KernelRefs.names(plan.has_existing, len(plan.strips))

  @_common.operand_names(names)
  def kernel(*refs):
    r = _KernelRefs.unpack(refs, plan.has_existing)

    def lhs_map(n_i, k_i, v):
      return k_i, r.meta[layout.tile + v]

    def rhs_map(n_i, k_i, v):
      return r.meta[layout.tile + v], n_i

    def out_map(n_i, k_i, v):
      return r.meta[layout.group + v], k_i, n_i

    for (ks, ns), acc in zip(plan.strips, r.accs, strict=True):
      bk, bn = ks.block, ns.block
      k_slice = pl.ds(ks.start, ks.size)
      n_slice = pl.ds(ns.start, ns.size)
      in_specs = [
        block_spec((bk, tm), lhs_map),
        block_spec((tm, bn), rhs_map),
      ]
      in_refs = [r.lhs.at[k_slice, :], r.rhs.at[:, n_slice]]
      if plan.has_existing:
        in_specs.append(block_spec((None, bk, bn), out_map))
        in_refs.append(r.existing.at[:, k_slice, n_slice])
      pltpu.emit_pipeline(
        _tgmm_step(plan, r, acc, bk, bn),
        grid=(ns.size // bn, ks.size // bk, r.num_visits),
        in_specs=in_specs,
        out_specs=[block_spec((None, bk, bn), out_map)],
      )(*in_refs, r.out.at[:, k_slice, n_slice])

  return kernel


def tgmm_call(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  existing_out: jax.Array | None,
  cfg: TgmmConfig,
) -> jax.Array:
  k, m = lhs.shape
  n = rhs.shape[1]
  assert cfg.tiling is not None  # else the windows implementation runs
  tm, tk, tn = cfg.tiling
  num_local = cfg.num_actual_groups
  out_dtype = cfg.preferred_element_type
  meta, layout = tgmm_metadata(
    group_sizes, group_offset, m=m, tm=tm, num_local=num_local
  )
  has_existing = existing_out is not None
  plan = _TgmmPlan(
    tm=tm,
    strips=tuple(
      (ks, ns) for ks in split_strips(k, tk) for ns in split_strips(n, tn)
    ),
    layout=layout,
    has_existing=has_existing,
    in_dtype=input_dtype(lhs, rhs),
    out_dtype=out_dtype,
    buffer_count=cfg.buffer_count,
  )
  scratch = [pltpu.SMEM((layout.length,), jnp.int32)]
  scratch += [
    pltpu.VMEM((ks.block, ns.block), jnp.float32) for ks, ns in plan.strips
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
    [
      (
        _common.single_core_mesh(),
        _common.traced_in_x32(_tgmm_kernel(plan)),
      )
    ],
    out_types=_common.out_type(
      (num_local, k, n), out_dtype, _common.varying_axes(*operands)
    ),
    input_output_aliases={EXISTING_OUT_INDEX: 0} if has_existing else {},
    scratch_types=scratch,
    interpret=cfg.interpret,
    cost_estimate=cost,
    name="tgmm",
  )
  return call(*operands)
