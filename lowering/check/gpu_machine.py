"""A GPU launch on the checking executor: its plan and its machine.

A Mosaic GPU kernel runs one program per warpgroup of each block
(``grid`` x warpgroups). Global memory (the operands) is one buffer per
device; shared memory (kernel scratch, collective ``run_scoped``
allocations) is one buffer per block, which all warpgroups of the block
share; a ``run_scoped`` allocation without collective axes (an accumulator)
belongs to its warpgroup. Barriers are per-element state next to their
buffer (``gpu.Barrier``).
"""

import dataclasses
import math
from collections.abc import Hashable

import numpy as np

from mpmd import _jax
from mpmd._jax import core
from mpmd._lowering import jaxpr_util, merge, paths
from mpmd._lowering.check import machine, memory
from mpmd._lowering.check.memory import Buffer, View


@dataclasses.dataclass
class GpuPlan(machine.Plan):
  """A GPU launch's plan: programs are (block, warpgroup) pairs, block
  major; ``grid`` names the blocks' axes, ``threads`` the warpgroups'."""

  grid: tuple[tuple[core.AxisName, int], ...] = ()
  threads: tuple[core.AxisName, int] | None = None

  @property
  def num_warpgroups(self) -> int:
    return 1 if self.threads is None else self.threads[1]

  def axis_values(self, program: int) -> dict[core.AxisName, tuple[int, int]]:
    """Axis name -> (index, size) for ``program``."""
    block, wg = divmod(program, self.num_warpgroups)
    sizes = [s for _, s in self.grid]
    coords = np.unravel_index(block, sizes) if sizes else ()
    values = {
      a: (int(c), s) for (a, s), c in zip(self.grid, coords, strict=True)
    }
    if self.threads is not None:
      values[self.threads[0]] = (wg, self.threads[1])
    return values

  def block_of(self, program: int) -> int:
    return program // self.num_warpgroups


def block_name(grid, block: int) -> str:
  """``block {'m': 0}``: a block by its grid coordinates."""
  sizes = [s for _, s in grid]
  coords = np.unravel_index(block, sizes) if sizes else ()
  where = {a: int(c) for (a, _), c in zip(grid, coords, strict=True)}
  return f"block {where}"


def program_names(meshes, grid, layout) -> tuple[str, ...]:
  """``block {'m': 0} mesh 1 warpgroup {'compute': 1}`` per program."""
  names = []
  for block in range(math.prod(s for _, s in grid)):
    where = block_name(grid, block)
    if layout is None:
      names.append(f"{where} mesh 0")
      continue
    for r in layout.ranges():
      for k in range(r.size):
        coords = np.unravel_index(k, list(r.shape.values()))
        wgs = {a: int(c) for a, c in zip(r.shape, coords, strict=True)}
        names.append(f"{where} mesh {r.index} warpgroup {wgs}")
  return tuple(names)


def merged(params):
  """(mesh, jaxpr, layout) of a GPU launch: its meshes merged into one
  kernel whose thread axis holds every mesh's warpgroups (``merge``); a
  lone mesh without warpgroups as it is (layout None)."""
  meshes = params["meshes"]
  if len(meshes) == 1 and getattr(meshes[0], "num_threads", 0) is None:
    return meshes[0], params["jaxprs"][0], None
  mesh, jaxpr, _ = merge.merge_for_gpu(params)
  return mesh, jaxpr, merge.gpu_layout(meshes)


def grid_of(mesh) -> tuple[tuple[core.AxisName, int], ...]:
  cluster = tuple(getattr(mesh, "cluster", ()) or ())
  if math.prod(cluster) > 1:
    raise NotImplementedError(
      "mpmd checker: GPU clusters (cluster="
      f"{dict(zip(mesh.cluster_names, cluster, strict=True))}: cluster "
      "barriers and multicast TMA copies) are not supported; run the "
      "launch with interpret=None (the Mosaic GPU simulator)"
    )
  return tuple(
    (a, int(s)) for a, s in zip(mesh.grid_names, mesh.grid, strict=True)
  )


def is_barrier(aval) -> bool:
  dtype = getattr(getattr(aval, "inner_aval", aval), "dtype", None)
  return isinstance(dtype, _jax.gpu().core.BarrierType)


def is_accumulator(aval) -> bool:
  return isinstance(aval, _jax.gpu().core.WGMMAAbstractAccumulatorRef)


def _is_smem(aval) -> bool:
  space = getattr(aval, "memory_space", None)
  space = getattr(space, "memory_space", space)  # without its owner
  return space == _jax.gpu().core.MemorySpace.SMEM


def _unsupported_dtype(aval) -> str | None:
  dtype = getattr(getattr(aval, "inner_aval", aval), "dtype", None)
  if _jax.is_extended(dtype) and not is_barrier(aval):
    return str(dtype)
  return None


# Swizzling permutes bytes inside SMEM rows: which logical elements a Ref
# names stays the same, so the executor's logical views ignore it.
_SWIZZLES = ("SwizzleTransform", "UnswizzleRef")


def untile(ids: np.ndarray, tiling: tuple[int, ...]) -> np.ndarray:
  """Flat indices of a tiled buffer ``(*lead, *tiles, *tiling)`` seen at
  their logical shape ``(*lead, tiles[0] * tiling[0], ...)`` (what
  ``UntilingTransform`` makes of a tiled Ref)."""
  k = len(tiling)
  lead = ids.ndim - 2 * k
  order = list(range(lead))
  for i in range(k):
    order += [lead + i, lead + k + i]
  shape = ids.shape[:lead] + tuple(
    ids.shape[lead + i] * ids.shape[lead + k + i] for i in range(k)
  )
  return ids.transpose(order).reshape(shape)


