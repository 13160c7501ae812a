"""Collective matmul: ring all-gather fused with matmul, and its twin.

Two kernels, each one ``mpmd_map`` launch per device, called inside
``jax.shard_map``:

* :func:`all_gather_matmul` computes ``all_gather(lhs, axis_name, axis=1,
  tiled=True) @ rhs`` without materialising the gathered ``lhs`` first: the
  shards of ``lhs`` travel around a ring of devices, and the matmul of each
  shard that has arrived (with its block of rows of ``rhs``) runs while the
  next shard is on the wire.
* :func:`matmul_reduce_scatter` computes ``psum_scatter(lhs @ rhs, axis_name,
  scatter_dimension, tiled=True)``: partial sums travel the ring and each
  device adds its own contribution for the block that passes by, computing
  the next block's partial product while the previous one is on the wire.

Schedule (one ring direction; ``D`` devices, ring positions ``p``)::

  all-gather + matmul, at position p:
    step 0      send own shard -> p+1           | acc  = lhs_p     @ rhs[p]
    step t>=1   recv shard p-t, forward -> p+1  | acc += lhs_{p-t} @ rhs[p-t]
  matmul + reduce-scatter, at position p (block b = p-1-s):
    step 0      part = lhs @ rhs[:, b] -> send to p+1
    step s>=1   part = lhs @ rhs[:, b] (while block b+1 arrives from p-1)
                then send part + received -> p+1 (at s = D-1: the output)

With ``bidirectional=True`` the work is split in two halves that travel in
opposite directions (rows of ``lhs`` for the all-gather, the non-scattered
dimension of the output for the reduce-scatter), so each link carries half
the bytes per step and both directions of every ICI link are busy. This
works for every ring length (odd ones too); when the split dimension is odd
the kernel uses the unidirectional schedule instead.

Flow control. Each direction has ``buffering`` receive slots. A sender may
write transfer ``t`` into slot ``t % buffering`` of its neighbour only after
the neighbour has finished with the previous occupant of that slot (computed
with it and forwarded it); the neighbour says so by signalling a "capacity"
semaphore on the sender. With one slot, the receiver first copies the slot
to a local staging buffer and frees the slot at once: forwarding straight
out of the only slot would make every device wait for its neighbour to free
a slot, all around the ring.

Memory. Operands, ring slots and accumulators stay in HBM; the local matmul
of each step is a double-buffered pipeline of ``(block_n, block_k)`` x
``(block_k, block_m)`` tiles through VMEM, so no operand has to fit on chip.
When a reduce-scatter region is a single tile, its partial sums stay on
chip: computed into a VMEM send buffer, the arriving sum added in place, and
sent from there.

Rings. ``axis_name`` may name one mesh axis or several (their flattened
index, in the order given, as ``jax.lax.all_gather`` does); on a 2-D mesh
with ``axis_name="y"`` every row of devices is an independent ring. ``ring``
optionally gives the order in which the ring visits the devices (a
permutation of ``range(D)``), as device-id rings did in the hand-written
Mosaic kernel. Remote DMAs name their target as a dict ``{axis: index}``
over the ring's axes; the other mesh axes keep the sender's coordinate,
which is what makes rows/columns of a multi-axis mesh independent rings.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence
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

__all__ = [
  "BlockSizes",
  "all_gather_matmul",
  "matmul_reduce_scatter",
]

# Tile edge the local pipelines aim for. On TPU, (512, 512) tiles of bf16
# keep two double-buffered operand tiles and an f32 accumulator at about
# 3 MiB of VMEM, well inside the scoped-VMEM default of every TPU
# generation, and make each tile matmul large enough to keep the MXU busy.
# On the CPU fallback every tile is a loop iteration with its copies and
# accumulator round trip, so fewer, larger tiles win: all_gather_matmul at
# D=4, n=m=1024, K=2048 bf16 measured 1.63x XLA with 512 and 1.24x with
# whole-dimension tiles (one interleaved run).
_DEFAULT_BLOCK = {"tpu": 512}
_DEFAULT_BLOCK_ELSEWHERE = 2048
_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# The barrier semaphore handshake of every kernel here uses this collective id.
_COLLECTIVE_ID = 0


class BlockSizes(NamedTuple):
  """Tile sizes of the local matmul pipeline (``None``: pick automatically).

  Each size must divide the dimension it tiles (for the bidirectional
  all-gather that is ``n // 2``; for the reduce-scatter, the rows/columns of
  one scattered block). On TPU, pick multiples of (8, 128) for f32 and
  (16, 128) for bf16, or the whole dimension. Automatic sizes aim at 512 on
  TPU (VMEM) and at 2048 on the CPU fallback (fewer loop iterations).
  """

  block_n: int | None = None
  block_k: int | None = None
  block_m: int | None = None


# ---------------------------------------------------------------------------
# Argument checking (before anything is traced into a kernel).
# ---------------------------------------------------------------------------


class _Ring(NamedTuple):
  """A validated ring: mesh axes, their sizes, and the visiting order."""

  axes: tuple[str, ...]
  sizes: tuple[int, ...]
  # order[p] is the flattened axis index of the device at ring position p.
  order: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.sizes)


def _check_ring(
  fn_name: str, axis_name: Any, ring: Sequence[int] | None
) -> _Ring:
  if isinstance(axis_name, str):
    axes = (axis_name,)
  elif isinstance(axis_name, (tuple, list)) and axis_name:
    axes = tuple(axis_name)
  else:
    raise TypeError(
      f"{fn_name}: expected 'axis_name' to be a mesh axis name (str) or a "
      f"non-empty tuple of them, got {axis_name!r}"
    )
  if not all(isinstance(a, str) for a in axes):
    raise TypeError(
      f"{fn_name}: expected 'axis_name' to hold str axis names, got "
      f"{axis_name!r}"
    )
  if len(set(axes)) != len(axes):
    raise ValueError(
      f"{fn_name}: expected distinct axes in 'axis_name', got {axes!r}"
    )
  mesh = jax.sharding.get_abstract_mesh()
  manual = tuple(getattr(mesh, "manual_axes", ()))
  if mesh.empty or not manual:
    raise ValueError(
      f"{fn_name}: must be called inside jax.shard_map over a mesh with "
      f"axis {axis_name!r} (the kernel exchanges shards between the "
      "devices of that axis), but it was called outside shard_map. Wrap "
      f"the call: jax.shard_map(lambda a, b: {fn_name}(a, b, "
      f"axis_name={axis_name!r}), mesh=mesh, in_specs=..., out_specs=...)"
    )
  for a in axes:
    if a not in mesh.axis_names:
      raise ValueError(
        f"{fn_name}: 'axis_name' {a!r} is not an axis of the enclosing "
        f"shard_map mesh, whose axes are {tuple(mesh.axis_names)!r}"
      )
    if a not in manual:
      raise ValueError(
        f"{fn_name}: 'axis_name' {a!r} is not a manual axis of the "
        f"enclosing shard_map (manual axes: {manual!r}); add it to "
        "shard_map's axis_names"
      )
  sizes = tuple(int(mesh.shape[a]) for a in axes)
  size = math.prod(sizes)
  if ring is None:
    order = tuple(range(size))
  else:
    try:
      if isinstance(ring, str) or any(isinstance(i, bool) for i in ring):
        raise TypeError
      # operator.index, not int(): 1.7 or "1" is not a device index.
      order = tuple(operator.index(i) for i in ring)
    except TypeError:
      raise TypeError(
        f"{fn_name}: expected 'ring' to be a sequence of ints, got {ring!r}"
      ) from None
    if sorted(order) != list(range(size)):
      raise ValueError(
        f"{fn_name}: expected 'ring' to be a permutation of range({size}) "
        f"(the devices along {axes!r}), got {tuple(ring)!r}"
      )
  return _Ring(axes, sizes, order)


def _check_operands(fn_name: str, lhs: Any, rhs: Any, out_dtype: Any):
  for arg_name, x in (("lhs", lhs), ("rhs", rhs)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(
        f"{fn_name}: expected '{arg_name}' to be an array, got "
        f"{type(x).__name__}"
      )
    if len(x.shape) != 2:
      raise ValueError(
        f"{fn_name}: expected '{arg_name}' of rank 2, got shape "
        f"{tuple(x.shape)}"
      )
    if 0 in x.shape:
      raise ValueError(
        f"{fn_name}: expected '{arg_name}' with no zero-sized dimension, "
        f"got shape {tuple(x.shape)}"
      )
    if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
      raise TypeError(
        f"{fn_name}: expected '{arg_name}' of dtype float32 or bfloat16, "
        f"got {jnp.dtype(x.dtype).name}"
      )
  if lhs.dtype != rhs.dtype:
    raise TypeError(
      f"{fn_name}: expected 'lhs' and 'rhs' of the same dtype, got "
      f"{jnp.dtype(lhs.dtype).name} and {jnp.dtype(rhs.dtype).name}"
    )
  try:
    out_dtype = jnp.dtype(out_dtype)
  except TypeError:
    raise TypeError(
      f"{fn_name}: expected 'preferred_element_type' to be a dtype, got "
      f"{out_dtype!r}"
    ) from None
  if out_dtype not in _SUPPORTED_DTYPES:
    raise TypeError(
      f"{fn_name}: expected 'preferred_element_type' float32 or bfloat16, "
      f"got {out_dtype.name}"
    )
  return out_dtype


def _check_flag(fn_name: str, what: str, value: Any) -> bool:
  if not isinstance(value, bool | np.bool_):
    raise TypeError(f"{fn_name}: expected '{what}' to be a bool, got {value!r}")
  return bool(value)


def _check_buffering(fn_name: str, buffering: Any) -> int:
  if isinstance(buffering, bool) or not isinstance(buffering, int):
    raise TypeError(
      f"{fn_name}: expected 'buffering' to be an int, got {buffering!r}"
    )
  if buffering < 1:
    raise ValueError(
      f"{fn_name}: expected 'buffering' >= 1 (receive slots per ring "
      f"direction), got {buffering}"
    )
  return buffering


def _pick_block(
  fn_name: str,
  what: str,
  dim: int,
  requested: int | None,
  platform: str | None = None,
) -> int:
  """The tile edge for a dimension: requested (checked) or automatic, for
  ``platform`` (default: the one kernels are being built for)."""
  if requested is not None:
    if isinstance(requested, bool) or not isinstance(requested, int):
      raise TypeError(
        f"{fn_name}: expected block_sizes.{what} to be an int, got "
        f"{requested!r}"
      )
    if requested <= 0 or dim % requested:
      raise ValueError(
        f"{fn_name}: expected block_sizes.{what} to divide the dimension "
        f"it tiles ({dim}), got {requested}"
      )
    return requested
  platform = targets.platform() if platform is None else platform
  target = _DEFAULT_BLOCK.get(platform, _DEFAULT_BLOCK_ELSEWHERE)
  if dim <= target:
    return dim
  # The largest lane-aligned divisor not above the target; else no tiling.
  for block in range(target, 0, -128):
    if dim % block == 0:
      return block
  return dim


def _check_block_sizes(fn_name: str, block_sizes: Any) -> BlockSizes:
  if block_sizes is None:
    return BlockSizes()
  if not isinstance(block_sizes, BlockSizes):
    raise TypeError(
      f"{fn_name}: expected 'block_sizes' to be a BlockSizes or None, got "
      f"{type(block_sizes).__name__}"
    )
  return block_sizes


# ---------------------------------------------------------------------------
# mpmd_map and the kernel-side building blocks.
# ---------------------------------------------------------------------------


def _launch(
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
  mesh = meshes.tensorcore_mesh("core", num_cores=1)
  return mpmd_map(
    [(mesh, body)],
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


def _out_type(
  shape: tuple[int, ...], dtype: Any, operands: Sequence[jax.Array], ring: _Ring
) -> jax.ShapeDtypeStruct:
  """An output type for ``jax.shard_map(..., check_vma=True)``.

  Outputs vary over the mesh axes the operands vary over, and over the ring's
  axes: even the all-gather matmul's copies on the ring's devices agree only
  up to rounding (each device sums the shards in its own order).
  """
  varying = frozenset().union(
    *(jax.typeof(x).manual_axis_type.varying for x in operands)
  )
  if varying:  # check_vma=True: every manual axis is tracked
    varying |= frozenset(ring.axes)
  return jax.ShapeDtypeStruct(
    shape,
    dtype,
    manual_axis_type=jax.sharding.ManualAxisType(varying=varying),
  )


def _ring_table(ring: _Ring) -> jax.Array:
  """This device's view of the ring, computed outside the kernel.

  Row 0, column j: the flattened axis index of the device j positions
  downstream of this one; row 1 + a: that device's coordinate along
  ``ring.axes[a]``. The kernel reads it from SMEM with static column
  indices. Computing it here (rather than from ``lax.axis_index`` inside the
  kernel) keeps mesh-varying values out of the kernel's jaxpr, which the TPU
  simulator cannot evaluate under ``shard_map(check_vma=True)``, and leaves
  the kernel only scalar loads.
  """
  flat = lax.axis_index(ring.axes[0])
  for a, size in zip(ring.axes[1:], ring.sizes[1:], strict=True):
    flat = flat * size + lax.axis_index(a)
  inverse = [0] * ring.size
  for position, device in enumerate(ring.order):
    inverse[device] = position
  position = jnp.asarray(inverse, jnp.int32)[flat]
  downstream = lax.rem(
    position + jnp.arange(ring.size, dtype=jnp.int32), ring.size
  )
  devices = jnp.asarray(ring.order, jnp.int32)[downstream]
  coords, rest = [], devices
  for size in reversed(ring.sizes):
    coords.append(lax.rem(rest, size))
    rest = rest // size
  return jnp.stack([devices, *reversed(coords)]).astype(jnp.int32)


class _RingCoords:
  """Where this device's ring neighbours are, read from the ring table."""

  def __init__(self, ring: _Ring, table_smem: Any):
    self.ring = ring
    self.table = table_smem
    self._ids: dict[int, dict[str, jax.Array]] = {}

  def device_at(self, offset: int) -> jax.Array:
    """Flattened axis index of the device ``offset`` positions away."""
    return self.table[0, offset % self.ring.size]

  def device_id(self, offset: int) -> dict[str, jax.Array]:
    """Mesh coordinates (along the ring's axes) for a remote DMA/signal.

    Read once per offset, so the first call must be at the kernel's top
    level (not under ``pl.when`` or in a loop body): every
    transfer to a neighbour then names it by the same values, which lets
    the CPU lockstep path reuse what it learnt about the ring.
    """
    column = offset % self.ring.size
    if column not in self._ids:
      self._ids[column] = {
        a: self.table[1 + i, column] for i, a in enumerate(self.ring.axes)
      }
    return self._ids[column]


