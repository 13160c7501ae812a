"""``mpmd_map_p``: N (mesh, kernel jaxpr) pairs launched as one kernel.

Params (all hashable):
  jaxprs: one closed-over-nothing ``Jaxpr`` per mesh; each takes
    ``(*inputs, *outputs, *scratch)`` as refs (scalar inputs as values) and
    returns nothing. All jaxprs share that signature.
  meshes: the Pallas meshes, one per jaxpr.
  out_avals: the ``ShapedArray`` of each output.
  input_output_aliases: ``FrozenDict`` input index -> output index.
  compiler_params, interpret, debug, cost_estimate, name, metadata: as for
    ``pallas_call``; ``interpret=None`` means "native where there is hardware,
    the CPU fallback on CPU".
  cpu_path: the ``mpmd._lowering.paths.Path`` the CPU fallback takes, decided
    once where the launch is traced (it depends on the kernels, the meshes,
    ``interpret`` and the enclosing shard_map). The launch's effects and
    its CPU lowering follow from it. Rules that rebuild the kernels keep
    it: discharge only turns Ref operands into aliased outputs, batching
    launches the same kernels per batch element, and neither changes what
    decides the path.

The rules follow, one after another: impl, abstract eval, typecheck,
discharge, DCE, partial eval, batching. Lowering lives in ``mpmd._lowering``.
"""

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from mpmd import _jax
from mpmd._jax import (
  FrozenDict,
  ad,
  ad_util,
  api_util,
  batching,
  config,
  core,
  effects,
  lu,
  pallas_core,
  pe,
  state,
  util,
)
from mpmd._lowering import errors, external, paths
from mpmd._lowering.tracing import axis_env, tracing_context

mpmd_map_p = core.Primitive("mpmd_map")
mpmd_map_p.multiple_results = True


class HostCallbackEffect(effects.Effect):
  """A launch whose CPU fallback runs host callbacks (a simulator, checks).

  Unordered: each launch orders its own callbacks on a token chain of its
  own, so a failed launch leaves nothing behind for later ones. Equal to
  every instance of its class and built without arguments, as
  ``jax.export`` needs to serialize it.
  """

  def __eq__(self, other):
    return type(other) is type(self)

  def __hash__(self):
    return hash(type(self))

  def __str__(self):
    return "mpmd.HostCallback"


host_callback_effect = HostCallbackEffect()
effects.lowerable_effects.add_type(HostCallbackEffect)
effects.control_flow_allowed_effects.add_type(HostCallbackEffect)
effects.custom_derivatives_allowed_effects.add_type(HostCallbackEffect)
effects.remat_allowed_effects.add_type(HostCallbackEffect)


def _short(aval) -> str:
  return aval.str_short(short_dtypes=True)


def bind(*args: Any, **params: Any) -> list[Any]:
  """Binds ``mpmd_map_p``."""
  return mpmd_map_p.bind(*args, **params)


def num_scratch(jaxprs: Sequence[core.Jaxpr], num_args: int, num_outs: int):
  return len(jaxprs[0].invars) - num_args - num_outs


def retrace(
  jaxpr: core.Jaxpr,
  mesh: pallas_core.Mesh,
  meshes: Sequence[pallas_core.Mesh],
  body,
  avals=None,
  debug_info=None,
) -> core.Jaxpr:
  """Traces ``body`` over ``jaxpr``'s input avals (or ``avals``) in
  ``mesh``'s context, named by ``jaxpr``'s debug info (or ``debug_info``)."""
  avals = [v.aval for v in jaxpr.invars] if avals is None else avals
  debug_info = jaxpr.debug_info if debug_info is None else debug_info
  names = debug_info.arg_names if debug_info is not None else None
  if names is None or len(names) != len(avals):
    # A rewrite that adds operands (discharge, hidden outputs) renames them:
    # jax_enable_checks asserts one name per operand.
    debug_info = api_util.debug_info("mpmd_map", body, avals, {})
  fun = lu.wrap_init(body, debug_info=debug_info)
  with tracing_context(mesh, meshes):
    new_jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(fun, avals)
  if consts:
    raise ValueError(
      "mpmd_map: a kernel rewrite captured array constants "
      f"{[jax.typeof(c) for c in consts]}; pass arrays as inputs instead"
    )
  return new_jaxpr


# -- impl ---------------------------------------------------------------------


# JAX's cache utility: jax.clear_caches() lets go of the kernels' jaxprs.
@_jax.util.cache(max_size=256, trace_context_in_key=False)
def _jitted_launch(params: tuple[tuple[str, Any], ...]):
  return jax.jit(functools.partial(mpmd_map_p.bind, **dict(params)))


