"""The CPU fallback's fast path: programs unrolled one after another through
the HLO interpreter, axis indices as literals, state discharged. Exact for
kernels whose programs do not wait on each other (local DMAs and a program's
own semaphores complete in program order)."""

import enum
import functools
import math
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from mpmd import _jax, _pallas_ops
from mpmd._jax import (
  callback,
  core,
  hlo_interpreter,
  mlir,
  pallas_core,
  sharding_impls,
  state,
  tpu,
  tree_util,
)
from mpmd._lowering import (
  bounds,
  common,
  counts,
  errors,
  jaxpr_util,
  lockstep,
  merge,
  paths,
  ranges,
  watchdog,
  words,
)
from mpmd._lowering.check import static
from mpmd._primitives import mpmd_map as prim


def lower(ctx: mlir.LoweringRuleContext, *in_nodes, **params):
  programs, report, num_checks, sparsecores, both_write = _fast_programs(
    len(in_nodes), params
  )
  if both_write is not None and _may_reroute(ctx, params):
    checked = paths.checker_covers(params["jaxprs"], params["meshes"])
    if checked is not None:
      # A race unless they store the same bytes: the checking executor
      # tells (in upstream's meaning: the same bytes are no race).
      from mpmd._lowering.check import launch

      path = paths.Path(paths.CHECK, both_write, checked)
      if params["debug"]:
        print(f"mpmd_map: the checking executor runs it instead: {both_write}")
      return launch.lower(ctx, *in_nodes, path=path, **params)
  buffers = _buffers(len(in_nodes), params, programs[0], sparsecores)
  run = functools.partial(
    _run_unrolled,
    programs=programs,
    num_checks=num_checks,
    buffers=buffers,
    report=report,
  )
  # Kernels are traced without varying-axes types: under a
  # shard_map(check_vma=True) their index arithmetic mixes varying and
  # invariant values, and the loops and branches that carry the run-time
  # checks (``failures``) would tell them apart.
  with _jax.no_vma_check():
    return mlir.lower_fun(run, multiple_results=True)(
      ctx.replace(avals_in=common.plain_avals(ctx.avals_in)), *in_nodes
    )


class _Sharing(enum.Enum):
  """Who shares a scratch buffer on the fast path (None: nobody)."""

  DEVICE = enum.auto()  # every program of the device (HBM / ANY)
  SPARSECORE = enum.auto()  # the programs of one SparseCore (VMEM_SHARED)


def _sharing(aval: core.AbstractValue) -> _Sharing | None:
  space = getattr(aval, "memory_space", None)
  tpu_spaces = tpu().core.MemorySpace
  if space in (pallas_core.MemorySpace.ANY, tpu_spaces.HBM, None):
    return _Sharing.DEVICE
  if space is tpu_spaces.VMEM_SHARED:
    return _Sharing.SPARSECORE
  return None


class _Buffers(NamedTuple):
  """The unrolled programs' operands ``(*inputs, *outputs, *scratch)``."""

  num_in: int
  out_avals: tuple[core.AbstractValue, ...]
  # Output index -> the input it aliases (and starts as).
  out_sources: dict[int, int]
  # Per scratch operand: its physical aval, and who shares it (_sharing).
  scratch: tuple[tuple[core.AbstractValue, _Sharing | None], ...]
  # Per operand: whether the kernel takes it as a Ref.
  is_ref: tuple[bool, ...]
  # The operand indices of semaphores.
  semaphores: tuple[int, ...]
  # Per program: the SparseCore it runs on (0 for other programs).
  sparsecores: tuple[int, ...]

  def fresh(self, k: int, aval):
    """A new buffer for operand ``k``. Semaphores start at zero
    (uninitialised int32 would be a sentinel); semaphore inputs bring the
    count their launch left."""
    if k in self.semaphores:
      return jnp.zeros(aval.shape, aval.dtype)
    return _uninitialized(aval)

  def shared_key(self, k: int, program: int):
    """Which shared buffer scratch operand ``k`` of ``program`` is (None:
    its own)."""
    sharing = self.scratch[k][1]
    if sharing is _Sharing.DEVICE:
      return k
    if sharing is _Sharing.SPARSECORE:
      return (k, self.sparsecores[program])
    return None


