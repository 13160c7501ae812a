"""TPU: Mosaic, natively MPMD where Mosaic is, merged where it is not."""

from mpmd._jax import mlir, tpu
from mpmd.primitives import mpmd_map as prim


def lower(ctx: mlir.LoweringRuleContext, *in_nodes, **params):
  if params["interpret"] is not None:
    # interpret= forces interpretation on any platform.
    from mpmd.lowering import cpu

    return cpu.lower(ctx, *in_nodes, **params)
  meshes, jaxprs = params["meshes"], params["jaxprs"]
  core_types = {m.core_type for m in meshes}
  tensorcore = tpu().core.CoreType.TC
  if len(meshes) > 1 and core_types == {tensorcore}:
    # Mosaic has no MPMD across TensorCores: one SPMD kernel over all cores.
    from mpmd.lowering import merge

    mesh, jaxpr, params = merge.merge_for_tpu(params)
    meshes, jaxprs = (mesh,), (jaxpr,)
  elif len(meshes) > 1 and tensorcore in core_types:
    raise NotImplementedError(
      "mpmd_map: Mosaic on jax 0.10.2 cannot launch a TensorCore kernel "
      "next to SparseCore kernels; got meshes of core types "
      f"{sorted(str(t) for t in core_types)}"
    )
  return tpu().registration.mpmd_map_tpu_lowering_rule(
    ctx,
    *in_nodes,
    meshes=meshes,
    jaxprs=jaxprs,
    out_avals=params["out_avals"],
    input_output_aliases=params["input_output_aliases"],
    compiler_params=params["compiler_params"],
    interpret=None,
    debug=params["debug"],
    cost_estimate=params["cost_estimate"],
    metadata=params["metadata"],
    name=params["name"],
    external_meshes=(),
    num_scratch=prim.num_scratch(
      jaxprs, len(in_nodes), len(params["out_avals"])
    ),
  )