@mpmd_map_p.def_impl
def _mpmd_map_impl(*args, **params):
  if any(
    jnp.issubdtype(a.dtype, pallas_core.semaphore_dtype)
    for a in params["out_avals"]
  ):
    # JAX has no arrays of semaphores outside a jit (no result handler).
    raise NotImplementedError(
      "mpmd_map: semaphore outputs outside jax.jit; call the launch that "
      "returns a semaphore and the launch that takes it inside one jax.jit"
    )
  # Cached per params, so eager calls with the same kernel compile once.
  # Waited for, so that a failed launch raises its own error type here.
  jitted = _jitted_launch(tuple(sorted(params.items())))
  with config.disable_jit(False), errors.typed_errors():
    return jax.block_until_ready(jitted(*args))


# -- abstract eval ------------------------------------------------------------


def _kernel_effects(in_avals, jaxprs, meshes) -> set[core.Effect]:
  """The effects of the kernels that are visible outside the launch."""
  mesh_axes = set(axis_env(meshes))
  effs: set[core.Effect] = set()
  for mesh, jaxpr in zip(meshes, jaxprs, strict=True):
    for eff in jaxpr.effects:
      if mesh.discharges_effect(
        eff
      ) or pallas_core.kernel_local_effects.contains(eff):
        continue
      if isinstance(eff, effects.JaxprInputEffect):
        # Writes to a Ref the caller passed in are visible to the caller.
        index = jaxpr.invars.index(eff.input)
        if index < len(in_avals) and isinstance(
          in_avals[index], state.AbstractRef
        ):
          effs.add(eff.replace(index))
        continue
      if isinstance(eff, core.NamedAxisEffect) and eff.name in mesh_axes:
        continue
      effs.add(eff)
  return effs


@mpmd_map_p.def_effectful_abstract_eval
def _mpmd_map_abstract_eval(
  *in_avals,
  jaxprs,
  meshes,
  out_avals,
  input_output_aliases,
  cpu_path,
  **_,
):
  effs = _kernel_effects(in_avals, jaxprs, meshes)
  # The CPU fallback's host callbacks: declared where the launch is traced,
  # whatever platform lowers it (one export may carry several).
  if paths.runs_callbacks(cpu_path, jaxprs, len(in_avals) + len(out_avals)):
    effs.add(host_callback_effect)
  out_to_in = {o: i for i, o in input_output_aliases.items()}
  # An aliased output keeps its input's type (weak type, sharding), but it
  # is always an array, never the Ref a discharged input came from.
  outs = [
    in_avals[out_to_in[o]]
    if o in out_to_in
    and not isinstance(in_avals[out_to_in[o]], state.AbstractRef)
    else _outside_type(aval)
    for o, aval in enumerate(out_avals)
  ]
  return outs, effs


def _outside_type(aval):
  """The type outside the launch of an output declared in a kernel memory
  space. As upstream of the JAX version: up to 0.10 it keeps its type;
  from 0.11 on an array leaves as a device array (JAX's operations reject
  Pallas memory spaces; a later launch names the memory again:
  ``jax.new_ref(out, memory_space=pltpu.VMEM @ tc_mesh)``). A semaphore,
  which no operation outside a kernel takes, keeps its memory space
  without the owner: passed to a later launch as it is, it is a semaphore
  there too, which the CPU fallback counts as such."""
  space = getattr(aval, "memory_space", None)
  if (
    not _jax.OUTPUTS_LEAVE_AS_DEVICE_ARRAYS
    or space is None
    or isinstance(space, core.MemorySpace)
  ):
    return aval
  if paths.is_semaphore_array(aval):
    if isinstance(space, pallas_core.CoreMemorySpace):
      return aval.update(memory_space=space.memory_space)
    return aval
  return aval.update(memory_space=core.MemorySpace.Device)


# -- typecheck ----------------------------------------------------------------


def _kernel_operand_aval(aval: core.AbstractValue) -> core.ShapedArray:
  """The array a kernel operand holds: a Ref's, or the value's own."""
  inner = aval.inner_aval if isinstance(aval, state.AbstractRef) else aval
  if not isinstance(inner, core.ShapedArray):
    raise core.JaxprTypeError(
      f"mpmd_map: expected kernel operands of arrays, got {inner}"
    )
  return inner


