"""The CPU fallback: run the kernels, fast when possible, faithful when not."""

import functools
import math

import jax.numpy as jnp
from jax import lax

from mpmd import _jax
from mpmd._jax import (
  callback,
  config,
  core,
  hlo_interpreter,
  mlir,
  pallas_core,
  pallas_primitives,
  state,
  tpu,
  tree_util,
)
from mpmd.lowering import bounds, jaxpr_util, lockstep, paths, watchdog
from mpmd.primitives import mpmd_map as prim


def lower(ctx: mlir.LoweringRuleContext, *in_nodes, **params):
  jaxprs, meshes = params["jaxprs"], params["meshes"]
  paths.check_simulable(jaxprs)
  axes = lockstep.manual_axes(ctx.module_context.axis_context)
  path = paths.choose(jaxprs, meshes, params["interpret"], axes)
  if params["debug"]:
    print(f"mpmd_map: CPU fallback takes the {path.kind} path: {path.reason}")
  if path.kind == paths.LOCKSTEP:
    aliases = dict(params["input_output_aliases"])
    kernel = _alias_refs(jaxprs[0], len(in_nodes), aliases, meshes[0], meshes)
    return lockstep.lower(ctx, *in_nodes, kernel=kernel, axes=axes, **params)
  if path.kind == paths.FAST:
    programs, labels, num_checks = _fast_programs(len(in_nodes), params)
    run = functools.partial(
      _run_unrolled,
      programs=programs,
      labels=labels,
      num_checks=num_checks,
      **_buffers(len(in_nodes), params, programs[0]),
    )
    # Kernels are traced without varying-axes types: under a
    # shard_map(check_vma=True) their index arithmetic mixes varying and
    # invariant values, and checkify's conditionals would tell them apart.
    plain = [
      a.update(manual_axis_type=core.ManualAxisType()) for a in ctx.avals_in
    ]
    with config._check_vma(False):
      return mlir.lower_fun(run, multiple_results=True)(
        ctx.replace(avals_in=plain), *in_nodes
      )
  ranges = None
  if len(meshes) == 1 and getattr(meshes[0], "num_threads", 0) is None:
    # A GPU mesh without warpgroups: nothing to merge or share.
    [mesh], [jaxpr] = meshes, jaxprs
  else:
    # Even one mesh goes through the merge: it resolves programs named by
    # mesh axes (device_id={"core": 1}) and shares GPU scratch collectively.
    from mpmd.lowering import merge

    mesh, jaxpr, params, ranges = merge.merge_for_simulator(params, path)
  if path.kind == paths.TPU_SIMULATOR:
    from mpmd.lowering import tpu_simulator as simulator
  else:
    from mpmd.lowering import gpu_simulator as simulator
  return simulator.lower(
    ctx,
    *in_nodes,
    mesh=mesh,
    jaxpr=jaxpr,
    interpret=path.params,
    params=params,
    ranges=ranges,
  )


# -- the fast path ------------------------------------------------------------


def _is_shared(aval) -> bool:
  """Scratch every program sees (HBM / ANY); the rest is per program."""
  space = getattr(aval, "memory_space", None)
  tpu_spaces = tpu().core.MemorySpace
  return space in (pallas_core.MemorySpace.ANY, tpu_spaces.HBM, None)


def _buffers(num_in: int, params, program):
  kernel = params["jaxprs"][0]
  num_out = len(params["out_avals"])
  # Physical avals (semaphores as integers) come from a discharged program.
  physical = [v.aval for v in program.jaxpr.invars]
  return dict(
    num_in=num_in,
    out_avals=tuple(physical[num_in : num_in + num_out]),
    out_sources={o: i for i, o in params["input_output_aliases"].items()},
    scratch=tuple(
      (aval, _is_shared(v.aval))
      for v, aval in zip(
        kernel.invars[num_in + num_out :],
        physical[num_in + num_out :],
        strict=True,
      )
    ),
    is_ref=tuple(isinstance(v.aval, state.AbstractRef) for v in kernel.invars),
    semaphores=tuple(
      k
      for k, v in enumerate(kernel.invars[num_in + num_out :])
      if paths.is_semaphore(v.aval)
    ),
  )


def _alias_refs(jaxpr, num_in, aliases, mesh, meshes):
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


