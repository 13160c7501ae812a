"""The devices a lockstep kernel exchanges with: flat indices of device ids,
ring shifts known when traced or found at run time, and the collectives
that move values between them."""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpmd import _jax
from mpmd._jax import core, tree_util
from mpmd._lowering import device_ids, packing


class _Pattern(NamedTuple):
  """A device-id value (its tree and traced leaves) and the ring shift it
  was found to make (``Devices.pattern``)."""

  treedef: tree_util.PyTreeDef
  leaves: list[Any]
  branch: Any


class Devices:
  """The devices a kernel exchanges with: those differing along the axes
  its device ids name (``exchange_axes``)."""

  def __init__(self, axes, sizes: dict[core.AxisName, int], all_axes):
    self.axes = axes  # those the kernel exchanges along
    self.all_axes = all_axes  # every axis of the shard_map
    self.sizes = tuple(sizes[a] for a in axes)
    # Ring shifts found for device-id values (tracers, matched by
    # identity), forgotten when the kernel's trace ends.
    self._patterns: list[_Pattern] = []
    self.top_trace: Any = None  # set when the kernel's rewrite starts
    # What the kernel computes from the device's coordinates alone, on
    # every device (set before the rewrite where ``axes`` are all the
    # shard_map's: a device id names a device of ``axes`` only).
    self.known: device_ids.Known | None = None

  @property
  def count(self) -> int:
    return math.prod(self.sizes)

  def by_axis(self, device_id: Any) -> dict[Any, Any]:
    """``device_id`` as a dict (an index alone is along the first axis, a
    tuple's along the axes in order)."""
    if isinstance(device_id, dict):
      return device_id
    if isinstance(device_id, tuple | list):
      return dict(zip(self.axes, device_id, strict=True))
    return {self.axes[0]: device_id}

  def flat(self, device_id: Any) -> jax.Array:
    """The flat index of ``device_id`` (a dict, or an index along the only
    axis); axes a dict leaves out keep this device's coordinate."""
    device_id = self.by_axis(device_id)
    index = jnp.int32(0)
    for a, size in zip(self.axes, self.sizes, strict=True):
      coord = device_id.get(a)
      coord = lax.axis_index(a) if coord is None else coord
      index = index * size + jnp.asarray(coord, jnp.int32)
    return index

  def me(self) -> jax.Array:
    return self.flat({})

  def static_shift(self, device_id: Any) -> int | None:
    """``k`` if ``device_id`` (the kernel's Vars and Literals) is known
    when traced and names, on every device, the device ``k`` flat
    positions on (a ring shift); None otherwise."""
    known = self.known
    if known is None:
      return None
    device_id = self.by_axis(device_id)
    index = np.zeros(self.count, np.int64)
    for a, size in zip(self.axes, self.sizes, strict=True):
      coord = device_id.get(a)
      coord = known.coords(a) if coord is None else known.value(coord)
      if coord is None or np.any((coord < 0) | (coord >= size)):
        return None
      index = index * size + coord
    shifts = (index - np.arange(self.count)) % self.count
    return int(shifts[0]) if np.all(shifts == shifts[0]) else None

  def _same_trace_leaves(self, device_id: Any) -> tuple[Any, list] | None:
    """(tree, leaves) of ``device_id`` if it may be remembered: only values
    of the top-level trace are, and forgotten before it ends, so that no
    tracer outlives its trace."""
    leaves, treedef = tree_util.tree_flatten(device_id)
    if not all(
      isinstance(x, core.Tracer) and _jax.tracer_trace(x) is self.top_trace
      for x in leaves
    ):
      return None
    return treedef, leaves

  def known_pattern(self, device_id: Any) -> Any | None:
    """The ``pattern`` found before for this device-id value, if any (the
    same traced value targets the same devices)."""
    found = self._same_trace_leaves(device_id)
    if found is None:
      return None
    treedef, leaves = found
    for seen in self._patterns:
      if seen.treedef == treedef and all(
        a is b for a, b in zip(seen.leaves, leaves, strict=True)
      ):
        return seen.branch
    return None

  def pattern(self, device_id: Any, target_all: Any) -> Any:
    """``k`` if every device sends to the device ``k`` flat positions on (a
    ring shift), ``count`` otherwise, from every device's target (flat
    indices, gathered); remembered for ``device_id``."""
    offsets = lax.rem(
      target_all - jnp.arange(self.count, dtype=jnp.int32) + self.count,
      jnp.int32(self.count),
    )
    # Out-of-range ids take the gathered path, where they reach nobody.
    in_range = jnp.logical_and(target_all >= 0, target_all < self.count)
    uniform = jnp.all(jnp.logical_and(offsets == offsets[0], in_range))
    branch = jnp.where(uniform, offsets[0], self.count)
    found = self._same_trace_leaves(device_id)
    if found is not None:
      self._patterns.insert(0, _Pattern(*found, branch))  # the latest first
    return branch

  def forget(self) -> None:
    """Drops the remembered patterns and their tracers (trace ending)."""
    self._patterns.clear()
    self.top_trace = None

  def shift(self, k: int, tree: Any) -> Any:
    """``tree`` of the device ``k`` flat positions back (a ring shift)."""
    if k == 0:
      return tree
    perm = [(i, (i + k) % self.count) for i in range(self.count)]
    return tree_util.tree_map(lambda x: lax.ppermute(x, self.axes, perm), tree)

  def gather(self, tree: Any) -> Any:
    """Every device's ``tree``, stacked (None for static leaves, which every
    device shares), in one collective (``packing.Gathered``)."""
    leaves, treedef = tree_util.tree_flatten(tree)
    gathered = packing.Gathered(self.axes, leaves)
    return tree_util.tree_unflatten(
      treedef, [gathered.stacked(i) for i in range(len(leaves))]
    )
