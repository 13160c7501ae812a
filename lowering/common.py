"""What every platform's lowering shares: one mesh's launch as a grid."""

from collections.abc import Callable, Sequence
from typing import Any

import jax

from mpmd import _jax
from mpmd._jax import (
  api_util,
  core,
  lax_control_flow,
  lu,
  pallas_core,
  pallas_primitives,
  pe,
  pjit,
  state,
  tree_util,
)
from mpmd._lowering import bounds, jaxpr_util, paths
from mpmd._primitives import mpmd_map as prim


def _block_spec(aval, mesh):
  space = getattr(aval, "memory_space", None)
  if space is None or isinstance(space, core.MemorySpace):
    space = mesh.default_memory_space
  return pallas_core.BlockSpec(memory_space=space)


def _value_aval(aval):
  return aval.inner_aval if isinstance(aval, state.AbstractRef) else aval


def grid_mapping(
  mesh: pallas_core.Mesh,
  jaxpr: core.Jaxpr,
  in_avals: Sequence[core.AbstractValue],
  out_avals: Sequence[core.AbstractValue],
  debug: bool = False,
):
  """A ``GridMapping`` that runs ``jaxpr`` once per program of ``mesh``.

  Operands are whole arrays in their memory space; the kernel moves data
  itself (``mpmd_map`` has no automatic pipelining).
  """
  num_in, num_out = len(in_avals), len(out_avals)
  scratch = _scratch_refs(jaxpr, num_in + num_out)
  grid_spec = pallas_core.GridSpec(
    grid=tuple(mesh.shape.items()),
    in_specs=tuple(_block_spec(a, mesh) for a in in_avals),
    out_specs=tuple(_block_spec(a, mesh) for a in out_avals),
    scratch_shapes=tuple(
      pallas_core.MemoryRef(a.inner_aval, a.memory_space) for a in scratch
    ),
  )
  operands = [_value_aval(v.aval) for v in jaxpr.invars]
  _, mapping = pallas_core.get_grid_mapping(
    grid_spec,
    operands[:num_in],
    tree_util.tree_structure(tuple(range(num_in))),
    [f"args[{i}]" for i in range(num_in)],
    operands[num_in : num_in + num_out],
    tree_util.tree_structure(tuple(range(num_out))),
    [f"outs[{i}]" for i in range(num_out)],
    debug=debug,
  )
  return mapping


def pallas_params(mesh, jaxpr, ctx, params) -> dict[str, Any]:
  """The keyword params of Pallas' ``pallas_call`` lowerings for one mesh."""
  return dict(
    jaxpr=jaxpr,
    grid_mapping=grid_mapping(
      mesh, jaxpr, ctx.avals_in, params["out_avals"], params["debug"]
    ),
    mesh=mesh,
    input_output_aliases=tuple(params["input_output_aliases"].items()),
    debug=params["debug"],
    compiler_params=params["compiler_params"],
    cost_estimate=params["cost_estimate"],
    out_avals=params["out_avals"],
    metadata=params["metadata"],
    name=params["name"],
  )


def plain_avals(avals: Sequence[Any]) -> list[Any]:
  """The avals a CPU path's launch function takes: semaphores as their
  int32 counts in device memory (what their IR values are), arrays in a
  Pallas memory space (a frozen ``jax.new_ref(x, memory_space=pltpu.HBM)``
  the kernel closed over) in device memory, as the discharged kernels take
  them, without varying-axes types (kernels are traced without them)."""
  plain = []
  for a in avals:
    if paths.is_semaphore_array(a):
      a = core.physical_aval(a).update(memory_space=core.MemorySpace.Device)
    elif not isinstance(a.memory_space, core.MemorySpace):
      a = a.update(memory_space=core.MemorySpace.Device)
    plain.append(a.update(manual_axis_type=core.ManualAxisType()))
  return plain


def _scratch_refs(
  jaxpr: core.Jaxpr, num_operands: int
) -> list[state.AbstractRef]:
  """The avals of a kernel's scratch: its inputs after the operands."""
  refs = []
  for v in jaxpr.invars[num_operands:]:
    if not isinstance(v.aval, state.AbstractRef):
      raise TypeError(f"mpmd_map: expected kernel scratch Refs, got {v.aval}")
    refs.append(v.aval)
  return refs


