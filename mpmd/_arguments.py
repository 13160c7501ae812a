"""Checks of ``mpmd_map``'s arguments before any kernel is traced: meshes and
functions, out and scratch types, options, aliases (each run once, by
``mpmd._launch.check_launch``), and per call the operands."""

import inspect
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from mpmd import _jax, meshes
from mpmd._jax import (
  FrozenDict,
  core,
  pallas_core,
  state,
)
from mpmd._lowering import addressing, paths
from mpmd._primitives import mpmd_map as prim


def short(aval) -> str:
  return aval.str_short(short_dtypes=True)


def _is_mesh(mesh: Any) -> bool:
  return all(
    hasattr(mesh, a)
    for a in ("shape", "default_memory_space", "core_type", "tracing_context")
  )


def check_meshes_and_fns(
  meshes_and_fns: Any,
) -> tuple[tuple[Any, ...], tuple[Callable[..., None], ...]]:
  """``mpmd_map``'s ``meshes_and_fns``: its meshes (one object per
  distinct mesh) and its functions, checked pair by pair, then together."""
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
  pairs = [_checked_pair(i, pair) for i, pair in enumerate(meshes_and_fns)]
  meshes = tuple(mesh for mesh, _ in pairs)
  _check_sparsecore_meshes(meshes)
  _check_shared_axes(meshes)
  kinds = {paths.is_gpu_mesh(m) for m in meshes}
  if len(kinds) > 1:
    raise ValueError(
      "mpmd_map: cannot mix GPU meshes (plgpu.Mesh) with TPU meshes in one "
      f"launch, got {[type(m).__name__ for m in meshes]}"
    )
  return meshes, tuple(fn for _, fn in pairs)


def _checked_pair(i: int, pair: Any) -> tuple[Any, Callable[..., None]]:
  """``meshes_and_fns[i]``: a Pallas mesh of at least one program along
  every axis (the canonical object for it), and a callable."""
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
  return _canonical_mesh(mesh), fn


def _check_shared_axes(meshes: Sequence[Any]) -> None:
  """Meshes may share an axis name (a program then names the other mesh's
  program by its own index along it) only where the sizes agree."""
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


def check_interpret(interpret: Any, meshes: Sequence[Any]) -> None:
  gpu = paths.is_gpu_mesh(meshes[0])
  tpu_params = _jax.tpu().interpret.InterpretParams
  gpu_params = _jax.gpu().interpret.InterpretGPUParams
  if interpret is None or interpret is True:
    return
  from mpmd.checking import CheckParams

  if isinstance(interpret, CheckParams):
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
    "mpmd_map: expected 'interpret' to be None, True, an InterpretParams or "
    f"mpmd.CheckParams object, got {interpret!r}"
  )


def check_lojax(aval: Any, what: str) -> None:
  """Operands we do not take, named: hijax types (upstream lowers them to
  their parts when the program is lowered, after our kernel checks and
  CPU path choice, which read plain Refs; see
  docs/tutorials/from_upstream.md) and Pallas fuser dtypes (upstream's
  physicalize rule refuses them as operands too; inside kernels,
  ``fusible_dtype.physicalize`` rewrites them)."""
  if getattr(aval, "is_high", False):
    raise NotImplementedError(
      f"mpmd_map: hijax types (jax.experimental.hijax.HiType) are not "
      f"supported: {what} is a {type(aval).__name__}: {aval!r}; pass its "
      "parts (arrays or Refs) instead"
    )
  inner = getattr(aval, "inner_aval", aval)
  if _jax.is_fusion_dtype(getattr(inner, "dtype", None)):
    raise NotImplementedError(
      "mpmd_map: Pallas fuser dtypes (fuser.physicalize) are not supported "
      f"as launch operands (upstream: Fusion type found in avals): {what} "
      f"has dtype {inner.dtype}; pass its physical parts instead (a kernel "
      "may compute on fuser dtypes inside: physicalize rewrites it)"
    )


def as_out_type(out_type: Any, i: int) -> Any:
  """An ``out_types`` leaf as a ShapeDtypeStruct or memory-space type.

  Upstream takes "a PyTree of jax.ShapeDtypeStruct or JAX types": a JAX
  type (``jax.typeof(x)``) and an array (``x``, standing for its type) give
  the output that shape and dtype, and under ``shard_map`` the type's
  varying axes. Weak types are dropped: an output is a buffer of a dtype.
  """
  if isinstance(out_type, (jax.Array, np.ndarray, np.generic)):
    out_type = core.typeof(out_type)
  check_lojax(out_type, f"out_types leaf {i}")
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


