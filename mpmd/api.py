"""The public entry point: ``mpmd_map``."""

import contextlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from mpmd import _jax
from mpmd._jax import (
  FrozenDict,
  api_util,
  config,
  core,
  lu,
  pallas_core,
  pe,
  state,
  state_types,
  tree_util,
)
from mpmd.lowering import addressing, bounds, jaxpr_util, paths
from mpmd.primitives import mpmd_map as prim
from mpmd.types import Interpret, MeshAndFn


def _short(aval) -> str:
  return aval.str_short(short_dtypes=True)


def mpmd_map(
  meshes_and_fns: Sequence[MeshAndFn],
  /,
  out_types: Any = (),
  *,
  scratch_types: Any = (),
  input_output_aliases: Mapping[int, int] | None = None,
  compiler_params: Any = None,
  interpret: Interpret = None,
  debug: bool = False,
  cost_estimate: Any = None,
  name: str | None = None,
  metadata: Mapping[str, str] | None = None,
) -> Callable[..., Any]:
  """Runs a different kernel function on each of several meshes, in one launch.

  Each ``fn`` is called as ``fn(*in_refs, *out_refs, *scratch_refs)`` and
  returns None; the refs are shared by all meshes (inputs and outputs in each
  mesh's default memory space, e.g. HBM on TPU, GMEM on GPU). Inside ``fn``,
  ``jax.lax.axis_index(axis)`` of the mesh's axes gives the program's index.
  There is no automatic pipelining: kernels move their own data.

  Programs name each other as upstream's ``mpmd_map`` does: a
  ``pl.semaphore_signal(sem, device_id={...})`` targets the mesh that owns
  ``sem`` (``sem_type @ mesh``; an unowned semaphore is the caller's own
  mesh's), and axes ``device_id`` leaves out take the caller's own index
  where the caller's mesh has them too (a ``VectorSubcoreMesh`` and a
  ``ScalarSubcoreMesh`` share their core axis; a remote signal naming only
  device axes lands on the caller's own core). Where upstream has no rule
  (several TensorCore meshes), an unowned semaphore may also target the one
  mesh whose axes ``device_id`` names.

  Args:
    meshes_and_fns: non-empty sequence of ``(mesh, fn)``; meshes are Pallas
      meshes (``mpmd.tensorcore_mesh``, SparseCore meshes,
      ``plgpu.Mesh``). Meshes may share an axis name only with equal sizes.
      As upstream: at most one scalar-subcore and one vector-subcore
      SparseCore mesh, sharing their core axis (name and size), with axis
      names of their own next to a TensorCore mesh. Beyond upstream:
      several TensorCore meshes (upstream accepts one), and several GPU
      meshes, in one launch.
    out_types: a pytree of ``jax.ShapeDtypeStruct``, JAX types
      (``jax.typeof(x)``; under ``shard_map`` the output varies like the
      type says) or arrays (standing for their type), or memory-space
      annotated types such as ``pltpu.HBM(shape, dtype)``. Beyond upstream,
      which requires ``manual_axis_type`` on every output under
      ``shard_map(check_vma=True)``: an output without it varies like the
      inputs together, unless the kernels name a ``shard_map`` axis the
      inputs do not vary over (``axis_index``, ``device_id``), which is
      the error upstream raises.
    scratch_types: a pytree of scratch types (``pltpu.VMEM(shape, dtype)``,
      ``pltpu.SemaphoreType.DMA(())``, ``plgpu.SMEM(...)``, ...); with several
      TPU meshes, ``type @ mesh`` says which mesh's memory holds it, except
      where the memory space says so: ``pltpu.HBM`` (or ``pl.ANY``) is
      shared by all programs, ``pltpu.VMEM_SHARED`` by a SparseCore's
      subcores. A semaphore's owner is also the mesh its signals target.
    input_output_aliases: ``{input index: output index}``: the output starts
      as (and on hardware is the buffer of) that input.
    compiler_params: ``pltpu.CompilerParams`` / ``plgpu.CompilerParams``.
    interpret: None (default) compiles natively on TPU / GPU and runs the CPU
      fallback on CPU; True runs the HLO interpreter, as upstream does
      (remote DMAs under a ``shard_map`` become collectives); a
      ``pltpu.InterpretParams`` / ``mpmd.GPUInterpretParams`` forces that
      simulator with those settings, on any platform.
    debug: print the kernel jaxprs and, on CPU, which path runs and why.
    cost_estimate: a ``pl.CostEstimate`` for XLA's scheduler.
    name: the kernel's name in HLO and profiles.
    metadata: string key/values attached to the launch.

  Returns:
    A function of the inputs (a pytree of arrays or Refs) returning outputs
    with the structure of ``out_types``. Kernels may close over Refs and
    scalars; beyond upstream, ``vmap`` may batch a closed-over scalar (each
    batch element gets its own launch).

  Raises:
    TypeError: an argument of the wrong kind (a ``name`` that is not a str,
      ``compiler_params`` of another platform, aliases that are not int
      pairs, ...).
    ValueError: a bad value, found when the kernels are traced at the
      latest (before lowering): negative shapes, scratch in another
      platform's memory, a DMA between windows of different shapes or
      dtypes, a ``device_id`` or ``axis_index`` of an axis no mesh has, a
      ``device_id`` that leaves out an axis of another mesh (one the
      caller's mesh does not share) or names an axis its target lacks,
      a TPU kernel that reads or writes an HBM / ANY Ref in place, a DMA
      window fixed in a TPU kernel that leaves its buffer, SparseCore meshes
      that upstream does not combine.
    NotImplementedError: as upstream, with several TPU meshes, scratch
      without an owner outside HBM / ANY / VMEM_SHARED; one Ref passed
      twice, or closed over and passed; upstream features we do not
      support: hijax types, Pallas fuser dtypes (``fuser.physicalize``), and
      on the CPU fallback ``pl.select_ref`` (at trace time when
      ``interpret`` is given).

  Example (runs on CPU and TPU; a GPU mesh runs on CPU and GPU)::

    >>> mesh = mpmd.tensorcore_mesh("core", num_cores=1)
    >>> def double(x_hbm, o_hbm, buf):
    ...   pltpu.sync_copy(x_hbm, buf)
    ...   buf[...] *= 2
    ...   pltpu.sync_copy(buf, o_hbm)
    >>> f = mpmd.mpmd_map(
    ...     [(mesh, double)], jax.ShapeDtypeStruct((8, 128), jnp.float32),
    ...     scratch_types=[pltpu.VMEM((8, 128), jnp.float32)])
    >>> f(jnp.ones((8, 128)))[0, :4]
    Array([2., 2., 2., 2.], dtype=float32)
  """
  meshes, fns = _check_meshes_and_fns(meshes_and_fns)
  gpu = paths.is_gpu_mesh(meshes[0])
  flat_out_types, out_tree = tree_util.tree_flatten(out_types)
  flat_out_types = [_as_out_type(t, i) for i, t in enumerate(flat_out_types)]
  flat_scratch, scratch_tree = tree_util.tree_flatten(scratch_types)
  scratch_avals = [
    _canonical_owner(_scratch_aval(t, i)) for i, t in enumerate(flat_scratch)
  ]
  _check_scratch_owners(scratch_avals, meshes)
  _check_scratch_spaces(scratch_avals, gpu)
  _check_options(
    name=name,
    compiler_params=compiler_params,
    cost_estimate=cost_estimate,
    metadata=metadata,
    gpu=gpu,
  )
  # Layout transforms of scratch (swizzled / tiled SMEM): the simulators
  # allocate the logical buffer and need them.
  scratch_transforms = tuple(
    a.transforms if isinstance(a, state_types.TransformedRef) else ()
    for a in scratch_avals
  )
  aliases = _check_aliases_arg(input_output_aliases)
  if interpret is False:
    interpret = None  # CPU has no native path: False means "the default".
  _check_interpret(interpret, meshes)
  is_output_sequence = isinstance(out_types, Sequence)
  spec = dict(
    meshes=meshes,
    fns=tuple(fns),
    out_tree=out_tree,
    is_output_sequence=is_output_sequence,
    scratch_avals=tuple(scratch_avals),
    scratch_tree=scratch_tree,
    name=name,
  )

  def wrapper(*args):
    flat_args, in_tree = tree_util.tree_flatten(args)
    _check_refs_passed_once(flat_args)
    flat_avals = tuple(core.typeof(x) for x in flat_args)
    for i, aval in enumerate(flat_avals):
      _check_lojax(aval, f"input {i}")
    out_avals = _out_avals(flat_out_types, flat_avals)
    _check_aliases(aliases, flat_avals, out_avals)
    kernels = _KernelSpec(out_avals=out_avals, **spec)
    jaxprs, consts = _trace(kernels, flat_avals, in_tree)
    _check_consts_not_passed(consts, flat_args)
    _check_inferred_vma(flat_out_types, flat_avals, jaxprs, meshes)
    if interpret is not None:
      # Interpreted on every platform: what no CPU path runs fails now.
      paths.check_simulable(jaxprs)
    if debug:
      for mesh, jaxpr in zip(meshes, jaxprs, strict=True):
        print(f"mpmd_map: kernel jaxpr for mesh {dict(mesh.shape)}:\n{jaxpr}")
    scope = jax.named_scope(name) if name else contextlib.nullcontext()
    with scope:
      flat_outs = prim.bind(
        *flat_args,
        *consts,
        jaxprs=jaxprs,
        meshes=meshes,
        out_avals=out_avals,
        input_output_aliases=aliases,
        compiler_params=compiler_params,
        interpret=interpret,
        debug=debug,
        cost_estimate=cost_estimate,
        name=name,
        metadata=FrozenDict(metadata) if metadata is not None else None,
        scratch_transforms=scratch_transforms,
      )
    return out_tree.unflatten(flat_outs)

  return wrapper


