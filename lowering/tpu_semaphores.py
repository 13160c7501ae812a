"""The TPU simulator's semaphores in the user's terms, for deadlock reports.

The simulator knows a semaphore by an id and a wait by its semaphore and
count; a deadlock report names the kernel's operand instead ("semaphore
'ready' (scratch 1, sem[])") and the kernel lines that wait on it. And the
barrier semaphore's collective id, as Mosaic checks it.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import jax

from mpmd import _pallas_ops
from mpmd._jax import core, source_info_util, tpu
from mpmd._lowering import bounds, common, jaxpr_util
from mpmd._pallas_ops import Sync

# The TPU simulator numbers each core's semaphores from this id on, in the
# order it allocates them: the kernel's semaphore operands (one id per
# element of an array of semaphores), then those the kernel allocates as it
# runs (``pl.run_scoped``).
FIRST_SEMAPHORE_ID = 2000


class Named(NamedTuple):
  """A semaphore as the user knows it."""

  label: str  # "'ready' (scratch 1, sem[])"
  lines: tuple[str, ...] = ()  # the kernel lines that wait on it


def namer(params, num_in: int, scratch) -> Callable[[int], Named]:
  """``name(semaphore id)`` for a launch whose kernel scratch is
  ``scratch`` (the operands, as the simulator gets them, in their order)."""
  labels = common.operand_labels(params, num_in)
  first_scratch = num_in + len(params["out_avals"])
  waits = _wait_lines(params)
  by_id = {}
  for i, v in enumerate(scratch):
    if v.aval.memory_space is not tpu().core.MemorySpace.SEMAPHORE:
      continue
    shape = v.aval.inner_aval.shape
    label = labels[first_scratch + i]
    lines = tuple(waits.get(first_scratch + i, ()))
    for k in range(math.prod(shape)):
      index = f"[{k}] of " if shape else ""
      by_id[FIRST_SEMAPHORE_ID + len(by_id)] = Named(index + label, lines)

  collective_id = getattr(params["compiler_params"], "collective_id", None)
  if collective_id is not None:
    # The simulator's barrier semaphore has the collective id as its id.
    by_id[int(collective_id)] = Named(
      "of the launch's barrier (pltpu.get_barrier_semaphore(), collective "
      f"id {collective_id})"
    )

  def name(semaphore_id: int) -> Named:
    return by_id.get(
      semaphore_id,
      Named(f"{semaphore_id} the kernel allocated as it ran (pl.run_scoped)"),
    )

  return name


def _wait_lines(params) -> dict[int, list[str]]:
  """Operand position -> the kernel lines (``file:line``) that wait on it,
  in every mesh's kernel."""
  lines: dict[int, list[str]] = {}
  for jaxpr in common.user_jaxprs(params):
    positions = [str(k) for k in range(len(jaxpr.invars))]
    refs = bounds.trace_refs(jaxpr, positions)
    for eqn in jaxpr_util.iter_eqns(jaxpr):
      sem = _awaited_semaphore(eqn)
      sem = getattr(sem, "ref", sem)
      if not isinstance(sem, core.Var):
        continue
      position = refs.names.get(sem)
      if not isinstance(position, str) or not position.isdigit():
        continue
      where = source_info_util.summarize(eqn.source_info)
      at = lines.setdefault(int(position), [])
      if where not in at:
        at.append(where)
  return lines


def _awaited_semaphore(eqn):
  kind = _pallas_ops.kind(eqn)
  if kind is Sync.SEMAPHORE_WAIT:
    return _pallas_ops.SemaphoreWaitOperands.of(eqn).sem
  if kind is Sync.DMA_WAIT:
    return _pallas_ops.DmaOperands.of(eqn).awaited[1]
  return None


def check_collective_id(params) -> None:
  """What Mosaic rejects of a TPU launch's collective id (with JAX's
  default ``jax_pallas_auto_assign_collective_ids='no'``), rejected on the
  CPU fallback too: the barrier semaphore without one, or one without the
  barrier semaphore. A launch that asks for upstream's TPU simulator
  (``interpret=pltpu.InterpretParams()``) runs as it does upstream:
  unchecked."""
  mode = getattr(jax.config, "jax_pallas_auto_assign_collective_ids", "no")
  simulated = isinstance(params["interpret"], tpu().interpret.InterpretParams)
  if mode != "no" or simulated:
    return
  compiler_params = params["compiler_params"]
  collective_id = getattr(compiler_params, "collective_id", None)
  barrier = any(
    _pallas_ops.kind(eqn) is Sync.BARRIER_SEMAPHORE
    for jaxpr in common.user_jaxprs(params)
    for eqn in jaxpr_util.iter_eqns(jaxpr)
  )
  kernel = common.kernel_name(params)
  if barrier and collective_id is None:
    raise ValueError(
      f"mpmd_map: kernel {kernel} uses the barrier semaphore "
      "(pltpu.get_barrier_semaphore()) but compiler_params gives no "
      "collective_id, which Mosaic rejects on TPU (collective_id has to "
      "be specified when using a custom barrier): pass "
      "compiler_params=pltpu.CompilerParams(collective_id=0)"
    )
  allowed = getattr(
    compiler_params, "allow_collective_id_without_custom_barrier", False
  )
  if not barrier and collective_id is not None and not allowed:
    raise ValueError(
      f"mpmd_map: kernel {kernel} has collective_id={collective_id} in its "
      "compiler_params but uses no barrier semaphore, which Mosaic rejects "
      "on TPU (collective_id has to be unspecified or None when not using "
      "a custom barrier): drop it, or pass "
      "allow_collective_id_without_custom_barrier=True"
    )