def scoped_scratch(
  jaxpr: core.Jaxpr,
  num_operands: int,
  mesh: Any,  # a Mosaic GPU mesh (its module is imported lazily)
  meshes: Sequence[pallas_core.Mesh],
  which: Callable[[Any], bool] = lambda aval: True,
) -> tuple[core.Jaxpr, list[int]]:
  """Kernel scratch -> one ``run_scoped`` collective over the warpgroups.

  Scratch of a Mosaic GPU kernel (SMEM, barriers) belongs to its block, so
  one allocation shared by every warpgroup of the block is the same thing.
  Only the scratch avals for which ``which`` holds move into the scope; the
  new jaxpr takes the operands and then the others. Returns it and the
  indices (among the scratch) of those kept as kernel scratch.
  """
  scratch = _scratch_refs(jaxpr, num_operands)
  scoped = [i for i, a in enumerate(scratch) if which(a)]
  kept = [i for i in range(len(scratch)) if i not in scoped]
  if not scoped:
    return jaxpr, kept
  types = [
    pallas_core.MemoryRef(scratch[i].inner_aval, scratch[i].memory_space)
    for i in scoped
  ]
  collective_axes = () if mesh.thread_name is None else mesh.thread_name

  def body(*refs):
    operands, kept_refs = refs[:num_operands], refs[num_operands:]

    def run(*scoped_refs):
      all_scratch = [None] * len(scratch)
      for i, r in zip(kept, kept_refs, strict=True):
        all_scratch[i] = r
      for i, r in zip(scoped, scoped_refs, strict=True):
        all_scratch[i] = r
      core.eval_jaxpr(jaxpr, (), *operands, *all_scratch)

    pallas_primitives.run_scoped(run, *types, collective_axes=collective_axes)
    return ()

  avals = [v.aval for v in jaxpr.invars[:num_operands]]
  avals += [scratch[i] for i in kept]
  return prim.retrace(jaxpr, mesh, (*meshes, mesh), body, avals), kept


def alias_refs(jaxpr, num_in, aliases, mesh, meshes):
  """An aliased input and output are one buffer: the output's.

  A loop or branch that took both Refs takes that buffer once
  (``_distinct_refs``): JAX rejects the same Ref as two operands of one
  (``jax_enable_checks``), and discharges each copy on its own, so the
  last copy written back would win over the writes of the other.
  """
  if not aliases:
    return jaxpr

  def body(*refs):
    refs = list(refs)
    for i, o in aliases.items():
      refs[i] = refs[num_in + o]
    jaxpr_util.eval_with_rule(jaxpr, (), refs, _distinct_refs)
    return ()

  return prim.retrace(jaxpr, mesh, meshes, body)


def _firsts(operands: Sequence[Any]) -> list[int]:
  """Per operand, the position of its first occurrence if it is a Ref
  passed before, else its own."""
  first: dict[int, int] = {}
  return [
    first.setdefault(id(x), i)
    if isinstance(jax.typeof(x), state.AbstractRef)
    else i
    for i, x in enumerate(operands)
  ]


def _once(jaxpr: core.Jaxpr, consts, firsts: Sequence[int]):
  """``jaxpr`` taking each Ref once: only its inputs ``i`` with
  ``firsts[i] == i``, a repeated input reading its first occurrence. The
  new jaxpr and its consts."""
  keep = [i for i, f in enumerate(firsts) if f == i]
  avals = [jaxpr.invars[i].aval for i in keep]

  def body(*args):
    full = [args[keep.index(f)] for f in firsts]
    return jaxpr_util.eval_with_rule(jaxpr, consts, full, _distinct_refs)

  debug_info = api_util.debug_info("mpmd_map alias", body, avals, {})
  fun = lu.wrap_init(body, debug_info=debug_info)
  new, _, new_consts = pe.trace_to_jaxpr_dynamic(fun, avals)
  return new, new_consts


def _closed_once(j, firsts: Sequence[int]):
  return _jax.closed_jaxpr(*_once(*_jax.open_jaxpr(j), firsts))


