"""The public entry point: ``mpmd_map``."""

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from mpmd import _warp_map as warp_map
from mpmd._arguments import (
  check_aliases,
  check_arity,
  check_consts,
  check_consts_not_passed,
  check_consts_unbatched,
  check_lojax,
  check_refs_passed_once,
  kernel_aval,
  output_avals,
  short,
)
from mpmd._jax import (
  api_util,
  core,
  lu,
  pe,
  state,
  state_types,
  tree_util,
  util,
)
from mpmd._kernel_checks import (
  Roles,
  check_kernel,
  check_static_windows,
  raise_if_fixed_window_leaves,
  raise_if_unbound_axis,
)
from mpmd._launch import Kernels, Launch, check_launch
from mpmd._lowering import external, paths
from mpmd._primitives import mpmd_map as prim
from mpmd.types import Interpret, MeshAndFn


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
  (several TensorCore meshes), an unowned semaphore (one of
  ``pl.run_scoped``: scratch semaphores of a launch of several meshes
  need their ``@ mesh``) may also target the one mesh whose axes
  ``device_id`` names.

  Args:
    meshes_and_fns: non-empty sequence of ``(mesh, fn)``; meshes are Pallas
      meshes (``mpmd.tensorcore_mesh``, SparseCore meshes,
      ``plgpu.Mesh``). Meshes may share an axis name only with equal sizes.
      As upstream: at most one scalar-subcore and one vector-subcore
      SparseCore mesh, sharing their core axis (name and size), with axis
      names of their own next to a TensorCore mesh. Beyond upstream:
      several TensorCore meshes (upstream accepts one), and several GPU
      meshes, in one launch. Inside a GPU kernel body,
      ``mpmd_map([(plgpu.WarpMesh(axis_name=...), fn)])()`` runs ``fn``
      on each warp of the warpgroup, as upstream's (:mod:`mpmd._warp_map`).
    out_types: a pytree of ``jax.ShapeDtypeStruct``, JAX types
      (``jax.typeof(x)``; under ``shard_map`` the output varies like the
      type says) or arrays (standing for their type), or memory-space
      annotated types such as ``pltpu.HBM(shape, dtype)``. As upstream,
      under ``shard_map(check_vma=True)`` a ``jax.ShapeDtypeStruct`` says
      how the output varies across the mesh axes (``manual_axis_type=``;
      ``jax.typeof(x)`` carries that of ``x``), else ValueError. As
      upstream, an output may live in the memory of a mesh that runs
      nothing in this launch (``pltpu.VMEM(...) @ tc_mesh``, a semaphore
      ``@ tc_mesh``): kernels address its programs by ``device_id``
      (``{"tc": 0}``) and a later launch over that mesh takes the output
      back (the CPU fallback runs this for such a mesh of one program).
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
    A function of the inputs (a pytree of arrays, Refs or views of Refs:
    ``x_ref.at[i]``, ``x_ref.reshape(...)``, which the kernels see as such)
    returning outputs with the structure of ``out_types``. Kernels may
    close over Refs and scalars; as upstream, ``vmap`` may not batch a
    closed-over scalar (pass it as an input instead).

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
      support: hijax types, Pallas fuser dtypes as operands (kernels that
      use them inside are physicalized by ``fusible_dtype.physicalize``), and
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
  if warp_map.has_warp_mesh(meshes_and_fns):
    # Not a launch: a fork over the warps of the running warpgroup.
    return warp_map.warp_map(
      meshes_and_fns,
      out_types,
      scratch_types=scratch_types,
      input_output_aliases=input_output_aliases,
    )
  launch = check_launch(
    meshes_and_fns,
    out_types,
    scratch_types=scratch_types,
    input_output_aliases=input_output_aliases,
    compiler_params=compiler_params,
    interpret=interpret,
    debug=debug,
    cost_estimate=cost_estimate,
    name=name,
    metadata=metadata,
  )

  def wrapper(*args):
    return _call(launch, args)

  return wrapper


# -- one call of mpmd_map's function, in the order it takes its steps --------


