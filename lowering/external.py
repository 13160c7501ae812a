"""Meshes a launch reaches without running on them: upstream's *external
meshes*.

A SparseCore launch may write into a TensorCore's memory: its output is
``pltpu.VMEM(shape, dtype) @ tc_mesh`` (with a DMA semaphore ``@ tc_mesh``),
and its programs DMA into it with ``device_id={"tc": 0}``, the TensorCore
program that a later launch over ``tc_mesh`` runs and that waits for the
DMA. ``tc_mesh`` runs nothing in the first launch; it is external to it.
Upstream finds such meshes among the owners (``@ mesh``) of the launch's
operands, binds their axes while the kernels are traced (so that
``device_id`` may name them) and tells Mosaic about them when it lowers.

On the CPU fallback there is no TensorCore next to the SparseCore: the
external mesh's memory *is* the launch's operand (one buffer, handed to
the next launch), so a DMA or signal that names the one program of an
external mesh lands on that buffer and semaphore from the caller's own
program: :func:`localize` rewrites it so (``device_id`` without the
external mesh's axes). That is exact for an external mesh of one program,
the only kind whose memory one operand stands for; a launch that
addresses an external mesh of several programs still lowers for TPU and
is refused on CPU (:func:`check_addressable`).
"""

from collections.abc import Mapping, Sequence
from typing import Any

from mpmd import _pallas_ops
from mpmd._jax import core, pallas_core, pallas_primitives
from mpmd._lowering import addressing, jaxpr_util, tracing


def external_meshes(
  meshes: Sequence[pallas_core.Mesh], avals: Sequence[core.AbstractValue]
) -> tuple[Any, ...]:
  """The owners (``type @ mesh``) of ``avals`` that are none of ``meshes``,
  each once, in the order the operands name them."""
  found: list[Any] = []
  for aval in avals:
    space = getattr(aval, "memory_space", None)
    if not isinstance(space, pallas_core.CoreMemorySpace):
      continue
    owner = space.mesh
    if not any(addressing.same_mesh(owner, m) for m in (*meshes, *found)):
      found.append(owner)
  return tuple(found)


def of_kernels(
  meshes: Sequence[pallas_core.Mesh], jaxprs: Sequence[core.Jaxpr]
) -> tuple:
  """The external meshes of a bound launch (its kernels' operands)."""
  return external_meshes(meshes, [v.aval for v in jaxprs[0].invars])


def _programs(mesh: pallas_core.Mesh) -> int:
  count = 1
  for size in dict(mesh.shape).values():
    count *= size
  return count


def _external_axes(meshes, jaxprs) -> dict[Any, Any]:
  """Axis name -> the external mesh that has it."""
  return {
    axis: mesh
    for mesh in of_kernels(meshes, jaxprs)
    for axis in dict(mesh.shape)
  }


def _split(device_id: Any, external: Mapping[Any, Any]):
  """(the external meshes ``device_id`` names, ``device_id`` without
  their axes, None where nothing is left)."""
  if not isinstance(device_id, Mapping):
    return [], device_id
  named = []
  for axis in device_id:
    mesh = external.get(axis)
    if mesh is not None and not any(mesh is m for m in named):
      named.append(mesh)
  rest = {a: v for a, v in device_id.items() if a not in external}
  return named, (rest or None) if named else device_id


def check_addressable(meshes, jaxprs) -> None:
  """Raises where a kernel addresses an external mesh of several programs,
  whose per-program memory no operand of the launch stands for on CPU."""
  external = _external_axes(meshes, jaxprs)
  if not external:
    return
  for jaxpr in jaxprs:
    for eqn in jaxpr_util.iter_eqns(jaxpr):
      device_id = _device_id(eqn, eqn.invars)
      named, _ = _split(device_id, external)
      many = [m for m in named if _programs(m) > 1]
      if many:
        mesh = many[0]
        raise NotImplementedError(
          f"mpmd_map: kernel {jaxpr.debug_info.func_src_info}: "
          f"{eqn.primitive.name} addresses a program of mesh "
          f"{dict(mesh.shape)}, which runs nothing in this launch (its "
          f"memory holds an operand) and has {_programs(mesh)} programs: "
          "the CPU fallback runs such launches for an external mesh of one "
          "program only (one operand is its memory); the kernel still "
          "lowers for TPU"
        )


def _device_id(eqn, operands) -> Any:
  if _pallas_ops.is_dma(eqn):
    return _pallas_ops.DmaOperands.of(eqn, operands).device_id
  if _pallas_ops.kind(eqn) is _pallas_ops.Sync.SIGNAL:
    return _pallas_ops.SignalOperands.of(eqn, operands).device_id
  return None


def localize(meshes, jaxprs) -> tuple[Any, ...]:
  """``jaxprs`` with each DMA and signal that names the one program of an
  external mesh issued as the caller's own (the external axes dropped from
  its ``device_id``). Kernels that address no external mesh come back as
  they are."""
  external = _external_axes(meshes, jaxprs)
  external = {a: m for a, m in external.items() if _programs(m) == 1}
  if not external:
    return tuple(jaxprs)

  def rule(eqn, invals):
    device_id = _device_id(eqn, invals)
    named, rest = _split(device_id, external)
    if not named:
      return None
    if eqn.primitive is pallas_primitives.semaphore_signal_p:
      signal = _pallas_ops.SignalOperands.of(eqn, invals)
      flat, tree = signal._replace(device_id=rest).flatten()
      return jaxpr_util.bind_rewritten(eqn, flat, rule, args_tree=tree)
    dma = _pallas_ops.DmaOperands.of(eqn, invals)
    flat, tree = dma._replace(device_id=rest).flatten()
    return jaxpr_util.bind_rewritten(eqn, flat, rule, tree=tree)

  out = []
  for mesh, jaxpr in zip(meshes, jaxprs, strict=True):
    if any(
      _split(_device_id(e, e.invars), external)[0]
      for e in jaxpr_util.iter_eqns(jaxpr)
    ):
      with tracing.tracing_context(mesh, meshes):
        jaxpr = jaxpr_util.rewrite(jaxpr, rule)
    out.append(jaxpr)
  return tuple(out)
