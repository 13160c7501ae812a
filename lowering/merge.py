"""The multi-mesh merge: N (mesh, kernel) pairs become one SPMD kernel.

Platforms without native MPMD run one kernel over a flat *super-axis* of
``sum(mesh sizes)`` programs. Program ``g`` belongs to the mesh ``i`` whose
range ``[offset_i, offset_i + size_i)`` holds it, and runs that mesh's
kernel with the mesh's axis indices computed from ``g - offset_i``
(row-major), everywhere in the kernel: loops, conds and scopes included.

Programs name each other by upstream's rules (``mpmd._lowering.addressing``):
``pl.semaphore_signal(sem, 1, device_id={"subcore": 1})`` with ``sem`` owned
by (``@``) a mesh becomes a signal to that mesh's program at those axes, the
axes left out taking the caller's own index (``core_index`` of the merged
kernel on TPU); device-mesh axes under ``shard_map`` stay in ``device_id``.
A DMA addresses the owner of its receive semaphore the same way, its target
program named along the merged kernel's core axis in ``device_id`` (where
Mosaic and the TPU simulator of jax >= 0.12 take a core).
Scratch written ``type @ mesh`` is private to each program like any kernel
scratch; unowned HBM scratch is shared by all programs of a device, and
VMEM_SHARED by the programs of one SparseCore (one HBM buffer each). On GPU,
meshes own consecutive warpgroup ranges of one block and all scratch (SMEM,
barriers) is one collective allocation of the block.
"""

import contextlib
import dataclasses
import math
from typing import Any

import jax
import numpy as np

from mpmd import _jax, _pallas_ops
from mpmd._jax import (
  core,
  gpu,
  pallas_core,
  pallas_primitives,
  state,
)
from mpmd._lowering import addressing, jaxpr_util, paths, watchdog
from mpmd._pallas_ops import Sync
from mpmd._primitives import mpmd_map as prim

SUPER_AXIS = "_mpmd_programs"


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each mesh's programs sit on the super-axis."""

  meshes: tuple[pallas_core.Mesh, ...]
  # The axes each mesh contributes to the super-axis (GPU: the thread axis;
  # TPU: all of its axes).
  local_axes: tuple[dict[core.AxisName, int], ...]

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

  def owner(self, axis: core.AxisName) -> int | None:
    """The first mesh with ``axis`` among its own (merged) axes."""
    for j, axes in enumerate(self.local_axes):
      if axis in axes:
        return j
    return None


