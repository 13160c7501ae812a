"""Which way the CPU fallback runs a launch, and why.

* ``fast``: programs unrolled one after another through the HLO interpreter,
  axis indices as literals, state discharged. Exact for kernels whose
  programs do not synchronise with each other (local DMAs and a program's
  own semaphores are fine: they complete in program order).
* ``lockstep``: kernels that synchronise devices of a ``shard_map`` through
  remote DMAs and semaphores, issued by every device in step: discharged
  like the fast path, each remote operation an XLA collective
  (``mpmd._lowering.lockstep``).
* ``tpu-simulator`` / ``gpu-simulator``: Pallas' threaded simulators, one
  thread per program, with simulated memories, DMAs, semaphores, barriers.
* ``check``: our checking executor (``mpmd._lowering.check``): every program
  under one deterministic, seeded scheduler, with oracles for deadlocks,
  races, uninitialised reads and leftovers.
"""

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from mpmd import _jax, _pallas_ops
from mpmd._jax import (
  core,
  mlir,
  pallas_core,
  pallas_primitives,
  sharding_impls,
)
from mpmd._lowering import addressing, jaxpr_util
from mpmd._pallas_ops import Sync


class Kind(enum.StrEnum):
  """The ways the CPU fallback runs a launch (the module docstring says
  each); a ``str``, so messages and ``kind == "fast"`` read as before."""

  FAST = "fast"
  LOCKSTEP = "lockstep"
  TPU_SIMULATOR = "tpu-simulator"
  GPU_SIMULATOR = "gpu-simulator"
  CHECK = "check"


FAST = Kind.FAST
LOCKSTEP = Kind.LOCKSTEP
TPU_SIMULATOR = Kind.TPU_SIMULATOR
GPU_SIMULATOR = Kind.GPU_SIMULATOR
CHECK = Kind.CHECK
KINDS = tuple(Kind)


@dataclasses.dataclass(frozen=True)
class Path:
  """How the CPU fallback runs a launch: decided once, where the launch is
  traced (:func:`choose`), and carried as the ``cpu_path`` param of
  ``mpmd_map_p``; its effects and the CPU lowering follow from it."""

  kind: Kind
  reason: str
  # The simulator's settings (None on the fast and lockstep paths).
  params: Any = None
  # The lockstep path: the enclosing shard_map's axes (its devices exchange
  # data along them).
  manual_axes: tuple[core.AxisName, ...] = ()


def is_semaphore(aval: core.AbstractValue) -> bool:
  """A Ref of (DMA / regular / barrier) semaphores."""
  inner = getattr(aval, "inner_aval", None)
  dtype = getattr(inner, "dtype", None)
  return dtype is not None and jnp.issubdtype(
    dtype, _jax.pallas_core.semaphore_dtype
  )


def is_semaphore_array(aval: core.AbstractValue) -> bool:
  """A launch's semaphore input or output (a value, not a Ref)."""
  dtype = getattr(aval, "dtype", None)
  return dtype is not None and jnp.issubdtype(
    dtype, _jax.pallas_core.semaphore_dtype
  )


def semaphore_operands(jaxpr: core.Jaxpr, num_operands: int) -> tuple[int, ...]:
  """The positions of the semaphores among a kernel's first
  ``num_operands`` operands (its inputs and outputs)."""
  return tuple(
    k for k, v in enumerate(jaxpr.invars[:num_operands]) if is_semaphore(v.aval)
  )


def check_semaphore_operands(
  jaxprs: Sequence[core.Jaxpr],
  meshes: Sequence[pallas_core.Mesh],
  num_operands: int,
) -> None:
  """Raises for semaphore inputs / outputs no CPU path can carry.

  A semaphore that crosses launches holds the count its launch left (bytes
  of in-flight DMAs, or signals not yet waited), which the next launch
  takes over. The CPU paths carry that count for a launch of one program
  per device: with several, each core has its own semaphores, and whose
  count the operand holds is not defined.
  """
  if not semaphore_operands(jaxprs[0], num_operands):
    return
  if any(is_gpu_mesh(m) for m in meshes):
    raise NotImplementedError(
      "mpmd_map: TPU semaphores as inputs or outputs of a launch on GPU "
      "meshes (GPU programs synchronise through barriers)"
    )
  programs = sum(math.prod(dict(m.shape).values()) for m in meshes)
  if programs != 1:
    raise NotImplementedError(
      "mpmd_map: semaphores as inputs or outputs of a launch of several "
      f"programs (this one runs {programs}) on the CPU fallback: each core "
      "holds its own semaphores, so whose count crosses the launch is not "
      "defined; pass counts between launches of one program"
    )


