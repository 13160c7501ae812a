"""A device's peers in an exchange along ``shard_map`` axes: the groups that
exchange, each device's position in its group, its peers' mesh coordinates
(for remote DMAs), the checks of an exchange's arguments and the barrier
handshake before the first remote DMA.
Shared by :mod:`ragged` and :mod:`fused`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mpmd.api import mpmd_map
from mpmd.kernels import _common
from mpmd.kernels.collective_matmul._ring import check_ring
from mpmd.types import Interpret

# The barrier semaphore handshake uses this collective id.
COLLECTIVE_ID = 0


class Groups(NamedTuple):
  """The devices that exchange: ``members[g][p]`` is the flattened index
  (along ``axes``) of position ``p`` of group ``g``."""

  axes: tuple[str, ...]
  sizes: tuple[int, ...]
  members: tuple[tuple[int, ...], ...]

  @property
  def size(self) -> int:
    """Devices per group (the ``D`` of ``k * D`` slices)."""
    return len(self.members[0])


def check_groups(fn: str, axis_name: Any, axis_index_groups: Any) -> Groups:
  """The exchange's axes (inside ``shard_map``) and its device groups."""
  ring = check_ring(fn, axis_name, None)
  size = ring.size
  if axis_index_groups is None:
    return Groups(ring.axes, ring.sizes, (tuple(range(size)),))
  try:
    if isinstance(axis_index_groups, str):
      raise TypeError
    groups = tuple(
      tuple(as_index(i) for i in group) for group in axis_index_groups
    )
  except TypeError:
    raise TypeError(
      f"{fn}: expected 'axis_index_groups' to be None or a sequence of "
      f"sequences of ints, got {axis_index_groups!r}"
    ) from None
  flat = sorted(i for g in groups for i in g)
  if not groups or flat != list(range(size)):
    raise ValueError(
      f"{fn}: expected 'axis_index_groups' to hold every index of "
      f"range({size}) (the devices along {ring.axes!r}) exactly once, got "
      f"{axis_index_groups!r}"
    )
  if len({len(g) for g in groups}) != 1:
    raise ValueError(
      f"{fn}: expected 'axis_index_groups' of equal sizes, got sizes "
      f"{[len(g) for g in groups]}"
    )
  return Groups(ring.axes, ring.sizes, groups)


def check_arguments(
  fn: str, operand, output, offsets: dict[str, Any], groups: Groups
) -> int:
  """Checks the data and metadata arguments; returns ``k``, the slices per
  device."""
  _common.check_array(fn, "operand", operand, shape_doc="(N, ...)")
  _common.check_array(fn, "output", output, shape_doc="(M, ...)")
  for arg, x in (("operand", operand), ("output", output)):
    if not np.ndim(x):
      raise ValueError(
        f"{fn}: expected '{arg}' of rank >= 1 (rows along its first "
        "dimension), got a scalar"
      )
  if jnp.dtype(operand.dtype) != jnp.dtype(output.dtype):
    raise TypeError(
      f"{fn}: expected 'operand' and 'output' of the same dtype, got "
      f"{jnp.dtype(operand.dtype).name} and {jnp.dtype(output.dtype).name}"
    )
  if tuple(operand.shape[1:]) != tuple(output.shape[1:]):
    raise ValueError(
      f"{fn}: expected 'operand' (N, ...) and 'output' (M, ...) with the "
      f"same trailing dimensions, got shapes {tuple(operand.shape)} and "
      f"{tuple(output.shape)}"
    )
  length = None
  for arg, x in offsets.items():
    _common.check_array(fn, arg, x, rank=1, shape_doc="(k * D,)")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(
        f"{fn}: expected '{arg}' of an integer dtype, got "
        f"{jnp.dtype(x.dtype).name}"
      )
    if length is None:
      length = x.shape[0]
    elif x.shape[0] != length:
      lengths = {a: y.shape[0] for a, y in offsets.items()}
      raise ValueError(
        f"{fn}: expected 'input_offsets', 'send_sizes', 'output_offsets' "
        f"and 'recv_sizes' of the same length, got {lengths}"
      )
  d = groups.size
  if not length or length % d:
    raise ValueError(
      f"{fn}: expected offsets and sizes of length k * {d} (k >= 1 slices "
      f"for each of the {d} devices that exchange), got length {length}"
    )
  return length // d


def as_index(i: Any) -> int:
  if isinstance(i, bool) or not isinstance(i, int | np.integer):
    raise TypeError
  return int(i)


def lookup(index: jax.Array, table: Sequence[int]) -> jax.Array:
  """``table[index]`` for a traced index and a static table (a kernel
  captures no arrays): one select per entry, nothing for the identity.
  Entries are built from ``index`` (``index * 0 + value``) so that under
  ``shard_map(check_vma=True)`` they vary over the same axes: mixing in a
  constant would insert a ``pvary``, which Mosaic cannot lower."""
  if list(table) == list(range(len(table))):
    return index
  zero = index * 0
  out = zero + table[0]
  for i, value in enumerate(table[1:], 1):
    out = jnp.where(index == i, zero + value, out)
  return out