def _call(launch: Launch, args: tuple[Any, ...]) -> Any:
  """The outputs of ``launch`` on ``args``: the operands checked, the
  kernels traced for their types, the CPU path chosen, the launch bound."""
  flat_args, in_tree = tree_util.tree_flatten(args)
  flat_args, views = _split_views(flat_args)
  flat_avals = _input_avals(flat_args)
  # Per call: under shard_map the output avals say how the outputs vary.
  out_avals = output_avals(launch.out_types)
  check_aliases(launch.input_output_aliases, flat_avals, out_avals)
  jaxprs, consts = _trace(launch.kernels, out_avals, flat_avals, in_tree, views)
  check_consts_not_passed(consts, flat_args)
  cpu_path = _choose_cpu_path(jaxprs, launch)
  flat_outs = _bind(launch, (*flat_args, *consts), jaxprs, out_avals, cpu_path)
  return launch.kernels.out_tree.unflatten(flat_outs)


def _split_views(flat_args) -> tuple[list[Any], tuple[Any, ...]]:
  """Operands that are views of a Ref (``x_ref.at[i]``,
  ``x_ref.reshape(...)``), as upstream allows: the launch takes the Ref
  itself, and each kernel sees the view of it (its transforms, returned
  per operand, None for a whole operand). A view's traced indices reach
  the kernels as closed-over scalars do."""
  views = tuple(
    x.transforms if isinstance(x, state_types.TransformedRef) else None
    for x in flat_args
  )
  if not any(v is not None for v in views):
    return list(flat_args), views
  refs = [
    x.ref if isinstance(x, state_types.TransformedRef) else x for x in flat_args
  ]
  return refs, views


def _input_avals(flat_args) -> tuple[Any, ...]:
  check_refs_passed_once(flat_args)
  flat_avals = tuple(core.typeof(x) for x in flat_args)
  for i, aval in enumerate(flat_avals):
    check_lojax(aval, f"input {i}")
  return flat_avals


def _choose_cpu_path(jaxprs, launch: Launch):
  if launch.interpret is not None:
    # Interpreted on every platform: what no CPU path runs fails now.
    paths.check_simulable(jaxprs)
  # The CPU fallback runs a DMA to the one program of an external mesh
  # (its memory holds an operand) as the caller's own: chosen as such.
  jaxprs = external.localize(launch.meshes, jaxprs)
  return paths.choose(
    jaxprs, launch.meshes, launch.interpret, paths.traced_manual_axes()
  )


def _bind(launch: Launch, operands, jaxprs, out_avals, cpu_path):
  if launch.debug:
    for mesh, jaxpr in zip(launch.meshes, jaxprs, strict=True):
      print(f"mpmd_map: kernel jaxpr for mesh {dict(mesh.shape)}:\n{jaxpr}")
  scope = (
    jax.named_scope(launch.name) if launch.name else contextlib.nullcontext()
  )
  with scope:
    return prim.bind(
      *operands,
      jaxprs=jaxprs,
      meshes=launch.meshes,
      out_avals=out_avals,
      input_output_aliases=launch.input_output_aliases,
      compiler_params=launch.compiler_params,
      interpret=launch.interpret,
      cpu_path=cpu_path,
      debug=launch.debug,
      cost_estimate=launch.cost_estimate,
      name=launch.name,
      metadata=launch.metadata,
      scratch_transforms=launch.scratch_transforms,
    )


# -- tracing the kernels ------------------------------------------------------


class _Traced:
  """A launch's traced kernels, once traced without constants to carry."""

  __slots__ = ("value",)

  def __init__(self):
    self.value: tuple[tuple[core.Jaxpr, ...], list[Any]] | None = None


# Traced kernels by (kernels, output and operand types): the same kernel
# functions on
# the same shapes give the same jaxprs, hence one compilation (jit's cache
# and the primitive's impl cache key on them). Tracing depends on the
# context too (the axis env inside shard_map or not, the abstract mesh, the
# TPU target): JAX's trace context is in the key. A JAX cache, so that
# jax.clear_caches() lets go of the user's kernel functions.
@util.cache(max_size=512, trace_context_in_key=True)
def _traced(kernels: Kernels, out_avals, flat_in_avals, in_tree) -> _Traced:
  return _Traced()