def is_gpu_mesh(mesh: pallas_core.Mesh) -> bool:
  # Without the Mosaic GPU backend there are no GPU meshes to recognise.
  try:
    return isinstance(mesh, _jax.gpu().core.Mesh)
  except ImportError:
    return False


# SparseCore primitives that synchronise subcores, which neither the HLO
# interpreter nor the TPU simulator implements.
_UNSIMULATED = (Sync.SUBCORE_BARRIER, Sync.FETCH_AND_ADD)


def sync_reason(
  jaxprs: Sequence[core.Jaxpr], meshes: Sequence[pallas_core.Mesh] = ()
) -> str | None:
  """Why programs of these kernels may wait on each other (None if never)."""
  for i, jaxpr in enumerate(jaxprs):
    if _spins(jaxpr):
      # The fast path would loop forever where nobody signals.
      return "it reads a semaphore inside a while loop (it may spin)"
    for eqn in jaxpr_util.iter_eqns(jaxpr):
      name, kind = eqn.primitive.name, _pallas_ops.kind(eqn)
      if kind in (Sync.DMA_START, Sync.DMA_WAIT):
        sem, device_id = addressing.dma_operands(eqn, eqn.invars)
        if device_id is not None:
          return f"it issues a remote DMA ({name} with a device_id)"
        if meshes and addressing.owner_of(sem.aval, meshes, i) not in (
          None,
          i,
        ):
          return f"it issues a DMA ({name}) to another mesh's program"
      elif kind is Sync.SIGNAL:
        signal = _pallas_ops.SignalOperands.of(eqn)
        sem = signal.sem
        if signal.device_id is not None or signal.core_index is not None:
          return "it signals a semaphore of another program"
        # With no device_id, a semaphore another mesh owns is that mesh's
        # program's at the caller's own indices of the axes they share.
        if meshes and addressing.owner_of(sem.aval, meshes, i) not in (
          None,
          i,
        ):
          return "it signals a semaphore of another mesh's program"
      elif kind is Sync.BARRIER_SEMAPHORE:
        return "it uses the cross-device barrier semaphore"
  return None


def _spins(jaxpr: core.Jaxpr, in_loop: bool = False) -> bool:
  """Whether ``jaxpr`` reads a semaphore inside a while loop: a program
  that may spin until another signals."""
  for eqn in jaxpr.eqns:
    if in_loop and _pallas_ops.kind(eqn) is Sync.SEMAPHORE_READ:
      return True
    loop = in_loop or eqn.primitive.name == "while"
    if any(_spins(sub, loop) for sub in jaxpr_util.sub_jaxprs(eqn.params)):
      return True
  return False


def check_simulable(jaxprs: Sequence[core.Jaxpr]) -> None:
  """Raises for kernels that no CPU path can run (they still lower)."""
  for jaxpr in jaxprs:
    for eqn in jaxpr_util.iter_eqns(jaxpr):
      if _pallas_ops.kind(eqn) in _UNSIMULATED:
        raise NotImplementedError(
          f"mpmd_map: the CPU fallback cannot run {eqn.primitive.name!r} "
          "(SparseCore synchronisation across subcores): no simulator on "
          "jax 0.10.2 implements it. The kernel still lowers for TPU."
        )
      if _selects_ref(eqn):
        raise NotImplementedError(
          "mpmd_map: the CPU fallback cannot run pl.select_ref (a Ref "
          f"chosen at run time, here by {eqn.primitive.name!r}): neither "
          "the HLO interpreter nor the simulators implement it. The kernel "
          "still lowers for TPU; on CPU, branch with lax.cond / pl.when "
          "between the Refs instead."
        )


