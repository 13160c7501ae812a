"""What every platform's lowering shares: one mesh's launch as a grid."""

from collections.abc import Callable, Sequence
from typing import Any

from mpmd._jax import core, pallas_core, pallas_primitives, state, tree_util
from mpmd.lowering import paths
from mpmd.primitives import mpmd_map as prim


def _block_spec(aval, mesh):
  space = getattr(aval, "memory_space", None)
  if space is None or isinstance(space, core.MemorySpace):
    space = mesh.default_memory_space
  return pallas_core.BlockSpec(memory_space=space)


def _value_aval(aval):
  return aval.inner_aval if isinstance(aval, state.AbstractRef) else aval


def grid_mapping(
  mesh: Any,
  jaxpr: core.Jaxpr,
  in_avals: Sequence[Any],
  out_avals: Sequence[Any],
  debug: bool = False,
):
  """A ``GridMapping`` that runs ``jaxpr`` once per program of ``mesh``.

  Operands are whole arrays in their memory space; the kernel moves data
  itself (``mpmd_map`` has no automatic pipelining).
  """
  num_in, num_out = len(in_avals), len(out_avals)
  scratch = [v.aval for v in jaxpr.invars[num_in + num_out :]]
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
  int32 counts in device memory (what their IR values are), without
  varying-axes types (kernels are traced without them)."""
  plain = []
  for a in avals:
    if paths.is_semaphore_array(a):
      a = core.physical_aval(a).update(memory_space=core.MemorySpace.Device)
    plain.append(a.update(manual_axis_type=core.ManualAxisType()))
  return plain


def scoped_scratch(
  jaxpr: core.Jaxpr,
  num_operands: int,
  mesh: Any,
  meshes: Sequence[Any],
  which: Callable[[Any], bool] = lambda aval: True,
) -> tuple[core.Jaxpr, list[int]]:
  """Kernel scratch -> one ``run_scoped`` collective over the warpgroups.

  Scratch of a Mosaic GPU kernel (SMEM, barriers) belongs to its block, so
  one allocation shared by every warpgroup of the block is the same thing.
  Only the scratch avals for which ``which`` holds move into the scope; the
  new jaxpr takes the operands and then the others. Returns it and the
  indices (among the scratch) of those kept as kernel scratch.
  """
  scratch = [v.aval for v in jaxpr.invars[num_operands:]]
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
  """An aliased input and output are one buffer: the output's."""
  if not aliases:
    return jaxpr

  def body(*refs):
    refs = list(refs)
    for i, o in aliases.items():
      refs[i] = refs[num_in + o]
    core.eval_jaxpr(jaxpr, (), *refs)
    return ()

  return prim.retrace(jaxpr, mesh, meshes, body)
