"""Pallas' synchronisation equations, read into named records.

Pallas packs a DMA's or a semaphore operation's operands into a pytree whose
layout is private (and has moved between JAX versions). This module is the
one place that unpacks them: each record's ``of(eqn, values)`` takes an
equation and its operand values (or its variables, for a static look) and
names the parts. Primitives are matched by object.
"""

import dataclasses
from typing import Any

from mpmd import _jax
from mpmd._jax import core, pallas_primitives, state_types


def tpu_primitives():
  return _jax.tpu().primitives


def split_ref(ref: Any) -> tuple[Any, tuple[Any, ...]]:
  """(base Ref, its transforms) of a Ref or a transformed view of one."""
  if isinstance(ref, state_types.TransformedRef):
    return ref.ref, tuple(ref.transforms)
  return ref, ()


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
    src, dst, recv, send, device_id = eqn.params["tree"].unflatten(values)
    return cls(
      RefOperand.of(src),
      RefOperand.of(dst),
      None if recv is None else RefOperand.of(recv),
      None if send is None else RefOperand.of(send),
      device_id,
      eqn.params["device_id_type"],
      bool(eqn.params.get("add", False)),
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
    src, dst, sem, _, _ = eqn.params["tree"].unflatten(values)
    # wait_send / wait_read: the operands come swapped, the awaited
    # semaphore in the receive slot and the source in the destination's.
    is_send = _jax.dma_wait_is_send(eqn.params)
    return cls(RefOperand.of(sem), RefOperand.of(dst), is_send)


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
    tree = eqn.params["args_tree"]
    ref, transforms, inc, device_id, core_index = tree.unflatten(values)
    return cls(
      RefOperand.of(ref, transforms),
      inc,
      device_id,
      eqn.params["device_id_type"],
      core_index,
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
    parts = eqn.params["args_tree"].unflatten(values)
    ref, transforms, value = parts[:3]
    decrement = bool(parts[3]) if len(parts) > 3 else True
    return cls(RefOperand.of(ref, transforms), value, decrement)


@dataclasses.dataclass(frozen=True)
class SemRead:
  """``semaphore_read``: the count ``sem`` holds now."""

  sem: RefOperand

  @classmethod
  def of(cls, eqn: core.JaxprEqn, values) -> "SemRead":
    ref, transforms = eqn.params["args_tree"].unflatten(values)
    return cls(RefOperand.of(ref, transforms))


def record_types() -> dict[Any, type]:
  """Synchronisation primitive -> the record that reads its equations."""
  tpu = tpu_primitives()
  return {
    tpu.dma_start_p: DmaStart,
    tpu.dma_wait_p: DmaWait,
    pallas_primitives.semaphore_signal_p: Signal,
    pallas_primitives.semaphore_wait_p: SemWait,
    pallas_primitives.semaphore_read_p: SemRead,
  }