def _local_index(layout: Layout, i: int, axis: core.AxisName):
  """The mesh-``i`` index along ``axis``, computed from the super-axis."""
  axes = layout.local_axes[i]
  names = list(axes)
  stride = math.prod(list(axes.values())[names.index(axis) + 1 :])
  local = jax.lax.axis_index(SUPER_AXIS) - np.int32(layout.offsets[i])
  return (local // np.int32(stride)) % np.int32(axes[axis])


def _program_of(layout: Layout, i: int, target: addressing.Target):
  """The super-axis index of the program ``target`` names; axes it leaves
  out take caller ``i``'s own index (``addressing`` checked they can)."""
  axes = layout.local_axes[target.mesh]
  sizes = list(axes.values())
  flat = jax.numpy.int32(layout.offsets[target.mesh])
  inside = []
  for k, axis in enumerate(axes):
    coord = target.coords[axis]
    if coord is None:
      coord = _local_index(layout, i, axis)
    elif isinstance(coord, jax.core.Tracer):
      # Known at run time only: past its axis it names no program (-1,
      # which every path reports), not a program of another mesh.
      coord = jax.numpy.asarray(coord, np.int32)
      inside.append((coord >= 0) & (coord < np.int32(sizes[k])))
    stride = np.int32(math.prod(sizes[k + 1 :]))
    flat = flat + jax.numpy.asarray(coord, np.int32) * stride
  if inside:
    flat = jax.numpy.where(jax.numpy.all(jax.numpy.stack(inside)), flat, -1)
  return flat


def _names_kernel_axes(layout: Layout, device_id: Any) -> bool:
  return isinstance(device_id, dict) and any(
    layout.owner(a) is not None for a in device_id
  )


def dma_target(layout: Layout, i: int, eqn, invals) -> addressing.Target | None:
  """The program of the launch a DMA of mesh ``i`` lands on, None if it
  lands on the caller's own program (of this or a remote device).

  Upstream's rules, as for a signal: the target is the receive
  semaphore's owner, ``device_id`` names its axes, the rest default to the
  caller's own index."""
  sem, _ = addressing.dma_operands(eqn, eqn.invars)
  _, device_id = addressing.dma_operands(eqn, invals)
  target = addressing.resolve(
    layout.meshes, i, sem.aval, device_id, f"mpmd_map: {eqn.primitive.name}"
  )
  if target is None or (
    target.mesh == i and not _names_kernel_axes(layout, device_id)
  ):
    return None
  return target


def _dma_to_program(layout: Layout, i: int, eqn, invals, target, rule):
  """Names the target program along the merged kernel's core axis in
  ``device_id``: the TPU simulator (jax >= 0.11) and Mosaic take a core
  axis there, and land the DMA (and its receive signal) on that core."""
  dma = _pallas_ops.DmaOperands.of(eqn, invals)
  rest = target.device_id
  if rest is not None and not isinstance(rest, dict):
    raise NotImplementedError(
      f"mpmd_map: {eqn.primitive.name} to another program of the launch "
      f"names its device by {rest!r}; name the devices by a dict of mesh "
      'axes (device_id={"x": peer, ...}) when the DMA targets another '
      "program"
    )
  device_id = {**(rest or {}), SUPER_AXIS: _program_of(layout, i, target)}
  flat, tree = dma._replace(device_id=device_id).flatten()
  return jaxpr_util.bind_rewritten(eqn, flat, rule, tree=tree)


def _rule(layout: Layout, i: int, platform: str):
  axis_rule = jaxpr_util.axis_index_rule(
    lambda axis: (
      _local_index(layout, i, axis) if axis in layout.local_axes[i] else None
    ),
    dict(layout.local_axes[i]),
  )

  def rule(eqn, invals):
    kind = _pallas_ops.kind(eqn)
    if eqn.primitive is pallas_primitives.semaphore_signal_p:
      signal = _pallas_ops.SignalOperands.of(eqn, invals)
      device_id, core_index = signal.device_id, signal.core_index
      sem_var = _pallas_ops.SignalOperands.of(eqn).sem
      what = "mpmd_map: semaphore_signal(device_id=...)"
      target = addressing.resolve(
        layout.meshes, i, sem_var.aval, device_id, what
      )
      names_axes = _names_kernel_axes(layout, device_id)
      if (
        target is None
        or (platform == "gpu" and not names_axes)
        # The caller's own mesh, its program given by core_index.
        or (core_index is not None and not names_axes and target.mesh == i)
      ):
        return axis_rule(eqn, invals)
      if core_index is not None:
        raise ValueError(
          "mpmd_map: semaphore_signal names its target program both by "
          "device_id (mesh axes, or the semaphore's owner) and by "
          "core_index; use one"
        )
      if platform == "gpu":
        raise NotImplementedError(
          "mpmd_map: GPU programs synchronise through barriers; "
          "semaphore_signal to another mesh's program is TPU-only"
        )
      signal._replace(
        device_id=target.device_id,
        core_index=_program_of(layout, i, target),
      ).bind(eqn)
      return []
    if kind is Sync.RUN_SCOPED:
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
    if kind in (Sync.DMA_START, Sync.DMA_WAIT):
      target = dma_target(layout, i, eqn, invals)
      if target is not None:
        return _dma_to_program(layout, i, eqn, invals, target, rule)
    return axis_rule(eqn, invals)

  return rule


@contextlib.contextmanager
def _in_user_terms(layout: Layout):
  """Errors raised while merging name the user's meshes, never the merged
  kernel's internal axis (``SUPER_AXIS``)."""
  try:
    yield
  except (ValueError, TypeError, NotImplementedError, NameError) as e:
    message = str(e)
    if SUPER_AXIS not in message:
      raise
    meshes = ", ".join(
      addressing.describe_mesh(layout.meshes, j)
      for j in range(len(layout.meshes))
    )
    for name in (repr(SUPER_AXIS), SUPER_AXIS):
      message = message.replace(name, f"<the programs of {meshes}>")
    raise type(e)(message) from None


def _strip_owner(aval):
  """``type @ mesh`` is a plain memory space once programs are merged."""
  if isinstance(aval, state.AbstractRef) and isinstance(
    aval.memory_space, pallas_core.CoreMemorySpace
  ):
    return state.AbstractRef(aval.inner_aval, aval.memory_space.memory_space)
  return aval


def _is_vmem_shared(aval) -> bool:
  return getattr(aval, "memory_space", None) is (
    _jax.tpu().core.MemorySpace.VMEM_SHARED
  )


def _merged_aval(aval):
  """A Ref as the merged kernel sees it: no owner, VMEM_SHARED as HBM (the
  simulator keeps HBM per device, which the merge splits per SparseCore)."""
  aval = _strip_owner(aval)
  if _is_vmem_shared(aval):
    return state.AbstractRef(aval.inner_aval, _jax.tpu().core.MemorySpace.HBM)
  return aval


def sparsecore_axis(mesh) -> core.AxisName | None:
  """The core axis of a SparseCore mesh (None for other meshes)."""
  return getattr(mesh, "core_axis_name", None) or (
    mesh.axis_name if type(mesh).__name__ == "ScalarSubcoreMesh" else None
  )


def num_sparsecores(meshes) -> int:
  """How many SparseCores the launch's SparseCore meshes span."""
  axes = [sparsecore_axis(m) for m in meshes]
  return max(
    [m.shape[a] for m, a in zip(meshes, axes, strict=True) if a is not None],
    default=1,
  )


def _merge(layout: Layout, merged_mesh, jaxprs, platform, avals=None):
  """One kernel jaxpr that switches each program to its mesh's kernel.

  VMEM_SHARED scratch (a SparseCore's memory, shared by its subcores)
  becomes one HBM buffer per SparseCore: every program of the merged kernel
  sees HBM, and each SparseCore program is handed its core's buffer.
  """
  with _in_user_terms(layout):
    return _merge_unchecked(layout, merged_mesh, jaxprs, platform, avals)


def _merge_unchecked(layout: Layout, merged_mesh, jaxprs, platform, avals):
  meshes = layout.meshes
  rewritten = []
  for i, (mesh, jaxpr) in enumerate(zip(meshes, jaxprs, strict=True)):
    # Owners (`sem @ mesh`) say whom a signal targets: strip them after.
    with prim.tracing_context(merged_mesh, (*meshes, merged_mesh)):
      with mesh.tracing_context():
        jaxpr = jaxpr_util.rewrite(jaxpr, _rule(layout, i, platform))
    rewritten.append(jaxpr_util.map_avals(jaxpr, _merged_aval))
  offsets = layout.offsets
  kernel_avals = avals or [_strip_owner(v.aval) for v in jaxprs[0].invars]
  shared = [_is_vmem_shared(a) for a in kernel_avals]
  copies = num_sparsecores(meshes) if any(shared) else 1
  merged_avals = []
  for aval, is_shared in zip(kernel_avals, shared, strict=True):
    merged_avals += [_merged_aval(aval)] * (copies if is_shared else 1)

  def operands(refs, copy: int):
    """The kernel's operands, with SparseCore ``copy``'s VMEM_SHARED."""
    refs, out = list(refs), []
    for is_shared in shared:
      if is_shared:
        out.append(refs[copy])
        del refs[:copies]
      else:
        out.append(refs.pop(0))
    return out

  def run(i, j, refs):
    axis = sparsecore_axis(meshes[i])
    if copies == 1 or axis is None:
      core.eval_jaxpr(j, (), *operands(refs, 0))
      return
    jax.lax.switch(
      _local_index(layout, i, axis),
      [
        lambda c=c: (core.eval_jaxpr(j, (), *operands(refs, c)), None)[1]
        for c in range(copies)
      ],
    )

  def body(*refs):
    program = jax.lax.axis_index(SUPER_AXIS)
    which = (
      sum((program >= np.int32(o)).astype(np.int32) for o in offsets[1:])
      if len(offsets) > 1
      else np.int32(0)
    )
    branches = [
      (lambda i=i, j=j: run(i, j, refs)) for i, j in enumerate(rewritten)
    ]
    jax.lax.switch(which, [lambda b=b: (b(), None)[1] for b in branches])
    return ()

  return prim.retrace(
    jaxprs[0], merged_mesh, (*meshes, merged_mesh), body, merged_avals
  )


def _tpu_layout(meshes) -> Layout:
  return Layout(tuple(meshes), tuple(dict(m.shape) for m in meshes))


def _strip_params(params, merged_mesh, jaxpr):
  # ``user_jaxprs``: the kernels as traced, one per mesh, which name the
  # operands in messages (the merged kernel has mesh 0's names).
  return dict(
    params,
    meshes=(merged_mesh,),
    jaxprs=(jaxpr,),
    user_jaxprs=params.get("user_jaxprs", params["jaxprs"]),
  )


def merge_for_tpu(params):
  """Several TensorCore meshes -> one TensorCore mesh over all programs."""
  layout = _tpu_layout(params["meshes"])
  mesh = _jax.tensorcore_mesh(SUPER_AXIS, num_cores=layout.total)
  jaxpr = _merge(layout, mesh, params["jaxprs"], "tpu")
  return mesh, jaxpr, _strip_params(params, mesh, jaxpr)


def gpu_layout(meshes) -> Layout:
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
  layout = gpu_layout(meshes)
  mesh = _merged_gpu_mesh(meshes, layout.total)
  jaxpr = _merge(layout, mesh, params["jaxprs"], "gpu")
  return mesh, jaxpr, _strip_params(params, mesh, jaxpr)


def dma_to_program(layout: Layout, jaxprs) -> tuple[int, Any] | None:
  """(mesh, equation) of the first DMA addressed to another program of the
  launch, None if there is none."""
  for i, jaxpr in enumerate(jaxprs):
    for eqn in jaxpr_util.iter_eqns(jaxpr):
      if _pallas_ops.is_dma(eqn) and (
        dma_target(layout, i, eqn, eqn.invars) is not None
      ):
        return i, eqn
  return None


def _check_no_dma_to_program(layout: Layout, jaxprs) -> None:
  found = dma_to_program(layout, jaxprs)
  if found is not None:
    i, eqn = found
    raise NotImplementedError(
      f"mpmd_map: {addressing.describe_mesh(layout.meshes, i)} issues a "
      f"DMA ({eqn.primitive.name}) addressed to another program of the "
      f"launch, which the TPU simulator of jax {jax.__version__} cannot run "
      "(it lands every DMA on the issuing core; jax >= 0.12 runs it). Stage "
      "the data in shared HBM scratch and signal a semaphore instead"
    )


def merge_for_simulator(params, path):
  """Merges for a CPU simulator; also returns which programs are whose."""
  if path.kind == paths.GPU_SIMULATOR:
    layout = gpu_layout(params["meshes"])
    mesh, jaxpr, params = merge_for_gpu(params)
  else:
    layout = _tpu_layout(params["meshes"])
    if _jax.JAX_VERSION < (0, 12):
      _check_no_dma_to_program(layout, params["jaxprs"])
    mesh, jaxpr, params = merge_for_tpu(params)
  return mesh, jaxpr, params, layout.ranges()
