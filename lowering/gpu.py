"""CUDA: Mosaic GPU; several meshes become warpgroup ranges of one kernel."""

from collections.abc import Callable, Sequence
from typing import Any

from mpmd import _jax
from mpmd._jax import core, mlir, pallas_core, pallas_primitives
from mpmd.lowering import common, paths
from mpmd.primitives import mpmd_map as prim


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
  num_operands = len(in_nodes) + len(params["out_avals"])
  jaxpr, _ = scoped_scratch(jaxpr, num_operands, mesh, meshes)
  return _jax.lower_mosaic_gpu(
    ctx, *in_nodes, **common.pallas_params(mesh, jaxpr, ctx, params)
  )