def _selects_ref(eqn: core.JaxprEqn) -> bool:
  """Whether an equation's operands include a ``pl.select_ref`` view (a
  ``SelectTransform`` in their pytree)."""
  select = _jax.state_types.SelectTransform
  for value in eqn.params.values():
    if not isinstance(value, _jax.tree_util.PyTreeDef):
      continue
    if value.num_leaves != len(eqn.invars):
      continue
    if _has(value.unflatten(eqn.invars), select):
      return True
  return False


def _has(x: Any, kind: type) -> bool:
  """Whether ``x`` (operands: tuples of Refs and transformed views) holds
  an instance of ``kind``."""
  if isinstance(x, kind):
    return True
  if isinstance(x, (tuple, list)):
    return any(_has(y, kind) for y in x)
  if isinstance(x, _jax.state_types.TransformedRef):
    return _has(x.ref, kind) or _has(x.transforms, kind)
  return False


def choose(
  jaxprs: Sequence[core.Jaxpr],
  meshes: Sequence[pallas_core.Mesh],
  interpret: Any,
  manual_axes: tuple[core.AxisName, ...] = (),
) -> Path:
  """The CPU-fallback path for a launch (see the module docstring).

  ``manual_axes``: those of the enclosing ``shard_map`` where the launch is
  lowered (the lockstep path exchanges data along them).
  """
  tpu_params = _jax.tpu().interpret.InterpretParams
  gpu_params = _jax.gpu().interpret.InterpretGPUParams
  from mpmd import checking
  from mpmd._lowering.check import params as check_params

  if isinstance(interpret, checking.CheckParams):
    return Path(CHECK, "interpret= gave mpmd.CheckParams", interpret)
  forced = check_params.forced()
  if isinstance(forced, str):
    forced = checking.CheckParams(schedule=forced, per_call=True)
  if forced is not None:
    if not isinstance(interpret, (tpu_params, gpu_params)):
      return Path(CHECK, "the mpmd_check config state asks for it", forced)
    if isinstance(forced, check_params.Session):
      forced.ran_elsewhere(type(interpret).__name__)
  if isinstance(interpret, tpu_params):
    _check_simulator_counts(jaxprs)
    return Path(TPU_SIMULATOR, "interpret= gave TPU InterpretParams", interpret)
  if isinstance(interpret, gpu_params):
    return Path(GPU_SIMULATOR, "interpret= gave GPU InterpretParams", interpret)
  if any(is_gpu_mesh(m) for m in meshes):
    return Path(
      GPU_SIMULATOR,
      "GPU meshes run in the Mosaic GPU simulator",
      gpu_params(),
    )
  reason = sync_reason(jaxprs, meshes)
  if reason is None:
    if interpret is True:
      return Path(FAST, "interpret=True forces the HLO interpreter")
    return Path(FAST, "no program waits on another")
  why_not = lockstep_why_not(jaxprs, meshes, manual_axes)
  if why_not is None:
    # Also for interpret=True: like upstream's HLO interpreter, every
    # device runs its program and remote DMAs become collectives.
    return Path(
      LOCKSTEP, f"{reason}, in step on every device", manual_axes=manual_axes
    )
  if interpret is True:
    raise NotImplementedError(
      "mpmd_map: interpret=True runs each device's programs in the HLO "
      f"interpreter, which cannot run this kernel: {reason}, and not in "
      f"step on every device: {why_not}. Pass "
      "interpret=pltpu.InterpretParams() (or interpret=None on CPU) for "
      "the TPU simulator."
    )
  checked = checker_covers(jaxprs, meshes)
  if checked is not None:
    return Path(
      CHECK,
      f"{reason}, and not in lockstep: {why_not}; the checking executor "
      "runs it (its default schedule: deterministic, deadlocks at once)",
      checked,
    )
  _check_simulator_counts(jaxprs)
  return Path(
    TPU_SIMULATOR, f"{reason}, and not in lockstep: {why_not}", tpu_params()
  )


