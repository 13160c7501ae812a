"""TPU: Mosaic, natively MPMD where Mosaic is, merged where it is not."""

import jax

from mpmd import _jax, _pallas_ops
from mpmd._jax import mlir, pallas_core, tpu
from mpmd._lowering import addressing, cpu, external, jaxpr_util, merge
from mpmd._primitives import mpmd_map as prim


def _check_subcore_signals(meshes, jaxprs) -> None:
  """Mosaic of jax 0.10.2 cannot serialize a scalar subcore's signal to a
  vector subcore ("subcore_id linearization requested for non-SC vector
  subcore type"); newer Mosaic can. Say so instead of failing inside it."""
  if _jax.JAX_VERSION >= (0, 11):
    return
  scalar = tpu().core.CoreType.SC_SCALAR_SUBCORE
  vector = tpu().core.CoreType.SC_VECTOR_SUBCORE
  for mesh, jaxpr in zip(meshes, jaxprs, strict=True):
    if mesh.core_type != scalar:
      continue
    for eqn in jaxpr_util.iter_eqns(jaxpr):
      if _pallas_ops.kind(eqn) is not _pallas_ops.Sync.SIGNAL:
        continue
      sem = _pallas_ops.SignalOperands.of(eqn).sem
      space = getattr(sem.aval, "memory_space", None)
      if (
        isinstance(space, pallas_core.CoreMemorySpace)
        and space.mesh.core_type == vector
      ):
        raise NotImplementedError(
          "mpmd_map: Mosaic on jax 0.10.2 cannot lower a semaphore_signal "
          "from a ScalarSubcoreMesh program to a VectorSubcoreMesh program "
          "(jax >= 0.12 can); the CPU fallback runs it"
        )


def _check_subcore_dmas(meshes, jaxprs) -> None:
  """Mosaic of jax 0.10.2 cannot address another SparseCore program by a
  DMA: it drops the target of a DMA to the caller's own mesh (and of one
  without device_id), and cannot serialize a scalar subcore's DMA to a
  vector subcore. Say so instead of lowering a DMA to the wrong program."""
  if _jax.JAX_VERSION >= (0, 12):
    return
  layout = merge.Layout(tuple(meshes), tuple(dict(m.shape) for m in meshes))
  found = merge.dma_to_program(layout, jaxprs)
  if found is not None:
    i, eqn = found
    raise NotImplementedError(
      f"mpmd_map: Mosaic on jax {jax.__version__} cannot lower a DMA "
      f"({eqn.primitive.name}) from a SparseCore program "
      f"({addressing.describe_mesh(meshes, i)}) to another program of the "
      "launch (jax >= 0.12 can); stage the data in shared memory and "
      "signal a semaphore instead"
    )


def lower(ctx: mlir.LoweringRuleContext, *in_nodes, **params):
  if params["interpret"] is not None:
    # interpret= forces interpretation on any platform.
    return cpu.lower(ctx, *in_nodes, **params)
  meshes, jaxprs = params["meshes"], params["jaxprs"]
  core_type = tpu().core.CoreType
  others = [m for m in meshes if not isinstance(m.core_type, core_type)]
  if others:
    raise NotImplementedError(
      "mpmd_map: TPU lowering needs TPU meshes (pltpu.TensorCoreMesh, "
      "SparseCore meshes); got "
      f"{[f'{type(m).__name__} ({m.core_type})' for m in others]}, which "
      "lower for their own platform ('cuda' for plgpu.Mesh)"
    )
  # Meshes whose memory holds an operand but that run nothing here: Mosaic
  # resolves a device_id naming their programs (upstream's external meshes).
  outside = external.of_kernels(meshes, jaxprs)
  core_types = {m.core_type for m in meshes}
  tensorcore = tpu().core.CoreType.TC
  if len(meshes) > 1 and core_types == {tensorcore}:
    # Mosaic has no MPMD across TensorCores: one SPMD kernel over all cores.
    mesh, jaxpr, params = merge.merge_for_tpu(params)
    meshes, jaxprs = (mesh,), (jaxpr,)
  elif len(meshes) > 1 and tensorcore in core_types:
    raise NotImplementedError(
      "mpmd_map: Mosaic on jax 0.10.2 cannot launch a TensorCore kernel "
      "next to SparseCore kernels; got meshes of core types "
      f"{sorted(str(t) for t in core_types)}"
    )
  _check_subcore_signals(meshes, jaxprs)
  if tensorcore not in core_types:
    _check_subcore_dmas(meshes, jaxprs)
  # Mosaic has no 64-bit types: under jax_enable_x64 the Python ints that
  # its rules lower (literals, jnp helpers traced again) stay 32-bit.
  with _jax.config.enable_x64(False):
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
      external_meshes=outside,
      num_scratch=prim.num_scratch(
        jaxprs, len(in_nodes), len(params["out_avals"])
      ),
    )
