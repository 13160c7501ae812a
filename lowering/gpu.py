"""CUDA: Mosaic GPU; several meshes become warpgroup ranges of one kernel."""

from mpmd import _jax
from mpmd._jax import mlir
from mpmd._lowering import common, cpu, merge, paths


def lower(ctx: mlir.LoweringRuleContext, *in_nodes, **params):
  if params["interpret"] is not None:
    return cpu.lower(ctx, *in_nodes, **params)
  meshes, jaxprs = params["meshes"], params["jaxprs"]
  if not all(paths.is_gpu_mesh(m) for m in meshes):
    raise NotImplementedError(
      "mpmd_map: CUDA lowering needs Mosaic GPU meshes (plgpu.Mesh); got "
      f"{[type(m).__name__ for m in meshes]}"
    )
  if len(meshes) > 1:
    mesh, jaxpr, params = merge.merge_for_gpu(params)
  else:
    [mesh], [jaxpr] = meshes, jaxprs
  num_operands = len(in_nodes) + len(params["out_avals"])
  jaxpr, _ = common.scoped_scratch(jaxpr, num_operands, mesh, meshes)
  return _jax.lower_mosaic_gpu(
    ctx, *in_nodes, **common.pallas_params(mesh, jaxpr, ctx, params)
  )
