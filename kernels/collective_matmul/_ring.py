"""The ring: its axes and order, device coordinates on it, the
handshake, the transfer streams (one per ring direction) and their slots."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mpmd.kernels._common import DeviceCoords


class Ring(NamedTuple):
  """A validated ring: mesh axes, their sizes, and the visiting order."""

  axes: tuple[str, ...]
  sizes: tuple[int, ...]
  # order[p] is the flattened axis index of the device at ring position p.
  order: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.sizes)


def check_ring(
  fn_name: str, axis_name: Any, ring: Sequence[int] | None
) -> Ring:
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
  return Ring(axes, sizes, order)


class RingCoords:
  """Where this device's ring neighbours are, computed in the kernel from
  its own coordinates (``lax.axis_index`` of the ring's axes) and the
  ring's static order: a few scalar operations on a TPU, and values the CPU
  fallback knows for every device when it traces the kernel, so that its
  devices need not exchange their targets to agree on a ring shift
  (``mpmd._lowering.device_ids``)."""

  def __init__(self, ring: Ring):
    """Built at the kernel's top level: its values are used throughout."""
    self.ring = ring
    flat = lax.axis_index(ring.axes[0])
    for a, size in zip(ring.axes[1:], ring.sizes[1:], strict=True):
      flat = flat * size + lax.axis_index(a)
    inverse = [0] * ring.size
    for position, device in enumerate(ring.order):
      inverse[device] = position
    self._position = _lookup(flat, inverse)  # this device's, on the ring
    self._ids: dict[int, DeviceCoords] = {}

  def device_at(self, offset: int | jax.Array) -> jax.Array:
    """Flattened axis index of the device ``offset`` positions away."""
    ring = self.ring
    position = lax.rem(self._position + offset % ring.size, ring.size)
    return _lookup(position, ring.order)

  def device_id(self, offset: int) -> DeviceCoords:
    """Mesh coordinates (along the ring's axes) for a remote DMA/signal.

    Computed once per offset, so the first call must be at the kernel's
    top level (not under ``pl.when`` or in a loop body): every transfer to
    a neighbour then names it by the same values.
    """
    column = offset % self.ring.size
    if column not in self._ids:
      rest, coords = self.device_at(column), []
      for size in reversed(self.ring.sizes):
        coords.append(lax.rem(rest, size))
        rest = rest // size
      self._ids[column] = {
        a: c for a, c in zip(self.ring.axes, reversed(coords), strict=True)
      }
    return self._ids[column]


def _lookup(index: jax.Array, table: Sequence[int]) -> jax.Array:
  """``table[index]`` for a traced scalar index into a static table (a
  kernel captures no arrays): the index itself for the identity, else one
  select per entry."""
  if list(table) == list(range(len(table))):
    return index
  out = jnp.int32(table[0])
  for i, value in enumerate(table[1:], 1):
    out = jnp.where(index == i, jnp.int32(value), out)
  return out


def handshake(coords: RingCoords, offsets: Sequence[int] = (-1, 1)) -> None:
  """The devices ``offsets`` ring positions away (default: both ring
  neighbours) are inside this kernel before any remote DMA to them."""
  barrier = pltpu.get_barrier_semaphore()
  for offset in offsets:
    pl.semaphore_signal(barrier, 1, device_id=coords.device_id(offset))
  pl.semaphore_wait(barrier, len(offsets))


class _Stream(NamedTuple):
  """One ring direction: +1 sends to the next ring position, -1 back."""

  offset: int
  tag: str
  # Static (start, size) of the part of the work this direction carries.
  start: int
  size: int


def make_streams(size: int, bidirectional: bool) -> tuple[_Stream, ...]:
  if bidirectional and size % 2 == 0:
    half = size // 2
    return (_Stream(1, "cw", 0, half), _Stream(-1, "ccw", half, half))
  return (_Stream(1, "cw", 0, size),)


def ring_scratch(scratch, streams, slots: int):
  """Adds, per stream, the send / receive DMA semaphores and the capacity
  semaphore to a kernel's named scratch."""
  for st in streams:
    scratch[f"send_{st.tag}"] = pltpu.SemaphoreType.DMA
    scratch[f"recv_{st.tag}"] = pltpu.SemaphoreType.DMA((slots,))
    scratch[f"cap_{st.tag}"] = pltpu.SemaphoreType.REGULAR
  return scratch
