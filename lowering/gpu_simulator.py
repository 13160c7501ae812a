"""The faithful CPU path for GPU meshes: Pallas' Mosaic GPU simulator.

Besides running the kernel, it records barrier waits for the deadlock
watchdog (a simulated barrier wait otherwise blocks forever) and turns the
race detector's verdict into an error.
"""

import contextlib
import re
from typing import Any

from mpmd import _jax, _patches
from mpmd._jax import core, gpu, mlir, pallas_core, source_info_util
from mpmd._lowering import (
  callbacks,
  common,
  errors,
  host_programs,
  jaxpr_util,
  supervised,
  warps,
  watchdog,
)
from mpmd._primitives import mpmd_map as prim


@contextlib.contextmanager
def _watched(barrier, device, program, logging_info):
  where = ""
  if logging_info is not None and logging_info.source_info is not None:
    where = source_info_util.summarize(logging_info.source_info)
  with watchdog.waiting(
    f"device {device} {watchdog.describe_program(program)}",
    f"on a barrier (phase {barrier.phase})",
    where,
    lambda message: _jax.abort_gpu_barrier(barrier),
  ):
    try:
      yield
    except Exception as e:
      # The watchdog ended the wait (the barrier raises for its waiters):
      # the launch's deadlock is this wait's error.
      deadlock = watchdog.running_deadlock()
      if deadlock is not None:
        raise deadlock from None
      passed = _PHASE_PASSED.search(str(e))
      if passed is None:
        raise
      who = f"device {device} {watchdog.describe_program(program)}"
      raise _PhasePassed(who, where, int(passed.group(1))) from None


# The simulators' words (jax 0.10.2 and 0.12) for a wait on a barrier that
# has completed phases its waiter did not wait for.
_PHASE_PASSED = re.compile(r"barrier is already at phase (\d+)")


class _PhasePassed(Exception):
  """A barrier wait two or more phases behind its barrier (more arrivals
  than its ``num_arrivals``, or a wait skipped): raised by the wait, worded
  for the user by the launch's ``describe``, which knows the kernel."""

  def __init__(self, who: str, where: str, phase: int):
    super().__init__(who, where, phase)
    self.who, self.where, self.phase = who, where, phase

  def describe(self, kernel: str) -> errors.DeadlockError:
    return errors.DeadlockError(
      f"mpmd_map: kernel {kernel}: {self.who} waits on a barrier at "
      f"{self.where or 'an unknown line'} for a phase that the barrier has "
      f"already completed (it is at phase {self.phase}): more warpgroups "
      "arrive on it than its num_arrivals counts, or this one skipped a "
      "wait. On hardware a wait on its parity then blocks for good (or "
      "passes a phase early). interpret=mpmd.CheckParams() names the "
      "barrier."
    )


# 0.12's simulator, when a barrier completes a second phase before any
# warpgroup waited for the first: the bug of ``_PhasePassed`` (more
# arrivals than ``num_arrivals``), seen by the arriving thread when it
# runs before every waiter (thread timing decides which one reports).
_UNOBSERVED = re.compile(
  r"Barrier completed phase (\d+), but no threads observed"
)


def _unobserved(
  error: BaseException, kernel: str
) -> errors.DeadlockError | None:
  """``error`` (the simulator's) as the deadlock it means, if it is the
  arriving thread's report above; else None."""
  found = (
    _UNOBSERVED.search(str(error)) if isinstance(error, ValueError) else None
  )
  if found is None:
    return None
  phase = int(found.group(1))
  return errors.DeadlockError(
    f"mpmd_map: kernel {kernel}: a barrier completed phase {phase} before "
    f"any warpgroup waited for phase {phase - 1}: more warpgroups arrive on "
    "it than its num_arrivals counts, or the waits were skipped. On "
    "hardware a wait on its parity then blocks for good (or passes a phase "
    "early). interpret=mpmd.CheckParams() names the barrier."
  )


def _watch_wait(barrier, device, program, logging_info):
  """Records a simulated barrier wait of our launches for the deadlock
  watchdog (None: not ours, it runs as JAX wrote it)."""
  if not watchdog.launch_running():
    return None
  return _watched(barrier, device, program, logging_info)


def _reset() -> None:
  # Each launch starts from a fresh simulator: a failed one leaves its state
  # behind, and jax 0.10.2's numbers buffers on from the last launch's
  # (out-of-bounds reports name operands by the numbers of this launch).
  gpu().simulator_callbacks.reset_gpu_interpret_mode_state()


def _runnable(jaxpr: core.Jaxpr, mesh) -> core.Jaxpr:
  """``jaxpr`` in terms this jax's simulator runs (itself where it runs it
  all): jax 0.10.2's has no rule for warp maps (run one warp after another,
  :mod:`mpmd._lowering.warps`) nor for ``plgpu.layout_cast``, which changes
  no value (0.12's simulator skips it too)."""
  layout_cast = gpu().core.layout_cast_p
  casts = not _jax.GPU_SIMULATOR_RUNS_LAYOUT_CASTS and any(
    eqn.primitive is layout_cast for eqn in jaxpr_util.iter_eqns(jaxpr)
  )
  maps = not _jax.GPU_SIMULATOR_RUNS_WARP_MAPS and warps.has_warp_map(jaxpr)
  if not (casts or maps):
    return jaxpr

  def rule(eqn, invals):
    if casts and eqn.primitive is layout_cast:
      return [invals[0]]
    return warps.sequential_rule(eqn, invals) if maps else None

  def body(*refs):
    return jaxpr_util.eval_with_rule(jaxpr, (), refs, rule)

  return prim.retrace(jaxpr, mesh, (mesh,), body)


def _is_barrier(aval) -> bool:
  return isinstance(aval.inner_aval.dtype, gpu().core.BarrierType)


