"""The multi-mesh merge: N (mesh, kernel) pairs become one SPMD kernel.

Platforms without native MPMD run one kernel over a flat *super-axis* of
``sum(mesh sizes)`` programs. Program ``g`` belongs to the mesh ``i`` whose
range ``[offset_i, offset_i + size_i)`` holds it, and runs that mesh's
kernel with the mesh's axis indices computed from ``g - offset_i``
(row-major), everywhere in the kernel: loops, conds and scopes included.

Programs name each other by mesh axes: ``pl.semaphore_signal(sem, 1,
device_id={"consumer": 1})`` becomes a signal to the program of the
consumer mesh at that index (``core_index`` on TPU); device-mesh axes under
``shard_map`` stay in ``device_id``. Scratch written ``type @ mesh`` is
private to each program like any kernel scratch (the owner is who uses
it); unowned HBM scratch is shared by all programs of a device. On GPU,
meshes own consecutive warpgroup ranges of one block and all scratch (SMEM,
barriers) is one collective allocation of the block.
"""

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from mpmd import _jax
from mpmd._jax import (
  core,
  gpu,
  pallas_core,
  pallas_primitives,
  state,
  tree_util,
)
from mpmd.lowering import jaxpr_util, watchdog
from mpmd.primitives import mpmd_map as prim

SUPER_AXIS = "_mpmd_programs"


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each mesh's programs sit on the super-axis."""

  meshes: tuple[Any, ...]
  # The axes each mesh contributes to the super-axis (GPU: the thread axis;
  # TPU: all of its axes).
  local_axes: tuple[dict[Any, int], ...]

  @property
  def sizes(self) -> list[int]:
    return [math.prod(a.values()) for a in self.local_axes]

  @property
  def offsets(self) -> list[int]:
    return [int(o) for o in np.cumsum([0, *self.sizes[:-1]])]

  @property
  def total(self) -> int:
    return sum(self.sizes)

  def ranges(self) -> tuple[watchdog.MeshRange, ...]:
    return tuple(
      watchdog.MeshRange(i, dict(axes), offset)
      for i, (axes, offset) in enumerate(
        zip(self.local_axes, self.offsets, strict=True)
      )
    )

  def owner(self, axis: Any) -> int | None:
    owners = [i for i, axes in enumerate(self.local_axes) if axis in axes]
    if len(owners) > 1:
      raise ValueError(
        f"mpmd_map: axis {axis!r} belongs to meshes {owners}, so naming a "
        "program by it is ambiguous; give the meshes distinct axis names"
      )
    return owners[0] if owners else None