# -- validation ---------------------------------------------------------------


def _is_mesh(mesh: Any) -> bool:
  return all(
    hasattr(mesh, a)
    for a in ("shape", "default_memory_space", "core_type", "tracing_context")
  )


def _check_meshes_and_fns(meshes_and_fns) -> tuple[tuple[Any, ...], list]:
  if isinstance(meshes_and_fns, (str, bytes)) or not isinstance(
    meshes_and_fns, Sequence
  ):
    raise TypeError(
      "mpmd_map: expected 'meshes_and_fns' to be a sequence of (mesh, fn) "
      f"pairs, got {type(meshes_and_fns).__name__}"
    )
  if not meshes_and_fns:
    raise ValueError(
      "mpmd_map: expected at least one (mesh, fn) pair in "
      "'meshes_and_fns', got an empty sequence"
    )
  meshes, fns = [], []
  for i, pair in enumerate(meshes_and_fns):
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
      raise TypeError(
        f"mpmd_map: expected meshes_and_fns[{i}] to be a (mesh, fn) pair, "
        f"got {pair!r}"
      )
    mesh, fn = pair
    if not _is_mesh(mesh):
      raise TypeError(
        f"mpmd_map: expected meshes_and_fns[{i}][0] to be a Pallas mesh "
        "(e.g. mpmd.tensorcore_mesh(...) or plgpu.Mesh(...)), got "
        f"{type(mesh).__name__}"
      )
    if not callable(fn):
      raise TypeError(
        f"mpmd_map: expected meshes_and_fns[{i}][1] to be callable, got "
        f"{type(fn).__name__}"
      )
    shape = dict(mesh.shape)
    if not all(
      isinstance(n, int | np.integer) and not isinstance(n, bool) and n >= 1
      for n in shape.values()
    ):
      raise ValueError(
        f"mpmd_map: expected meshes_and_fns[{i}][0] to be a mesh with at "
        f"least one program along every axis, got axis sizes {shape}"
      )
    meshes.append(_canonical_mesh(mesh))
    fns.append(fn)
  _check_sparsecore_meshes(meshes)
  sizes: dict[Any, tuple[int, int]] = {}
  for i, mesh in enumerate(meshes):
    for axis, size in mesh.shape.items():
      if axis in sizes and sizes[axis][1] != size:
        j, other = sizes[axis]
        raise ValueError(
          f"mpmd_map: axis {axis!r} has size {other} in mesh {j} but "
          f"size {size} in mesh {i}; meshes may share an axis name only "
          "with the same size"
        )
      sizes.setdefault(axis, (i, size))
  kinds = {paths.is_gpu_mesh(m) for m in meshes}
  if len(kinds) > 1:
    raise ValueError(
      "mpmd_map: cannot mix GPU meshes (plgpu.Mesh) with TPU meshes in one "
      f"launch, got {[type(m).__name__ for m in meshes]}"
    )
  return tuple(meshes), fns