class GpuMachine(machine.Machine):
  """One GPU launch (see the module docstring); ``gpu`` keeps the state of
  barriers, asynchronous copies and WGMMAs."""

  def __init__(self, plan: GpuPlan, strategy):
    super().__init__(plan, strategy)
    self.gpu_plan = plan
    from mpmd._lowering.check import gpu

    self.gpu = gpu.State()
    self.smem: set[int] = set()  # ids of shared-memory buffers

  def buffer(self, label, key, aval, data=None) -> Buffer:
    """A buffer for ``aval``: barriers get per-element barrier state,
    accumulators start at zero (as Mosaic GPU allocates them)."""
    inner = aval.inner_aval
    bad = _unsupported_dtype(aval)
    if bad is not None:
      raise NotImplementedError(
        f"mpmd checker: a GPU buffer of dtype {bad} ({label})"
      )
    if is_barrier(aval):
      b = Buffer(label, key, inner.shape, np.int32, self.aranges, data=None)
      self.gpu.new_barrier(b, inner.dtype.num_arrivals)
      return b
    if is_accumulator(aval):
      zeros = np.zeros(inner.shape, inner.dtype)
      return Buffer(
        label, key, inner.shape, inner.dtype, self.aranges, data=zeros
      )
    if paths.is_semaphore(aval):
      raise NotImplementedError(
        f"mpmd checker: semaphores in a GPU launch ({label})"
      )
    b = Buffer(label, key, inner.shape, inner.dtype, self.aranges, data=data)
    if _is_smem(aval):
      self.smem.add(id(b))
    return b

  def _operand_buffers(self, inputs):
    plan = self.gpu_plan
    avals = [v.aval for v in plan.jaxpr.invars]
    num_operands = plan.num_in + len(plan.out_avals)
    for d in range(plan.num_devices):
      shared: dict[tuple[Hashable, ...], Buffer] = {}
      for k, aval in enumerate(avals[:num_operands]):
        if not hasattr(aval, "inner_aval"):
          continue  # a scalar value (closed over by a kernel): no memory
        key = ("operand", k)
        if k >= plan.num_in and k - plan.num_in in plan.aliases:
          shared[key] = shared[("operand", plan.aliases[k - plan.num_in])]
          continue
        data = None
        if k < plan.num_in:
          data = inputs[k][d] if plan.device_axes else inputs[k]
        shared[key] = self.buffer(self._label(k, d), key, aval, data)
      blocks: dict[int, dict[tuple[Hashable, ...], Buffer]] = {}
      for g in range(plan.num_programs):
        block = plan.block_of(g)
        if block not in blocks:
          blocks[block] = dict(shared)
          # The block's own (SMEM, barriers): named by the block, which
          # all its warpgroups share.
          where = f"{plan.device_name(d)}{block_name(plan.grid, block)}"
          for k in range(num_operands, len(avals)):
            key = ("operand", k)
            label = f"{plan.labels[k]!r} ({where})"
            blocks[block][key] = self.buffer(label, key, avals[k])
        self.memory[(d, g)] = blocks[block]

  def allocate_scoped(self, ctx, eqn, avals_vars, collective=False):
    """``run_scoped`` buffers: per block when ``collective`` (the
    warpgroups of a block share them), else per warpgroup."""
    mine = self.memory[(ctx.device, ctx.program)]
    views = []
    for k, v in enumerate(avals_vars):
      owner = "block" if collective else ctx.program
      key = ("scoped", eqn, k, ctx.scope_depth, owner)
      if key not in mine:
        label = memory.Lazy(
          lambda k=k, d=ctx.device, g=ctx.program, at=ctx.where, p=self.plan: (
            f"{jaxpr_util.scoped_names(eqn)[k]} at {at} ({p.name(d, g)})"
          )
        )
        mine[key] = self.buffer(label, key, v.aval)
      views.append(View(mine[key], mine[key].ids))
    return tuple(views)

  def resolve(self, ref, transforms, describe) -> View:
    from mpmd._lowering.check import records

    if isinstance(ref, records.RefOperand):
      ref, transforms = ref.ref, (*ref.transforms, *transforms)
    view = super().resolve(ref, (), describe)
    for t in transforms or ():
      name = type(t).__name__
      if name == "UntilingTransform":
        view = View(view.buffer, untile(view.ids, tuple(t.tiling)))
      elif name not in _SWIZZLES:
        view = super().resolve(view, (t,), describe)
    return view

  def load(self, ctx, view: View, eqn, check_init=True, mask=None, read=True):
    value = super().load(ctx, view, eqn, check_init, mask, read)
    self._touched(ctx, view, mask, write=False)
    return value

  def store(self, ctx, view: View, value, eqn, mask=None):
    super().store(ctx, view, value, eqn, mask)
    self._touched(ctx, view, mask, write=True)

  def _touched(self, ctx, view: View, mask, write: bool) -> None:
    """Generic-proxy SMEM accesses, for the commit_smem checks."""
    if id(view.buffer) in self.smem:
      comp = self.comp(ctx.device, ctx.program)
      ids = view.ids
      if mask is not None:
        ids = ids[np.broadcast_to(np.asarray(mask, bool), view.shape)]
      self.gpu.touched_smem(comp, view.buffer, ids, ctx.where, write)