def _local_index(layout: Layout, i: int, axis: Any):
  """The mesh-``i`` index along ``axis``, computed from the super-axis."""
  axes = layout.local_axes[i]
  names = list(axes)
  stride = math.prod(list(axes.values())[names.index(axis) + 1 :])
  local = jax.lax.axis_index(SUPER_AXIS) - np.int32(layout.offsets[i])
  return (local // np.int32(stride)) % np.int32(axes[axis])


def _program_of(layout: Layout, j: int, coords: dict[Any, Any], caller: str):
  """The super-axis index of mesh ``j``'s program at ``coords``."""
  axes = layout.local_axes[j]
  missing = [a for a in axes if a not in coords]
  if missing:
    raise ValueError(
      f"mpmd_map: {caller} names mesh {j} by axes {sorted(map(str, coords))}"
      f" but not {missing}; name every axis of the target mesh"
    )
  sizes = list(axes.values())
  flat = jax.numpy.int32(layout.offsets[j])
  for k, axis in enumerate(axes):
    stride = np.int32(math.prod(sizes[k + 1 :]))
    flat = flat + jax.numpy.asarray(coords[axis], np.int32) * stride
  return flat


def _split_device_id(layout: Layout, device_id: Any, caller: str):
  """Splits a ``device_id`` dict into (target program, device-mesh part)."""
  if not isinstance(device_id, dict):
    return None, device_id
  kernel_axes = {
    a: v for a, v in device_id.items() if layout.owner(a) is not None
  }
  if not kernel_axes:
    return None, device_id
  owners = {layout.owner(a) for a in kernel_axes}
  if len(owners) > 1:
    raise ValueError(
      f"mpmd_map: {caller} names axes {sorted(map(str, kernel_axes))} of "
      f"several meshes {sorted(owners)}; a program belongs to one mesh"
    )
  [j] = owners
  rest = {a: v for a, v in device_id.items() if a not in kernel_axes}
  return _program_of(layout, j, kernel_axes, caller), (rest or None)


def _rule(layout: Layout, i: int, platform: str):
  axis_rule = jaxpr_util.axis_index_rule(
    lambda axis: (
      _local_index(layout, i, axis) if axis in layout.local_axes[i] else None
    ),
    dict(layout.local_axes[i]),
  )

  def rule(eqn, invals):
    if eqn.primitive is pallas_primitives.semaphore_signal_p:
      tree = eqn.params["args_tree"]
      ref, transforms, inc, device_id, core_index = tree.unflatten(invals)
      target, device_id = _split_device_id(
        layout, device_id, "semaphore_signal(device_id=...)"
      )
      if target is None:
        return axis_rule(eqn, invals)
      if core_index is not None:
        raise ValueError(
          "mpmd_map: semaphore_signal names its target program both by "
          "device_id mesh axes and by core_index; use one"
        )
      if platform == "gpu":
        raise NotImplementedError(
          "mpmd_map: GPU programs synchronise through barriers; "
          "semaphore_signal to another mesh's program is TPU-only"
        )
      flat, new_tree = tree_util.tree_flatten(
        [ref, transforms, inc, device_id, target]
      )
      pallas_primitives.semaphore_signal_p.bind(
        *flat,
        args_tree=new_tree,
        device_id_type=eqn.params["device_id_type"],
      )
      return []
    if eqn.primitive is pallas_primitives.run_scoped_p:
      axes = eqn.params["collective_axes"]
      mine = [a for a in axes if a in layout.local_axes[i]]
      if mine and len(layout.meshes) > 1:
        raise NotImplementedError(
          f"mpmd_map: run_scoped(collective_axes={axes!r}) allocates over "
          f"the warpgroups of mesh {i} only, which a multi-mesh launch "
          "cannot do; put memory shared by the launch in scratch_types"
        )
      if mine:  # one mesh: its thread axis is now the super-axis
        renamed = tuple(SUPER_AXIS if a in mine else a for a in axes)
        return jaxpr_util.bind_rewritten(
          eqn, invals, rule, collective_axes=renamed
        )
    if eqn.primitive.name in ("dma_start", "dma_wait"):
      *_, device_id = eqn.params["tree"].unflatten(invals)
      if isinstance(device_id, dict) and any(
        layout.owner(a) is not None for a in device_id
      ):
        raise NotImplementedError(
          "mpmd_map: a DMA cannot target another program of the launch "
          "(DMAs land on the same core of the destination device); stage "
          "cross-mesh data in shared HBM scratch and signal a semaphore"
        )
    return axis_rule(eqn, invals)

  return rule


def _strip_owner(aval):
  """``type @ mesh`` is a plain memory space once programs are merged."""
  if isinstance(aval, state.AbstractRef) and isinstance(
    aval.memory_space, pallas_core.CoreMemorySpace
  ):
    return state.AbstractRef(aval.inner_aval, aval.memory_space.memory_space)
  return aval


def _merge(layout: Layout, merged_mesh, jaxprs, platform, avals=None):
  """One kernel jaxpr that switches each program to its mesh's kernel."""
  meshes = layout.meshes
  rewritten = []
  for i, (mesh, jaxpr) in enumerate(zip(meshes, jaxprs, strict=True)):
    jaxpr = jaxpr_util.map_avals(jaxpr, _strip_owner)
    with prim.tracing_context(merged_mesh, (*meshes, merged_mesh)):
      with mesh.tracing_context():
        rewritten.append(jaxpr_util.rewrite(jaxpr, _rule(layout, i, platform)))
  offsets = layout.offsets

  def body(*refs):
    program = jax.lax.axis_index(SUPER_AXIS)
    which = (
      sum((program >= np.int32(o)).astype(np.int32) for o in offsets[1:])
      if len(offsets) > 1
      else np.int32(0)
    )
    branches = [(lambda j=j: core.eval_jaxpr(j, (), *refs)) for j in rewritten]
    jax.lax.switch(which, [lambda b=b: (b(), None)[1] for b in branches])
    return ()

  avals = avals or [_strip_owner(v.aval) for v in jaxprs[0].invars]
  return prim.retrace(
    jaxprs[0], merged_mesh, (*meshes, merged_mesh), body, avals
  )


def _tpu_layout(meshes) -> Layout:
  return Layout(tuple(meshes), tuple(dict(m.shape) for m in meshes))


def _strip_params(params, merged_mesh, jaxpr):
  return dict(params, meshes=(merged_mesh,), jaxprs=(jaxpr,))


def merge_for_tpu(params):
  """Several TensorCore meshes -> one TensorCore mesh over all programs."""
  layout = _tpu_layout(params["meshes"])
  mesh = _jax.tensorcore_mesh(SUPER_AXIS, num_cores=layout.total)
  jaxpr = _merge(layout, mesh, params["jaxprs"], "tpu")
  return mesh, jaxpr, _strip_params(params, mesh, jaxpr)


def _gpu_layout(meshes) -> Layout:
  first = meshes[0]
  for i, m in enumerate(meshes):
    if (m.grid, m.grid_names, m.cluster, m.cluster_names) != (
      first.grid,
      first.grid_names,
      first.cluster,
      first.cluster_names,
    ):
      raise ValueError(
        "mpmd_map: GPU meshes of one launch share the grid and cluster "
        f"(they are warpgroups of the same blocks); mesh 0 has grid "
        f"{dict(zip(first.grid_names, first.grid, strict=True))}, mesh {i} has "
        f"{dict(zip(m.grid_names, m.grid, strict=True))}"
      )
    if m.num_threads is None:
      raise ValueError(
        f"mpmd_map: GPU mesh {i} needs num_threads and thread_name (its "
        "warpgroups) to share a launch with other meshes"
      )
  return Layout(
    tuple(meshes), tuple({m.thread_name: m.num_threads} for m in meshes)
  )


def _merged_gpu_mesh(meshes, total: int):
  first = meshes[0]
  return gpu().core.Mesh(
    grid=first.grid,
    grid_names=first.grid_names,
    cluster=first.cluster,
    cluster_names=first.cluster_names,
    num_threads=total,
    thread_name=SUPER_AXIS,
    kernel_name=first.kernel_name,
  )


def merge_for_gpu(params):
  """GPU meshes -> one Mosaic GPU mesh; each owns a warpgroup range.

  Kernel scratch (SMEM, barriers) is per block, so every mesh shares it.
  """
  meshes = params["meshes"]
  layout = _gpu_layout(meshes)
  mesh = _merged_gpu_mesh(meshes, layout.total)
  jaxpr = _merge(layout, mesh, params["jaxprs"], "gpu")
  return mesh, jaxpr, _strip_params(params, mesh, jaxpr)


def merge_for_simulator(params, path):
  """Merges for a CPU simulator; also returns which programs are whose."""
  from mpmd.lowering import paths

  if path.kind == paths.GPU_SIMULATOR:
    layout = _gpu_layout(params["meshes"])
    mesh, jaxpr, params = merge_for_gpu(params)
  else:
    layout = _tpu_layout(params["meshes"])
    mesh, jaxpr, params = merge_for_tpu(params)
  return mesh, jaxpr, params, layout.ranges()
