"""The matmul reduce-scatter kernel: ring steps, flow control, the launch."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mpmd.kernels._common import operand_names
from mpmd.kernels.collective_matmul._ring import (
  Ring,
  RingCoords,
  handshake,
  make_streams,
  ring_scratch,
)
from mpmd.kernels.collective_matmul._tiles import (
  TileBuffers,
  add,
  add_to_held,
  launch,
  matmul,
  matmul_whole,
  named_refs,
  out_type,
  remote_copy,
)
from mpmd.kernels.collective_matmul.checks import BlockSizes, pick_blocks
from mpmd.types import Interpret


class RsConfig(NamedTuple):
  """Static configuration of one matmul + reduce-scatter (hashable)."""

  ring: Ring
  scatter_dimension: int
  bidirectional: bool
  buffering: int
  out_dtype: np.dtype
  block_sizes: BlockSizes
  interpret: Interpret
  implementation: str  # "ring" or "direct" (see _direct.py)


def rs_geometry(config: RsConfig, n: int, m: int):
  """Scattered block shape and the directions that split it."""
  num = config.ring.size
  if config.scatter_dimension == 0:
    block = (n // num, m)
    split = m  # each direction carries some of the columns
  else:
    block = (n, m // num)
    split = n  # ... or some of the rows
  streams = make_streams(split, config.bidirectional) if num > 1 else ()
  if streams:
    region = (
      (block[0], streams[0].size)
      if config.scatter_dimension == 0
      else (streams[0].size, block[1])
    )
  else:
    region = block
  return block, streams, region


def _rs_buffers(config, lhs, rhs, geometry, blocks, slots):
  """The launch's outputs and scratch, by name (see ``named_refs``)."""
  ring = config.ring
  dtype = jnp.dtype(lhs.dtype)
  block, streams, region = geometry
  bn, _, bm = blocks
  # A region of one tile stays on chip: each step's partial product is
  # computed into a VMEM send buffer, the arriving running sum is added in
  # place, and the remote DMA leaves from VMEM. Larger regions park the
  # partial product and the send buffers in HBM.
  on_chip = region == (bn, bm)
  outs: dict[str, Any] = {
    "out": out_type(block, config.out_dtype, (lhs, rhs), ring)
  }
  f32 = jnp.float32
  for st in streams:
    operands = (lhs, rhs)
    if not on_chip:
      outs[f"part_{st.tag}"] = out_type(region, f32, operands, ring)
      for i in range(2):
        outs[f"send_buf_{st.tag}_{i}"] = out_type(region, f32, operands, ring)
    for i in range(slots):
      outs[f"slots_{st.tag}_{i}"] = out_type(region, f32, operands, ring)
  scratch = ring_scratch(
    TileBuffers.scratch_types(dtype, config.out_dtype, *blocks).named(),
    streams,
    slots,
  )
  if on_chip:
    for st in streams:
      for i in range(2):
        scratch[f"send_buf_{st.tag}_{i}"] = pltpu.VMEM(region, f32)
  return outs, scratch, on_chip


class _RsPlan(NamedTuple):
  """What the matmul reduce-scatter body needs to know, fixed at trace time."""

  ring: Ring
  dim: int  # the scatter dimension
  block: tuple[int, int]  # the scattered output block
  streams: tuple[Any, ...]  # ``make_streams``; empty on a ring of one
  slots: int  # ring buffer slots per direction
  k: int  # the contracting dimension
  on_chip: bool  # partial sums held in VMEM (see ``_rs_buffers``)
  names: tuple[str, ...]  # of the outputs and scratch, in order


def _rs_body(plan: _RsPlan):
  """The kernel: per ring step, a partial product plus the arriving sum."""
  ring, dim, block, streams = plan.ring, plan.dim, plan.block, plan.streams
  slots, k, on_chip, names = plan.slots, plan.k, plan.on_chip, plan.names
  num = ring.size
  last = num - 2

  @operand_names(("lhs", "rhs", *names))
  def body(*refs):
    (lhs_ref, rhs_ref), r = named_refs(refs, 2, names)
    bufs = TileBuffers.from_named(r)
    out_ref = r["out"]
    coords = RingCoords(ring)

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
      matmul(
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
      matmul_whole(bufs, lhs_ref, rhs_ref, out_ref)
      return

    handshake(coords)

    def transfer(st, s):
      # Transfer s carries send_buf[s % 2] to slot s % slots downstream.
      return remote_copy(
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
            add_to_held(bufs, send_buf, arrived, final)
          else:
            dst = send_buf if final is None else final
            add(bufs, r[f"part_{st.tag}"], arrived, dst)
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

  return body


def rs_kernel_call(config: RsConfig, lhs: jax.Array, rhs: jax.Array):
  fn_name = "matmul_reduce_scatter"
  num = config.ring.size
  n, k = lhs.shape
  _, m = rhs.shape
  dtype = jnp.dtype(lhs.dtype)
  geometry = rs_geometry(config, n, m)
  block, streams, region = geometry
  blocks = pick_blocks(fn_name, config.block_sizes, region[0], k, region[1])
  slots = min(config.buffering, max(num - 1, 1))
  outs, scratch, on_chip = _rs_buffers(
    config, lhs, rhs, geometry, blocks, slots
  )
  plan = _RsPlan(
    ring=config.ring,
    dim=config.scatter_dimension,
    block=block,
    streams=tuple(streams),
    slots=slots,
    k=k,
    on_chip=on_chip,
    names=(*outs, *scratch),
  )
  bytes_in = (n * k + k * m) * dtype.itemsize
  call = launch(
    _rs_body(plan),
    out_types=tuple(outs.values()),
    scratch_types=tuple(scratch.values()),
    collective=num > 1,
    interpret=config.interpret,
    name="matmul_reduce_scatter",
    flops=2 * n * k * m + n * m,
    bytes_accessed=bytes_in + block[0] * block[1] * config.out_dtype.itemsize,
  )
  return call(lhs, rhs)[0]