class Peers:
  """This device's place in its group and its peers' mesh coordinates,
  computed from ``lax.axis_index`` and static tables (values the CPU
  fallback knows for every device when it traces the kernel)."""

  def __init__(self, groups: Groups):
    self.groups = groups
    flat = lax.axis_index(groups.axes[0])
    for a, size in zip(groups.axes[1:], groups.sizes[1:], strict=True):
      flat = flat * size + lax.axis_index(a)
    total = math.prod(groups.sizes)
    group_of, position_of = [0] * total, [0] * total
    for g, members in enumerate(groups.members):
      for p, i in enumerate(members):
        group_of[i], position_of[i] = g, p
    self._group = lookup(flat, group_of)
    self.position = lookup(flat, position_of)  # in the group
    self._members = [i for members in groups.members for i in members]
    self.ids = [self._device_id(o) for o in range(groups.size)]

  def position_at(self, offset: int) -> jax.Array:
    """Group position of the peer ``offset`` positions on."""
    size = self.groups.size
    return lax.rem(self.position + offset, size)

  def _device_id(self, offset: int) -> _common.DeviceCoords:
    size = self.groups.size
    rest = lookup(self._group * size + self.position_at(offset), self._members)
    coords = []
    for axis_size in reversed(self.groups.sizes):
      coords.append(lax.rem(rest, axis_size))
      rest = rest // axis_size
    return {
      a: c for a, c in zip(self.groups.axes, reversed(coords), strict=True)
    }


def handshake(peers: Peers) -> None:
  """Every peer is inside the kernel before any remote DMA to it."""
  d = peers.groups.size
  if d == 1:
    return
  barrier = pltpu.get_barrier_semaphore()
  for o in range(1, d):
    pl.semaphore_signal(barrier, 1, device_id=peers.ids[o])
  pl.semaphore_wait(barrier, d - 1)


def varying(groups: Groups, *operands) -> frozenset[Any]:
  """The manual axes a launch's outputs vary over (``check_vma=True``)."""
  axes = _common.varying_axes(*operands)
  if axes:  # check_vma=True: every manual axis is tracked
    axes |= frozenset(groups.axes)
  return axes


def launch(
  groups: Groups,
  interpret: Interpret,
  body,
  out_types,
  scratch_types,
  *,
  meshes=None,
  **kwargs,
):
  """An ``mpmd_map`` launch of one exchange on each device: ``body`` on a
  single TensorCore (or ``meshes``, ``[(mesh, fn), ...]``, with ``body``
  None), with the barrier semaphore of :func:`handshake` where ``groups``
  have peers (Mosaic rejects a collective id without a barrier)."""
  meshes = meshes or [(_common.single_core_mesh(), body)]
  collective_id = COLLECTIVE_ID if groups.size > 1 else None
  return mpmd_map(
    [(mesh, _common.traced_in_x32(fn)) for mesh, fn in meshes],
    out_types=out_types,
    scratch_types=scratch_types,
    compiler_params=pltpu.CompilerParams(collective_id=collective_id),
    interpret=interpret,
    **kwargs,
  )


def exchange_metadata(
  groups: Groups, values: jax.Array, interpret: Interpret = None
) -> jax.Array:
  """``all_to_all`` of int32 ``values`` (rows, k * D) within the groups:
  column block ``j`` of the result is column block ``me`` of device ``j``'s
  ``values`` (``jax.lax.all_to_all(..., tiled=True)`` along the columns)."""
  d = groups.size
  rows, width = values.shape
  k = width // d
  # Blocks as leading rows so that each moves as one DMA.
  blocks = values.reshape(rows, d, k).transpose(1, 0, 2)
  axes = varying(groups, values)

  def body(blocks_hbm, out, send_sem, recv_sem):
    peers = Peers(groups)
    me = peers.position
    pltpu.sync_copy(blocks_hbm.at[pl.ds(me, 1)], out.at[pl.ds(me, 1)])
    handshake(peers)
    copies = [
      pltpu.make_async_remote_copy(
        blocks_hbm.at[pl.ds(peers.position_at(o), 1)],
        out.at[pl.ds(me, 1)],
        send_sem,
        recv_sem,
        device_id=peers.ids[o],
      )
      for o in range(1, d)
    ]
    for copy in copies:
      copy.start()
    for copy in copies:
      copy.wait_recv()
    for copy in copies:
      copy.wait_send()

  (out,) = launch(
    groups,
    interpret,
    body,
    (_common.out_type(blocks.shape, jnp.int32, axes),),
    (pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA),
    name="ragged_all_to_all_metadata",
  )(blocks)
  return out.transpose(1, 0, 2).reshape(rows, width)