def _distinct_refs(eqn, invals):
  """Rule: a cond, loop, scope or call given one Ref twice takes it once
  (calls are inlined); other equations are bound as they are."""
  p, params = eqn.primitive, eqn.params
  calls = {pjit.jit_p: "jaxpr", core.closed_call_p: "call_jaxpr"}
  nested = (
    lax_control_flow.cond_p,
    lax_control_flow.while_p,
    lax_control_flow.scan_p,
    pallas_primitives.run_scoped_p,
  )
  if (p not in calls and p not in nested) or _firsts(invals) == list(
    range(len(invals))
  ):
    # Bound as it is: the jaxprs of an equation given distinct Refs are
    # given distinct Refs inside too.
    outs = p.bind(*invals, **p.get_bind_params(params))
    return outs if p.multiple_results else [outs]
  if p in calls:
    inner, consts = _jax.open_jaxpr(params[calls[p]])
    return jaxpr_util.eval_with_rule(inner, consts, invals, _distinct_refs)
  new = dict(params)
  if p is pallas_primitives.run_scoped_p:
    # The scope's constvars are its operands (the Refs it closes over).
    firsts = _firsts(invals)
    scope = pe.convert_constvars_jaxpr(params["jaxpr"])
    allocated = range(len(invals), len(scope.invars))
    body, consts = _once(scope, (), [*firsts, *allocated])
    if consts:
      raise NotImplementedError(
        "mpmd_map: rewriting a nested kernel scope captured constants"
      )
    operands = [x for i, x in enumerate(invals) if firsts[i] == i]
    new["jaxpr"] = _jax.scope_jaxpr(body, len(operands), operands)
  elif p is lax_control_flow.scan_p:
    # Refs are among the scan's constants (it carries and scans arrays).
    num_consts, _ = _jax.scan_layout(params)
    consts = invals[:num_consts]
    firsts = _firsts(consts)
    firsts += range(num_consts, len(invals))
    kept = [x for i, x in enumerate(consts) if firsts[i] == i]
    new = _jax.scan_with_consts(params, len(kept))
    new["jaxpr"] = _closed_once(params["jaxpr"], firsts)
    operands = [*kept, *invals[num_consts:]]
  elif p is lax_control_flow.cond_p:
    index, ops = invals[0], invals[1:]
    firsts = _firsts(ops)
    new["branches"] = tuple(_closed_once(b, firsts) for b in params["branches"])
    operands = [index, *(x for i, x in enumerate(ops) if firsts[i] == i)]
  else:
    # JAX checks the cond's consts and the body's apart, each with the
    # carry (which holds no Refs).
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts = invals[:nc], invals[nc : nc + nb]
    carry = invals[nc + nb :]
    ones = []
    for key, consts in ("cond", cond_consts), ("body", body_consts):
      firsts = _firsts(consts)
      firsts += range(len(consts), len(consts) + len(carry))
      new[f"{key}_jaxpr"] = _closed_once(params[f"{key}_jaxpr"], firsts)
      ones.append([x for i, x in enumerate(consts) if firsts[i] == i])
      new[f"{key}_nconsts"] = len(ones[-1])
    operands = [*ones[0], *ones[1], *carry]
  outs = p.bind(*operands, **p.get_bind_params(new))
  return outs if p.multiple_results else [outs]


# -- the launch's operands in the user's terms (simulator error messages) ----


def operand_labels(params, num_in: int) -> list[str]:
  """``'x_ref' (input 0, f32[256])`` for each operand and scratch of the
  launch; where meshes name one differently, their names together."""
  num_out = len(params["out_avals"])
  per_mesh = [
    bounds.operand_names(j, num_in, num_out, params["input_output_aliases"])
    for j in user_jaxprs(params)
  ]
  labels = []
  for names in zip(*per_mesh, strict=True):
    # "'x' (input 0, f32[256])": the same role and type in every mesh.
    named = [n.partition(" (") for n in names if not n.startswith("(")]
    if not named:
      labels.append(names[0])
      continue
    refs = " / ".join(dict.fromkeys(n for n, _, _ in named))
    labels.append(f"{refs} ({named[0][2]}")
  return labels


def user_jaxprs(params):
  """The launch's kernels as traced, one per mesh (not merged)."""
  return params.get("user_jaxprs", params["jaxprs"])


def kernel_name(params) -> str:
  if params.get("name"):
    return params["name"]
  return " + ".join(
    str(j.debug_info.func_src_info) for j in user_jaxprs(params)
  )