def _check_sparsecore_meshes(meshes: Sequence[Any]) -> None:
  """Upstream's rules for SparseCore meshes in one launch (its meshes'
  ``check_is_compatible_with``): one scalar-subcore and one vector-subcore
  mesh at most, which share the core axis (same name, same number of
  cores), and whose axes are not named like a TensorCore mesh's axis.

  Upstream accepts no second TensorCore mesh, and no TensorCore mesh before
  a SparseCore one; we do (our extension: several TensorCore meshes are
  merged into one kernel, and the CPU fallback runs a TensorCore mesh next
  to SparseCore ones).
  """
  try:
    from jax.experimental.pallas import tpu_sc as plsc
  except ImportError:  # no SparseCore support in this jaxlib: no such meshes
    return
  scalar = [
    (i, m)
    for i, m in enumerate(meshes)
    if isinstance(m, plsc.ScalarSubcoreMesh)
  ]
  vector = [
    (i, m)
    for i, m in enumerate(meshes)
    if isinstance(m, plsc.VectorSubcoreMesh)
  ]
  for kind, found in (
    ("ScalarSubcoreMesh", scalar),
    ("VectorSubcoreMesh", vector),
  ):
    if len(found) > 1:
      raise ValueError(
        f"mpmd_map: expected at most one {kind} in 'meshes_and_fns' (they "
        f"would run on the same subcores), got meshes "
        f"{[i for i, _ in found]}"
      )
  if scalar and vector:
    (i, s), (j, v) = scalar[0], vector[0]
    if (s.axis_name, s.num_cores) != (v.core_axis_name, v.num_cores):
      raise ValueError(
        f"mpmd_map: the ScalarSubcoreMesh meshes_and_fns[{i}][0] should "
        "have the same core axis name and number of cores as the "
        f"VectorSubcoreMesh meshes_and_fns[{j}][0]: got {s.axis_name!r} "
        f"with {s.num_cores} cores and {v.core_axis_name!r} with "
        f"{v.num_cores} cores"
      )
  tensorcore = _jax.tpu().core.TensorCoreMesh
  for j, tc in enumerate(meshes):
    if not isinstance(tc, tensorcore):
      continue
    for i, sc in (*scalar, *vector):
      shared = set(sc.shape) & set(tc.shape)
      if shared:
        raise ValueError(
          f"mpmd_map: the {type(sc).__name__} meshes_and_fns[{i}][0] should "
          "have axis names different from the TensorCoreMesh "
          f"meshes_and_fns[{j}][0]: both name {sorted(shared)}"
        )


def _check_interpret(interpret: Any, meshes: Sequence[Any]) -> None:
  gpu = paths.is_gpu_mesh(meshes[0])
  tpu_params = _jax.tpu().interpret.InterpretParams
  gpu_params = _jax.gpu().interpret.InterpretGPUParams
  if interpret is None or interpret is True:
    return
  if isinstance(interpret, gpu_params if gpu else tpu_params):
    return
  if isinstance(interpret, (tpu_params, gpu_params)):
    raise ValueError(
      f"mpmd_map: expected 'interpret' for {'GPU' if gpu else 'TPU'} meshes "
      f"({'mpmd.GPU' if gpu else 'pltpu.'}InterpretParams), got "
      f"{type(interpret).__name__}"
    )
  raise TypeError(
    "mpmd_map: expected 'interpret' to be None, True, or an InterpretParams "
    f"object, got {interpret!r}"
  )


def _check_lojax(aval: Any, what: str) -> None:
  """Upstream features we do not support, named: hijax types (upstream
  lowers them to their parts) and Pallas fuser dtypes (which
  ``fuser.physicalize`` resolves through upstream's own mpmd_map)."""
  if getattr(aval, "is_high", False):
    raise NotImplementedError(
      f"mpmd_map: hijax types (jax.experimental.hijax.HiType) are not "
      f"supported: {what} is a {type(aval).__name__}: {aval!r}; pass its "
      "parts (arrays or Refs) instead"
    )
  inner = getattr(aval, "inner_aval", aval)
  if _jax.is_fusion_dtype(getattr(inner, "dtype", None)):
    raise NotImplementedError(
      "mpmd_map: Pallas fuser dtypes (fuser.physicalize) are not supported: "
      f"{what} has dtype {inner.dtype}; pass its physical parts instead"
    )


def _as_out_type(out_type: Any, i: int) -> Any:
  """An ``out_types`` leaf as a ShapeDtypeStruct or memory-space type.

  Upstream takes "a PyTree of jax.ShapeDtypeStruct or JAX types": a JAX
  type (``jax.typeof(x)``) and an array (``x``, standing for its type) give
  the output that shape and dtype, and under ``shard_map`` the type's
  varying axes. Weak types are dropped: an output is a buffer of a dtype.
  """
  if isinstance(out_type, (jax.Array, np.ndarray, np.generic)):
    out_type = core.typeof(out_type)
  _check_lojax(out_type, f"out_types leaf {i}")
  if isinstance(out_type, core.ShapedArray):
    out_type = jax.ShapeDtypeStruct(
      out_type.shape,
      out_type.dtype,
      manual_axis_type=getattr(out_type, "manual_axis_type", None),
    )
  if not (
    isinstance(out_type, (jax.ShapeDtypeStruct, pallas_core.MemoryRef))
    or hasattr(out_type, "get_ref_aval")
  ):
    raise TypeError(
      f"mpmd_map: expected out_types leaf {i} to be a jax.ShapeDtypeStruct, "
      "a JAX type (jax.typeof(x)), an array, or a memory-space type such "
      f"as pltpu.HBM(shape, dtype), got {type(out_type).__name__}: "
      f"{out_type!r}"
    )
  shape = getattr(out_type, "shape", ())
  if hasattr(out_type, "get_ref_aval"):
    shape = _inner_shape(out_type.get_ref_aval())
  _check_shape(shape, f"out_types leaf {i}")
  return out_type