def _trace(kernels: Kernels, out_avals, flat_in_avals, in_tree, views):
  if any(v is not None for v in views):
    # A view's indices may be tracers of the enclosing trace: not cached.
    return _trace_uncached(kernels, out_avals, flat_in_avals, in_tree, views)
  slot = _traced(kernels, out_avals, tuple(flat_in_avals), in_tree)
  if slot.value is not None:
    return slot.value
  jaxprs, consts = _trace_uncached(
    kernels, out_avals, flat_in_avals, in_tree, views
  )
  # Kernels that close over values are not kept: what they capture may be
  # a tracer of an enclosing trace.
  if not consts:
    slot.value = (jaxprs, consts)
  return jaxprs, consts


def _trace_uncached(
  kernels: Kernels, out_avals, flat_in_avals, in_tree, in_views
):
  views = _kernel_views(kernels, out_avals, flat_in_avals, in_tree, in_views)
  # Meshes whose memory holds an operand (`VMEM @ tc_mesh`) but that run
  # nothing here: the kernels may name their programs in a device_id.
  outside = external.external_meshes(kernels.meshes, views.flat_avals)
  reach = (*kernels.meshes, *outside)
  traced = [
    _trace_kernel(kernels, caller, views, reach)
    for caller in range(len(kernels.meshes))
  ]
  jaxprs, all_consts = _unify_consts(
    traced, kernels.meshes, views.num_in, views.flat_avals, reach
  )
  check_static_windows(
    jaxprs,
    kernels.meshes,
    views.num_in + len(all_consts),
    views.num_out,
  )
  return jaxprs, all_consts


class _Views(NamedTuple):
  """What every kernel is called with: ``(*inputs, *outputs, *scratch)``
  as the kernel sees them (``flat``, unflattened by ``tree``), and as they
  are traced (``flat_avals``); ``num_in`` inputs, then ``num_out``
  outputs, then scratch."""

  flat: list[Any]
  tree: Any
  flat_avals: list[Any]
  num_in: int
  num_out: int


def _kernel_views(
  kernels: Kernels, out_avals, flat_in_avals, in_tree, in_views
) -> _Views:
  meshes = kernels.meshes
  kernel_avals = [
    kernel_aval(a, meshes)
    if view is None
    else state_types.TransformedRef(kernel_aval(a, meshes), view)
    for a, view in zip(flat_in_avals, in_views, strict=True)
  ]
  out_refs = [kernel_aval(a, meshes) for a in out_avals]
  if kernels.is_output_sequence:
    out_args = list(kernels.out_tree.unflatten(out_refs))
  else:
    out_args = [kernels.out_tree.unflatten(out_refs)]
  scratch = kernels.scratch_tree.unflatten(kernels.scratch_avals)
  if isinstance(scratch, Mapping):
    args, kwargs = [*in_tree.unflatten(kernel_avals), *out_args], scratch
  else:
    args = [*in_tree.unflatten(kernel_avals), *out_args, *scratch]
    kwargs = {}
  flat_views, kernel_tree = tree_util.tree_flatten((args, kwargs))
  # Scratch with layout transforms (e.g. swizzled SMEM) and views of an
  # input Ref are traced as the Ref; the kernel sees the view of it.
  flat_kernel_avals = [
    v.ref if isinstance(v, state_types.TransformedRef) else v
    for v in flat_views
  ]
  return _Views(
    flat_views,
    kernel_tree,
    flat_kernel_avals,
    num_in=len(flat_in_avals),
    num_out=len(out_avals),
  )


