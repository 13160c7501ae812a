"""CUDA: Mosaic GPU; several meshes become warpgroup ranges of one kernel."""

from mpmd._jax import gpu, mlir
from mpmd.lowering import common, paths


def lower(ctx: mlir.LoweringRuleContext, *in_nodes, **params):
  if params["interpret"] is not None:
    from mpmd.lowering import cpu

    return cpu.lower(ctx, *in_nodes, **params)
  meshes, jaxprs = params["meshes"], params["jaxprs"]
  if not all(paths.is_gpu_mesh(m) for m in meshes):
    raise NotImplementedError(
      "mpmd_map: CUDA lowering needs Mosaic GPU meshes (plgpu.Mesh); got "
      f"{[type(m).__name__ for m in meshes]}"
    )
  if len(meshes) > 1:
    from mpmd.lowering import merge

    mesh, jaxpr, params = merge.merge_for_gpu(params)
  else:
    [mesh], [jaxpr] = meshes, jaxprs
  return gpu().registration.pallas_call_lowering(
    ctx,
    *in_nodes,
    interpret=False,
    **common.pallas_params(mesh, jaxpr, ctx, params),
  )