def _fast_programs(num_in: int, params):
  """One pure jaxpr per program, in launch order, axis indices literal; a
  label for each (``mesh 1 program 0 (core=0)``); how many run-time checks
  they make (``bounds.Checks``).

  DMAs and semaphores go through the lockstep path's rewrite: semaphores
  count bytes in int32 (Pallas' discharge rules count elements in int16,
  which several large pending DMAs wrap), and DMA windows are checked.
  """
  meshes = params["meshes"]
  aliases = dict(params["input_output_aliases"])
  num_out = len(params["out_avals"])
  programs, labels, num_checks = [], [], 0
  # Meshes by position, never `meshes.index(mesh)`: upstream meshes compare
  # with `==`, which is elementwise (and ambiguous) for a multi-core
  # TensorCoreMesh on jax 0.10.2, and a mesh may appear twice.
  kernels = zip(meshes, params["jaxprs"], strict=True)
  for i, (mesh, traced) in enumerate(kernels):
    jaxpr = _alias_refs(traced, num_in, aliases, mesh, meshes)
    sizes = dict(mesh.shape)
    with prim.tracing_context(mesh, meshes):
      jaxpr, consts = hlo_interpreter.resolve_physical_types(jaxpr, ())
      if consts:
        raise NotImplementedError("mpmd_map: kernel captured constants")
      jaxpr = jaxpr_util.map_avals(jaxpr, lockstep.widen)
    refs = bounds.trace_refs(
      jaxpr, bounds.operand_names(traced, num_in, num_out)
    )
    proven = bounds.prove(jaxpr, sizes)
    for program in range(math.prod(sizes.values())):
      values = jaxpr_util.literal_axis_values(sizes, program)
      coords = ", ".join(f"{a}={int(v)}" for a, v in values.items())
      label = f"mesh {i} program {program} ({coords})"
      checks = bounds.Checks(
        traced.debug_info.func_src_info,
        refs,
        proven,
        path="fast path (programs run one after another)",
        where=lambda args, label=label: f", {label}",
      )
      rule = lockstep.sync_rule(
        checks, first=jaxpr_util.axis_index_rule(values.get, sizes)
      )
      with prim.tracing_context(mesh, meshes):
        unrolled = jaxpr_util.rewrite(jaxpr, rule)
        programs.append(_jax.discharge_state(_jax.closed_jaxpr(unrolled)))
      labels.append(label)
      num_checks += checks.count
  return programs, labels, num_checks


def _uninitialized(aval):
  return pallas_primitives.uninitialized_value(aval.shape, aval.dtype)


def _run_unrolled(
  *args,
  programs,
  labels,
  num_checks,
  num_in,
  out_avals,
  out_sources,
  scratch,
  is_ref,
  semaphores,
):
  num_out = len(out_avals)

  def scratch_value(k, aval):
    # Semaphores start at zero (uninitialised int32 would be a sentinel).
    if k in semaphores:
      return jnp.zeros(aval.shape, aval.dtype)
    return _uninitialized(aval)

  def launch(*args):
    outs = [
      args[out_sources[o]] if o in out_sources else _uninitialized(aval)
      for o, aval in enumerate(out_avals)
    ]
    shared = {
      k: _uninitialized(aval)
      for k, (aval, is_shared) in enumerate(scratch)
      if is_shared
    }
    stuck = []
    for program in programs:
      operands = [
        *args,
        *outs,
        *(
          shared[k] if k in shared else scratch_value(k, aval)
          for k, (aval, _) in enumerate(scratch)
        ),
      ]
      # The discharged program returns the final value of each Ref operand.
      updated = iter(core.eval_jaxpr(program.jaxpr, program.consts, *operands))
      operands = [
        next(updated) if r else x for x, r in zip(operands, is_ref, strict=True)
      ]
      outs = operands[num_in : num_in + num_out]
      shared = {k: operands[num_in + num_out + k] for k in shared}
      # A wait that found its semaphore short poisoned it (negative): on
      # hardware that program would wait forever.
      stuck.append(
        functools.reduce(
          jnp.logical_or,
          [jnp.any(operands[num_in + num_out + k] < 0) for k in semaphores],
          jnp.bool_(False),
        )
      )
    return outs, jnp.stack(stuck)

  error, (outs, stuck) = bounds.checked(launch, num_checks)(*args)
  if semaphores or error is not None:
    failed = jnp.any(stuck)
    if error is not None:
      failed = jnp.logical_or(failed, bounds.failed(error))
    leaves, treedef = tree_util.tree_flatten(error)
    raise_error = functools.partial(
      _raise_for, labels, treedef if leaves else None
    )
    # Python runs only to raise: a callback per launch costs milliseconds.
    lax.cond(
      failed,
      lambda: callback.io_callback(raise_error, None, stuck, *leaves),
      lambda: None,
    )
  return outs


def _raise_for(labels, treedef, stuck, *leaves) -> None:
  failure = bounds.first_failure(treedef, leaves)
  if failure is not None:
    raise failure
  waiting = [label for label, s in zip(labels, stuck, strict=True) if s]
  if waiting:
    raise watchdog.DeadlockError(
      "mpmd_map deadlock: on the CPU fast path (programs run one after "
      "another) these programs waited on a semaphore more than it was "
      f"signalled, so on hardware they would wait forever: {waiting}"
    )