def lower(
  ctx: mlir.LoweringRuleContext,
  *in_nodes,
  mesh: Any,
  jaxpr: core.Jaxpr,
  interpret: Any,
  params: dict[str, Any],
  ranges: tuple[watchdog.MeshRange, ...] | None = None,
):
  """Lowers one (possibly merged) GPU mesh kernel to the simulator."""
  _patches.watch_gpu_barrier_waits(_watch_wait)
  _patches.let_gpu_simulator_take_numpy()
  host_programs.install()
  callbacks.install()
  num_operands = len(in_nodes) + len(params["out_avals"])
  jaxpr = _runnable(jaxpr, mesh)
  # Barriers as kernel scratch fail in the simulator (docs/design.md,
  # trap 6); the rest stays kernel scratch, which the simulator allocates
  # at its logical shape, given its layout transforms.
  jaxpr, kept = common.scoped_scratch(
    jaxpr, num_operands, mesh, params["meshes"], _is_barrier
  )
  describe = _out_of_bounds_in_user_terms(
    params, len(in_nodes), jaxpr.invars, kept
  )
  transforms = tuple(params["scratch_transforms"][i] for i in kept)
  pallas_params = common.pallas_params(mesh, jaxpr, ctx, params)
  pallas_params["kernel_arg_transforms"] = ((),) * num_operands + transforms
  interpret, races_are_errors = _jax.race_params(interpret)
  if ranges is None:
    thread_axis = (
      {mesh.thread_name: mesh.num_threads} if mesh.num_threads else {}
    )
    ranges = (watchdog.MeshRange(0, thread_axis, 0),)

  def run(*args):
    return gpu().simulator.interpret_pallas_call(
      *args, interpret_params=interpret, **pallas_params
    )

  return supervised.lower_supervised(
    ctx,
    in_nodes,
    ranges=ranges,
    run=run,
    reset=_reset,
    original_failure=lambda: None,  # this simulator keeps none
    races_found=_jax.gpu_simulator_races_found,
    detect_races=interpret.detect_races,
    races_are_errors=races_are_errors,
    orders="barriers",
    simulator_effects=pallas_core.get_interpret_effects(interpret),
    describe=describe,
  )


def _out_of_bounds_in_user_terms(params, num_in: int, invars, kept):
  """The launch's ``describe`` for the watchdog: the simulator's
  out-of-bounds report, naming the operand (its Ref's name, role and type)
  and the kernel instead of the simulator's buffer key."""
  labels = common.operand_labels(params, num_in)
  num_out = len(params["out_avals"])
  num_operands = num_in + num_out
  aliased = set(dict(params["input_output_aliases"]).values())
  # The simulator's order of allocation (see FIRST_BUFFER_ID).
  order = labels[:num_in]
  order += [labels[num_in + j] for j in range(num_out) if j not in aliased]
  kernel_operands = [*range(num_operands), *(num_operands + i for i in kept)]
  order += [
    labels[k]
    for k, v in zip(kernel_operands, invars, strict=True)
    if not _is_gmem(v.aval)
  ]
  scoped = [i for i in range(len(labels) - num_operands) if i not in kept]
  order += [labels[num_operands + i] for i in scoped]
  first = FIRST_BUFFER_ID
  by_id = {first + n: label for n, label in enumerate(order)}
  kernel = common.kernel_name(params)

  def describe(error):
    if isinstance(error, _PhasePassed):
      return error.describe(kernel)
    unobserved = _unobserved(error, kernel)
    if unobserved is not None:
      return unobserved
    found = _out_of_bounds(error)
    if found is None:
      return None
    buffer_id, report = found
    label = by_id.get(
      buffer_id,
      "a buffer the kernel allocated as it ran (pl.run_scoped scratch, "
      f"a barrier; the simulator's buffer {buffer_id})",
    )
    return errors.OutOfBoundsError(
      "mpmd_map: a simulated access out of bounds (hardware faults) in "
      f"kernel {kernel}: {report.replace('{key}', label)}"
    )

  return describe


def _out_of_bounds(error: BaseException) -> tuple[int, str] | None:
  """``(buffer id, report)`` if ``error`` is the Mosaic GPU simulator's
  report of an out-of-bounds access, else None.

  The simulator raises a plain IndexError (0.12: a ValueError for an
  element-wise swap) whose only record of the buffer is the allocation key
  in its text, ``HostAllocationKey(..., buffer_id=N)``: that text is the
  one route to it. ``report`` is the text with the key cut out (``{key}``
  where it was), for the caller to name the buffer there.
  """
  if not isinstance(error, (IndexError, ValueError)):
    return None
  text = str(error)
  if not text.startswith("Out-of-bounds"):
    return None
  found = _GPU_ALLOCATION_KEY.search(text)
  if found is None:
    return None
  report = text[: found.start()] + "{key}" + text[found.end() :]
  return int(found.group(1)), report


_GPU_ALLOCATION_KEY = re.compile(r"HostAllocationKey\([^()]*buffer_id=(\d+)\)")


# -- the Mosaic GPU simulator's buffers, in the user's terms -----------------

# The Mosaic GPU simulator numbers each launch's buffers from this id on, in
# the order it allocates them: the inputs, the outputs not aliased to an
# input, the kernel's other operands outside GMEM, then what the kernel
# allocates as it runs (scoped scratch, barriers).
FIRST_BUFFER_ID = 100


def _is_gmem(aval) -> bool:
  """Whether the Mosaic GPU simulator keeps a kernel operand of ``aval`` in
  the GMEM buffer of the launch's input or output (else its own buffer)."""
  space = getattr(aval, "memory_space", None)
  return gpu().simulator_callbacks.is_gmem_memory_space(space)
