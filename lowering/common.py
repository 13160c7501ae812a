"""What every platform's lowering shares: one mesh's launch as a grid."""

from collections.abc import Sequence
from typing import Any

from mpmd._jax import core, pallas_core, state, tree_util
from mpmd.lowering import paths


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
