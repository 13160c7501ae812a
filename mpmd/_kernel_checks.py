"""Checks of the traced kernels before they are bound: what each program
may touch (memory spaces, collectives, DMAs, device ids, core indices), fixed
DMA windows, unbound axis names."""

import math
import operator
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
from jax.experimental import pallas as pl

from mpmd import _jax, _pallas_ops
from mpmd._arguments import short
from mpmd._jax import (
  core,
  pallas_core,
  state_indexing,
)
from mpmd._lowering import addressing, bounds, errors, jaxpr_util, paths
from mpmd._pallas_ops import Sync
from mpmd._primitives import mpmd_map as prim

_UNBOUND_AXIS = re.compile(r"unbound axis name: (.+?)(?:\. |\.?$)", re.M)


def raise_if_unbound_axis(error: NameError, mesh, meshes, debug_info):
  """JAX's advice for an unbound axis ("call axis_index under shard_map")
  misleads in a kernel: say which axes the kernel can name."""
  found = _UNBOUND_AXIS.search(str(error))
  if found is None:
    return  # not an axis name: a NameError of the user's code
  outer = jax.sharding.get_abstract_mesh()
  outer_axes = () if outer.empty else tuple(outer.axis_names)
  others = {a: n for m in meshes if m is not mesh for a, n in m.shape.items()}
  raise ValueError(
    f"mpmd_map: kernel {debug_info.func_src_info} names axis "
    f"{found.group(1)!r}, which is not an axis of its mesh "
    f"{dict(mesh.shape)}"
    + (f", of the launch's other meshes {others}" if others else "")
    + (
      f", or of the enclosing shard_map {outer_axes}"
      if outer_axes
      else " (and there is no enclosing shard_map)"
    )
  ) from None


class _Fixed(NamedTuple):
  """One index of a ``.at[...]`` window, as written: its text, and whether
  it stays inside its dimension (True when not fixed at trace time)."""

  text: str
  inside: bool


def _fixed(x: Any) -> int | None:
  """``x`` as a Python int if it is fixed at trace time, else None."""
  try:
    return operator.index(x)
  except TypeError:  # a traced value (or no integer at all)
    return None


def _fixed_dims(indices: tuple[Any, ...], shape) -> list[_Fixed] | None:
  """Per dimension of ``shape``, its index among ``indices`` (None if they
  do not index it as we know: JAX then reports what is wrong itself)."""
  if sum(i is Ellipsis for i in indices) > 1:
    return None
  if Ellipsis in indices:
    k = indices.index(Ellipsis)
    fill = (slice(None),) * (len(shape) - len(indices) + 1)
    indices = (*indices[:k], *fill, *indices[k + 1 :])
  if len(indices) > len(shape):
    return None
  indices = (*indices, *(slice(None),) * (len(shape) - len(indices)))
  dims = []
  for index, size in zip(indices, shape, strict=True):
    if isinstance(index, slice):  # JAX clamps Python slices into the shape
      start, stop, _ = index.indices(size)
      written = _fixed(index.start) if index.start is not None else 0
      if written is not None and not -size <= written < size and size:
        # ... but refuses one that starts past it (``x.at[8:16]`` of 8).
        stop = "" if index.stop is None else index.stop
        dims.append(_Fixed(f"{written}:{stop}", False))
        continue
      dims.append(_Fixed(f"{start}:{stop}", True))
    elif isinstance(index, pl.Slice):
      start, length = _fixed(index.start), _fixed(index.size)
      if start is None or length is None:
        dims.append(_Fixed("(traced)", True))
        continue
      last = start + (length - 1) * index.stride
      step = f":{index.stride}" if index.stride != 1 else ""
      dims.append(
        _Fixed(
          f"{start}:{start + length * index.stride}{step}",
          length <= 0 or (start >= 0 and last < size),
        )
      )
    else:
      value = _fixed(index)
      if value is None:
        dims.append(_Fixed("(traced)", True))
      else:
        dims.append(_Fixed(str(value), 0 <= value < size))
  return dims