def _inner_shape(aval: Any) -> tuple[Any, ...]:
  inner = getattr(aval, "inner_aval", aval)
  return tuple(getattr(inner, "shape", ()))


def _check_shape(shape: Sequence[Any], what: str) -> None:
  # Symbolic dimensions (jax.export shape polymorphism) are fine.
  if any(
    not core.is_dim(d) or (core.is_constant_dim(d) and d < 0) for d in shape
  ):
    raise ValueError(
      f"mpmd_map: expected {what} to have a shape of non-negative ints, "
      f"got {tuple(shape)}"
    )


def _out_avals(out_types, in_avals) -> tuple[core.AbstractValue, ...]:
  """Output avals; inside ``shard_map(check_vma=True)`` an output that does
  not say how it varies varies like the inputs together (as an elementwise
  op would). A kernel whose output varies over more axes (it reads
  ``axis_index``) says so with ``ShapeDtypeStruct(manual_axis_type=...)``."""
  if _jax.vma_checked():
    varying = frozenset().union(
      *(
        a.manual_axis_type.varying
        for a in in_avals
        if getattr(a, "manual_axis_type", None) is not None
      )
    )
    out_types = [
      jax.ShapeDtypeStruct(
        t.shape,
        t.dtype,
        sharding=t.sharding,
        manual_axis_type=jax.sharding.ManualAxisType(varying=varying),
      )
      if isinstance(t, jax.ShapeDtypeStruct) and t.manual_axis_type is None
      else t
      for t in out_types
    ]
  return tuple(_jax.out_shape_to_aval(t) for t in out_types)


def _check_inferred_vma(out_types, in_avals, jaxprs, meshes) -> None:
  """An output inferred to vary like the inputs (``_out_avals``) must not
  hide a dependence on the device: a kernel that names a ``shard_map`` axis
  the inputs do not vary over (its ``axis_index``, a ``device_id``) may
  write different values on each device. Upstream requires every output
  type to say how it varies under ``check_vma``; we ask for it there."""
  if not _jax.vma_checked():
    return
  inferred = [
    i
    for i, t in enumerate(out_types)
    if isinstance(t, jax.ShapeDtypeStruct) and t.manual_axis_type is None
  ]
  outer = jax.sharding.get_abstract_mesh()
  if not inferred or outer.empty:
    return
  kernel_axes = set(prim.axis_env(meshes))
  outer_axes = set(outer.axis_names) - kernel_axes
  varying = frozenset().union(
    *(
      a.manual_axis_type.varying
      for a in in_avals
      if getattr(a, "manual_axis_type", None) is not None
    )
  )
  named = _named_axes(jaxprs, outer_axes) - varying
  if named:
    raise ValueError(
      f"mpmd_map: under shard_map(check_vma=True), out_types leaf "
      f"{inferred[0]} must say how it varies across mesh axes "
      "(jax.ShapeDtypeStruct(..., manual_axis_type=...)): the kernels name "
      f"shard_map axes {sorted(named)} (axis_index, device_id), over which "
      "the inputs do not vary, so the output cannot be inferred to vary like "
      "the inputs; or set check_vma=False on jax.shard_map"
    )


def _named_axes(jaxprs, outer_axes: set[Any]) -> set[Any]:
  """The axes of ``outer_axes`` the kernels name; a ``device_id`` that is
  not a dict of axes names the device along all of them."""
  named: set[Any] = set()
  for jaxpr in jaxprs:
    for eqn in jaxpr_util.iter_eqns(jaxpr):
      name = eqn.primitive.name
      if name == "axis_index":
        axes = eqn.params["axis_name"]
        named.update(axes if isinstance(axes, tuple) else (axes,))
        continue
      if name == "dma_start":
        *_, device_id = eqn.params["tree"].unflatten(eqn.invars)
      elif name == "semaphore_signal":
        *_, device_id, _ = eqn.params["args_tree"].unflatten(eqn.invars)
      else:
        continue
      if isinstance(device_id, Mapping):
        named.update(device_id)
      elif device_id is not None:
        named.update(outer_axes)
  return named & outer_axes


def _scratch_aval(scratch_type: Any, i: int) -> Any:
  if not hasattr(scratch_type, "get_ref_aval"):
    raise TypeError(
      f"mpmd_map: expected scratch_types leaf {i} to be a scratch type "
      "(pltpu.VMEM(shape, dtype), pltpu.SemaphoreType.DMA(()), "
      f"plgpu.SMEM(...)), got {type(scratch_type).__name__}"
    )
  aval = scratch_type.get_ref_aval()
  _check_shape(_inner_shape(aval), f"scratch_types leaf {i}")
  return aval