def output_avals(out_types) -> tuple[core.AbstractValue, ...]:
  """Output avals. As upstream: inside ``shard_map(check_vma=True)`` every
  ``jax.ShapeDtypeStruct`` output says how it varies across the mesh axes
  (``manual_axis_type``); a JAX type or an array as out type carries its
  own."""
  if _jax.vma_checked():
    for i, t in enumerate(out_types):
      if isinstance(t, jax.ShapeDtypeStruct) and t.manual_axis_type is None:
        raise ValueError(
          f"mpmd_map: under shard_map(check_vma=True), expected out_types "
          f"leaf {i} ({_type_str(t)}) to say how it varies across the mesh "
          "axes: jax.ShapeDtypeStruct(shape, dtype, manual_axis_type="
          "jax.sharding.ManualAxisType(varying=...)) or jax.typeof(x) of an "
          "array that varies alike; got manual_axis_type=None. Or set "
          "check_vma=False on jax.shard_map. (Upstream's words: When "
          "`check_vma=True` on `jax.shard_map`, `manual_axis_type` on "
          "`jax.ShapeDtypeStruct` must not be `None`.)"
        )
  return tuple(_jax.out_shape_to_aval(t) for t in out_types)


def _type_str(t) -> str:
  return core.ShapedArray(tuple(t.shape), t.dtype).str_short(short_dtypes=True)


def scratch_aval(scratch_type: Any, i: int) -> Any:
  if not hasattr(scratch_type, "get_ref_aval"):
    raise TypeError(
      f"mpmd_map: expected scratch_types leaf {i} to be a scratch type "
      "(pltpu.VMEM(shape, dtype), pltpu.SemaphoreType.DMA(()), "
      f"plgpu.SMEM(...)), got {type(scratch_type).__name__}"
    )
  aval = scratch_type.get_ref_aval()
  check_lojax(aval, f"scratch_types leaf {i}")
  _check_shape(_inner_shape(aval), f"scratch_types leaf {i}")
  return aval


def check_scratch_spaces(scratch_avals, gpu: bool) -> None:
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


