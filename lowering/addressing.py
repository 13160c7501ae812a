"""Which program a ``semaphore_signal(device_id=...)`` names: upstream's rules.

Upstream's Mosaic lowering (``_device_id_to_logical``) defines how the
programs of one launch name each other, and we follow it on every path:

* The **target mesh** is the semaphore's owner (``sem_type @ mesh``); a
  semaphore without an owner belongs to the caller's own mesh. (Our
  extension, for launches upstream has no rules for: with several
  TensorCore meshes, and for unowned semaphores, the mesh whose axes
  ``device_id`` names is the target: the caller's, else the owner's, else
  the one mesh that has them all.)
* ``device_id`` names axes of the target mesh and of the enclosing
  ``shard_map``'s device mesh. **Axes it leaves out take the caller's own
  index** where the caller's mesh has the axis too (a ``VectorSubcoreMesh``
  and a ``ScalarSubcoreMesh`` share their core axis; a mesh shares every
  axis with itself, so a remote signal that names only device axes lands on
  the caller's own core of the remote device). A left-out axis the caller's
  mesh lacks is an error, as upstream's.
* Naming an axis that the target mesh lacks is an error.

The checks run when the kernels are traced (``mpmd._kernel_checks``), so
every path reports the same error; the CPU fallback's merge
(``mpmd._lowering.merge``) computes the target program from the same
resolution.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from mpmd import _jax, _pallas_ops
from mpmd._jax import core, pallas_core


def describe_mesh(meshes: Sequence[pallas_core.Mesh], j: int) -> str:
  """``mesh 1 {'s_core': 1} (sc_scalar_subcore)``: names the user's mesh."""
  mesh = meshes[j]
  kind = getattr(mesh, "core_type", None)
  kind = f" ({getattr(kind, 'value', kind)})" if kind is not None else ""
  return f"mesh {j} {dict(mesh.shape)}{kind}"


def _core_type_name(mesh: pallas_core.Mesh) -> str:
  kind = getattr(mesh, "core_type", None)
  return getattr(kind, "name", str(kind))


def _set_str(names) -> str:
  return "{" + ", ".join(repr(a) for a in sorted(names, key=str)) + "}"


def same_mesh(a: pallas_core.Mesh, b: pallas_core.Mesh) -> bool:
  # Not `==`: a TensorCoreMesh compares its device arrays elementwise and
  # crashes on meshes of different sizes (jax 0.10.2).
  return a is b or (
    type(a) is type(b) and hash(a) == hash(b) and dict(a.shape) == dict(b.shape)
  )


def owner_of(
  aval: core.AbstractValue, meshes: Sequence[pallas_core.Mesh], caller: int
) -> int | None:
  """The launch mesh that owns a Ref (``type @ mesh``), None if unowned.

  A mesh listed twice owns through the caller where the caller is it, else
  through its first listing.
  """
  space = getattr(aval, "memory_space", None)
  if not isinstance(space, pallas_core.CoreMemorySpace):
    return None
  if same_mesh(space.mesh, meshes[caller]):
    return caller
  for j, mesh in enumerate(meshes):
    if same_mesh(space.mesh, mesh):
      return j
  return None


@dataclasses.dataclass(frozen=True)
class Target:
  """A resolved ``device_id``: mesh ``mesh``'s program at ``coords``."""

  mesh: int
  # Every axis of the target mesh -> the index the device_id gave, or None
  # where it takes the caller's own index.
  coords: dict[core.AxisName, Any]
  # The device_id without the kernel axes (None if nothing is left).
  device_id: Any