def raise_if_fixed_window_leaves(
  error: ValueError, operands, debug_info, num_in: int, num_out: int
) -> None:
  """JAX rejects a ``.at[...]`` window fixed past its Ref's end where it is
  written, with a bare ``ValueError``: re-raised as a
  ``mpmd.OutOfBoundsError`` (also a ``ValueError``) that names the kernel,
  the Ref and the window, as for the windows it lets through.

  Args:
    error: what tracing the kernel raised.
    operands: the kernel's flat Ref operands, as traced.
    debug_info: the kernel's (its name, source and argument names).
    num_in: how many of ``operands`` are inputs; then ``num_out`` outputs,
      then scratch.
  """
  for view, indices in _jax.ref_indexings(error.__traceback__):
    shape = tuple(view.shape)
    dims = _fixed_dims(indices, shape)
    if dims is None or all(d.inside for d in dims):
      continue
    root = view
    while isinstance(root, _jax.state_types.TransformedRef):
      root = root.ref
    k = next((k for k, r in enumerate(operands) if r is root), None)
    name = _operand(k, debug_info, num_in, num_out, root)
    if root is not view:
      name += f", in its view of shape {shape}"
    window = f".at[{', '.join(d.text for d in dims)}]"
    at = _indexing_line(error.__traceback__)
    raise errors.StaticOutOfBoundsError(
      f"mpmd_map: kernel {debug_info.func_src_info}: the window {window} "
      f"is out of bounds of {name} ({at}hardware would fault; JAX: {error})"
    ) from None


def _indexing_line(traceback) -> str:
  """``at file.py:12; ``: the line whose ``.at[...]`` JAX refused (the
  frame that called ``RefIndexer.__getitem__``), "" if none did."""
  getitem = _jax.state_types.RefIndexer.__getitem__.__code__
  caller = None
  while traceback is not None:
    if traceback.tb_frame.f_code is getitem and caller is not None:
      return f"at {caller.tb_frame.f_code.co_filename}:{caller.tb_lineno}; "
    caller, traceback = traceback, traceback.tb_next
  return ""


def _operand(k: int | None, debug_info, num_in: int, num_out: int, ref):
  """``'x_hbm' (input 0, f32[8,128])``, as run-time errors name it."""
  aval = jax.typeof(ref)
  aval = getattr(aval, "inner_aval", aval).str_short(short_dtypes=True)
  if k is None:
    return f"a closed-over Ref ({aval})"
  if k < num_in:
    role = f"input {k}"
  elif k < num_in + num_out:
    role = f"output {k - num_in}"
  else:
    role = f"scratch {k - num_in - num_out}"
  names = debug_info.arg_names or ()
  name = f"{names[k]!r} " if k < len(names) and names[k] else ""
  return f"{name}({role}, {aval})"


class Roles(NamedTuple):
  """Names a kernel's operands in messages: ``'x_hbm' (input 0)``."""

  debug_info: Any
  num_in: int
  num_out: int
  # Closed-over values that lead the traced jaxpr's inputs (jax 0.11+; up
  # to 0.10 they are its constvars).
  num_consts: int = 0

  def describe(self, jaxpr: core.Jaxpr, var: Any, aval: Any) -> str:
    if isinstance(var, str):  # named by _check_eqns
      return f"{var} ({short(aval)})"
    if var in jaxpr.constvars:
      return f"a closed-over Ref ({short(aval)})"
    try:
      k = jaxpr.invars.index(var)
    except ValueError:
      return short(aval)  # not traced back to a kernel operand
    if k < self.num_consts:
      return f"a closed-over Ref ({short(aval)})"
    k -= self.num_consts
    if k < self.num_in:
      role = f"input {k}"
    elif k < self.num_in + self.num_out:
      role = f"out_types leaf {k - self.num_in}"
    else:
      role = f"scratch_types leaf {k - self.num_in - self.num_out}"
    names = self.debug_info.arg_names
    name = f"{names[k]!r} " if names and k < len(names) else ""
    return f"{name}({role}, {short(aval)})"


def check_kernel(jaxpr: core.Jaxpr, caller: int, meshes, roles: Roles):
  """What the kernel asks of DMAs, signals and scoped allocations, checked
  where it is written (trace time) instead of by a lowering or a simulator
  after the kernel is merged."""
  kernel = f"mpmd_map: kernel {roles.debug_info.func_src_info}"
  outer = jax.sharding.get_abstract_mesh()
  axis_sizes = {} if outer.empty else dict(outer.shape)
  device_axes = tuple(axis_sizes)
  axis_sizes.update(prim.axis_env(meshes))
  where = _Where(caller, meshes, axis_sizes, roles, kernel, device_axes)
  _check_eqns(jaxpr, jaxpr, {}, where)