def _check_simulator_counts(jaxprs: Sequence[core.Jaxpr]) -> None:
  """Raises for a DMA whose semaphore is a REGULAR one: Mosaic adds 1 to it
  when the copy is done, Pallas' TPU simulator adds the copy's bytes (and
  only prints the count left at the kernel's exit), so the simulator would
  not run the program that TPUs run."""
  for jaxpr in jaxprs:
    for eqn in jaxpr_util.iter_eqns(jaxpr):
      if _pallas_ops.kind(eqn) is not Sync.DMA_START:
        continue
      avals = _pallas_ops.DmaOperands.of(eqn, [v.aval for v in eqn.invars])
      if any(
        _pallas_ops.signalled_once(s) for s in (avals.dst_sem, avals.src_sem)
      ):
        raise NotImplementedError(
          "mpmd_map: Pallas' TPU simulator cannot run a DMA whose semaphore "
          "is a REGULAR semaphore: it adds the copy's bytes to it, where "
          "Mosaic adds 1 when the copy is done. Run the launch on the "
          "checking executor (interpret=mpmd.CheckParams()), or give the "
          "DMA a pltpu.SemaphoreType.DMA semaphore."
        )


def checker_covers(jaxprs, meshes):
  """``CheckParams()`` where the checking executor runs every operation of
  a launch whose programs wait on each other (else None: the simulator)."""
  from mpmd import checking
  from mpmd._lowering.check import interp

  if any(is_gpu_mesh(m) for m in meshes):
    return None
  semaphore_space = _jax.tpu().core.MemorySpace.SEMAPHORE

  def space(aval):  # without its owner (`type @ mesh`)
    space = getattr(aval, "memory_space", None)
    return getattr(space, "memory_space", space)

  if any(
    is_semaphore(v.aval) and space(v.aval) is not semaphore_space
    for v in jaxprs[0].invars
  ):
    return None  # semaphores carried from launch to launch
  if any(interp.unsupported(j) is not None for j in jaxprs):
    return None
  # Not asked for: a launch means what it means on upstream's simulator,
  # where programs storing the same bytes in one place are no error.
  return checking.CheckParams(identical_writes_race=False)


def fully_manual_axes(
  names: Sequence[core.AxisName], manual: Any
) -> tuple[core.AxisName, ...]:
  """``names`` (a shard_map mesh's axes, in order) if all are in ``manual``,
  else (): the lockstep path needs every axis manual (its deadlock report
  is a callback, which JAX allows only in a fully manual shard_map)."""
  names = tuple(names)
  return names if names and set(names) <= set(manual) else ()


