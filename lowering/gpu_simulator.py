"""The faithful CPU path for GPU meshes: Pallas' Mosaic GPU simulator.

Besides running the kernel, it records barrier waits for the deadlock
watchdog (a simulated barrier wait otherwise blocks forever) and turns the
race detector's verdict into an error.
"""

import functools
import threading
from typing import Any

from mpmd._jax import (
  core,
  gpu,
  mlir,
  pallas_core,
  pallas_primitives,
  source_info_util,
)
from mpmd.lowering import callbacks, common, watchdog
from mpmd.primitives import mpmd_map as prim


@functools.cache
def _install_wait_hook() -> None:
  barrier = gpu().simulator_memory.Barrier
  original = barrier.wait

  @functools.wraps(original)
  def wait(self, device_id, local_thread_id, logging_info=None):
    where = ""
    if logging_info is not None and logging_info.source_info is not None:
      where = source_info_util.summarize(logging_info.source_info)

    def notify():
      with self.cv:
        self.cv.notify_all()

    raise_here = watchdog.raise_in_thread(threading.get_ident(), notify)

    def abort(message):
      _aborted.set()
      raise_here(message)

    with (
      watchdog.reraise_with_message(),
      watchdog.waiting(
        f"device {device_id} {watchdog.describe_program(int(local_thread_id))}",
        f"on a barrier (phase {self.phase})",
        where,
        abort,
      ),
    ):
      return original(self, device_id, local_thread_id, logging_info)

  barrier.wait = wait


_aborted = threading.Event()


def _reset_if_failed() -> None:
  if _aborted.is_set():
    gpu().simulator_callbacks.reset_gpu_interpret_mode_state()
    _aborted.clear()


def _races_found() -> bool:
  races = gpu().simulator_callbacks._races
  return races is not None and races.races_found


def _is_barrier(aval) -> bool:
  return isinstance(aval.inner_aval.dtype, gpu().core.BarrierType)


def _scoped_barriers(jaxpr, num_operands, transforms, mesh, meshes):
  """Barrier scratch -> one collective ``run_scoped`` over the warpgroups.

  The simulator cannot take barriers as kernel scratch on jax 0.10.2 ("nan +
  barrier"); a scope collective over the thread axis is the same allocation,
  shared by every warpgroup of the block.
  """
  scratch = [v.aval for v in jaxpr.invars[num_operands:]]
  barriers = [i for i, a in enumerate(scratch) if _is_barrier(a)]
  if not barriers or mesh.thread_name is None:
    return jaxpr, tuple(transforms)
  kept = [i for i in range(len(scratch)) if i not in barriers]
  types = [
    pallas_core.MemoryRef(scratch[i].inner_aval, scratch[i].memory_space)
    for i in barriers
  ]

  def body(*refs):
    operands, kept_refs = refs[:num_operands], refs[num_operands:]

    def scoped(*barrier_refs):
      all_scratch = [None] * len(scratch)
      for i, r in zip(kept, kept_refs, strict=True):
        all_scratch[i] = r
      for i, r in zip(barriers, barrier_refs, strict=True):
        all_scratch[i] = r
      core.eval_jaxpr(jaxpr, (), *operands, *all_scratch)

    pallas_primitives.run_scoped(
      scoped, *types, collective_axes=mesh.thread_name
    )
    return ()

  avals = [v.aval for v in jaxpr.invars[:num_operands]]
  avals += [scratch[i] for i in kept]
  new = prim.retrace(jaxpr, mesh, (*meshes, mesh), body, avals)
  return new, tuple(transforms[i] for i in kept)


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
  _install_wait_hook()
  callbacks.install()
  num_operands = len(in_nodes) + len(params["out_avals"])
  transforms = params["scratch_transforms"]
  jaxpr, transforms = _scoped_barriers(
    jaxpr, num_operands, transforms, mesh, params["meshes"]
  )
  pallas_params = common.pallas_params(mesh, jaxpr, ctx, params)
  pallas_params["kernel_arg_transforms"] = ((),) * num_operands + transforms
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
    races_found=_races_found,
    detect_races=interpret.detect_races,
    orders="barriers",
  )