class _Where(NamedTuple):
  """The kernel being checked: its mesh (by position) among the launch's."""

  caller: int
  meshes: tuple[Any, ...]
  axis_sizes: dict[Any, int]
  roles: Roles
  kernel: str
  device_axes: tuple[Any, ...]  # the enclosing shard_map's, in order
  # Where the enclosing operation is in the user's code: the line of an
  # operation JAX made (a ``sync_copy``'s DMA, inside its ``run_scoped``).
  line: str = ""


def check_static_windows(jaxprs, meshes, num_in: int, num_out: int) -> None:
  """A DMA window fixed in a TPU kernel that leaves its buffer faults on
  the hardware: an error at trace time, whichever platform the launch is
  then lowered for. ``jaxprs`` are the kernels as bound (closed-over values
  hoisted to inputs ``num_in`` on), which ``bounds`` knows how to name."""
  for mesh, jaxpr in zip(meshes, jaxprs, strict=True):
    if paths.is_gpu_mesh(mesh):
      continue
    bounds.check_static(
      jaxpr,
      bounds.operand_names(jaxpr, num_in, num_out),
      jaxpr.debug_info.func_src_info,
    )


def _check_eqns(top, jaxpr, outer, where: _Where) -> None:
  """``outer`` maps a variable of a nested jaxpr to the kernel operand it
  stands for (so that messages can name it)."""
  mesh = where.meshes[where.caller]
  roles, kernel = where.roles, where.kernel
  for eqn in jaxpr.eqns:
    name, kind = eqn.primitive.name, _pallas_ops.kind(eqn)
    at = _at(jaxpr_util.line(eqn) or where.line)
    if kind in (Sync.DMA_START, Sync.DMA_WAIT):
      if kind is Sync.DMA_START:
        _check_dma(top, eqn, outer, roles, kernel, at)
      sem, device_id = addressing.dma_operands(eqn, eqn.invars)
      what = f"{kernel}: a DMA ({name})"
      _check_device_id(device_id, eqn.params["device_id_type"], where, what, at)
      what = f"{what}{at}{_sem(top, sem, outer, roles)}"
      target = addressing.resolve(
        where.meshes, where.caller, sem.aval, device_id, what
      )
      _check_sparsecore_dma(target, device_id, where, what)
    elif kind is Sync.SIGNAL:
      signal = _pallas_ops.SignalOperands.of(eqn)
      sem, device_id = signal.sem, signal.device_id
      core_index = signal.core_index
      what = f"{kernel}: semaphore_signal"
      _check_device_id(device_id, eqn.params["device_id_type"], where, what, at)
      if device_id is None:
        _check_core_index(core_index, mesh, what, at)
      addressing.resolve(
        where.meshes,
        where.caller,
        sem.aval,
        device_id,
        f"{what}{at}{_sem(top, sem, outer, roles)}",
      )
    elif kind is Sync.RUN_SCOPED:
      _check_collective_axes(eqn.params.get("collective_axes"), mesh, kernel)
    elif name in _REF_ACCESS and not paths.is_gpu_mesh(mesh):
      _check_direct_access(top, eqn, outer, mesh, roles, kernel, at)
    elif name in _GPU_REF_TRANSFORMS and paths.is_gpu_mesh(mesh):
      _check_gpu_indices(top, eqn, outer, roles, kernel, at)
    for sub in jaxpr_util.sub_jaxprs(eqn.params):
      inner = dict(outer)
      for v, x in _operands_of(eqn, sub):
        if isinstance(x, core.Var) and v.aval == x.aval:
          inner[v] = outer.get(x, x)
      if kind is Sync.RUN_SCOPED:
        inner.update(zip(sub.invars, jaxpr_util.scoped_names(eqn), strict=True))
      _check_eqns(
        top, sub, inner, where._replace(line=jaxpr_util.line(eqn) or where.line)
      )


# Primitives that read or write a Ref's elements in place (``x_ref[...]``,
# ``x_ref[...] = v``, ``x_ref[...] += v``, ``pl.load``, ``pl.store``), by
# what they do to it.
_REF_ACCESS = {
  "get": "reads",
  "masked_load": "reads",
  "swap": "writes",
  "masked_swap": "writes",
  "addupdate": "updates",
}


