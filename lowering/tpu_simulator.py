"""The faithful CPU path for TPU meshes: Pallas' threaded TPU simulator.

Two traps of that simulator on jax 0.10.2 are worked around here, narrowly
(docs/design.md, traps 1 and 2):

1. A semaphore signal with neither ``device_id`` nor ``core_index`` (a
   program signalling itself) is delivered to core 0, so programs > 0 that
   signal their own semaphores wait forever. We name the program's own core.
2. HBM / ANY scratch is rejected as kernel scratch (an input must be either an
   input or an output). Such scratch becomes a hidden extra output that the
   caller never sees.
"""

from typing import Any

import jax

from mpmd import _jax, _pallas_ops, _patches
from mpmd._jax import (
  core,
  mlir,
  pallas_core,
  pallas_primitives,
  source_info_util,
  tpu,
  util,
)
from mpmd._lowering import (
  callbacks,
  common,
  host_programs,
  jaxpr_util,
  paths,
  watchdog,
)
from mpmd._primitives import mpmd_map as prim


def _signal_own_core(core_axis):
  """Rule: a local signal without ``core_index`` goes to this program."""

  def rule(eqn, invals):
    if eqn.primitive is not pallas_primitives.semaphore_signal_p:
      return None
    signal = _pallas_ops.SignalOperands.of(eqn, invals)
    if signal.device_id is not None or signal.core_index is not None:
      return None
    core_index = jax.lax.axis_index(core_axis)
    return signal._replace(core_index=core_index).bind(eqn)

  return rule


def _is_hbm(aval) -> bool:
  space = aval.memory_space
  return space in (pallas_core.MemorySpace.ANY, tpu().core.MemorySpace.HBM)


_READ_LOCK_S = 1.0


def _watch_wait(semaphore, value, global_core_id, has_tasks, logging_info):
  """Records a simulated semaphore wait of our launches for the deadlock
  watchdog (None: not ours, it runs as JAX wrote it)."""
  if not watchdog.launch_running():
    return None
  memory = semaphore.shared_memory
  device, core = divmod(int(global_core_id), memory.num_cores_per_device)
  where = ""
  if logging_info is not None and logging_info.source_info is not None:
    where = source_info_util.summarize(logging_info.source_info)
  kind = "DMA semaphore" if has_tasks else "semaphore"

  def abort(message):
    _jax.fail_tpu_simulation(
      memory, watchdog.DeadlockError(message), device, core
    )

  def what() -> str:
    # Worded when the deadlock is reported: what reached it by then (read
    # under the semaphore's lock where it is free, as a waiter leaves it).
    locked = semaphore.cv.acquire(timeout=_READ_LOCK_S)
    try:
      holds = int(semaphore.count_by_core[global_core_id])
    finally:
      if locked:
        semaphore.cv.release()
    return f"on a {kind} for {value} (it holds {holds} now)"

  return watchdog.waiting(
    f"device {device} {watchdog.describe_program(core)}",
    what,
    where,
    abort,
  )


def _reset_if_failed() -> None:
  if _jax.tpu_simulator_failure() is not None:
    tpu().simulator.reset_tpu_interpret_mode_state()


def _races_found() -> bool:
  races = tpu().simulator.races
  return races is not None and races.races_found


def lower(
  ctx: mlir.LoweringRuleContext,
  *in_nodes,
  mesh: Any,
  jaxpr: core.Jaxpr,
  interpret: Any,
  params: dict[str, Any],
  ranges: tuple[watchdog.MeshRange, ...] | None = None,
):
  """Lowers one (possibly merged) TPU mesh kernel to the simulator.

  ``ranges`` says which programs belong to which of the user's meshes (for
  error messages); by default, all to mesh 0.
  """
  num_in, num_out = len(in_nodes), len(params["out_avals"])
  if paths.semaphore_operands(jaxpr, num_in + num_out):
    # Pallas' simulator gives every semaphore operand a fresh semaphore and
    # cannot read a count back out of a kernel (no semaphore_read).
    raise NotImplementedError(
      "mpmd_map: semaphores as inputs or outputs of a launch in the TPU "
      "simulator (interpret=pltpu.InterpretParams()): it cannot carry a "
      "semaphore's count from one launch to the next. The CPU fallback's "
      "default paths can: pass interpret=None."
    )
  _patches.watch_tpu_semaphore_waits(_watch_wait)
  host_programs.install()
  callbacks.install()
  [core_axis] = mesh.shape
  with prim.tracing_context(mesh, params["meshes"]):
    jaxpr = jaxpr_util.rewrite(jaxpr, _signal_own_core(core_axis))

  # Trap 2: HBM scratch moves behind the outputs.
  ins, outs, scratch = util.split_list(jaxpr.invars, [num_in, num_out])
  hidden = [v for v in scratch if _is_hbm(v.aval)]
  if hidden:
    kept = [v for v in scratch if not _is_hbm(v.aval)]
    jaxpr = jaxpr.replace(invars=[*ins, *outs, *hidden, *kept])
    hidden_avals = [v.aval.inner_aval for v in hidden]
    params = dict(params, out_avals=(*params["out_avals"], *hidden_avals))
  pallas_params = common.pallas_params(mesh, jaxpr, ctx, params)
  if ranges is None:
    ranges = (watchdog.MeshRange(0, dict(mesh.shape), 0),)

  interpret, races_are_errors = _jax.race_params(interpret)

  def run(*args):
    results = tpu().simulator.interpret_pallas_call(
      *args, interpret_params=interpret, **pallas_params
    )
    return results[:num_out]

  return watchdog.lower_supervised(
    ctx,
    in_nodes,
    ranges=ranges,
    run=run,
    reset=_reset_if_failed,
    original_failure=_jax.tpu_simulator_failure,
    races_found=_races_found,
    detect_races=interpret.detect_races,
    races_are_errors=races_are_errors,
    orders="semaphores or DMA waits",
    simulator_effects=pallas_core.get_interpret_effects(interpret),
  )