def _trace_kernel(kernels: Kernels, caller: int, views: _Views, reach):
  """The jaxpr of mesh ``caller``'s kernel, checked, and its consts;
  ``reach``: the launch's meshes, then the external meshes it addresses."""
  fn = kernels.fns[caller]
  # Named as the kernel takes its operands: a pytree of scratch gets
  # ``scratch['acc'][0]``, not a position among the flattened Refs.
  args, kwargs = views.tree.unflatten(views.flat_avals)
  debug_info = api_util.debug_info("mpmd_map", fn, args, kwargs)
  check_arity(fn, args, kwargs, debug_info)
  if kernels.name is not None:
    debug_info = debug_info.replace_func_name(kernels.name)
  jaxpr, consts = _trace_to_jaxpr(
    fn, kernels.meshes[caller], reach, views, debug_info
  )
  check_consts(consts, debug_info)
  check_consts_unbatched(consts, debug_info)
  check_kernel(
    jaxpr,
    caller,
    reach,
    Roles(
      debug_info,
      views.num_in,
      views.num_out,
      num_consts=len(jaxpr.invars) - len(views.flat_avals),
    ),
  )
  return jaxpr, consts


def _trace_to_jaxpr(fn, mesh, reach, views: _Views, debug_info):
  """``fn`` traced on ``views`` with ``mesh``'s axes bound (and those of
  the meshes it can ``reach``), the errors of tracing it said in terms of
  the kernel: an axis it cannot name, a fixed window that leaves its Ref,
  a value it returns."""
  returned = []
  traced_refs = []  # the kernel's Refs while it is traced, to name them

  def flat_fn(*refs):
    traced_refs[:] = refs
    refs = [
      state_types.TransformedRef(r, v.transforms)
      if isinstance(v, state_types.TransformedRef)
      else r
      for r, v in zip(refs, views.flat, strict=True)
    ]
    args, kwargs = views.tree.unflatten(refs)
    returned.append(fn(*args, **kwargs))
    traced_refs.clear()  # kept for errors only: a tracer must not outlive
    return []

  try:
    with prim.tracing_context(mesh, reach):
      jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
        lu.wrap_init(flat_fn, debug_info=debug_info), views.flat_avals
      )
  except NameError as e:
    raise_if_unbound_axis(e, mesh, reach, debug_info)
    raise
  except ValueError as e:
    raise_if_fixed_window_leaves(
      e, traced_refs, debug_info, views.num_in, views.num_out
    )
    raise
  if returned[0] is not None:
    leaves = tree_util.tree_leaves(returned[0])
    types = [short(core.typeof(x)) if _is_array(x) else repr(x) for x in leaves]
    raise ValueError(
      f"mpmd_map: kernel {debug_info.func_src_info}: must return None "
      "(write to its output refs), but it returned "
      f"{', '.join(types) or tree_util.tree_structure(returned[0])}"
    )
  return jaxpr, consts


def _is_array(x) -> bool:
  try:
    return isinstance(core.typeof(x), core.ShapedArray)
  except TypeError:
    return False


def _unify_consts(traced, meshes, num_in, flat_kernel_avals, reach):
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
    kernel_aval(a, meshes) if r else a
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

    with prim.tracing_context(mesh, reach):
      jaxprs.append(
        prim.retrace(
          jaxpr,
          mesh,
          reach,
          body,
          avals,
          _hoisted_names(
            jaxpr, num_in, len(all_consts), len(flat_kernel_avals)
          ),
        )
      )
  return tuple(jaxprs), all_consts


def _hoisted_names(
  jaxpr: core.Jaxpr, num_in: int, num_consts: int, num_operands: int
):
  """The debug info of ``jaxpr`` (the user's kernel, of ``num_operands``
  operands) for the retrace that hoists ``num_consts`` closed-over values
  to inputs after its ``num_in`` inputs: the kernel's name and its operands'
  names, the hoisted values unnamed (else errors would name the retrace's
  function and its ``args[i]``). None when the kernel's names are unknown."""
  info = jaxpr.debug_info
  names = None if info is None else info.arg_names
  if names is None or len(names) < num_operands:
    return None
  # The kernel's own closed-over values lead its names from jax 0.11 on.
  names = names[len(names) - num_operands :]
  names = (*names[:num_in], *("",) * num_consts, *names[num_in:])
  return info._replace(arg_names=names)
