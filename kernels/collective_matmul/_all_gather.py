"""The all-gather matmul kernel: ring steps, flow control, the launch."""

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
  launch,
  matmul,
  named_refs,
  out_type,
  remote_copy,
)
from mpmd.kernels.collective_matmul.checks import BlockSizes, pick_blocks
from mpmd.types import Interpret


class AgConfig(NamedTuple):
  """Static configuration of one all-gather matmul (hashable)."""

  ring: Ring
  bidirectional: bool
  buffering: int
  out_dtype: np.dtype
  block_sizes: BlockSizes
  interpret: Interpret
  implementation: str  # "ring" or "direct" (see _direct.py)


class _AgPlan(NamedTuple):
  """What the all-gather matmul body needs to know, fixed at trace time."""

  ring: Ring
  streams: tuple[Any, ...]  # ``make_streams``; empty on a ring of one
  slots: int  # ring buffer slots per direction
  n: int  # rows of lhs (and of the output)
  k_local: int  # this device's columns of lhs
  m: int  # columns of rhs (and of the output)
  acc_in_out: bool  # accumulate in the output (else in an f32 "acc")
  return_gathered: bool
  names: tuple[str, ...]  # of the outputs and scratch, in order


def _ag_buffers(config, lhs, rhs, streams, slots, blocks, return_gathered):
  """The launch's outputs and scratch, by name (see ``named_refs``)."""
  ring = config.ring
  n, k_local = lhs.shape
  k_total, m = rhs.shape
  dtype = jnp.dtype(lhs.dtype)
  out_dtype = config.out_dtype
  outs: dict[str, Any] = {"out": out_type((n, m), out_dtype, (lhs, rhs), ring)}
  acc_in_out = out_dtype == jnp.float32 or ring.size == 1
  if not acc_in_out:
    outs["acc"] = out_type((n, m), jnp.float32, (lhs, rhs), ring)
  # Ring buffers live in HBM. They are outputs of the launch (and dropped
  # afterwards) rather than scratch so that remote DMAs may target them on
  # every execution path.
  for st in streams:
    for i in range(slots):
      outs[f"slots_{st.tag}_{i}"] = out_type(
        (st.size, k_local), dtype, (lhs,), ring
      )
    if slots == 1:
      outs[f"stage_{st.tag}"] = out_type(
        (st.size, k_local), dtype, (lhs,), ring
      )
  if return_gathered:
    outs["gathered"] = out_type((n, k_total), dtype, (lhs,), ring)
  scratch = ring_scratch(
    TileBuffers.scratch_types(dtype, out_dtype, *blocks).named(),
    streams,
    slots,
  )
  return outs, scratch, acc_in_out


def _ag_body(plan: _AgPlan):
  """The kernel: the local matmul, then one per ring transfer received."""
  ring, streams, slots = plan.ring, plan.streams, plan.slots
  n, k_local, m = plan.n, plan.k_local, plan.m
  acc_in_out, return_gathered, names = (
    plan.acc_in_out,
    plan.return_gathered,
    plan.names,
  )
  num = ring.size
  last = num - 2  # index of the last ring transfer

  @operand_names(("lhs", "rhs", *names))
  def body(*refs):
    (lhs_ref, rhs_ref), r = named_refs(refs, 2, names)
    bufs = TileBuffers.from_named(r)
    out_ref = r["out"]
    acc_ref = out_ref if acc_in_out else r["acc"]
    coords = RingCoords(ring)
    me = coords.device_at(0)

    def local_matmul(src, st_start, st_size, origin, *, first, final):
      region = pl.ds(st_start, st_size)
      matmul(
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

    handshake(coords)

    def transfer(st, src, t):
      # Transfer t lands in slot t % slots of the downstream neighbour.
      return remote_copy(
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

  return body


def ag_kernel_call(
  config: AgConfig, lhs: jax.Array, rhs: jax.Array, *, return_gathered: bool
):
  fn_name = "all_gather_matmul"
  ring = config.ring
  num = ring.size
  n, k_local = lhs.shape
  k_total, m = rhs.shape
  dtype = jnp.dtype(lhs.dtype)
  out_dtype = config.out_dtype
  streams = make_streams(n, config.bidirectional) if num > 1 else ()
  rows = streams[0].size if streams else n
  blocks = pick_blocks(fn_name, config.block_sizes, rows, k_local, m)
  # Slots beyond the number of transfers would never be used.
  slots = min(config.buffering, max(num - 1, 1))
  outs, scratch, acc_in_out = _ag_buffers(
    config, lhs, rhs, streams, slots, blocks, return_gathered
  )
  plan = _AgPlan(
    ring=ring,
    streams=tuple(streams),
    slots=slots,
    n=n,
    k_local=k_local,
    m=m,
    acc_in_out=acc_in_out,
    return_gathered=return_gathered,
    names=(*outs, *scratch),
  )
  call = launch(
    _ag_body(plan),
    out_types=tuple(outs.values()),
    scratch_types=tuple(scratch.values()),
    collective=num > 1,
    interpret=config.interpret,
    name="all_gather_matmul",
    flops=2 * n * k_total * m,
    bytes_accessed=(n * k_total + k_total * m) * dtype.itemsize
    + n * m * out_dtype.itemsize,
  )
  results = dict(zip(outs, call(lhs, rhs), strict=True))
  return results["out"], results.get("gathered")