def _mpmd_map_typecheck(ctx_factory, *in_atoms, **params):
  del ctx_factory
  in_avals = [x.aval for x in in_atoms]
  jaxprs, out_avals = params["jaxprs"], params["out_avals"]
  aliases = params["input_output_aliases"]
  if len(jaxprs) != len(params["meshes"]):
    raise core.JaxprTypeError(
      f"mpmd_map: {len(jaxprs)} jaxprs for {len(params['meshes'])} meshes"
    )
  cpu_path = params["cpu_path"]
  if not isinstance(cpu_path, paths.Path) or cpu_path.kind not in paths.KINDS:
    raise core.JaxprTypeError(
      f"mpmd_map: cpu_path must be a mpmd._lowering.paths.Path of kind "
      f"{' / '.join(paths.KINDS)}, got {cpu_path!r}"
    )
  arity = len(jaxprs[0].invars)
  for jaxpr in jaxprs:
    if len(jaxpr.invars) != arity or jaxpr.outvars or jaxpr.constvars:
      raise core.JaxprTypeError(
        "mpmd_map: every kernel jaxpr must take the same operands, close "
        "over nothing and return nothing"
      )
    operands = jaxpr.invars[: len(in_avals) + len(out_avals)]
    expected = [*in_avals, *out_avals]
    for i, (var, aval) in enumerate(zip(operands, expected, strict=True)):
      got = _kernel_operand_aval(var.aval)
      want = _kernel_operand_aval(aval)
      if (got.shape, got.dtype) != (want.shape, want.dtype):
        raise core.JaxprTypeError(
          f"mpmd_map: kernel operand {i} is {_short(got)} but the "
          f"launch passes {_short(want)}"
        )
  for i, o in aliases.items():
    a, b = _kernel_operand_aval(in_avals[i]), out_avals[o]
    if (a.shape, a.dtype) != (b.shape, b.dtype):
      raise core.JaxprTypeError(
        f"mpmd_map: input {i} ({_short(a)}) aliases output {o} ({_short(b)})"
      )
  return _mpmd_map_abstract_eval(*in_avals, **params)


core.custom_typechecks[mpmd_map_p] = _mpmd_map_typecheck


# -- discharge ----------------------------------------------------------------


def _mpmd_map_discharge(in_avals, avals_out, *args, **params):
  """Refs passed to the launch become extra outputs aliased to them.

  The kernels keep their signature plus one output per Ref input; the body
  reads and writes the new output where it used the Ref, so the aliased
  buffer carries the updates on every platform.
  """
  del avals_out
  jaxprs, meshes = params["jaxprs"], params["meshes"]
  out_avals = params["out_avals"]
  ref_ins = [
    i for i, a in enumerate(in_avals) if isinstance(a, state.AbstractRef)
  ]
  num_in, num_out = len(in_avals), len(out_avals)

  def rewrite(jaxpr, mesh):
    avals = [v.aval for v in jaxpr.invars]
    ins, outs, scratch = util.split_list(avals, [num_in, num_out])
    new_outs = [avals[i] for i in ref_ins]

    def body(*refs):
      ins_, outs_, new_, scratch_ = util.split_list(
        refs, [num_in, num_out, len(ref_ins)]
      )
      ins_ = list(ins_)
      for i, ref in zip(ref_ins, new_, strict=True):
        ins_[i] = ref
      core.eval_jaxpr(jaxpr, (), *ins_, *outs_, *scratch_)
      return ()

    return retrace(
      jaxpr,
      mesh,
      meshes,
      body,
      [*ins, *outs, *new_outs, *scratch],
      _discharged_names(jaxpr.debug_info, num_in, num_out, ref_ins),
    )

  new_jaxprs = tuple(rewrite(j, m) for j, m in zip(jaxprs, meshes, strict=True))
  aliases = dict(params["input_output_aliases"])
  for k, i in enumerate(ref_ins):
    aliases[i] = num_out + k
  new_params = dict(
    params,
    jaxprs=new_jaxprs,
    out_avals=(*out_avals, *(in_avals[i].inner_aval for i in ref_ins)),
    input_output_aliases=FrozenDict(aliases),
  )
  results = mpmd_map_p.bind(*args, **new_params)
  outs, updated = util.split_list(results, [num_out])
  new_invals = [None] * num_in
  for i, val in zip(ref_ins, updated, strict=True):
    new_invals[i] = val
  return new_invals, outs


_jax.register_discharge_rule(mpmd_map_p, _mpmd_map_discharge)


def _discharged_names(info, num_in: int, num_out: int, ref_ins):
  """The kernel's debug info for its discharged form: its own name, and
  each new output named as the Ref input it carries (errors then name the
  user's kernel and Refs, not this rule's ``body`` and ``refs[4]``). None
  where the kernel's names are unknown."""
  names = None if info is None else info.arg_names
  if names is None or len(names) < num_in + num_out:
    return None
  new = tuple(names[i] for i in ref_ins)
  names = (*names[: num_in + num_out], *new, *names[num_in + num_out :])
  return info._replace(arg_names=names)


