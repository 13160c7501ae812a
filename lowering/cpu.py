"""The CPU fallback: run the kernels, fast when possible, faithful when not."""

import jax

from mpmd._jax import (
  mlir,
  sharding_impls,
)
from mpmd._lowering import (
  callbacks,
  common,
  external,
  fast,
  gpu_simulator,
  lockstep,
  merge,
  paths,
  tpu_semaphores,
  tpu_simulator,
)


def lower(ctx: mlir.LoweringRuleContext, *in_nodes, **params):
  jaxprs, meshes = params["jaxprs"], params["meshes"]
  path: paths.Path = params["cpu_path"]
  paths.check_simulable(jaxprs)
  # A DMA or signal to the one program of a mesh that runs nothing here
  # (its memory holds an operand) lands on that operand: the caller's own.
  external.check_addressable(meshes, jaxprs)
  jaxprs = external.localize(meshes, jaxprs)
  params = {**params, "jaxprs": jaxprs}
  callbacks.install()  # our callbacks' errors reach the caller typed
  num_operands = len(in_nodes) + len(params["out_avals"])
  paths.check_semaphore_operands(jaxprs, meshes, num_operands)
  tpu_semaphores.check_collective_id(params)
  if params["debug"]:
    print(f"mpmd_map: CPU fallback takes the {path.kind} path: {path.reason}")
  if path.kind in (paths.TPU_SIMULATOR, paths.GPU_SIMULATOR):
    _check_one_process(jaxprs, path, ctx.module_context.axis_context)
  if path.kind == paths.LOCKSTEP:
    _check_lowered_in_traced_shard_map(path, ctx.module_context.axis_context)
    aliases = dict(params["input_output_aliases"])
    kernel = common.alias_refs(
      jaxprs[0], len(in_nodes), aliases, meshes[0], meshes
    )
    return lockstep.lower(
      ctx, *in_nodes, kernel=kernel, axes=path.manual_axes, **params
    )
  if path.kind == paths.FAST:
    return fast.lower(ctx, *in_nodes, **params)
  if path.kind == paths.CHECK:
    from mpmd._lowering.check import launch

    return launch.lower(ctx, *in_nodes, path=path, **params)
  ranges = None
  if len(meshes) == 1 and getattr(meshes[0], "num_threads", 0) is None:
    # A GPU mesh without warpgroups: nothing to merge or share.
    [mesh], [jaxpr] = meshes, jaxprs
  else:
    # Even one mesh goes through the merge: it resolves programs named by
    # mesh axes (device_id={"core": 1}) and shares GPU scratch collectively.
    mesh, jaxpr, params, ranges = merge.merge_for_simulator(params, path)
  tpu = path.kind == paths.TPU_SIMULATOR
  simulator = tpu_simulator if tpu else gpu_simulator
  return simulator.lower(
    ctx,
    *in_nodes,
    mesh=mesh,
    jaxpr=jaxpr,
    interpret=path.params,
    params=params,
    ranges=ranges,
  )


def _check_lowered_in_traced_shard_map(
  path: paths.Path, axis_context: mlir.AxisContext
) -> None:
  """The lockstep path exchanges data along the axes of the shard_map the
  launch was traced in: it must be lowered in that shard_map."""
  axes = paths.manual_axes(axis_context)
  if axes != path.manual_axes:
    raise RuntimeError(
      "mpmd_map: internal error: the launch was traced inside a shard_map "
      f"manual over axes {path.manual_axes} (it takes the lockstep path) "
      f"but is lowered with manual axes {axes}; please report this"
    )


def _launch_processes(axis_context: mlir.AxisContext) -> set[int] | None:
  """The processes whose devices a launch is lowered for (None when the
  lowering does not know its devices: a shard_map over an abstract mesh)."""
  devices = None
  if isinstance(axis_context, sharding_impls.SPMDAxisContext):
    if isinstance(axis_context.mesh, jax.sharding.Mesh):
      devices = axis_context.mesh.devices.flat
  elif isinstance(axis_context, sharding_impls.ShardingContext):
    if axis_context.num_devices == 1:
      return {jax.process_index()}
    devices = axis_context.device_assignment
  return None if devices is None else {d.process_index for d in devices}


def _check_one_process(
  jaxprs, path: paths.Path, axis_context: mlir.AxisContext
) -> None:
  """The simulators keep all simulated memory (buffers, semaphores, DMAs in
  flight) inside one Python process: across processes the programs would
  wait forever for data and signals that never arrive. A launch whose
  devices all live in this process (one process's devices of a
  multi-process job) is fine."""
  count = jax.process_count()
  if count == 1:
    return
  processes = _launch_processes(axis_context)
  if processes is None:
    spans = (
      f"may span processes (jax.process_count() is {count} and the "
      "lowering does not know the launch's devices)"
    )
  elif len(processes) == 1:
    return
  else:
    spans = f"spans processes {sorted(processes)}"
  kernels = ", ".join(str(j.debug_info.func_src_info) for j in jaxprs)
  raise NotImplementedError(
    f"mpmd_map: kernel {kernels} needs the CPU fallback's {path.kind} "
    f"path ({path.reason}), which simulates memory, DMAs and semaphores "
    f"within one process only, and this launch {spans}. Across processes "
    "the CPU fallback runs kernels on the lockstep path (remote DMAs and "
    "signals that every device issues in step, outside conditions), "
    "single-device kernels on the fast path, and the rest on the checking "
    "executor (interpret=None or mpmd.CheckParams(): every process runs "
    "the whole launch); pass one of those, or run it in one process "
    '(simulated devices: jax.config.update("jax_num_cpu_devices", n)).'
  )
