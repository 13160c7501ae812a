"""Semaphores on the CPU fallback's compiled paths (fast and lockstep): int32
counts that a wait which finds too little poisons (sets far below zero, so
that no later signal lifts it), for the launch to report at its end."""

import math
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from mpmd import _pallas_ops
from mpmd._jax import core, pallas_core, state_primitives, state_types, tpu
from mpmd._lowering import jaxpr_util

# Far below any count a kernel reaches, and far from wrapping around.
_POISON = -(1 << 30)


def poisoned(count: Any) -> jax.Array:
  """Where a wait found too little (a count a negative signal took below
  zero is not: it is left over, as on the checker)."""
  return count <= _POISON // 2


def signal(sem: Any, inc: Any) -> None:
  """Adds ``inc`` to a semaphore, unless it is poisoned."""
  before = state_primitives.ref_get(sem, None)
  inc = jnp.asarray(inc, jnp.int32)
  state_primitives.ref_set(
    sem, None, jnp.where(poisoned(before), before, before + inc)
  )


def wait(sem: Any, value: ArrayLike, decrement: bool = True) -> jax.Array:
  """Takes ``value`` from a semaphore, or poisons it if it holds less;
  returns whether it held enough."""
  before = state_primitives.ref_get(sem, None)
  value = jnp.asarray(value, jnp.int32)
  after = before - value if decrement else before
  state_primitives.ref_set(sem, None, jnp.where(before < value, _POISON, after))
  return jnp.all(before >= value)


def ref_bytes(ref: Any) -> int:
  """What a DMA of ``ref``'s shape adds to its semaphores (bytes, as on
  hardware and in the simulator)."""
  return math.prod(ref.shape) * np.dtype(ref.dtype).itemsize


def dma_amount(once: bool, ref: Any) -> int:
  """What a DMA of ``ref`` adds to a semaphore: its bytes, or 1 where
  ``once`` (a REGULAR semaphore: ``_pallas_ops.signalled_once``)."""
  return 1 if once else ref_bytes(ref)


# Per dma_start: whether its receive and its send semaphore count 1.
Once = tuple[bool, bool]


def once_flags(jaxpr: core.Jaxpr) -> list[Once]:
  """``Once`` of each ``dma_start`` of ``jaxpr`` (nested ones too, in
  program order), read before its semaphores become plain integers (which
  forgets their kind)."""
  flags = []
  for eqn in jaxpr_util.iter_eqns(jaxpr):
    if _pallas_ops.kind(eqn) is _pallas_ops.Sync.DMA_START:
      avals = _pallas_ops.DmaOperands.of(eqn, [v.aval for v in eqn.invars])
      flags.append(
        (
          _pallas_ops.signalled_once(avals.dst_sem),
          _pallas_ops.signalled_once(avals.src_sem),
        )
      )
  return flags


def once_by_eqn(
  jaxpr: core.Jaxpr, flags: list[Once]
) -> dict[core.JaxprEqn, Once]:
  """``flags`` (``once_flags`` of the same kernel before its semaphores
  became integers) by each ``dma_start`` of ``jaxpr``, the equations the
  lowering then walks: turning semaphores into integers keeps every
  equation, in order."""
  starts = [
    eqn
    for eqn in jaxpr_util.iter_eqns(jaxpr)
    if _pallas_ops.kind(eqn) is _pallas_ops.Sync.DMA_START
  ]
  if len(starts) != len(flags):
    raise AssertionError(
      f"mpmd: internal error: {len(flags)} dma_starts became {len(starts)}"
    )
  return dict(zip(starts, flags, strict=True))


def widen(aval: core.AbstractValue) -> core.AbstractValue:
  """Semaphore counts as int32 (Pallas' interpreters use int16)."""
  if not is_count(aval):
    return aval
  inner = aval.inner_aval
  if (
    isinstance(inner, core.ShapedArray)
    and inner.dtype == pallas_core.SEMAPHORE_INTERPRET_DTYPE
  ):
    return aval.update(inner_aval=inner.update(dtype=jnp.int32))
  return aval


def is_count(aval: core.AbstractValue) -> TypeGuard[state_types.AbstractRef]:
  """A Ref in semaphore memory (of physical integer counts)."""
  if not isinstance(aval, state_types.AbstractRef):
    return False
  space = aval.memory_space
  # Scratch placed on one mesh's cores (`SEMAPHORE @ mesh`) wraps the space.
  if isinstance(space, pallas_core.CoreMemorySpace):
    space = space.memory_space
  return space == tpu().core.MemorySpace.SEMAPHORE


def with_transforms(ref: Any, transforms: Any) -> Any:
  if not transforms:
    return ref
  return state_types.TransformedRef(ref, tuple(transforms))