def resolve(
  meshes: Sequence[pallas_core.Mesh],
  caller: int,
  sem_aval: core.AbstractValue,
  device_id: Any,
  what: str,
) -> Target | None:
  """Resolves a signal's target; None for a signal to the caller itself
  (no device_id, and the semaphore is the caller's own)."""
  kernel_axes = {a for m in meshes for a in m.shape}
  named = (
    {a: v for a, v in device_id.items() if a in kernel_axes}
    if isinstance(device_id, Mapping)
    else {}
  )
  rest = (
    {a: v for a, v in device_id.items() if a not in kernel_axes}
    if isinstance(device_id, Mapping)
    else device_id
  )
  owner = owner_of(sem_aval, meshes, caller)
  if owner is None or (named and _tensorcores_only(meshes)):
    owner = _named_target(meshes, caller, owner, named, what)
  if owner == caller and device_id is None:
    return None
  target = meshes[owner]
  foreign = [a for a in named if a not in target.shape]
  if foreign:
    raise ValueError(
      f"{what} names device_id axes {sorted(foreign, key=str)} that the "
      f"target {describe_mesh(meshes, owner)} does not have (the target is "
      "the semaphore's owner, `@ mesh`, else the caller's own mesh)"
    )
  own = meshes[caller].shape
  missing = [a for a in target.shape if a not in named and a not in own]
  if missing:
    raise ValueError(
      f"{what} addresses {describe_mesh(meshes, owner)} from "
      f"{describe_mesh(meshes, caller)}. When addressing "
      f"{_core_type_name(target)} from {_core_type_name(meshes[caller])} "
      f"and specifying axes={_set_str(named)} the following axes are "
      f"missing from the mesh: {_set_str(missing)}. Name them in device_id "
      "(only axes the two meshes share default to the caller's own index), "
      "or, if the semaphore is meant for the caller's own programs, give it "
      "the caller's mesh as its owner (`type @ mesh`): the target is the "
      "semaphore's owner"
    )
  if isinstance(rest, Mapping) and not rest:
    rest = None
  coords = {a: named.get(a) for a in target.shape}
  return Target(owner, coords, rest)


def dma_operands(
  eqn: core.JaxprEqn, operands: Sequence[Any]
) -> tuple[Any, Any]:
  """(receive semaphore, device_id) of a ``dma_start`` / ``dma_wait``
  among ``operands`` (its variables or values): the semaphore whose owner
  is the target, as for a signal (upstream's ``dest_mesh``)."""
  dma = _pallas_ops.DmaOperands.of(eqn, operands)
  return _underlying(dma.dst_sem), dma.device_id


def _underlying(sem: Any) -> Any:
  """The semaphore Ref (variable or value) under views of it. Of the
  semaphores ``pl.select_ref`` chooses from at run time, the first: JAX
  selects only among Refs of one type, so of one memory and owner mesh."""
  while isinstance(sem, _jax.state_types.TransformedRef):
    sem = sem.ref
  if isinstance(sem, tuple):
    return _underlying(sem[0])
  return sem


def _tensorcores_only(meshes: Sequence[pallas_core.Mesh]) -> bool:
  """Several TensorCore meshes: a launch upstream has no rules for."""
  return len(meshes) > 1 and all(
    getattr(getattr(m, "core_type", None), "name", None) == "TC" for m in meshes
  )


def _named_target(meshes, caller: int, owner, named, what: str) -> int:
  """The mesh whose axes ``named`` are: the caller's, else the owner's,
  else the one mesh with them all (our extension)."""
  for j in (caller, owner):
    if j is not None and all(a in meshes[j].shape for a in named):
      return j
  having = [j for j, m in enumerate(meshes) if all(a in m.shape for a in named)]
  if len(having) == 1:
    return having[0]
  names = sorted(named, key=str)
  if not having:
    with_some = [
      describe_mesh(meshes, j)
      for j, m in enumerate(meshes)
      if set(named) & set(m.shape)
    ]
    raise ValueError(
      f"{what} names device_id axes {names} of several meshes {with_some}; "
      "a program belongs to one mesh"
    )
  raise ValueError(
    f"{what} names device_id axes {names}, which "
    f"{[describe_mesh(meshes, j) for j in having]} all have: say which mesh "
    "with the semaphore's owner (`pltpu.SemaphoreType.REGULAR @ mesh`)"
  )