def traced_manual_axes() -> tuple[core.AxisName, ...]:
  """``fully_manual_axes`` of the shard_map being traced.

  What the lowering's axis context gives (:func:`manual_axes`) for the
  same shard_map; the CPU lowering checks that they agree.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  return fully_manual_axes(mesh.axis_names, getattr(mesh, "manual_axes", ()))


def runs_callbacks(
  path: Path, jaxprs: Sequence[core.Jaxpr], num_operands: int
) -> bool:
  """Whether the CPU lowering of a launch on ``path`` runs host callbacks
  whose effects the launch declares where it is traced.

  They depend on the kernel (and on the enclosing shard_map), not on the
  host: one export may carry a CPU lowering next to the TPU / CUDA one, and
  the native lowerings simply pass the effect tokens on. The simulators
  call back all along. The fast and lockstep paths call back only to
  report a failure after the run (a short semaphore, a deadlock, a failed
  check), and declare no effect for it, which would cost every call JAX's
  fast dispatch (0.1-0.2 ms): a launch whose results go unused may be
  dropped, checks and all, as it would be on hardware. A launch with
  semaphore operands (which outlive it; ``num_operands``: its inputs and
  outputs, the kernel's first arguments) declares it. (JAX keeps a failed
  first call's error for ``effects_barrier``; the CPU lowering lets ours
  end with their call: ``callbacks.install``.)
  """
  invars = jaxprs[0].invars
  return path.kind not in (FAST, LOCKSTEP) or any(
    is_semaphore(v.aval) for v in invars[:num_operands]
  )


# Nesting under which devices may disagree on whether (or how often) an
# operation runs: an exchange there would leave the others waiting.
_DIVERGENT = ("cond", "while")


_MESH = pallas_primitives.DeviceIdType.MESH


def manual_axes(axis_context: mlir.AxisContext) -> tuple[core.AxisName, ...]:
  """``paths.fully_manual_axes`` of the shard_map being lowered."""
  if not isinstance(axis_context, sharding_impls.SPMDAxisContext):
    return ()
  return fully_manual_axes(
    axis_context.mesh.axis_names, axis_context.manual_axes
  )


def mesh_sizes(axis_context: mlir.AxisContext) -> dict[core.AxisName, int]:
  """The size of each axis of the mesh of the shard_map being lowered
  (empty outside a shard_map: no mesh axes to name)."""
  if not isinstance(axis_context, sharding_impls.SPMDAxisContext):
    return {}
  return {a: int(s) for a, s in axis_context.mesh.shape.items()}


def exchange_axes(
  jaxpr: core.Jaxpr, axes: tuple[core.AxisName, ...]
) -> tuple[core.AxisName, ...]:
  """The mesh axes the kernel's remote operations name, in mesh order.

  Devices that differ along other axes never exchange, so they need not
  reach the same exchanges (a launch under a condition on another axis).
  """
  named = set()
  for eqn in jaxpr_util.iter_eqns(jaxpr):
    target = _pallas_ops.remote_target(eqn)
    if isinstance(target, dict):
      named |= set(target)
    elif target is not None:
      named |= set(axes)
  return tuple(a for a in axes if a in named) or axes


def lockstep_why_not(
  jaxprs: Sequence[core.Jaxpr],
  meshes: Sequence[pallas_core.Mesh],
  axes: tuple[core.AxisName, ...],
) -> str | None:
  """Why a synchronising kernel cannot run in lockstep (None if it can).

  ``axes``: the mesh axes of the enclosing shard_map (``manual_axes``).
  """
  if not axes:
    return (
      "it is not inside a jax.shard_map manual over every mesh axis (no "
      "devices to exchange with)"
    )
  if len(meshes) != 1 or math.prod(meshes[0].shape.values()) != 1:
    return "it runs several programs per device"

  def walk(jaxpr, enclosing, scoped_semaphores):
    for eqn in jaxpr.eqns:
      name, kind = eqn.primitive.name, _pallas_ops.kind(eqn)
      if kind is Sync.BARRIER_SEMAPHORE and enclosing:
        return f"it takes the barrier semaphore inside {enclosing[-1]}"
      if kind is Sync.SEMAPHORE_READ and "while" in enclosing:
        return "it reads a semaphore inside a while loop (it may spin)"
      if kind is Sync.SIGNAL:
        if _pallas_ops.SignalOperands.of(eqn).core_index is not None:
          return "it signals another core's semaphore"
      target = _pallas_ops.remote_target(eqn)
      if target is not None:
        if eqn.params["device_id_type"] is not _MESH:
          return f"a remote {name} names its device by a LOGICAL id"
        if kind is Sync.DMA_START and _pallas_ops.DmaOperands.of(eqn).add:
          return "it issues an accumulating remote DMA"
        divergent = [e for e in enclosing if e in _DIVERGENT]
        if divergent:
          return f"it issues a remote {name} inside {divergent[-1]}"
        if scoped_semaphores:
          return (
            f"it issues a remote {name} inside pl.run_scoped with "
            "semaphores (their counts are not checked at the end)"
          )
        if isinstance(target, dict):
          foreign = [a for a in target if a not in axes]
          if foreign:
            return (
              f"a remote {name} names axes {foreign} that are not axes "
              f"{axes} of the enclosing shard_map"
            )
        elif len(axes) != 1:
          return f"a remote {name} names its device by a flat id"
      scoped = scoped_semaphores or (
        kind is Sync.RUN_SCOPED
        and any(is_semaphore(v.aval) for v in eqn.params["jaxpr"].invars)
      )
      for sub in jaxpr_util.sub_jaxprs(eqn.params):
        reason = walk(sub, (*enclosing, name), scoped)
        if reason is not None:
          return reason
    return None

  return walk(jaxprs[0], (), False)
