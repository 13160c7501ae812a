"""The CPU fallback: run the kernels, fast when possible, faithful when not."""

import functools
import math

import jax.numpy as jnp
from jax import lax

from mpmd import _jax
from mpmd._jax import (
  callback,
  core,
  hlo_interpreter,
  mlir,
  pallas_core,
  pallas_primitives,
  state,
  tpu,
)
from mpmd.lowering import jaxpr_util, lockstep, paths, watchdog
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
    programs, labels = _fast_programs(len(in_nodes), params)
    run = functools.partial(
      _run_unrolled,
      programs=programs,
      labels=labels,
      **_buffers(len(in_nodes), params, programs[0]),
    )
    return mlir.lower_fun(run, multiple_results=True)(ctx, *in_nodes)
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
  """One pure jaxpr per program, in launch order, axis indices literal;
  and a label for each (``mesh 1 program 0 (core=0)``)."""
  meshes = params["meshes"]
  aliases = dict(params["input_output_aliases"])
  programs, labels = [], []
  # Meshes by position, never `meshes.index(mesh)`: upstream meshes compare
  # with `==`, which is elementwise (and ambiguous) for a multi-core
  # TensorCoreMesh on jax 0.10.2, and a mesh may appear twice.
  for i, (mesh, jaxpr) in enumerate(zip(meshes, params["jaxprs"], strict=True)):
    jaxpr = _alias_refs(jaxpr, num_in, aliases, mesh, meshes)
    sizes = dict(mesh.shape)
    for program in range(math.prod(sizes.values())):
      values = jaxpr_util.literal_axis_values(sizes, program)
      with prim.tracing_context(mesh, meshes):
        unrolled = jaxpr_util.rewrite_axis_indices(jaxpr, values.get, sizes)
        physical, consts = hlo_interpreter.resolve_physical_types(unrolled, ())
        programs.append(
          _jax.discharge_state(_jax.closed_jaxpr(physical, consts))
        )
      coords = ", ".join(f"{a}={int(v)}" for a, v in values.items())
      labels.append(f"mesh {i} program {program} ({coords})")
  return programs, labels


def _uninitialized(aval):
  return pallas_primitives.uninitialized_value(aval.shape, aval.dtype)


def _run_unrolled(
  *args,
  programs,
  labels,
  num_in,
  out_avals,
  out_sources,
  scratch,
  is_ref,
  semaphores,
):
  outs = [
    args[out_sources[o]] if o in out_sources else _uninitialized(aval)
    for o, aval in enumerate(out_avals)
  ]
  shared = {
    k: _uninitialized(aval)
    for k, (aval, is_shared) in enumerate(scratch)
    if is_shared
  }
  num_out = len(out_avals)
  stuck = []
  for program in programs:
    operands = [
      *args,
      *outs,
      *(
        shared[k] if k in shared else _uninitialized(aval)
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
    # A wait that took more than was signalled drove a count negative: on
    # hardware that program would wait forever.
    stuck.append(
      functools.reduce(
        jnp.logical_or,
        [jnp.any(operands[num_in + num_out + k] < 0) for k in semaphores],
        jnp.bool_(False),
      )
    )
  if semaphores:
    stuck = jnp.stack(stuck)
    # Python runs only to raise: a callback per launch costs milliseconds.
    lax.cond(
      jnp.any(stuck),
      lambda: callback.io_callback(
        functools.partial(_raise_if_stuck, labels), None, stuck
      ),
      lambda: None,
    )
  return outs


def _raise_if_stuck(labels, stuck) -> None:
  waiting = [label for label, s in zip(labels, stuck, strict=True) if s]
  if waiting:
    raise watchdog.DeadlockError(
      "mpmd_map deadlock: on the CPU fast path (programs run one after "
      "another) these programs waited on a semaphore more than it was "
      f"signalled, so on hardware they would wait forever: {waiting}"
    )