def _buffers(num_in: int, params, program, sparsecores) -> _Buffers:
  kernel = params["jaxprs"][0]
  num_out = len(params["out_avals"])
  # Physical avals (semaphores as integers) come from a discharged program.
  physical = [v.aval for v in program.jaxpr.invars]
  return _Buffers(
    num_in=num_in,
    out_avals=tuple(physical[num_in : num_in + num_out]),
    out_sources={o: i for i, o in params["input_output_aliases"].items()},
    scratch=tuple(
      (aval, _sharing(v.aval))
      for v, aval in zip(
        kernel.invars[num_in + num_out :],
        physical[num_in + num_out :],
        strict=True,
      )
    ),
    is_ref=tuple(isinstance(v.aval, state.AbstractRef) for v in kernel.invars),
    semaphores=tuple(
      k for k, v in enumerate(kernel.invars) if paths.is_semaphore(v.aval)
    ),
    sparsecores=sparsecores,
  )


def _may_reroute(ctx: mlir.LoweringRuleContext, params) -> bool:
  """Whether a launch whose programs write the same elements may run on the
  checking executor instead (which tells a race from the same bytes): not
  where host callbacks cannot go (an export; a shard_map manual over only
  some axes) nor where ``interpret=True`` asks for the HLO interpreter,
  whose meaning (the last program's bytes) upstream's is."""
  module = ctx.module_context
  if module.lowering_parameters.for_export or params["interpret"] is True:
    return False
  axis_context = module.axis_context
  if isinstance(axis_context, sharding_impls.SPMDAxisContext):
    return bool(paths.manual_axes(axis_context))
  return True


def _fast_programs(num_in: int, params):
  """One pure jaxpr per program, in launch order, axis indices literal; a
  label for each (``mesh 1 program 0 (core=0)``); how many run-time checks
  they make (``bounds.Checks``); the SparseCore each runs on (0 for other
  programs), whose VMEM_SHARED it sees; where two programs write the same
  elements (``static.find_race``; None if none do).

  DMAs and semaphores go through the lockstep path's rewrite: semaphores
  count bytes in int32 (Pallas' discharge rules count elements in int16,
  which several large pending DMAs wrap), and DMA windows are checked.
  """
  meshes = params["meshes"]
  aliases = dict(params["input_output_aliases"])
  num_out = len(params["out_avals"])
  programs, labels, num_checks, sparsecores = [], [], 0, []
  found: list[list[static.Access]] = []  # per program: statically known
  names: list[list[str]] = []  # per program: its kernel's operand names
  kernel_of: list[str] = []  # per program: its kernel (``kern at f.py:3``)
  waits: list[dict[str, list[str]]] = []  # per program: ``_wait_lines``
  # Meshes by position, never `meshes.index(mesh)`: upstream meshes compare
  # with `==`, which is elementwise (and ambiguous) for a multi-core
  # TensorCoreMesh on jax 0.10.2, and a mesh may appear twice.
  kernels = zip(meshes, params["jaxprs"], strict=True)
  for i, (mesh, traced) in enumerate(kernels):
    jaxpr = common.alias_refs(traced, num_in, aliases, mesh, meshes)
    sizes = dict(mesh.shape)
    with prim.tracing_context(mesh, meshes):
      flags = counts.once_flags(jaxpr)
      jaxpr, consts = hlo_interpreter.resolve_physical_types(jaxpr, ())
      if consts:
        raise NotImplementedError("mpmd_map: kernel captured constants")
      jaxpr = jaxpr_util.map_avals(jaxpr, lockstep.widen)
      once = counts.once_by_eqn(jaxpr, flags)
    kernel_names = bounds.operand_names(traced, num_in, num_out, aliases)
    refs = bounds.trace_refs(jaxpr, kernel_names)
    kernel_waits = _wait_lines(jaxpr, refs)
    proven = ranges.prove(jaxpr, sizes, once)
    sparsecore_axis = merge.sparsecore_axis(mesh)
    for program in range(math.prod(sizes.values())):
      values = jaxpr_util.literal_axis_values(sizes, program)
      sparsecores.append(
        0 if sparsecore_axis is None else int(values[sparsecore_axis])
      )
      coords = ", ".join(f"{a}={int(v)}" for a, v in values.items())
      label = f"mesh {i} program {program} ({coords})"
      with prim.tracing_context(mesh, meshes):
        found.append(static.accesses(jaxpr, len(labels), values))
      checks = bounds.Checks(
        traced.debug_info.func_src_info,
        refs,
        proven,
        path="fast path (programs run one after another)",
        where=lambda args, label=label: f", {label}",
      )
      rule = lockstep.sync_rule(
        checks,
        first=jaxpr_util.axis_index_rule(values.get, sizes),
        once=once,
      )
      with prim.tracing_context(mesh, meshes):
        unrolled = jaxpr_util.rewrite(jaxpr, rule)
        programs.append(_jax.discharge_state(_jax.closed_jaxpr(unrolled)))
      labels.append(label)
      names.append(kernel_names)
      waits.append(kernel_waits)
      kernel_of.append(traced.debug_info.func_src_info)
      num_checks += checks.count
  kernel = params["jaxprs"][0]
  operands = num_in + num_out
  out_to_in = {o: i for i, o in aliases.items()}

  def shared(program: int, k: int):
    """Which buffer operand ``k`` of ``program`` is (None: its own)."""
    if k < operands:
      return ("operand", out_to_in.get(k - num_in, k) if k >= num_in else k)
    sharing = _sharing(kernel.invars[k].aval)
    if sharing is _Sharing.DEVICE:
      return k
    if sharing is _Sharing.SPARSECORE:
      return (k, sparsecores[program])
    return None

  both_write = static.find_race(found, shared, labels, names)
  report = _Report(
    tuple(kernel_of), tuple(labels), tuple(map(tuple, names)), tuple(waits)
  )
  return programs, report, num_checks, tuple(sparsecores), both_write