def _check_scratch_spaces(scratch_avals, gpu: bool) -> None:
  """Scratch lives in memories of the launch's platform: Mosaic GPU has no
  VMEM or TPU semaphores, Mosaic TPU no SMEM of Mosaic GPU's kind."""
  tpu_spaces = _jax.tpu().core.MemorySpace
  gpu_spaces = _jax.gpu().core.MemorySpace
  foreign, platform, examples = (
    (tpu_spaces, "GPU", "plgpu.SMEM, plgpu.Barrier, plgpu.GMEM")
    if gpu
    else (gpu_spaces, "TPU", "pltpu.VMEM, pltpu.SMEM, pltpu.HBM, semaphores")
  )
  for i, aval in enumerate(scratch_avals):
    space = getattr(aval, "memory_space", None)
    if isinstance(space, pallas_core.CoreMemorySpace):
      space = space.memory_space
    if isinstance(space, foreign):
      raise ValueError(
        f"mpmd_map: expected scratch_types leaf {i} in a {platform} memory "
        f"space ({examples}) for {platform} meshes, got "
        f"{getattr(space, 'name', space)}"
      )


def _check_options(
  *, name, compiler_params, cost_estimate, metadata, gpu: bool
) -> None:
  if name is not None and not isinstance(name, str):
    raise TypeError(
      f"mpmd_map: expected 'name' to be a str or None, got {name!r}"
    )
  params_type = (_jax.gpu() if gpu else _jax.tpu()).core.CompilerParams
  if compiler_params is not None and not isinstance(
    compiler_params, params_type
  ):
    expected = "plgpu.CompilerParams" if gpu else "pltpu.CompilerParams"
    platform = "GPU" if gpu else "TPU"
    raise TypeError(
      f"mpmd_map: expected 'compiler_params' for {platform} meshes to be "
      f"None or a {expected}, got {type(compiler_params).__name__}: "
      f"{compiler_params!r}"
    )
  if cost_estimate is not None and not isinstance(
    cost_estimate, pallas_core.CostEstimate
  ):
    raise TypeError(
      "mpmd_map: expected 'cost_estimate' to be None or a pl.CostEstimate, "
      f"got {cost_estimate!r}"
    )
  if metadata is not None and not (
    isinstance(metadata, Mapping)
    and all(
      isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    )
  ):
    raise TypeError(
      "mpmd_map: expected 'metadata' to be None or a mapping of str to "
      f"str, got {metadata!r}"
    )


def _check_aliases_arg(aliases: Any) -> FrozenDict:
  """``input_output_aliases`` as a FrozenDict of non-negative int pairs
  (their range is checked against the operands at call time)."""
  if aliases is None:
    return FrozenDict({})
  if not isinstance(aliases, Mapping):
    raise TypeError(
      "mpmd_map: expected 'input_output_aliases' to be a dict {input "
      f"index: output index}}, got {type(aliases).__name__}: {aliases!r}"
    )
  for i, o in aliases.items():
    if not all(
      isinstance(x, int | np.integer) and not isinstance(x, bool)
      for x in (i, o)
    ):
      raise TypeError(
        "mpmd_map: expected 'input_output_aliases' to map int input "
        f"indices to int output indices, got {{{i!r}: {o!r}}}"
      )
  return FrozenDict({int(i): int(o) for i, o in aliases.items()})


_CANONICAL_MESHES: dict[Any, Any] = {}


def _canonical_mesh(mesh: Any) -> Any:
  """One object per distinct mesh.

  Equal meshes created twice (say, per call) meet in avals, which JAX
  compares; a TensorCoreMesh compares its device arrays elementwise and
  crashes on multi-core meshes (jax 0.10.2), unless both sides are the same
  object, which Python's equality checks first.
  """
  key = (type(mesh), hash(mesh), tuple(mesh.shape.items()))
  return _CANONICAL_MESHES.setdefault(key, mesh)


def _canonical_owner(aval: Any) -> Any:
  space = getattr(aval, "memory_space", None)
  if isinstance(space, pallas_core.CoreMemorySpace):
    owner = _canonical_mesh(space.mesh)
    if owner is not space.mesh:
      return state.AbstractRef(
        aval.inner_aval,
        pallas_core.CoreMemorySpace(space.memory_space, owner),
      )
  return aval


def _check_scratch_owners(scratch_avals, meshes) -> None:
  """With several TPU meshes, scratch says whose memory holds it (``type @
  mesh``) unless its memory space says so: HBM (and ANY) is the device's,
  shared by all programs; VMEM_SHARED is a SparseCore's, shared by its
  subcores. Upstream raises NotImplementedError for the rest, and so do we."""
  tpu_spaces = _jax.tpu().core.MemorySpace
  shared = (
    pallas_core.MemorySpace.ANY,
    tpu_spaces.HBM,
    tpu_spaces.VMEM_SHARED,
  )
  for i, aval in enumerate(scratch_avals):
    space = getattr(aval, "memory_space", None)
    if isinstance(space, pallas_core.CoreMemorySpace):
      if not any(addressing.same_mesh(space.mesh, m) for m in meshes):
        raise ValueError(
          f"mpmd_map: scratch_types leaf {i} is owned (`@ mesh`) by a mesh "
          f"of core type {space.mesh.core_type} that is not in this launch"
        )
      continue
    tpu_launch = not any(paths.is_gpu_mesh(m) for m in meshes)
    if len(meshes) > 1 and tpu_launch and space not in shared:
      raise NotImplementedError(
        f"mpmd_map: scratch_types leaf {i} in {space} without an owner in a "
        "launch of several meshes: per-program scratch names its mesh "
        "(`pltpu.VMEM @ mesh`, `pltpu.SemaphoreType.REGULAR @ mesh`); "
        "scratch shared by all programs is pltpu.HBM, and by a SparseCore's "
        "subcores pltpu.VMEM_SHARED"
      )


def _kernel_aval(aval: Any, meshes: Sequence[Any]) -> Any:
  """How a launch operand appears to the kernels: a Ref in a memory space."""
  if isinstance(aval, state.AbstractRef):
    return aval
  if isinstance(aval, core.ShapedArray):
    space = aval.memory_space
    if space == core.MemorySpace.Device:
      defaults = {m.default_memory_space for m in meshes}
      hbm = _jax.tpu().core.MemorySpace.HBM
      if defaults == {pallas_core.MemorySpace.ANY, hbm}:
        # TensorCores default to ANY, SparseCores to HBM: HBM suits both.
        defaults = {hbm}
      if len(defaults) != 1:
        raise ValueError(
          "mpmd_map: meshes with different default memory spaces "
          f"{sorted(map(str, defaults))} need operands with an explicit "
          "memory space"
        )
      [space] = defaults
    return state.AbstractRef(aval, memory_space=space)
  if hasattr(aval, "get_ref_aval"):
    return aval.get_ref_aval()
  raise TypeError(f"mpmd_map: unsupported operand type {aval}")