# Mosaic GPU operations on Refs: the parameters holding their leading Refs'
# transforms, in operand order.
_GPU_REF_TRANSFORMS = {
  "copy_gmem_to_smem": (
    "src_transforms_treedef",
    "dst_transforms_treedef",
    "barrier_transforms_treedef",
  ),
  "copy_smem_to_gmem": ("src_transforms_treedef", "dst_transforms_treedef"),
  "barrier_arrive": ("transforms_treedef",),
  "barrier_wait": ("transforms_treedef",),
}


def _check_gpu_indices(top, eqn, outer, roles, kernel: str, at: str) -> None:
  """A literal index past its Ref's dimension in a Mosaic GPU operation
  (``barriers.at[3]`` of 2): Pallas' GPU simulator would use some other
  element, hardware some other memory. (Slices are JAX's to check.)"""
  keys = _GPU_REF_TRANSFORMS[eqn.primitive.name]
  flat = eqn.invars[len(keys) :]
  for ref, key in zip(eqn.invars[: len(keys)], keys, strict=True):
    tree = eqn.params.get(key)
    if tree is None:
      continue
    n = tree.num_leaves
    transforms, flat = tree.unflatten(flat[:n]), flat[n:]
    first = transforms[0] if transforms else None
    if not isinstance(first, state_indexing.NDIndexer):
      continue  # (later indexers index a view, not the Ref)
    shape = ref.aval.shape
    for dim, (index, size) in enumerate(
      zip(first.indices, shape, strict=False)
    ):
      if isinstance(index, core.Literal) and not 0 <= int(index.val) < size:
        name = roles.describe(top, outer.get(ref, ref), ref.aval)
        raise errors.StaticOutOfBoundsError(
          f"{kernel}: {eqn.primitive.name}{at}: index {int(index.val)} of "
          f"dimension {dim} of {name} is out of bounds (size {size}); "
          "hardware would use other memory"
        )


def _tpu_memory_space(aval, mesh) -> Any:
  """Where a Ref lives on a TPU: a Ref without a memory space (a kernel
  operand) is in its mesh's default one (ANY for TensorCores, HBM for
  SparseCores), as Mosaic places it."""
  space = getattr(aval, "memory_space", None)
  if isinstance(space, pallas_core.CoreMemorySpace):
    space = space.memory_space
  return mesh.default_memory_space if space is None else space


def _check_direct_access(
  top, eqn, outer, mesh, roles, kernel: str, at: str
) -> None:
  """Mosaic TPU reads and writes only VMEM and SMEM Refs in place; data in
  HBM (or ANY, or shared VMEM) moves by DMA. The CPU fallback would run
  such a kernel, so it is rejected here, the same on every path."""
  ref = eqn.invars[0]
  aval = ref.aval
  space = _tpu_memory_space(aval, mesh)
  tpu_spaces = _jax.tpu().core.MemorySpace
  if space not in (
    pallas_core.MemorySpace.ANY,
    tpu_spaces.HBM,
    tpu_spaces.VMEM_SHARED,
  ):
    return
  ref = outer.get(ref, ref)
  raise ValueError(
    f"{kernel}: {_REF_ACCESS[eqn.primitive.name]} "
    f"{roles.describe(top, ref, aval)} in place{at}, but it is in "
    f"{getattr(space, 'name', space)} memory: on TPU only VMEM and SMEM "
    "Refs can be read or written directly; copy the data to or from VMEM "
    "scratch with pltpu.sync_copy / pltpu.async_copy"
  )


def _check_collective_axes(axes, mesh, kernel: str) -> None:
  """Each message ends with upstream's words for the same condition, which
  upstream's tests match."""
  axes = tuple(axes or ())
  unknown = [a for a in axes if a not in mesh.shape]
  if unknown:
    raise ValueError(
      f"{kernel}: run_scoped(collective_axes={axes!r}) names {unknown}, "
      f"which are not axes of the kernel's mesh {dict(mesh.shape)} "
      f"(upstream: Collective axis `{unknown[0]}` not found among axes "
      f"`{list(mesh.shape)}`)"
    )
  thread = getattr(mesh, "thread_name", None)
  if paths.is_gpu_mesh(mesh) and axes and axes != (thread,):
    # Mosaic GPU allocates collectively only across a block's warpgroups.
    if set(axes) & set(getattr(mesh, "cluster_names", ())):
      upstream = "Collective allocations along cluster axes are not supported."
    elif thread not in axes:
      upstream = (
        "Scoped allocation must have the thread axis in its collective axes."
      )
    else:
      upstream = None
    raise ValueError(
      f"{kernel}: run_scoped(collective_axes={axes!r}): expected no "
      f"collective axes or only the warpgroup axis ({thread!r},) of the "
      f"kernel's mesh {dict(mesh.shape)}"
      + (f" (upstream: {upstream})" if upstream else "")
    )