def _uninitialized(aval):
  return _pallas_ops.uninitialized(aval.shape, aval.dtype)


class _Report(NamedTuple):
  """How a failed launch's message names, per program, its kernel, the
  program itself and its operands (``bounds.operand_names``), and where
  its kernel waits on each semaphore (by name: ``_wait_lines``)."""

  kernels: tuple[str, ...]
  labels: tuple[str, ...]
  names: tuple[tuple[str, ...], ...]
  waits: tuple[dict[str, list[str]], ...]


def _wait_lines(jaxpr: core.Jaxpr, refs: bounds.Refs) -> dict[str, list[str]]:
  """Per semaphore operand (by its name in messages), the lines of the
  kernel's waits on it, for a deadlock's message."""
  lines: dict[str, list[str]] = {}
  for eqn, line in jaxpr_util.located(jaxpr):
    kind = _pallas_ops.kind(eqn)
    if kind is _pallas_ops.Sync.DMA_WAIT:
      sem = _pallas_ops.DmaOperands.of(eqn).awaited[1]
    elif kind is _pallas_ops.Sync.SEMAPHORE_WAIT:
      sem = _pallas_ops.SemaphoreWaitOperands.of(eqn).sem
    else:
      continue
    name = refs.names.get(ranges.ref_indexers(sem)[0])
    if name is not None and line and line not in lines.setdefault(name, []):
      lines[name].append(line)
  return lines


def _run_unrolled(*args, programs, num_checks, buffers: _Buffers, report):
  launch = functools.partial(_launch, programs=programs, buffers=buffers)
  error, (outs, stuck) = bounds.checked(launch, num_checks)(*args)
  if buffers.semaphores or error is not None:
    _raise_if_failed(error, stuck, report, buffers.semaphores)
  return outs


def _launch(*args, programs, buffers: _Buffers):
  """Runs the programs one after another; the outputs, and per program
  and semaphore whether it waited on it more than it was signalled, and
  whether it left it counting."""
  b = buffers
  outs = [
    args[b.out_sources[o]] if o in b.out_sources else b.fresh(b.num_in + o, a)
    for o, a in enumerate(b.out_avals)
  ]
  shared = {
    b.shared_key(k, p): _uninitialized(aval)
    for p in range(len(programs))
    for k, (aval, sharing) in enumerate(b.scratch)
    if sharing is not None
  }
  stuck, left = [], []
  for p, program in enumerate(programs):
    outs, program_stuck, program_left = _run_program(
      program, p, args, outs, shared, b
    )
    stuck.append(program_stuck)
    left.append(program_left)
  return outs, (jnp.stack(stuck), jnp.stack(left))  # (programs, semaphores)


