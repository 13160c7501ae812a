"""The faithful CPU path for TPU meshes: Pallas' threaded TPU simulator.

Two traps of that simulator on jax 0.10.2 are worked around here, narrowly:

1. A semaphore signal with neither ``device_id`` nor ``core_index`` (a
   program signalling itself) is delivered to core 0, so programs > 0 that
   signal their own semaphores wait forever. We name the program's own core.
2. HBM / ANY scratch is rejected as kernel scratch (an input must be either an
   input or an output). Such scratch becomes a hidden extra output that the
   caller never sees.
"""

from typing import Any

import jax

from mpmd._jax import (
  core,
  mlir,
  pallas_call,
  pallas_core,
  pallas_primitives,
  tpu,
  tree_util,
  util,
)
from mpmd.lowering import common, jaxpr_util
from mpmd.primitives import mpmd_map as prim


def _signal_own_core(core_axis):
  """Rule: a local signal without ``core_index`` goes to this program."""

  def rule(eqn, invals):
    if eqn.primitive is not pallas_primitives.semaphore_signal_p:
      return None
    ref, transforms, inc, device_id, core_index = eqn.params[
      "args_tree"
    ].unflatten(invals)
    if device_id is not None or core_index is not None:
      return None
    core_index = jax.lax.axis_index(core_axis)
    flat, tree = tree_util.tree_flatten(
      [ref, transforms, inc, device_id, core_index]
    )
    return pallas_primitives.semaphore_signal_p.bind(
      *flat, args_tree=tree, device_id_type=eqn.params["device_id_type"]
    )

  return rule


def _is_hbm(aval) -> bool:
  space = aval.memory_space
  return space in (pallas_core.MemorySpace.ANY, tpu().core.MemorySpace.HBM)


def lower(
  ctx: mlir.LoweringRuleContext,
  *in_nodes,
  mesh: Any,
  jaxpr: core.Jaxpr,
  interpret: Any,
  params: dict[str, Any],
):
  """Lowers one (possibly merged) TPU mesh kernel to the simulator."""
  num_in, num_out = len(in_nodes), len(params["out_avals"])
  [core_axis] = mesh.shape
  with prim.tracing_context(mesh, params["meshes"]):
    jaxpr = jaxpr_util.rewrite(jaxpr, _signal_own_core(core_axis))

  # Trap 2: HBM scratch moves behind the outputs.
  ins, outs, scratch = util.split_list(jaxpr.invars, [num_in, num_out])
  hidden = [v for v in scratch if _is_hbm(v.aval)]
  if hidden:
    kept = [v for v in scratch if not _is_hbm(v.aval)]
    jaxpr = jaxpr.replace(invars=[*ins, *outs, *hidden, *kept])
    params = dict(
      params,
      out_avals=(*params["out_avals"], *(v.aval.inner_aval for v in hidden)),
    )
    ctx = ctx.replace(
      avals_out=[*ctx.avals_out, *(v.aval.inner_aval for v in hidden)]
    )
  results = pallas_call._pallas_call_lowering(
    ctx,
    *in_nodes,
    interpret=interpret,
    **common.pallas_params(mesh, jaxpr, ctx, params),
  )
  return results[:num_out]
