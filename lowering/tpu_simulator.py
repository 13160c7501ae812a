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

import re
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
  errors,
  host_programs,
  jaxpr_util,
  paths,
  supervised,
  tpu_semaphores,
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
  named = watchdog.name_semaphore(semaphore.id)
  if named is not None:
    kind = f"the {kind} {named.label}"
    if not where and named.lines:
      # The kernel lines that wait on this semaphore (the simulator does not
      # say which one waits).
      lines = named.lines
      where = lines[0] if len(lines) == 1 else f"one of {', '.join(lines)}"
  else:
    kind = f"a {kind}"

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
    return f"on {kind} for {value} (it holds {holds} now)"

  return watchdog.waiting(
    f"device {device} {watchdog.describe_program(core)}",
    what,
    where,
    abort,
  )


_AT_BARRIER = {
  "start": "at the launch's start for every device to begin it",
  "end": "at the launch's end for every device to finish it",
}


def _watch_barrier(which: str, device_id):
  """Records a device of our launches waiting at one of the simulator's
  barriers among devices for the deadlock watchdog: a device whose
  computation failed before the launch never comes to either."""
  if not watchdog.launch_running():
    return None
  memory = _jax.tpu_simulator_memory()
  device = int(device_id)

  def abort(message):
    _jax.fail_tpu_simulation(memory, watchdog.DeadlockError(message), device, 0)
    if which == "end":  # the simulator's failure does not break it
      _jax.release_tpu_simulator_clean_up()

  return watchdog.waiting(f"device {device}", _AT_BARRIER[which], "", abort)


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
  _patches.watch_tpu_simulator_barriers(_watch_barrier)
  host_programs.install()
  callbacks.install()
  [core_axis] = mesh.shape
  with prim.tracing_context(mesh, params["meshes"]):
    jaxpr = jaxpr_util.rewrite(jaxpr, _signal_own_core(core_axis))

  # Trap 2: HBM scratch moves behind the outputs.
  ins, outs, scratch = util.split_list(jaxpr.invars, [num_in, num_out])
  hidden = [i for i, v in enumerate(scratch) if _is_hbm(v.aval)]
  kept = [i for i, v in enumerate(scratch) if not _is_hbm(v.aval)]
  describe = _out_of_bounds_in_user_terms(params, num_in, scratch, hidden)
  semaphore_name = tpu_semaphores.namer(params, num_in, scratch)
  if hidden:
    moved = [scratch[i] for i in hidden]
    jaxpr = jaxpr.replace(
      invars=[*ins, *outs, *moved, *(scratch[i] for i in kept)]
    )
    hidden_avals = [v.aval.inner_aval for v in moved]
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

  return supervised.lower_supervised(
    ctx,
    in_nodes,
    ranges=ranges,
    run=run,
    reset=_reset_if_failed,
    original_failure=_jax.tpu_simulator_failure,
    abandon=_jax.fail_tpu_simulator_device,
    release_absent=_jax.release_tpu_simulator_clean_up,
    races_found=_races_found,
    detect_races=interpret.detect_races,
    races_are_errors=races_are_errors,
    orders="semaphores or DMA waits",
    simulator_effects=pallas_core.get_interpret_effects(interpret),
    describe=describe,
    semaphore_name=semaphore_name,
  )


# -- the TPU simulator's buffers, in the user's terms --------------------------

# The TPU simulator numbers the buffers of each device and core from this id
# on, in the order it allocates them: the launch's inputs, its outputs not
# aliased to an input (HBM), then the kernel's operands outside HBM.
FIRST_BUFFER_ID = 100

# "Out-of-bounds read of (device core memory-space buffer-id): ..." (an
# IndexError, 0.12: a ValueError for a write or swap): its only record of
# the buffer, so the one route to the operand it belongs to.
_TPU_BUFFER = re.compile(r"^Out-of-bounds [\w ]+? of \(\d+ \d+ (\w+) (\d+)\)")


def _out_of_bounds_in_user_terms(params, num_in: int, scratch, hidden):
  """The launch's ``describe`` for the watchdog: the simulator's
  out-of-bounds report as an ``OutOfBoundsError`` naming the operand (its
  Ref's name, role and type) the access touched, and the kernel.

  ``scratch``: the kernel's scratch operands; ``hidden``: those in HBM,
  which the simulator gets as extra outputs (docs/design.md, trap 2), by
  scratch index.
  """
  labels = common.operand_labels(params, num_in)
  num_out = len(params["out_avals"])
  aliased = set(dict(params["input_output_aliases"]).values())
  scratch_labels = labels[num_in + num_out :]
  order = labels[:num_in]  # HBM buffers: inputs, then outputs not aliased
  order += [labels[num_in + j] for j in range(num_out) if j not in aliased]
  order += [scratch_labels[i] for i in hidden]
  # Then a buffer per operand outside HBM (inputs and outputs are in HBM).
  order += [
    scratch_labels[i]
    for i, v in enumerate(scratch)
    if i not in hidden and _has_buffer(v.aval)
  ]
  by_id = {FIRST_BUFFER_ID + n: label for n, label in enumerate(order)}
  kernel = common.kernel_name(params)

  def describe(error):
    if not isinstance(error, (IndexError, ValueError)):
      return None
    found = _TPU_BUFFER.search(str(error))
    if found is None:
      return None
    space, buffer_id = found.group(1), int(found.group(2))
    label = by_id.get(buffer_id, f"the simulator's {space} buffer {buffer_id}")
    return errors.OutOfBoundsError(
      "mpmd_map: a simulated access out of bounds (hardware faults) in "
      f"kernel {kernel}, on {label}: {error}"
    )

  return describe


def _has_buffer(aval) -> bool:
  """Whether the TPU simulator gives a scratch operand of ``aval`` a
  buffer (semaphores it counts apart)."""
  return aval.memory_space is not tpu().core.MemorySpace.SEMAPHORE