def _run_program(program, p: int, args, outs, shared, b: _Buffers):
  """Runs program ``p`` on the inputs, the outputs so far and its scratch
  (writing the buffers it shares back to ``shared``); its outputs, and per
  semaphore whether it is stuck on it and whether it left it counting."""
  num_in, num_out = b.num_in, len(b.out_avals)
  keys = [b.shared_key(k, p) for k in range(len(b.scratch))]
  operands = [
    *args,
    *outs,
    *(
      b.fresh(num_in + num_out + k, aval) if key is None else shared[key]
      for k, ((aval, _), key) in enumerate(zip(b.scratch, keys, strict=True))
    ),
  ]
  # The discharged program returns the final value of each Ref operand.
  updated = iter(words.evaluate(program, *operands))
  operands = [
    next(updated) if r else x for x, r in zip(operands, b.is_ref, strict=True)
  ]
  for k, key in enumerate(keys):
    if key is not None:
      shared[key] = operands[num_in + num_out + k]
  # A wait that found its semaphore short poisoned it: on hardware that
  # program would wait forever.
  stuck = [jnp.any(counts.poisoned(operands[k])) for k in b.semaphores]
  # A scratch semaphore not back to zero at the end: a signal nobody waited
  # for, a DMA nobody awaited (operands carry theirs to the next launch), a
  # negative signal.
  left = [
    jnp.any((operands[k] != 0) & ~counts.poisoned(operands[k]))
    & (k >= num_in + num_out)
    for k in b.semaphores
  ]
  none = jnp.zeros((0,), jnp.bool_)
  return (
    operands[num_in : num_in + num_out],
    jnp.stack(stuck) if stuck else none,
    jnp.stack(left) if left else none,
  )


def _raise_if_failed(
  error, stuck, report: _Report, semaphores: tuple[int, ...]
) -> None:
  """Raises, when the launch has run, the first failed check, or else a
  deadlock naming the stuck programs."""
  failed = jnp.any(stuck[0]) | jnp.any(stuck[1])
  if error is not None:
    failed = jnp.logical_or(failed, bounds.failed(error))
  leaves, treedef = tree_util.tree_flatten(error)
  raise_error = functools.partial(
    _raise_for, report, semaphores, treedef if leaves else None
  )
  # Python runs only to raise: a callback per launch costs milliseconds.
  lax.cond(
    failed,
    lambda: callback.io_callback(raise_error, None, stuck, *leaves),
    lambda: None,
  )


# What each per-program flag of ``_raise_for``'s ``stuck`` pair means, in
# order: the error and its message, ending with the flagged programs.
_SEMAPHORE_FAILURES = (
  (
    watchdog.DeadlockError,
    "mpmd_map deadlock: on the CPU fast path (programs run one after "
    "another), in {}, these programs waited on a semaphore more than it "
    "was signalled, so on hardware they would wait forever:\n",
  ),
  (
    errors.LeftoverError,
    "mpmd_map: on the CPU fast path, {} ended with scratch semaphores not "
    "back to zero (a signal nobody waited for, a DMA whose completion "
    "nobody awaited, or a negative signal):\n",
  ),
)


def _waited_at(waits: dict[str, list[str]], name: str) -> str:
  lines = waits.get(name)
  return f", waited on at {' and '.join(lines)}" if lines else ""


def _raise_for(
  report: _Report, semaphores: tuple[int, ...], treedef, stuck, *leaves
) -> None:
  failure = bounds.first_failure(treedef, leaves)
  if failure is not None:
    raise failure
  for (error, message), flags in zip(_SEMAPHORE_FAILURES, stuck, strict=True):
    lines, kernels = [], []
    deadlock = error is watchdog.DeadlockError
    for p, per_semaphore in enumerate(flags):
      found = [
        report.names[p][k]
        + (_waited_at(report.waits[p], report.names[p][k]) if deadlock else "")
        for k, flagged in zip(semaphores, per_semaphore, strict=True)
        if flagged
      ]
      if found:
        lines.append(f"  {report.labels[p]}: {', '.join(found)}")
        if report.kernels[p] not in kernels:
          kernels.append(report.kernels[p])
    if lines:
      plural = "s" if len(kernels) > 1 else ""
      where = f"kernel{plural} {' and '.join(kernels)}"
      raise error(message.format(where) + "\n".join(lines))