def _operands_of(eqn, sub: core.Jaxpr):
  """(variable of ``sub``, operand of ``eqn`` it receives) pairs, where the
  layout is the usual one: closed-over operands (``run_scoped``), else the
  trailing operands (``cond`` after its index, loops after their consts)."""
  operands = list(eqn.invars)
  if len(sub.constvars) == len(operands):
    return zip(sub.constvars, operands, strict=True)
  n = min(len(sub.invars), len(operands))
  return zip(
    sub.invars[len(sub.invars) - n :],
    operands[len(operands) - n :],
    strict=True,
  )


def _check_dma(top, eqn, outer, roles: Roles, kernel: str, at: str) -> None:
  by_avals = _pallas_ops.DmaOperands.of(eqn, [v.aval for v in eqn.invars])
  if _pallas_ops.kind(eqn) is Sync.DMA_START:
    _check_dma_semaphores(by_avals, kernel)
  src, dst = by_avals.src, by_avals.dst
  try:
    # The windows' shapes follow from the static slice sizes.
    src_type, dst_type = (src.shape, src.dtype), (dst.shape, dst.dtype)
  except Exception:  # noqa: BLE001 -- a view we cannot size: Mosaic checks
    return
  if src_type == dst_type:
    return
  dma = _pallas_ops.DmaOperands.of(eqn)
  src_var, dst_var = (_pallas_ops.split_ref(r)[0] for r in (dma.src, dma.dst))
  src_ref, dst_ref = src_var.aval, dst_var.aval
  src_var, dst_var = outer.get(src_var, src_var), outer.get(dst_var, dst_var)
  raise ValueError(
    f"{kernel}: a DMA{at} copies from "
    f"{roles.describe(top, src_var, src_ref)} into "
    f"{roles.describe(top, dst_var, dst_ref)}: expected the same shape and "
    f"dtype on both sides, got {_type_str(*src_type)} and "
    f"{_type_str(*dst_type)}"
  )


def _check_dma_semaphores(dma: _pallas_ops.DmaOperands, kernel: str) -> None:
  """Mosaic's rules for a DMA's semaphores (which its verifier enforces on
  TPU), at trace time on every path: both of one kind, and a REGULAR one
  (counted once, ``_pallas_ops.signalled_once``) not for SMEM."""
  once = [
    _pallas_ops.signalled_once(s)
    for s in (dma.dst_sem, dma.src_sem)
    if s is not None
  ]
  if len(set(once)) > 1:
    raise ValueError(
      f"{kernel}: a DMA's receive and send semaphores are of different "
      "kinds (one pltpu.SemaphoreType.DMA, one not): DMA source and target "
      "semaphore must have the same type"
    )
  smem = _jax.tpu().core.MemorySpace.SMEM
  spaces = [
    getattr(_pallas_ops.split_ref(r)[0], "memory_space", None)
    for r in (dma.src, dma.dst)
  ]
  spaces = [getattr(x, "memory_space", x) for x in spaces]  # `SMEM @ mesh`
  if any(once) and smem in spaces:
    raise ValueError(
      f"{kernel}: a DMA to or from SMEM signals a REGULAR semaphore: "
      "Non-DMA semaphores are not supported for DMAs involving SMEM; use a "
      "pltpu.SemaphoreType.DMA semaphore"
    )


def _type_str(shape, dtype) -> str:
  return core.ShapedArray(tuple(shape), dtype).str_short(short_dtypes=True)