def _handshake(coords: _RingCoords) -> None:
  """Both ring neighbours are inside this kernel before any remote DMA."""
  barrier = pltpu.get_barrier_semaphore()
  for offset in (-1, 1):
    pl.semaphore_signal(barrier, 1, device_id=coords.device_id(offset))
  pl.semaphore_wait(barrier, 2)


class _TileBuffers(NamedTuple):
  """VMEM scratch of one local matmul pipeline (see ``_matmul``)."""

  lhs: Any  # (2, block_n, block_k) in dtype
  rhs: Any  # (2, block_k, block_m) in dtype
  acc: Any  # (block_n, block_m) f32
  out: Any  # (block_n, block_m) in the output dtype
  extra: Any  # (block_n, block_m) f32: the addend of `_add`
  lhs_sems: Any  # DMA (2,)
  rhs_sems: Any  # DMA (2,)

  @staticmethod
  def scratch_types(dtype, out_dtype, bn: int, bk: int, bm: int):
    return _TileBuffers(
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
  def from_named(named: dict[str, Any]) -> _TileBuffers:
    return _TileBuffers(**{f: named[f"tile_{f}"] for f in _TileBuffers._fields})


def _dot_precision(dtype) -> lax.Precision:
  # f32 operands get full f32 products (the default may use bf16 passes on
  # TPU); bf16 products are exact in f32 anyway.
  if jnp.dtype(dtype) == jnp.float32:
    return lax.Precision.HIGHEST
  return lax.Precision.DEFAULT


def _matmul(
  bufs: _TileBuffers,
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
  precision = _dot_precision(bufs.lhs.dtype)
  acc = bufs.acc if acc is None else acc
  assert dst is not None or ni * nj == 1, "only one tile stays on chip"

  def tile_coords(t):
    kk = lax.rem(t, nk)
    ij = t // nk
    return ij // nj, lax.rem(ij, nj), kk

  def copies(t, slot):
    i, j, kk = tile_coords(t)
    lhs_copy = pltpu.make_async_copy(
      lhs.at[pl.ds(row0 + i * bn, bn), pl.ds(lhs_cols + kk * bk, bk)],
      bufs.lhs.at[slot],
      bufs.lhs_sems.at[slot],
    )
    rhs_copy = pltpu.make_async_copy(
      rhs.at[pl.ds(rhs_rows + kk * bk, bk), pl.ds(col0 + j * bm, bm)],
      bufs.rhs.at[slot],
      bufs.rhs_sems.at[slot],
    )
    return lhs_copy, rhs_copy

  for c in copies(0, 0):
    c.start()

  def tile(t, carry):
    slot = lax.rem(t, 2)
    i, j, kk = tile_coords(t)

    @pl.when(t + 1 < num_tiles)
    def _():
      for c in copies(t + 1, 1 - slot):
        c.start()

    dst_tile = (pl.ds(i * bn, bn), pl.ds(j * bm, bm))

    if init is not None:

      @pl.when(kk == 0)
      def _():
        pltpu.sync_copy(init.at[dst_tile], acc)

    for c in copies(t, slot):
      c.wait()
    product = jnp.dot(
      bufs.lhs[slot],
      bufs.rhs[slot],
      preferred_element_type=jnp.float32,
      precision=precision,
    )
    if init is None:
      # The first K tile sets the accumulator: no zeroing pass.
      @pl.when(kk == 0)
      def _():
        acc[...] = product

      @pl.when(kk > 0)
      def _():
        acc[...] += product

    else:
      acc[...] += product

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


def _add(bufs: _TileBuffers, a: Any, b: Any, dst: Any) -> None:
  """``dst = a + b`` over region-sized f32 HBM refs, tile by tile."""
  _, bn, _ = bufs.lhs.shape
  _, _, bm = bufs.rhs.shape
  nrows, ncols = dst.shape
  ni, nj = nrows // bn, ncols // bm

  def tile(t, carry):
    i, j = t // nj, lax.rem(t, nj)
    region = (pl.ds(i * bn, bn), pl.ds(j * bm, bm))
    pltpu.sync_copy(a.at[region], bufs.acc)
    pltpu.sync_copy(b.at[region], bufs.extra)
    if dst.dtype == jnp.float32:
      bufs.acc[...] += bufs.extra[...]
      pltpu.sync_copy(bufs.acc, dst.at[region])
    else:
      bufs.out[...] = (bufs.acc[...] + bufs.extra[...]).astype(dst.dtype)
      pltpu.sync_copy(bufs.out, dst.at[region])
    return carry

  lax.fori_loop(0, ni * nj, tile, 0)


def _add_to_held(
  bufs: _TileBuffers, held: Any, b: Any, dst: Any | None
) -> None:
  """``dst = held + b``: ``held`` a one-tile f32 region in VMEM (see
  ``_matmul(dst=None)``), ``b`` and ``dst`` HBM refs of its shape;
  ``dst=None`` adds in place."""
  pltpu.sync_copy(b, bufs.extra)
  if dst is None or dst.dtype == jnp.float32:
    held[...] += bufs.extra[...]
    if dst is not None:
      pltpu.sync_copy(held, dst)
  else:
    bufs.out[...] = (held[...] + bufs.extra[...]).astype(dst.dtype)
    pltpu.sync_copy(bufs.out, dst)


def _remote_copy(src: Any, dst: Any, send_sem: Any, recv_sem: Any, device_id):
  return pltpu.make_async_remote_copy(
    src, dst, send_sem, recv_sem, device_id=device_id
  )


class _Stream(NamedTuple):
  """One ring direction: +1 sends to the next ring position, -1 back."""

  offset: int
  tag: str
  # Static (start, size) of the part of the work this direction carries.
  start: int
  size: int


def _streams(size: int, bidirectional: bool) -> tuple[_Stream, ...]:
  if bidirectional and size % 2 == 0:
    half = size // 2
    return (_Stream(1, "cw", 0, half), _Stream(-1, "ccw", half, half))
  return (_Stream(1, "cw", 0, size),)


def _named_refs(refs, num_inputs: int, names: Sequence[str]):
  inputs = refs[:num_inputs]
  named = dict(zip(names, refs[num_inputs:], strict=True))
  return inputs, named


# ---------------------------------------------------------------------------
# all_gather_matmul
# ---------------------------------------------------------------------------


def _ring_scratch(scratch, ring: _Ring, num: int, streams, slots: int):
  """Adds the ring table (SMEM) and, per stream, the send / receive DMA
  semaphores and the capacity semaphore to a kernel's named scratch."""
  scratch["ring_table"] = pltpu.SMEM((1 + len(ring.axes), num), jnp.int32)
  for st in streams:
    scratch[f"send_{st.tag}"] = pltpu.SemaphoreType.DMA
    scratch[f"recv_{st.tag}"] = pltpu.SemaphoreType.DMA((slots,))
    scratch[f"cap_{st.tag}"] = pltpu.SemaphoreType.REGULAR
  return scratch


class _AgConfig(NamedTuple):
  """Static configuration of one all-gather matmul (hashable)."""

  ring: _Ring
  bidirectional: bool
  buffering: int
  out_dtype: Any
  block_sizes: BlockSizes
  interpret: Interpret


def _ag_kernel_call(
  config: _AgConfig, lhs: jax.Array, rhs: jax.Array, *, return_gathered: bool
):
  fn_name = "all_gather_matmul"
  ring = config.ring
  num = ring.size
  n, k_local = lhs.shape
  k_total, m = rhs.shape
  dtype = jnp.dtype(lhs.dtype)
  out_dtype = config.out_dtype
  streams = _streams(n, config.bidirectional) if num > 1 else ()
  rows = streams[0].size if streams else n
  bn = _pick_block(fn_name, "block_n", rows, config.block_sizes.block_n)
  bk = _pick_block(fn_name, "block_k", k_local, config.block_sizes.block_k)
  bm = _pick_block(fn_name, "block_m", m, config.block_sizes.block_m)
  # Slots beyond the number of transfers would never be used.
  slots = min(config.buffering, max(num - 1, 1))
  last = num - 2  # index of the last ring transfer

  outs: dict[str, Any] = {"out": _out_type((n, m), out_dtype, (lhs, rhs), ring)}
  acc_in_out = out_dtype == jnp.float32 or num == 1
  if not acc_in_out:
    outs["acc"] = _out_type((n, m), jnp.float32, (lhs, rhs), ring)
  # Ring buffers live in HBM. They are outputs of the launch (and dropped
  # afterwards) rather than scratch so that remote DMAs may target them on
  # every execution path.
  for st in streams:
    for i in range(slots):
      outs[f"slots_{st.tag}_{i}"] = _out_type(
        (st.size, k_local), dtype, (lhs,), ring
      )
    if slots == 1:
      outs[f"stage_{st.tag}"] = _out_type(
        (st.size, k_local), dtype, (lhs,), ring
      )
  if return_gathered:
    outs["gathered"] = _out_type((n, k_total), dtype, (lhs,), ring)
  scratch = _ring_scratch(
    _TileBuffers.scratch_types(dtype, out_dtype, bn, bk, bm).named(),
    ring,
    num,
    streams,
    slots,
  )
  names = (*outs, *scratch)

  def body(*refs):
    (table_ref, lhs_ref, rhs_ref), r = _named_refs(refs, 3, names)
    bufs = _TileBuffers.from_named(r)
    out_ref = r["out"]
    acc_ref = out_ref if acc_in_out else r["acc"]
    pltpu.sync_copy(table_ref, r["ring_table"])
    coords = _RingCoords(ring, r["ring_table"])
    me = coords.device_at(0)

    def local_matmul(src, st_start, st_size, origin, *, first, final):
      region = pl.ds(st_start, st_size)
      _matmul(
        bufs,
        src,
        rhs_ref,
        (out_ref if final else acc_ref).at[region],
        rows=(0, st_size),
        lhs_cols=0,
        rhs_rows=origin * k_local,
        cols=(0, m),
        k=k_local,
        init=None if first else acc_ref.at[region],
      )

    if return_gathered:
      pltpu.sync_copy(
        lhs_ref, r["gathered"].at[:, pl.ds(me * k_local, k_local)]
      )
    if not streams:
      local_matmul(lhs_ref, 0, n, me, first=True, final=True)
      return

    _handshake(coords)

    def transfer(st, src, t):
      # Transfer t lands in slot t % slots of the downstream neighbour.
      return _remote_copy(
        src,
        r[f"slots_{st.tag}_{t % slots}"],
        r[f"send_{st.tag}"],
        r[f"recv_{st.tag}"].at[t % slots],
        coords.device_id(st.offset),
      )

    for st in streams:
      transfer(st, lhs_ref.at[pl.ds(st.start, st.size)], 0).start()
    for st in streams:
      local_matmul(
        lhs_ref.at[pl.ds(st.start, st.size)],
        st.start,
        st.size,
        me,
        first=True,
        final=False,
      )

    for t in range(num - 1):
      sources = []
      if slots > 1:
        # Slot (t-1) % slots was computed with at t-1 and forwarded by our
        # transfer t: once that has left, transfer t-1+slots may refill
        # it. Both directions say so before waiting for what arrives, so
        # that (on the CPU lockstep path) the signals travel in one
        # exchange with the data.
        for st in streams:
          slot_ref = r[f"slots_{st.tag}_{t % slots}"]
          transfer(st, slot_ref, t).wait_send()
          if t >= 1 and t - 1 + slots <= last:
            pl.semaphore_signal(
              r[f"cap_{st.tag}"], 1, device_id=coords.device_id(-st.offset)
            )
      for st in streams:
        slot_ref = r[f"slots_{st.tag}_{t % slots}"]
        incoming = transfer(st, slot_ref, t)
        incoming.wait_recv()
        if slots == 1:
          incoming.wait_send()  # our own transfer t, same shape
          # Free the only slot at once (see the module docstring).
          src = r[f"stage_{st.tag}"]
          pltpu.sync_copy(slot_ref, src)
          if t + 1 <= last:
            pl.semaphore_signal(
              r[f"cap_{st.tag}"], 1, device_id=coords.device_id(-st.offset)
            )
        else:
          src = slot_ref
        if t + 1 <= last:
          if t + 1 >= slots:
            pl.semaphore_wait(r[f"cap_{st.tag}"], 1)
          transfer(st, src, t + 1).start()
        sources.append(src)
      for st, src in zip(streams, sources, strict=True):
        origin = coords.device_at(-st.offset * (t + 1))
        if return_gathered:
          pltpu.sync_copy(
            src,
            r["gathered"].at[
              pl.ds(st.start, st.size), pl.ds(origin * k_local, k_local)
            ],
          )
        local_matmul(
          src, st.start, st.size, origin, first=False, final=t == num - 2
        )

  call = _launch(
    body,
    out_types=tuple(outs.values()),
    scratch_types=tuple(scratch.values()),
    collective=num > 1,
    interpret=config.interpret,
    name="all_gather_matmul",
    flops=2 * n * k_total * m,
    bytes_accessed=(n * k_total + k_total * m) * dtype.itemsize
    + n * m * out_dtype.itemsize,
  )
  results = dict(zip(outs, call(_ring_table(ring), lhs, rhs), strict=True))
  return results["out"], results.get("gathered")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ag_matmul(config: _AgConfig, lhs: jax.Array, rhs: jax.Array):
  out, _ = _ag_kernel_call(config, lhs, rhs, return_gathered=False)
  return out


def _ag_matmul_fwd(config, lhs, rhs):
  out, gathered = _ag_kernel_call(config, lhs, rhs, return_gathered=True)
  return out, (gathered, rhs)


def _ag_matmul_bwd(config, residuals, d_out):
  # out = G @ rhs with G = all_gather(lhs). d_G = d_out @ rhs^T is needed on
  # every device but lhs's shard only gets its own columns, summed over the
  # ring: a matmul + reduce-scatter along the columns. d_rhs is local.
  gathered, rhs = residuals
  dtype = gathered.dtype
  d_out = d_out.astype(dtype)
  rs_config = _RsConfig(
    ring=config.ring,
    scatter_dimension=1,
    bidirectional=config.bidirectional,
    buffering=config.buffering,
    out_dtype=jnp.dtype(jnp.float32),
    block_sizes=BlockSizes(),
    interpret=config.interpret,
  )
  d_lhs = _rs_matmul(rs_config, d_out, rhs.T)
  d_rhs = jnp.dot(
    gathered.T,
    d_out,
    preferred_element_type=jnp.float32,
    precision=_dot_precision(dtype),
  )
  return d_lhs.astype(dtype), d_rhs.astype(dtype)


_ag_matmul.defvjp(_ag_matmul_fwd, _ag_matmul_bwd)


def all_gather_matmul(
  lhs: jax.Array,
  rhs: jax.Array,
  *,
  axis_name: str | tuple[str, ...],
  bidirectional: bool = True,
  buffering: int = 2,
  preferred_element_type: Any = jnp.float32,
  block_sizes: BlockSizes | None = None,
  ring: Sequence[int] | None = None,
  interpret: Interpret = None,
) -> jax.Array:
  """``all_gather(lhs, axis_name, axis=1, tiled=True) @ rhs``, fused.

  Call inside ``jax.shard_map``. The shards of ``lhs`` travel around the ring
  of devices along ``axis_name`` while each device multiplies the shards
  that have arrived with the matching rows of its ``rhs``; see the module
  docstring for the schedule. Differentiable: the VJP is a
  :func:`matmul_reduce_scatter` (for ``lhs``) and a local matmul with the
  gathered ``lhs`` that the forward kernel keeps (for ``rhs``).

  Args:
    lhs: local shard ``(n, k_local)``, float32 or bfloat16; the global
      operand is sharded along its columns (the contraction) over
      ``axis_name``.
    rhs: local ``(k_local * D, m)`` of the same dtype, ``D`` the ring length.
    axis_name: the mesh axis of the ring, or a tuple of axes (flattened in
      the order given, as ``jax.lax.all_gather`` does). On a multi-axis
      mesh, the devices that differ only along these axes form one ring.
    bidirectional: split the rows of ``lhs`` in two halves travelling in
      opposite directions (any ring length; needs ``n`` even, otherwise the
      unidirectional schedule is used).
    buffering: receive slots per ring direction (1, 2, 4, ...): how far a
      device may run ahead of its neighbour.
    preferred_element_type: output dtype, float32 (default) or bfloat16;
      accumulation is always in float32.
    block_sizes: tiles of the local matmul pipeline (see :class:`BlockSizes`).
    ring: order in which the ring visits the devices, a permutation of
      ``range(D)`` of flattened axis indices; default ``0, 1, ..., D-1``.
      The result does not depend on it (only the communication pattern).
    interpret: passed to ``mpmd.mpmd_map``: ``None`` compiles on TPU and
      runs the CPU fallback on CPU; a ``pltpu.InterpretParams`` forces the
      TPU simulator (e.g. with ``detect_races=True``).

  Returns:
    ``(n, m)`` array of ``preferred_element_type``, equal on every device of
    the ring.

  Raises:
    ValueError: called outside ``shard_map``, ``axis_name`` not a manual
      axis of the mesh, ``rhs.shape[0] != k_local * D``, bad ``ring``,
      ``buffering`` or block sizes.
    TypeError: unsupported or mismatched dtypes, non-array operands.

  Example:
    >>> mesh = jax.make_mesh((4,), ("x",))
    >>> lhs = jnp.ones((8, 512), jnp.bfloat16)  # sharded along K
    >>> rhs = jnp.ones((512, 128), jnp.bfloat16)  # replicated
    >>> f = jax.jit(jax.shard_map(
    ...     functools.partial(all_gather_matmul, axis_name="x"),
    ...     mesh=mesh, in_specs=(P(None, "x"), P()), out_specs=P(),
    ...     check_vma=False))
    >>> f(jax.device_put(lhs, NamedSharding(mesh, P(None, "x"))),
    ...   jax.device_put(rhs, NamedSharding(mesh, P()))).shape
    (8, 128)
  """
  fn_name = "all_gather_matmul"
  out_dtype = _check_operands(fn_name, lhs, rhs, preferred_element_type)
  ring_ = _check_ring(fn_name, axis_name, ring)
  n, k_local = lhs.shape
  if rhs.shape[0] != k_local * ring_.size:
    raise ValueError(
      f"{fn_name}: expected 'rhs' with k_local * ring = {k_local} * "
      f"{ring_.size} = {k_local * ring_.size} rows (lhs is {tuple(lhs.shape)}"
      f", ring {ring_.axes!r} has {ring_.size} devices), got "
      f"rhs.shape[0] = {rhs.shape[0]}"
    )
  config = _AgConfig(
    ring=ring_,
    bidirectional=_check_flag(fn_name, "bidirectional", bidirectional),
    buffering=_check_buffering(fn_name, buffering),
    out_dtype=out_dtype,
    block_sizes=_check_block_sizes(fn_name, block_sizes),
    interpret=interpret,
  )
  # Check the tiles now, not deep inside the kernel trace.
  streams = _streams(n, config.bidirectional) if ring_.size > 1 else ()
  rows = streams[0].size if streams else n
  _pick_block(fn_name, "block_n", rows, config.block_sizes.block_n)
  _pick_block(fn_name, "block_k", k_local, config.block_sizes.block_k)
  _pick_block(fn_name, "block_m", rhs.shape[1], config.block_sizes.block_m)
  return _ag_matmul(config, lhs, rhs)


# ---------------------------------------------------------------------------
# matmul_reduce_scatter
# ---------------------------------------------------------------------------


class _RsConfig(NamedTuple):
  """Static configuration of one matmul + reduce-scatter (hashable)."""

  ring: _Ring
  scatter_dimension: int
  bidirectional: bool
  buffering: int
  out_dtype: Any
  block_sizes: BlockSizes
  interpret: Interpret


def _rs_geometry(config: _RsConfig, n: int, m: int):
  """Scattered block shape and the directions that split it."""
  num = config.ring.size
  if config.scatter_dimension == 0:
    block = (n // num, m)
    split = m  # each direction carries some of the columns
  else:
    block = (n, m // num)
    split = n  # ... or some of the rows
  streams = _streams(split, config.bidirectional) if num > 1 else ()
  if streams:
    region = (
      (block[0], streams[0].size)
      if config.scatter_dimension == 0
      else (streams[0].size, block[1])
    )
  else:
    region = block
  return block, streams, region


def _rs_kernel_call(config: _RsConfig, lhs: jax.Array, rhs: jax.Array):
  fn_name = "matmul_reduce_scatter"
  ring = config.ring
  num = ring.size
  n, k = lhs.shape
  _, m = rhs.shape
  dtype = jnp.dtype(lhs.dtype)
  out_dtype = config.out_dtype
  dim = config.scatter_dimension
  block, streams, region = _rs_geometry(config, n, m)
  bn = _pick_block(fn_name, "block_n", region[0], config.block_sizes.block_n)
  bk = _pick_block(fn_name, "block_k", k, config.block_sizes.block_k)
  bm = _pick_block(fn_name, "block_m", region[1], config.block_sizes.block_m)
  slots = min(config.buffering, max(num - 1, 1))
  last = num - 2

  # A region of one tile stays on chip: each step's partial product is
  # computed into a VMEM send buffer, the arriving running sum is added in
  # place, and the remote DMA leaves from VMEM. Larger regions park the
  # partial product and the send buffers in HBM.
  on_chip = region == (bn, bm)
  outs: dict[str, Any] = {"out": _out_type(block, out_dtype, (lhs, rhs), ring)}
  f32 = jnp.float32
  for st in streams:
    operands = (lhs, rhs)
    if not on_chip:
      outs[f"part_{st.tag}"] = _out_type(region, f32, operands, ring)
      for i in range(2):
        outs[f"send_buf_{st.tag}_{i}"] = _out_type(region, f32, operands, ring)
    for i in range(slots):
      outs[f"slots_{st.tag}_{i}"] = _out_type(region, f32, operands, ring)
  scratch = _ring_scratch(
    _TileBuffers.scratch_types(dtype, out_dtype, bn, bk, bm).named(),
    ring,
    num,
    streams,
    slots,
  )
  if on_chip:
    for st in streams:
      for i in range(2):
        scratch[f"send_buf_{st.tag}_{i}"] = pltpu.VMEM(region, f32)
  names = (*outs, *scratch)

  def body(*refs):
    (table_ref, lhs_ref, rhs_ref), r = _named_refs(refs, 3, names)
    bufs = _TileBuffers.from_named(r)
    out_ref = r["out"]
    pltpu.sync_copy(table_ref, r["ring_table"])
    coords = _RingCoords(ring, r["ring_table"])

    def out_region(st):
      # The part of the output block this direction produces.
      if dim == 0:
        return out_ref.at[:, pl.ds(st.start, st.size)]
      return out_ref.at[pl.ds(st.start, st.size)]

    def partial_product(st, block_index, dst, acc=None):
      if dim == 0:
        rows = (block_index * block[0], block[0])
        cols = (st.start, st.size)
      else:
        rows = (st.start, st.size)
        cols = (block_index * block[1], block[1])
      _matmul(
        bufs,
        lhs_ref,
        rhs_ref,
        dst,
        rows=rows,
        lhs_cols=0,
        rhs_rows=0,
        cols=cols,
        k=k,
        init=None,
        acc=acc,
      )

    if not streams:
      _matmul(
        bufs,
        lhs_ref,
        rhs_ref,
        out_ref,
        rows=(0, n),
        lhs_cols=0,
        rhs_rows=0,
        cols=(0, m),
        k=k,
        init=None,
      )
      return

    _handshake(coords)

    def transfer(st, s):
      # Transfer s carries send_buf[s % 2] to slot s % slots downstream.
      return _remote_copy(
        r[f"send_buf_{st.tag}_{s % 2}"],
        r[f"slots_{st.tag}_{s % slots}"],
        r[f"send_{st.tag}"],
        r[f"recv_{st.tag}"].at[s % slots],
        coords.device_id(st.offset),
      )

    for s in range(num):
      # Block of the device 1 + s positions upstream: it reaches that device
      # after the remaining num - 1 - s hops.
      for st in streams:
        block_index = coords.device_at(-st.offset * (1 + s))
        send_buf = r[f"send_buf_{st.tag}_{s % 2}"]
        if on_chip:
          partial_product(st, block_index, None, acc=send_buf)
        elif s == 0:
          partial_product(st, block_index, send_buf)
        else:
          partial_product(st, block_index, r[f"part_{st.tag}"])
      if s >= 1:
        for st in streams:
          incoming = transfer(st, s - 1)
          incoming.wait_recv()
          send_buf = r[f"send_buf_{st.tag}_{s % 2}"]
          arrived = r[f"slots_{st.tag}_{(s - 1) % slots}"]
          final = out_region(st) if s == num - 1 else None
          if on_chip:
            _add_to_held(bufs, send_buf, arrived, final)
          else:
            dst = send_buf if final is None else final
            _add(bufs, r[f"part_{st.tag}"], arrived, dst)
          if (s - 1) + slots <= last:
            pl.semaphore_signal(
              r[f"cap_{st.tag}"],
              1,
              device_id=coords.device_id(-st.offset),
            )
      if s <= last:
        for st in streams:
          if s >= 1:
            transfer(st, s - 1).wait_send()
          if s >= slots:
            pl.semaphore_wait(r[f"cap_{st.tag}"], 1)
          transfer(st, s).start()
    for st in streams:
      transfer(st, last).wait_send()

  bytes_in = (n * k + k * m) * dtype.itemsize
  call = _launch(
    body,
    out_types=tuple(outs.values()),
    scratch_types=tuple(scratch.values()),
    collective=num > 1,
    interpret=config.interpret,
    name="matmul_reduce_scatter",
    flops=2 * n * k * m + n * m,
    bytes_accessed=bytes_in + block[0] * block[1] * out_dtype.itemsize,
  )
  return call(_ring_table(ring), lhs, rhs)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rs_matmul(config: _RsConfig, lhs: jax.Array, rhs: jax.Array):
  return _rs_kernel_call(config, lhs, rhs)


def _rs_matmul_fwd(config, lhs, rhs):
  return _rs_kernel_call(config, lhs, rhs), (lhs, rhs)


def _rs_matmul_bwd(config, residuals, d_out):
  # out = scatter(Z), Z = lhs @ rhs: d_Z = all_gather(d_out) along the
  # scattered dimension. The half of the VJP that contracts over that
  # dimension is an all-gather matmul; the other half is a local matmul
  # with the gathered d_out that the all-gather kernel keeps.
  lhs, rhs = residuals
  dtype = lhs.dtype
  d_out = d_out.astype(dtype)
  ag_config = _AgConfig(
    ring=config.ring,
    bidirectional=config.bidirectional,
    buffering=config.buffering,
    out_dtype=jnp.dtype(jnp.float32),
    block_sizes=BlockSizes(),
    interpret=config.interpret,
  )
  precision = _dot_precision(dtype)
  if config.scatter_dimension == 0:
    # d_rhs^T = all_gather(d_out^T, axis=1) @ lhs; d_lhs = d_Z @ rhs^T.
    d_rhs_t, d_z_t = _ag_kernel_call(
      ag_config, d_out.T, lhs, return_gathered=True
    )
    d_rhs = d_rhs_t.T
    d_lhs = jnp.dot(
      d_z_t.T, rhs.T, preferred_element_type=jnp.float32, precision=precision
    )
  else:
    # d_lhs = all_gather(d_out, axis=1) @ rhs^T; d_rhs = lhs^T @ d_Z.
    d_lhs, d_z = _ag_kernel_call(ag_config, d_out, rhs.T, return_gathered=True)
    d_rhs = jnp.dot(
      lhs.T, d_z, preferred_element_type=jnp.float32, precision=precision
    )
  return d_lhs.astype(dtype), d_rhs.astype(dtype)


_rs_matmul.defvjp(_rs_matmul_fwd, _rs_matmul_bwd)


def matmul_reduce_scatter(
  lhs: jax.Array,
  rhs: jax.Array,
  *,
  axis_name: str | tuple[str, ...],
  scatter_dimension: int = 0,
  bidirectional: bool = True,
  buffering: int = 2,
  preferred_element_type: Any = jnp.float32,
  block_sizes: BlockSizes | None = None,
  ring: Sequence[int] | None = None,
  interpret: Interpret = None,
) -> jax.Array:
  """``psum_scatter(lhs @ rhs, axis_name, scatter_dimension, tiled=True)``.

  Call inside ``jax.shard_map``. Each device's partial product ``lhs @ rhs``
  is cut into ``D`` blocks along ``scatter_dimension``; the running sums of
  the blocks travel the ring, and every device adds its own partial block
  to the sum passing by, computing the next block while the previous sum is
  on the wire. Differentiable: the VJP is an :func:`all_gather_matmul` plus
  a local matmul with the gathered cotangent.

  Args:
    lhs: local ``(n, k)``, float32 or bfloat16 (typically the contraction
      dimension is sharded over ``axis_name``, making ``lhs @ rhs`` a
      partial sum).
    rhs: local ``(k, m)`` of the same dtype.
    axis_name: the mesh axis of the ring, or a tuple of axes (see
      :func:`all_gather_matmul`).
    scatter_dimension: 0 (rows) or 1 (columns) of ``lhs @ rhs``; must be
      divisible by ``D``.
    bidirectional: split each block in two halves (along the other
      dimension) travelling in opposite directions; needs that dimension
      even, otherwise the unidirectional schedule is used.
    buffering: receive slots per ring direction.
    preferred_element_type: output dtype, float32 (default) or bfloat16;
      partial sums always travel and accumulate in float32.
    block_sizes: tiles of the local matmul pipeline (see :class:`BlockSizes`).
    ring: ring order, as in :func:`all_gather_matmul`.
    interpret: passed to ``mpmd.mpmd_map`` (see :func:`all_gather_matmul`).

  Returns:
    ``(n // D, m)`` (``scatter_dimension=0``) or ``(n, m // D)`` array of
    ``preferred_element_type``: this device's block of the summed product.

  Raises:
    ValueError: called outside ``shard_map``, ``axis_name`` not a manual
      axis of the mesh, contraction mismatch, scattered dimension not
      divisible by ``D``, bad ``scatter_dimension``, ``ring``, ``buffering``
      or block sizes.
    TypeError: unsupported or mismatched dtypes, non-array operands.

  Example:
    >>> mesh = jax.make_mesh((4,), ("x",))
    >>> lhs = jnp.ones((64, 512), jnp.bfloat16)  # sharded along K
    >>> rhs = jnp.ones((512, 128), jnp.bfloat16)  # sharded along K
    >>> f = jax.jit(jax.shard_map(
    ...     functools.partial(matmul_reduce_scatter, axis_name="x"),
    ...     mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x"),
    ...     check_vma=False))
    >>> f(jax.device_put(lhs, NamedSharding(mesh, P(None, "x"))),
    ...   jax.device_put(rhs, NamedSharding(mesh, P("x")))).shape
    (64, 128)
  """
  fn_name = "matmul_reduce_scatter"
  out_dtype = _check_operands(fn_name, lhs, rhs, preferred_element_type)
  ring_ = _check_ring(fn_name, axis_name, ring)
  n, k = lhs.shape
  if rhs.shape[0] != k:
    raise ValueError(
      f"{fn_name}: expected 'rhs' with lhs.shape[1] = {k} rows (the "
      f"contraction), got rhs.shape = {tuple(rhs.shape)}"
    )
  if scatter_dimension not in (0, 1) or isinstance(scatter_dimension, bool):
    raise ValueError(
      f"{fn_name}: expected 'scatter_dimension' 0 or 1, got "
      f"{scatter_dimension!r}"
    )
  m = rhs.shape[1]
  scattered = (n, m)[scatter_dimension]
  if scattered % ring_.size:
    raise ValueError(
      f"{fn_name}: expected dimension {scatter_dimension} of lhs @ rhs "
      f"({scattered}) to be divisible by the ring length {ring_.size} "
      f"(axis {axis_name!r}), got {scattered} % {ring_.size} = "
      f"{scattered % ring_.size}"
    )
  config = _RsConfig(
    ring=ring_,
    scatter_dimension=scatter_dimension,
    bidirectional=_check_flag(fn_name, "bidirectional", bidirectional),
    buffering=_check_buffering(fn_name, buffering),
    out_dtype=out_dtype,
    block_sizes=_check_block_sizes(fn_name, block_sizes),
    interpret=interpret,
  )
  _, _, region = _rs_geometry(config, n, m)
  _pick_block(fn_name, "block_n", region[0], config.block_sizes.block_n)
  _pick_block(fn_name, "block_k", k, config.block_sizes.block_k)
  _pick_block(fn_name, "block_m", region[1], config.block_sizes.block_m)
  return _rs_matmul(config, lhs, rhs)