def _check_refs_passed_once(flat_args: Sequence[Any]) -> None:
  """As upstream: one Ref is one operand (kernels would otherwise see two
  operands that alias, which neither Mosaic nor the CPU fallback models)."""
  seen: dict[int, int] = {}
  for i, x in enumerate(flat_args):
    if isinstance(core.typeof(x), state.AbstractRef):
      if id(x) in seen:
        raise NotImplementedError(
          "mpmd_map: cannot pass the same Ref into a mpmd_map more than "
          f"once: inputs {seen[id(x)]} and {i} are one Ref"
        )
      seen[id(x)] = i


def _check_consts_not_passed(consts: Sequence[Any], flat_args) -> None:
  passed = {id(x): i for i, x in enumerate(flat_args)}
  for c in consts:
    if id(c) in passed and isinstance(core.typeof(c), state.AbstractRef):
      raise NotImplementedError(
        "mpmd_map: a kernel closes over the Ref it is also passed as input "
        f"{passed[id(c)]}; closed-over Refs that alias a passed-in Ref are "
        "not supported: use the Ref the kernel is passed"
      )


def _check_consts(consts: Sequence[Any], debug_info) -> None:
  bad = [
    aval
    for c in consts
    if not isinstance(aval := core.typeof(c), state.AbstractRef)
    and not (isinstance(aval, core.ShapedArray) and not aval.shape)
  ]
  if bad:
    raise ValueError(
      f"mpmd_map: kernel {debug_info.func_src_info}: closes over arrays "
      f"{[_short(a) for a in bad]}; pass them as inputs (only Refs and "
      "scalars may be closed over)"
    )


def _check_aliases(aliases, in_avals, out_avals) -> None:
  outs = list(aliases.values())
  if len(set(outs)) != len(outs):
    raise ValueError(
      f"mpmd_map: input_output_aliases {dict(aliases)} aliases several "
      "inputs to one output; each output may alias at most one input"
    )
  for i, o in aliases.items():
    if not (0 <= i < len(in_avals)) or not (0 <= o < len(out_avals)):
      raise ValueError(
        f"mpmd_map: input_output_aliases {{{i}: {o}}} is out of range for "
        f"{len(in_avals)} inputs and {len(out_avals)} outputs"
      )
    a, b = in_avals[i], out_avals[o]
    if isinstance(a, state.AbstractRef):
      raise ValueError(
        f"mpmd_map: input {i} is a Ref, which the kernels update in place "
        "already; leave it out of input_output_aliases"
      )
    if (a.shape, a.dtype) != (b.shape, b.dtype):
      raise ValueError(
        f"mpmd_map: input {i} ({_short(a)}) cannot alias output {o} "
        f"({_short(b)}): shapes and dtypes must match"
      )


# -- checks of the traced kernels ---------------------------------------------


_UNBOUND_AXIS = re.compile(r"unbound axis name: (.+?)(?:\. |\.?$)", re.M)


def _raise_if_unbound_axis(error: NameError, mesh, meshes, debug_info):
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


class _Roles(NamedTuple):
  """Names a kernel's operands in messages: ``'x_hbm' (input 0)``."""

  debug_info: Any
  num_in: int
  num_out: int
  # Closed-over values that lead the traced jaxpr's inputs (jax 0.11+; up
  # to 0.10 they are its constvars).
  num_consts: int = 0

  def describe(self, jaxpr: core.Jaxpr, var: Any, aval: Any) -> str:
    if isinstance(var, str):  # named by _check_eqns
      return f"{var} ({_short(aval)})"
    if var in jaxpr.constvars:
      return f"a closed-over Ref ({_short(aval)})"
    try:
      k = jaxpr.invars.index(var)
    except ValueError:
      return _short(aval)  # not traced back to a kernel operand
    if k < self.num_consts:
      return f"a closed-over Ref ({_short(aval)})"
    k -= self.num_consts
    if k < self.num_in:
      role = f"input {k}"
    elif k < self.num_in + self.num_out:
      role = f"out_types leaf {k - self.num_in}"
    else:
      role = f"scratch_types leaf {k - self.num_in - self.num_out}"
    names = self.debug_info.arg_names
    name = f"{names[k]!r} " if names and k < len(names) else ""
    return f"{name}({role}, {_short(aval)})"


def _check_kernel(jaxpr: core.Jaxpr, caller: int, meshes, roles: _Roles):
  """What the kernel asks of DMAs, signals and scoped allocations, checked
  where it is written (trace time) instead of by a lowering or a simulator
  after the kernel is merged."""
  kernel = f"mpmd_map: kernel {roles.debug_info.func_src_info}"
  outer = jax.sharding.get_abstract_mesh()
  axis_sizes = {} if outer.empty else dict(outer.shape)
  axis_sizes.update(prim.axis_env(meshes))
  where = _Where(caller, meshes, axis_sizes, roles, kernel)
  _check_eqns(jaxpr, jaxpr, {}, where)


class _Where(NamedTuple):
  """The kernel being checked: its mesh (by position) among the launch's."""

  caller: int
  meshes: tuple[Any, ...]
  axis_sizes: dict[Any, int]
  roles: _Roles
  kernel: str