# -- DCE ----------------------------------------------------------------------


def _mpmd_map_dce(used_outs: list[bool], eqn: core.JaxprEqn):
  # A kernel cannot drop one of its outputs, but a launch whose results are
  # all unused and that has no visible effects can go.
  if not any(used_outs) and not eqn.effects:
    return [False] * len(eqn.invars), None
  return [True] * len(eqn.invars), eqn


_jax.register_dce_rule(mpmd_map_p, _mpmd_map_dce)


# -- partial eval -------------------------------------------------------------


def _mpmd_map_partial_eval_custom(saveable, unks_in, inst_in, eqn):
  """Kernels are never differentiated: they run where their inputs are known.

  Known inputs: the launch runs once, in the known jaxpr, and its outputs
  are residuals; a pure launch may be recomputed when the policy says so.
  A launch with effects (it writes Refs, or runs a simulator's callbacks)
  is never run twice.
  """
  num_outs = len(eqn.outvars)
  to_inst = [
    v
    for v, inst in zip(eqn.invars, inst_in, strict=True)
    if type(v) is core.Var and not inst
  ]
  if any(unks_in):
    return None, eqn, [True] * num_outs, [True] * num_outs, to_inst
  policy = pe.ensure_enum(
    saveable(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params)
  )
  if not eqn.effects and isinstance(policy, pe.RecomputeType):
    return eqn, eqn, [False] * num_outs, [True] * num_outs, to_inst
  return eqn, None, [False] * num_outs, [False] * num_outs, []


pe.partial_eval_jaxpr_custom_rules[mpmd_map_p] = _mpmd_map_partial_eval_custom


# -- differentiation ----------------------------------------------------------


def _mpmd_map_jvp(primals, tangents, **params):
  # JAX asks for a JVP whenever an operand is a Ref, even when no array
  # operand carries a tangent: then nothing is differentiated through the
  # kernel (its writes to Refs carry no tangent, they leave the tangent Refs
  # as they are).
  if all(
    type(t) is ad_util.Zero or isinstance(core.typeof(x), state.AbstractRef)
    for x, t in zip(primals, tangents, strict=True)
  ):
    outs = mpmd_map_p.bind(*primals, **params)
    return outs, [ad_util.p2tz(o) for o in outs]
  raise NotImplementedError(
    "mpmd_map: kernels are not differentiable by JAX. Give the function "
    "that calls mpmd_map a jax.custom_vjp (as mpmd.kernels.gmm does), or "
    "pass jax.lax.stop_gradient(x) for inputs that need no gradient."
  )


ad.primitive_jvps[mpmd_map_p] = _mpmd_map_jvp


# -- batching -----------------------------------------------------------------


def _slice(x, dim, b):
  return jax.lax.index_in_dim(x, b, axis=dim, keepdims=False)


def _written_inputs(jaxprs, num_args: int) -> set[int]:
  """Launch operands some kernel writes (through a Ref)."""
  written = set()
  for jaxpr in jaxprs:
    for eff in jaxpr.effects:
      if isinstance(eff, state.WriteEffect) and isinstance(eff.input, core.Var):
        index = jaxpr.invars.index(eff.input)
        if index < num_args:
          written.add(index)
  return written


# Upstream's words (its batching rule of mpmd_map_p).
UNBATCHABLE_CONST = (
  "Closed-over scalar constants cannot be batched. Pass them as inputs instead."
)


def _check_no_batched_scalar(jaxprs, dims) -> None:
  """Upstream's rule: a kernel operand taken by value (a closed-over
  scalar; inputs are Refs) must not be batched. ``mpmd.mpmd_map`` says so
  where it traces the kernel; this catches ``vmap`` of a ``jit`` of it."""
  for jaxpr in jaxprs:
    for var, d in zip(jaxpr.invars[: len(dims)], dims, strict=True):
      if d is not None and not isinstance(var.aval, state.AbstractRef):
        raise ValueError(
          "mpmd_map: vmap batches a value a kernel closes over: "
          + UNBATCHABLE_CONST
        )


def _mpmd_map_batching(axis_data, args, dims, **params):
  """``vmap`` of a launch (``_batched``). Run eagerly, it is waited for, so
  that a failed launch raises its own error type here, as an eager call
  does (``_mpmd_map_impl``)."""
  with errors.typed_errors():
    outs, out_dims = _batched(axis_data, args, dims, **params)
    if not any(isinstance(o, core.Tracer) for o in outs):
      jax.block_until_ready(outs)
  return outs, out_dims


