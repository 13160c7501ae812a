"""The checking executor's synchronisation operations, as records.

Each record's ``of(eqn, values)`` takes an equation and its operand values
(or its variables, for a static look) and names the parts the executor
needs, each Ref with all the views taken of it (``RefOperand``). Pallas'
operand layouts are read by ``mpmd._pallas_ops`` only.
"""

import dataclasses
import functools
from typing import Any

from mpmd import _pallas_ops
from mpmd._jax import core
from mpmd._pallas_ops import Sync, split_ref


@dataclasses.dataclass(frozen=True)
class RefOperand:
  """A Ref operand: the base Ref and the views applied to it."""

  ref: Any
  transforms: tuple[Any, ...]

  @classmethod
  def of(cls, ref: Any, transforms: Any = ()) -> "RefOperand":
    base, own = split_ref(ref)
    return cls(base, (*own, *tuple(transforms or ())))


@dataclasses.dataclass(frozen=True)
class DmaStart:
  """``dma_start``: copy ``src`` (here) to ``dst`` on the device / program
  ``device_id`` names; ``recv_sem`` is signalled where the data lands,
  ``send_sem`` here once the source is read."""

  src: RefOperand
  dst: RefOperand
  recv_sem: RefOperand | None
  send_sem: RefOperand | None
  device_id: Any
  device_id_type: Any
  add: bool

  @classmethod
  def of(cls, eqn: core.JaxprEqn, values) -> "DmaStart":
    dma = _pallas_ops.DmaOperands.of(eqn, values)
    return cls(
      RefOperand.of(dma.src),
      RefOperand.of(dma.dst),
      None if dma.dst_sem is None else RefOperand.of(dma.dst_sem),
      None if dma.src_sem is None else RefOperand.of(dma.src_sem),
      dma.device_id,
      dma.device_id_type,
      dma.add,
    )


@dataclasses.dataclass(frozen=True)
class DmaWait:
  """``dma_wait``: wait on ``sem`` for the bytes of the copy ``ref`` (the
  destination for a receive wait, the source for ``wait_send``)."""

  sem: RefOperand
  ref: RefOperand
  is_send: bool

  @classmethod
  def of(cls, eqn: core.JaxprEqn, values) -> "DmaWait":
    dma = _pallas_ops.DmaOperands.of(eqn, values)
    ref, sem = dma.awaited
    return cls(RefOperand.of(sem), RefOperand.of(ref), dma.waits_send)


@dataclasses.dataclass(frozen=True)
class Signal:
  """``semaphore_signal``: add ``inc`` to ``sem`` of the program that
  ``device_id`` / ``core_index`` name (this one when both are None)."""

  sem: RefOperand
  inc: Any
  device_id: Any
  device_id_type: Any
  core_index: Any

  @classmethod
  def of(cls, eqn: core.JaxprEqn, values) -> "Signal":
    op = _pallas_ops.SignalOperands.of(eqn, values)
    return cls(
      RefOperand.of(op.sem, op.transforms),
      op.inc,
      op.device_id,
      op.device_id_type,
      op.core_index,
    )


@dataclasses.dataclass(frozen=True)
class SemWait:
  """``semaphore_wait``: block until ``sem`` holds ``value``, then take it
  (unless ``decrement`` is False)."""

  sem: RefOperand
  value: Any
  decrement: bool

  @classmethod
  def of(cls, eqn: core.JaxprEqn, values) -> "SemWait":
    op = _pallas_ops.SemaphoreWaitOperands.of(eqn, values)
    return cls(
      RefOperand.of(op.sem, op.transforms), op.value, bool(op.decrement)
    )


@dataclasses.dataclass(frozen=True)
class SemRead:
  """``semaphore_read``: the count ``sem`` holds now."""

  sem: RefOperand

  @classmethod
  def of(cls, eqn: core.JaxprEqn, values) -> "SemRead":
    op = _pallas_ops.SemaphoreReadOperands.of(eqn, values)
    return cls(RefOperand.of(op.sem, op.transforms))


@functools.cache
def record_types() -> dict[core.Primitive, type]:
  """Synchronisation primitive -> the record that reads its equations."""
  records = {
    Sync.DMA_START: DmaStart,
    Sync.DMA_WAIT: DmaWait,
    Sync.SIGNAL: Signal,
    Sync.SEMAPHORE_WAIT: SemWait,
    Sync.SEMAPHORE_READ: SemRead,
  }
  return {_pallas_ops.primitive(k): r for k, r in records.items()}