def _check_static_windows(jaxprs, meshes, num_in: int, num_out: int) -> None:
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
  axis_sizes, roles, kernel = where.axis_sizes, where.roles, where.kernel
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("dma_start", "dma_wait"):
      if name == "dma_start":
        _check_dma(top, eqn, outer, roles, kernel)
      sem, device_id = addressing.dma_operands(eqn, eqn.invars)
      what = f"{kernel}: a DMA ({name})"
      _check_device_id(device_id, axis_sizes, what)
      target = addressing.resolve(
        where.meshes, where.caller, sem.aval, device_id, what
      )
      _check_sparsecore_dma(target, device_id, where, what)
    elif name == "semaphore_signal":
      tree = eqn.params["args_tree"]
      sem, *_, device_id, core_index = tree.unflatten(eqn.invars)
      what = f"{kernel}: semaphore_signal"
      _check_device_id(device_id, axis_sizes, what)
      if device_id is None:
        _check_core_index(core_index, mesh, what)
      addressing.resolve(where.meshes, where.caller, sem.aval, device_id, what)
    elif name == "run_scoped":
      _check_collective_axes(eqn.params.get("collective_axes"), mesh, kernel)
    elif name in _REF_ACCESS and not paths.is_gpu_mesh(mesh):
      _check_direct_access(top, eqn, outer, mesh, roles, kernel)
    for sub in jaxpr_util.sub_jaxprs(eqn.params):
      inner = dict(outer)
      for v, x in _operands_of(eqn, sub):
        if isinstance(x, core.Var) and v.aval == x.aval:
          inner[v] = outer.get(x, x)
      if name == "run_scoped":
        for k, v in enumerate(sub.invars):
          inner[v] = f"pl.run_scoped allocation {k}"
      _check_eqns(top, sub, inner, where)


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


def _tpu_memory_space(aval, mesh) -> Any:
  """Where a Ref lives on a TPU: a Ref without a memory space (a kernel
  operand) is in its mesh's default one (ANY for TensorCores, HBM for
  SparseCores), as Mosaic places it."""
  space = getattr(aval, "memory_space", None)
  if isinstance(space, pallas_core.CoreMemorySpace):
    space = space.memory_space
  return mesh.default_memory_space if space is None else space


def _check_direct_access(top, eqn, outer, mesh, roles, kernel: str) -> None:
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
    f"{roles.describe(top, ref, aval)} in place, but it is in "
    f"{getattr(space, 'name', space)} memory: on TPU only VMEM and SMEM "
    "Refs can be read or written directly; copy the data to or from VMEM "
    "scratch with pltpu.sync_copy / pltpu.async_copy"
  )