def _check_sparsecore_dma(target, device_id, where: _Where, what: str):
  """Mosaic addresses a SparseCore program's DMA to another mesh only by
  its ``device_id`` (without one it fails to verify): say so at trace
  time, on every path."""
  if target is None or target.mesh == where.caller or device_id is not None:
    return
  mesh = where.meshes[where.caller]
  kind = getattr(getattr(mesh, "core_type", None), "name", "")
  if not kind.startswith("SC_"):
    return
  target_mesh = where.meshes[target.mesh]
  axes = ", ".join(f"{a!r}: ..." for a in target_mesh.shape)
  raise ValueError(
    f"{what} lands on {addressing.describe_mesh(where.meshes, target.mesh)} "
    "(the owner of its receive semaphore) without a device_id: a "
    "SparseCore program addresses another mesh's program by device_id "
    f"only; pass device_id={{{axes}}} (axes shared with the caller may be "
    "left out)"
  )


def _sem(top, sem: Any, outer, roles: Roles) -> str:
  """`` of 'sem' (scratch_types leaf 1, ...)``: the semaphore an operation
  counts on, as the kernel names it ("" where it is no variable)."""
  if not isinstance(sem, core.Var):
    return ""
  return f" of {roles.describe(top, outer.get(sem, sem), sem.aval)}"


def _at(line: str) -> str:
  """`` (at file.py:12:4 (fn))``: where an operation is, for a message
  ("" where the user's code has no line for it)."""
  return f" (at {line})" if line else ""


def _check_device_id(device_id, id_type, where: _Where, what, at) -> None:
  """Axes a ``device_id`` dict names exist, a tuple has one index per axis
  of the shard_map's mesh; literal indices are in range (else a
  ``StaticOutOfBoundsError``: on hardware, a DMA or signal to a device
  that is not there)."""
  axis_sizes, axes = where.axis_sizes, where.device_axes
  written = device_id
  if device_id is None or isinstance(device_id, Mapping):
    pass
  elif id_type is _jax.pallas_primitives.DeviceIdType.LOGICAL:
    return  # a flat index
  else:
    ids = device_id if isinstance(device_id, tuple | list) else (device_id,)
    if len(ids) != len(axes):
      raise ValueError(
        f"{what}{at} names device_id {_shown(device_id)}: a device_id that "
        "is not a dict holds one index per axis of the enclosing "
        f"shard_map's mesh {axes}, in order (a dict names axes, kernel "
        "mesh axes too). Upstream's words: Number of device ids must match "
        f"the number of mesh axes, but got {len(ids)} ids for a "
        f"{len(axes)}D mesh."
      )
    device_id = dict(zip(axes, ids, strict=True))
  if not isinstance(device_id, Mapping):
    return
  for axis, index in device_id.items():
    size = axis_sizes.get(axis)
    if size is None:
      try:  # bound some other way (pmap): still the caller's trace
        size = jax.lax.axis_size(axis)
      except NameError:
        raise ValueError(
          f"{what}{at} names device_id axis {axis!r}, which is not an axis of "
          f"the kernel meshes or of an enclosing shard_map {axis_sizes}"
        ) from None
    if isinstance(index, core.Literal):
      value = int(index.val)
      if not 0 <= value < size:
        shown = (
          f"{{{axis!r}: {value}}}"
          if isinstance(written, Mapping)
          else _shown(written)
        )
        raise errors.StaticOutOfBoundsError(
          f"{what} names device_id {shown}: expected an index in [0, "
          f"{size}) along axis {axis!r}{at}"
        )


def _shown(device_id) -> str:
  """A ``device_id`` as written: literals by value, traced ones by type."""
  if not isinstance(device_id, tuple | list):
    return _shown([device_id])[1:-2]
  shown = [
    str(int(x.val)) if isinstance(x, core.Literal) else short(x.aval)
    for x in device_id
  ]
  return f"({', '.join(shown)}{',' if len(shown) == 1 else ''})"


def _check_core_index(core_index: Any, mesh, what: str, at: str) -> None:
  """A literal ``core_index`` names one of the caller's mesh's programs."""
  if not isinstance(core_index, core.Literal) or paths.is_gpu_mesh(mesh):
    return
  size, value = math.prod(mesh.shape.values()), int(core_index.val)
  if not 0 <= value < size:
    raise errors.StaticOutOfBoundsError(
      f"{what} names core_index={value}: expected an index in [0, {size}) "
      f"(the programs of its mesh {dict(mesh.shape)}){at}"
    )