def check_options(
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


def check_aliases_arg(aliases: Any) -> FrozenDict:
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


# Weak values: a mesh is held by the avals and kernels that use it, not by
# this table, which only says which of equal meshes came first.
_CANONICAL_MESHES: weakref.WeakValueDictionary[Any, Any] = (
  weakref.WeakValueDictionary()
)


def _canonical_mesh(mesh: Any) -> Any:
  """One object per distinct mesh, one that compares as a bool.

  Meshes meet in avals, which JAX compares; a TensorCoreMesh of jax 0.10.2
  compares its device arrays elementwise (``meshes.comparable``).
  """
  key = (type(mesh), hash(mesh), tuple(mesh.shape.items()))
  return _CANONICAL_MESHES.setdefault(key, meshes.comparable(mesh))


def canonical_owner(aval: Any) -> Any:
  space = getattr(aval, "memory_space", None)
  if isinstance(space, pallas_core.CoreMemorySpace):
    owner = _canonical_mesh(space.mesh)
    if owner is not space.mesh:
      return state.AbstractRef(
        aval.inner_aval,
        pallas_core.CoreMemorySpace(space.memory_space, owner),
      )
  return aval


def check_scratch_owners(
  scratch_avals, meshes, names: Callable[[], Sequence[str]] = tuple
) -> None:
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
  tpu_launch = not any(paths.is_gpu_mesh(m) for m in meshes)
  unowned = []
  for i, aval in enumerate(scratch_avals):
    space = getattr(aval, "memory_space", None)
    if isinstance(space, pallas_core.CoreMemorySpace):
      if not any(addressing.same_mesh(space.mesh, m) for m in meshes):
        leaf = _leaf(i, names())
        raise ValueError(
          f"mpmd_map: scratch_types leaf {leaf} is owned (`@ mesh`) by a "
          f"mesh {dict(space.mesh.shape)} of core type "
          f"{space.mesh.core_type} that is not in this launch (its meshes: "
          f"{', '.join(str(dict(m.shape)) for m in meshes)})"
        )
      continue
    if len(meshes) > 1 and tpu_launch and space not in shared:
      unowned.append((i, space))
  if unowned:
    named = names()
    leaves = [f"{_leaf(i, named)} in {space}" for i, space in unowned]
    axes = " or ".join(str(list(m.shape)) for m in meshes)
    raise NotImplementedError(
      f"mpmd_map: scratch_types leaf {', leaf '.join(leaves)} without an "
      "owner in a launch of several meshes: per-program scratch names the "
      "mesh of the programs that use it (`pltpu.VMEM(...) @ mesh`, "
      "`pltpu.SemaphoreType.REGULAR @ mesh`; here the mesh of axes "
      f"{axes}); scratch shared by all programs is pltpu.HBM, and by a "
      "SparseCore's subcores pltpu.VMEM_SHARED (upstream: MPMD map with "
      "more than one mesh requires scratch_type to have a `core_type` "
      "specified)"
    )


def _leaf(i: int, names: Sequence[str]) -> str:  # ``0 ('buf')``
  return f"{i} ({names[i]})" if i < len(names) and names[i] else f"{i}"


def kernel_aval(aval: Any, meshes: Sequence[Any]) -> Any:
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


def check_refs_passed_once(flat_args: Sequence[Any]) -> None:
  """As upstream: one Ref is one operand (kernels would otherwise see two
  operands that alias, which neither Mosaic nor the CPU fallback models)."""
  seen: dict[int, int] = {}
  for i, x in enumerate(flat_args):
    if isinstance(core.typeof(x), state.AbstractRef):
      if id(x) in seen:
        raise NotImplementedError(
          "mpmd_map: cannot pass the same Ref into a mpmd_map more than "
          f"once: inputs {seen[id(x)]} and {i} are one Ref (upstream: Cannot "
          "pass the same ref into a mpmd map multiple times)"
        )
      seen[id(x)] = i


def check_consts_not_passed(consts: Sequence[Any], flat_args) -> None:
  passed = {id(x): i for i, x in enumerate(flat_args)}
  for c in consts:
    if id(c) in passed and isinstance(core.typeof(c), state.AbstractRef):
      raise NotImplementedError(
        "mpmd_map: a kernel closes over the Ref it is also passed as input "
        f"{passed[id(c)]}; closed-over Refs that alias a passed-in Ref are "
        "not supported: use the Ref the kernel is passed (upstream: "
        "Closed-over ref aliases with a passed-in ref is not supported.)"
      )


def check_consts(consts: Sequence[Any], debug_info) -> None:
  for c in consts:
    check_lojax(
      core.typeof(c), f"a value kernel {debug_info.func_src_info} closes over"
    )
  bad = [
    aval
    for c in consts
    if not isinstance(aval := core.typeof(c), state.AbstractRef)
    and not (isinstance(aval, core.ShapedArray) and not aval.shape)
  ]
  if bad:
    raise ValueError(
      f"mpmd_map: kernel {debug_info.func_src_info}: closes over arrays "
      f"{[short(a) for a in bad]}; pass them as inputs (only Refs and "
      "scalars may be closed over)"
    )


def check_consts_unbatched(consts: Sequence[Any], debug_info) -> None:
  """A kernel that closes over a value ``vmap`` batches is an error, as
  upstream's batching rule says: raised here, where the kernel is traced,
  before any check of the kernel itself, the order upstream's errors come
  in (its batching rule runs before Mosaic sees the kernel). Under ``jit``
  inside ``vmap`` the batching rule itself raises it."""
  for c in consts:
    if (
      isinstance(c, _jax.batching.BatchTracer)
      and c.batch_dim is not None  # None: not mapped
      and not isinstance(core.typeof(c), state.AbstractRef)
    ):
      raise ValueError(
        f"mpmd_map: kernel {debug_info.func_src_info} closes over "
        f"{short(core.typeof(c))}, which vmap batches: {prim.UNBATCHABLE_CONST}"
      )


def check_aliases(aliases, in_avals, out_avals) -> None:
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
        f"mpmd_map: input {i} ({short(a)}) cannot alias output {o} "
        f"({short(b)}): shapes and dtypes must match"
      )


def check_arity(fn, args, kwargs, debug_info):
  """A kernel's signature takes what ``mpmd_map`` passes it: its inputs,
  then its outputs, then its scratch (a ``TypeError`` that says so, not
  only Python's count of positional arguments)."""
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # (no signature to check: a builtin)
    return
  try:
    signature.bind(*args, **kwargs)
  except TypeError as e:
    keywords = f" and keyword scratch {sorted(kwargs)}" if kwargs else ""
    raise TypeError(
      f"mpmd_map: kernel {debug_info.func_src_info} is called with its "
      "inputs, then its outputs, then its scratch Refs "
      f"({len(args)} positional arguments{keywords}), but its signature "
      f"does not take them: {e}"
    ) from None