def _check_collective_axes(axes, mesh, kernel: str) -> None:
  axes = tuple(axes or ())
  unknown = [a for a in axes if a not in mesh.shape]
  if unknown:
    raise ValueError(
      f"{kernel}: run_scoped(collective_axes={axes!r}) names {unknown}, "
      f"which are not axes of the kernel's mesh {dict(mesh.shape)}"
    )
  thread = getattr(mesh, "thread_name", None)
  if paths.is_gpu_mesh(mesh) and axes and axes != (thread,):
    # Mosaic GPU allocates collectively only across a block's warpgroups.
    raise ValueError(
      f"{kernel}: run_scoped(collective_axes={axes!r}): expected no "
      f"collective axes or only the warpgroup axis ({thread!r},) of the "
      f"kernel's mesh {dict(mesh.shape)}"
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


def _check_dma(top, eqn, outer, roles: _Roles, kernel: str) -> None:
  avals = [v.aval for v in eqn.invars]
  src, dst, *_ = eqn.params["tree"].unflatten(avals)
  try:
    # The windows' shapes follow from the static slice sizes.
    src_type, dst_type = (src.shape, src.dtype), (dst.shape, dst.dtype)
  except Exception:  # noqa: BLE001 -- a view we cannot size: Mosaic checks
    return
  if src_type == dst_type:
    return
  src_var, dst_var = eqn.invars[0], eqn.invars[_num_leaves(src)]
  src_var, dst_var = outer.get(src_var, src_var), outer.get(dst_var, dst_var)
  src_ref, dst_ref = avals[0], avals[_num_leaves(src)]
  raise ValueError(
    f"{kernel}: a DMA copies from "
    f"{roles.describe(top, src_var, src_ref)} into "
    f"{roles.describe(top, dst_var, dst_ref)}: expected the same shape and "
    f"dtype on both sides, got {_type_str(*src_type)} and "
    f"{_type_str(*dst_type)}"
  )


def _num_leaves(tree: Any) -> int:
  return len(tree_util.tree_leaves(tree))


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


def _check_device_id(device_id: Any, axis_sizes, what: str) -> None:
  """Axes a ``device_id`` dict names exist; literal indices are in range."""
  if not isinstance(device_id, Mapping):
    return
  for axis, index in device_id.items():
    size = axis_sizes.get(axis)
    if size is None:
      try:  # bound some other way (pmap): still the caller's trace
        size = jax.lax.axis_size(axis)
      except NameError:
        raise ValueError(
          f"{what} names device_id axis {axis!r}, which is not an axis of "
          f"the kernel meshes or of an enclosing shard_map {axis_sizes}"
        ) from None
    if isinstance(index, core.Literal):
      value = int(index.val)
      if not 0 <= value < size:
        raise ValueError(
          f"{what} names device_id {{{axis!r}: {value}}}: expected an "
          f"index in [0, {size}) along axis {axis!r}"
        )


def _check_core_index(core_index: Any, mesh, what: str) -> None:
  """A literal ``core_index`` names one of the caller's mesh's programs."""
  if not isinstance(core_index, core.Literal) or paths.is_gpu_mesh(mesh):
    return
  size, value = math.prod(mesh.shape.values()), int(core_index.val)
  if not 0 <= value < size:
    raise ValueError(
      f"{what} names core_index={value}: expected an index in [0, {size}) "
      f"(the programs of its mesh {dict(mesh.shape)})"
    )


# -- tracing ------------------------------------------------------------------


class _KernelSpec(NamedTuple):
  meshes: tuple[Any, ...]
  fns: tuple[Callable[..., None], ...]
  out_avals: tuple[Any, ...]
  out_tree: Any
  is_output_sequence: bool
  scratch_avals: tuple[Any, ...]
  scratch_tree: Any
  name: str | None


# Traced kernels by (kernels, operand types): the same kernel functions on
# the same shapes give the same jaxprs, hence one compilation (jit's cache
# and the primitive's impl cache key on them). Kernels that close over values
# are not cached: what they capture may be a tracer of an enclosing trace.
_TRACED: dict[Any, tuple[tuple[core.Jaxpr, ...], list[Any]]] = {}
_MAX_TRACED = 512


def _trace(spec: _KernelSpec, flat_in_avals, in_tree):
  # Tracing depends on the context too: the axis env (inside shard_map or
  # not), the abstract mesh, the TPU target (all in JAX's trace context).
  key = (spec, flat_in_avals, in_tree, config.trace_context())
  if (hit := _TRACED.get(key)) is not None:
    return hit
  jaxprs, consts = _trace_uncached(spec, flat_in_avals, in_tree)
  if not consts:
    if len(_TRACED) >= _MAX_TRACED:
      _TRACED.pop(next(iter(_TRACED)))
    _TRACED[key] = (jaxprs, consts)
  return jaxprs, consts


def _trace_uncached(spec: _KernelSpec, flat_in_avals, in_tree):
  meshes = spec.meshes
  kernel_avals = [_kernel_aval(a, meshes) for a in flat_in_avals]
  out_refs = [_kernel_aval(a, meshes) for a in spec.out_avals]
  if spec.is_output_sequence:
    out_args = list(spec.out_tree.unflatten(out_refs))
  else:
    out_args = [spec.out_tree.unflatten(out_refs)]
  scratch = spec.scratch_tree.unflatten(spec.scratch_avals)
  if isinstance(scratch, Mapping):
    args, kwargs = [*in_tree.unflatten(kernel_avals), *out_args], scratch
  else:
    args = [*in_tree.unflatten(kernel_avals), *out_args, *scratch]
    kwargs = {}
  flat_views, kernel_tree = tree_util.tree_flatten((args, kwargs))
  # Scratch with layout transforms (e.g. swizzled SMEM) is traced as its
  # physical Ref; the kernel sees the transformed view of it.
  flat_kernel_avals = [
    v.ref if isinstance(v, state_types.TransformedRef) else v
    for v in flat_views
  ]
  traced = []
  for caller, (mesh, fn) in enumerate(zip(meshes, spec.fns, strict=True)):
    debug_info = api_util.debug_info("mpmd_map", fn, flat_kernel_avals, {})
    if spec.name is not None:
      debug_info = debug_info.replace_func_name(spec.name)
    returned = []

    def flat_fn(*refs, fn=fn, returned=returned):
      refs = [
        state_types.TransformedRef(r, v.transforms)
        if isinstance(v, state_types.TransformedRef)
        else r
        for r, v in zip(refs, flat_views, strict=True)
      ]
      args, kwargs = kernel_tree.unflatten(refs)
      returned.append(fn(*args, **kwargs))
      return []

    try:
      with prim.tracing_context(mesh, meshes):
        jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
          lu.wrap_init(flat_fn, debug_info=debug_info), flat_kernel_avals
        )
    except NameError as e:
      _raise_if_unbound_axis(e, mesh, meshes, debug_info)
      raise
    if returned[0] is not None:
      raise ValueError(
        f"mpmd_map: kernel {debug_info.func_src_info}: must return None "
        "(write to its output refs), but it returned "
        f"{tree_util.tree_structure(returned[0])}"
      )
    _check_consts(consts, debug_info)
    _check_kernel(
      jaxpr,
      caller,
      meshes,
      _Roles(
        debug_info,
        len(flat_in_avals),
        len(spec.out_avals),
        num_consts=len(jaxpr.invars) - len(flat_kernel_avals),
      ),
    )
    traced.append((jaxpr, consts))
  jaxprs, all_consts = _unify_consts(
    traced, meshes, len(flat_in_avals), flat_kernel_avals
  )
  _check_static_windows(
    jaxprs, meshes, len(flat_in_avals) + len(all_consts), len(spec.out_avals)
  )
  return jaxprs, all_consts


def _unify_consts(traced, meshes, num_in, flat_kernel_avals):
  """Closed-over Refs and scalars become inputs shared by all kernels.

  Every kernel then takes ``(*inputs, *consts, *outputs, *scratch)``, the
  consts deduplicated across kernels by identity.
  """
  unique: dict[int, Any] = {}
  for _, consts in traced:
    for c in consts:
      unique.setdefault(id(c), c)
  if not unique:
    return tuple(jaxpr for jaxpr, _ in traced), []
  all_consts = list(unique.values())
  const_avals = [core.typeof(c) for c in all_consts]
  # Mosaic GPU takes no scalar operands: a closed-over scalar is passed as a
  # GMEM Ref and read where the kernel uses it.
  gpu = paths.is_gpu_mesh(meshes[0])
  as_ref = [gpu and not isinstance(a, state.AbstractRef) for a in const_avals]
  const_avals = [
    _kernel_aval(a, meshes) if r else a
    for a, r in zip(const_avals, as_ref, strict=True)
  ]
  avals = [
    *flat_kernel_avals[:num_in],
    *const_avals,
    *flat_kernel_avals[num_in:],
  ]
  jaxprs = []
  for mesh, (jaxpr, consts) in zip(meshes, traced, strict=True):
    position = {id(c): k for k, c in enumerate(all_consts)}

    def body(*args, jaxpr=jaxpr, consts=consts, position=position):
      ins, cs, rest = (
        args[:num_in],
        args[num_in : num_in + len(all_consts)],
        (args[num_in + len(all_consts) :]),
      )
      cs = [c[...] if r else c for c, r in zip(cs, as_ref, strict=True)]
      mine = [cs[position[id(c)]] for c in consts]
      core.eval_jaxpr(jaxpr, mine, *ins, *rest)
      return ()

    with prim.tracing_context(mesh, meshes):
      jaxprs.append(prim.retrace(jaxpr, mesh, meshes, body, avals))
  return tuple(jaxprs), all_consts
