"""``implementation="direct"``: every device DMAs straight to every other
device.

The ring hides each transfer behind a matmul. On the CPU fallback nothing
overlaps (the devices run in step, and every exchange between them is a
rendezvous of all of them), so there the kernels default to a schedule with
one exchange instead of ``D - 1`` (its data in one ``all_gather``; blocks
too large to gather everywhere move by one ring shift per peer, each a
rendezvous of its own, see ``mpmd._lowering.exchange``):

  all-gather + matmul:   send own shard to every other device, wait for
                         the D - 1 others, gather, one matmul of it all
  matmul + reduce-scatter: one matmul of the whole partial product, send
                         block b to device b, wait for the D - 1 others,
                         sum own block + arrived blocks (upstream order)

It is a valid TPU kernel too (remote DMAs to non-neighbours are routed), so
``implementation="direct"`` also lowers for TPU, where the ring is faster
(and ``implementation="ring"`` runs on the CPU fallback).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mpmd.kernels._common import operand_names
from mpmd.kernels.collective_matmul._reduce_scatter import rs_geometry
from mpmd.kernels.collective_matmul._ring import (
  RingCoords,
  handshake,
)
from mpmd.kernels.collective_matmul._tiles import (
  TileBuffers,
  add_all,
  launch,
  matmul_whole,
  named_refs,
  out_type,
  remote_copy,
)
from mpmd.kernels.collective_matmul.checks import pick_block, pick_blocks


class SumBuffers(NamedTuple):
  """VMEM scratch of ``tiles.add_all`` (one output tile)."""

  acc: Any  # (block_n, block_m) f32
  extra: Any  # (block_n, block_m) f32
  out: Any  # (block_n, block_m) in the output dtype


def _scratch(dtype, out_dtype, tiles) -> dict[str, Any]:
  scratch = TileBuffers.scratch_types(dtype, out_dtype, *tiles).named()
  scratch["send"] = pltpu.SemaphoreType.DMA
  scratch["recv"] = pltpu.SemaphoreType.DMA
  return scratch


def _others(num: int) -> range:
  """Ring offsets of the other devices."""
  return range(1, num)


def ag_direct_call(config, lhs: jax.Array, rhs: jax.Array, *, return_gathered):
  """``all_gather_matmul`` by direct DMAs (``config``: an ``AgConfig``)."""
  ring = config.ring
  num = ring.size
  n, k_local = lhs.shape
  k_total, m = rhs.shape
  dtype = jnp.dtype(lhs.dtype)
  tiles = pick_blocks("all_gather_matmul", config.block_sizes, n, k_total, m)
  outs = {
    "out": out_type((n, m), config.out_dtype, (lhs, rhs), ring),
    "gathered": out_type((n, k_total), dtype, (lhs,), ring),
  }
  # Slot j receives the shard of the device j positions upstream: HBM
  # outputs (dropped) so that remote DMAs may target them on every path.
  # One each, then copied into ``gathered``: landing a shard in a window of
  # one large buffer would, on the CPU fallback, thread the whole buffer
  # through a conditional (jax 0.10.2's XLA copies it there).
  for j in _others(num):
    outs[f"slot_{j}"] = out_type((n, k_local), dtype, (lhs,), ring)
  scratch = _scratch(dtype, config.out_dtype, tiles)
  names = (*outs, *scratch)

  @operand_names(("lhs", "rhs", *names))
  def body(*refs):
    (lhs_ref, rhs_ref), r = named_refs(refs, 2, names)
    coords = RingCoords(ring)

    def columns(offset):
      # Every device's shard goes in the columns of its flattened index.
      origin = coords.device_at(offset)
      return r["gathered"].at[:, pl.ds(origin * k_local, k_local)]

    pltpu.sync_copy(lhs_ref, columns(0))
    handshake(coords, _others(num))
    copies = [
      remote_copy(
        lhs_ref, r[f"slot_{j}"], r["send"], r["recv"], coords.device_id(j)
      )
      for j in _others(num)
    ]
    for copy in copies:
      copy.start()
    # One semaphore counts every arrival's bytes (the same from every
    # device): only after all of them is any one slot sure to be full.
    for copy in copies:
      copy.wait_recv()
    for j in _others(num):
      pltpu.sync_copy(r[f"slot_{j}"], columns(-j))
    for copy in copies:
      copy.wait_send()
    matmul_whole(TileBuffers.from_named(r), r["gathered"], rhs_ref, r["out"])

  call = launch(
    body,
    out_types=tuple(outs.values()),
    scratch_types=tuple(scratch.values()),
    collective=True,
    interpret=config.interpret,
    name="all_gather_matmul",
    flops=2 * n * k_total * m,
    bytes_accessed=(n * k_total + k_total * m) * dtype.itemsize
    + n * m * config.out_dtype.itemsize,
  )
  out, gathered, *_ = call(lhs, rhs)
  return out, gathered if return_gathered else None


def _rs_direct_buffers(config, lhs, rhs, block):
  """The launch's outputs and scratch, by name (see ``named_refs``)."""
  fn_name = "matmul_reduce_scatter"
  ring = config.ring
  n, k = lhs.shape
  _, m = rhs.shape
  out_dtype = config.out_dtype
  tiles = pick_blocks(fn_name, config.block_sizes, n, k, m)
  # The sums tile the block automatically (block_sizes tile the matmul).
  sum_n = pick_block(fn_name, "block_n", block[0], None)
  sum_m = pick_block(fn_name, "block_m", block[1], None)
  f32 = jnp.float32
  operands = (lhs, rhs)
  outs = {
    "out": out_type(block, out_dtype, operands, ring),
    "product": out_type((n, m), f32, operands, ring),
  }
  # Slot j receives from the device j positions upstream: one buffer each,
  # so that landing a block (in a conditional, on the CPU fallback) threads
  # only that block through it.
  for j in _others(ring.size):
    outs[f"slot_{j}"] = out_type(block, f32, operands, ring)
  scratch = _scratch(jnp.dtype(lhs.dtype), out_dtype, tiles)
  sums = SumBuffers(
    acc=pltpu.VMEM((sum_n, sum_m), f32),
    extra=pltpu.VMEM((sum_n, sum_m), f32),
    out=pltpu.VMEM((sum_n, sum_m), out_dtype),
  )
  scratch.update({f"sum_{f}": v for f, v in sums._asdict().items()})
  return outs, scratch


