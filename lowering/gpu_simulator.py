"""The faithful CPU path for GPU meshes: Pallas' Mosaic GPU simulator.

Besides running the kernel, it records barrier waits for the deadlock
watchdog (a simulated barrier wait otherwise blocks forever) and turns the
race detector's verdict into an error.
"""

import contextlib
import threading
from typing import Any

from mpmd import _jax, _patches
from mpmd._jax import core, gpu, mlir, pallas_core, source_info_util
from mpmd.lowering import (
  callbacks,
  common,
  host_programs,
  warps,
  watchdog,
)


@contextlib.contextmanager
def _watched(barrier, device, program, logging_info):
  where = ""
  if logging_info is not None and logging_info.source_info is not None:
    where = source_info_util.summarize(logging_info.source_info)

  def notify():
    with barrier.cv:
      barrier.cv.notify_all()

  raise_here = watchdog.raise_in_thread(threading.get_ident(), notify)

  def abort(message):
    _aborted.set()
    raise_here(message)

  with (
    watchdog.reraise_with_message(),
    watchdog.waiting(
      f"device {device} {watchdog.describe_program(program)}",
      f"on a barrier (phase {barrier.phase})",
      where,
      abort,
    ),
  ):
    yield


def _watch_wait(barrier, device, program, logging_info):
  """Records a simulated barrier wait of our launches for the deadlock
  watchdog (None: not ours, it runs as JAX wrote it)."""
  if not watchdog.launch_running():
    return None
  return _watched(barrier, device, program, logging_info)


_aborted = threading.Event()


def _reset_if_failed() -> None:
  if _aborted.is_set():
    gpu().simulator_callbacks.reset_gpu_interpret_mode_state()
    _aborted.clear()


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
  jaxpr = warps.sequential(jaxpr, mesh)
  # Barriers as kernel scratch fail in the simulator (docs/design.md,
  # trap 6); the rest
  # stays kernel scratch, which the simulator allocates at its logical
  # shape, given its layout transforms.
  jaxpr, kept = common.scoped_scratch(
    jaxpr, num_operands, mesh, params["meshes"], _is_barrier
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

  return watchdog.lower_supervised(
    ctx,
    in_nodes,
    ranges=ranges,
    run=run,
    reset=_reset_if_failed,
    original_failure=lambda: None,  # this simulator keeps none
    races_found=_jax.gpu_simulator_races_found,
    detect_races=interpret.detect_races,
    races_are_errors=races_are_errors,
    orders="barriers",
    simulator_effects=pallas_core.get_interpret_effects(interpret),
  )