def _batched(axis_data, args, dims, **params):
  """``vmap`` of a launch: one launch per batch element, results stacked.

  A kernel addresses its refs arbitrarily (DMAs, dynamic slices), so a batch
  axis cannot be threaded through its body in general; each element gets its
  own launch. Without ordered effects the launches form one ``lax.map`` loop
  (the kernel is compiled once); otherwise they are unrolled in order.
  """
  if all(d is None for d in dims):
    outs = mpmd_map_p.bind(*args, **params)
    return outs, [None] * len(outs)
  _check_no_batched_scalar(params["jaxprs"], dims)
  size = axis_data.size
  written = _written_inputs(params["jaxprs"], len(args))
  for i, (x, d) in enumerate(zip(args, dims, strict=True)):
    if (
      d is None
      and i in written
      and isinstance(core.typeof(x), state.AbstractRef)
    ):
      raise ValueError(
        f"mpmd_map: vmap of a launch that writes the unbatched Ref operand "
        f"{i}: every batch element would write it. Batch that Ref too."
      )
  has_refs = any(
    d is not None and isinstance(core.typeof(x), state.AbstractRef)
    for x, d in zip(args, dims, strict=True)
  )
  ordered = any(
    effects.ordered_effects.contains(e)
    for e in _mpmd_map_abstract_eval(*(core.typeof(x) for x in args), **params)[
      1
    ]
  )
  if not has_refs and not ordered:
    batched = [i for i, d in enumerate(dims) if d is not None]
    moved = [jnp.moveaxis(args[i], dims[i], 0) for i in batched]

    def one(xs):
      call_args = list(args)
      for i, x in zip(batched, xs, strict=True):
        call_args[i] = x
      return mpmd_map_p.bind(*call_args, **params)

    outs = jax.lax.map(one, moved)
    return list(outs), [0] * len(outs)

  per_element = []
  for b in range(size):
    call_args = []
    for x, d in zip(args, dims, strict=True):
      if d is None:
        call_args.append(x)
      elif isinstance(aval := core.typeof(x), state.AbstractRef):
        call_args.append(
          core.new_ref(_slice(x[...], d, b), memory_space=aval.memory_space)
        )
      else:
        call_args.append(_slice(x, d, b))
    per_element.append(mpmd_map_p.bind(*call_args, **params))
    for x, d, y in zip(args, dims, call_args, strict=True):
      if d is not None and isinstance(core.typeof(x), state.AbstractRef):
        index = (slice(None),) * d + (b,)
        x[index] = core.freeze(y)
  outs = [jnp.stack(o) for o in zip(*per_element, strict=True)]
  return outs, [0] * len(outs)


batching.fancy_primitive_batchers[mpmd_map_p] = _mpmd_map_batching


# -- physicalize (the Pallas fuser) -------------------------------------------


def _mpmd_map_physicalize(ctx, *args, jaxprs, meshes, **params):
  """Kernels that compute on fusion dtypes inside (``fusible_dtype.pack``
  then ``unpack``) become kernels of their physical parts, as upstream's
  rule does; the launch's operands are physical already (``mpmd_map``
  refuses fusion dtypes there)."""
  fused = [
    a
    for a in (*ctx.avals_in, *ctx.avals_out)
    if _jax.is_fusion_dtype(getattr(_kernel_operand_aval(a), "dtype", None))
  ]
  if fused:
    raise NotImplementedError(
      "mpmd_map: launch operands of Pallas fuser dtypes cannot be "
      f"physicalized: {fused}; pass their physical parts"
    )
  reach = (*meshes, *external.of_kernels(meshes, jaxprs))
  physical = []
  for mesh, jaxpr in zip(meshes, jaxprs, strict=True):
    with tracing_context(mesh, reach):
      new = _jax.physicalize_jaxpr(jaxpr)
    if len(new.invars) != len(jaxpr.invars):
      raise NotImplementedError(
        f"mpmd_map: kernel {jaxpr.debug_info.func_src_info}: scratch of "
        "Pallas fuser dtypes cannot be physicalized; allocate its physical "
        "parts as scratch"
      )
    # The kernel keeps its name (Mosaic names the kernel after it).
    physical.append(_jax.replace_jaxpr(new, debug_info=jaxpr.debug_info))
  return mpmd_map_p.bind(*args, jaxprs=tuple(physical), meshes=meshes, **params)


_jax.register_physicalize_rule(mpmd_map_p, _mpmd_map_physicalize)