def rs_direct_call(config, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  """``matmul_reduce_scatter`` by direct DMAs (``config``: an
  ``RsConfig``)."""
  ring = config.ring
  num = ring.size
  n, k = lhs.shape
  _, m = rhs.shape
  dtype = jnp.dtype(lhs.dtype)
  out_dtype = config.out_dtype
  dim = config.scatter_dimension
  block, _, _ = rs_geometry(config, n, m)
  outs, scratch = _rs_direct_buffers(config, lhs, rhs, block)
  names = (*outs, *scratch)

  @operand_names(("lhs", "rhs", *names))
  def body(*refs):
    (lhs_ref, rhs_ref), r = named_refs(refs, 2, names)
    coords = RingCoords(ring)
    product = r["product"]
    matmul_whole(TileBuffers.from_named(r), lhs_ref, rhs_ref, product)

    def block_of(device):
      if dim == 0:
        return product.at[pl.ds(device * block[0], block[0])]
      return product.at[:, pl.ds(device * block[1], block[1])]

    handshake(coords, _others(num))
    copies = [
      remote_copy(
        block_of(coords.device_at(j)),
        r[f"slot_{j}"],
        r["send"],
        r["recv"],
        coords.device_id(j),
      )
      for j in _others(num)
    ]
    for copy in copies:
      copy.start()
    for copy in copies:
      copy.wait_recv()
    arrived = [r[f"slot_{j}"] for j in _others(num)]
    add_all(
      SumBuffers(*(r[f"sum_{f}"] for f in SumBuffers._fields)),
      (block_of(coords.device_at(0)), *arrived),
      r["out"],
    )
    for copy in copies:
      copy.wait_send()

  call = launch(
    body,
    out_types=tuple(outs.values()),
    scratch_types=tuple(scratch.values()),
    collective=True,
    interpret=config.interpret,
    name="matmul_reduce_scatter",
    flops=2 * n * k * m + n * m,
    bytes_accessed=(n * k + k * m) * dtype.itemsize
    + block[0] * block[1] * out_dtype.itemsize,
  )
  return call(lhs, rhs)[0]
