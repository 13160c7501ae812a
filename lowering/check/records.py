"""The checking executor's synchronisation operations, as records.

Each record's ``of(eqn, values)`` takes an equation and its operand values
(or its variables, for a static look) and names the parts the executor
needs, each Ref with all the views taken of it (``RefOperand``). Pallas'
operand layouts are read by ``mpmd._pallas_ops`` only.
"""

import dataclasses
import functools
from typing import Any

import numpy as np

from mpmd import _pallas_ops
from mpmd._jax import core, state, tree_util
from mpmd._pallas_ops import Sync, split_ref


class Views(tuple):
  """The views taken of a Ref, remembered per kernel (``record_of``,
  ``interp``'s indexers): the same object stands for the same views each
  time, so a launch can look up the window they cut by its id."""

  __slots__ = ()


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
  # Semaphores that count 1 when the copy lands rather than its bytes
  # (REGULAR semaphores: ``_pallas_ops.signalled_once``).
  recv_once: bool = False
  send_once: bool = False

  @classmethod
  def of(cls, eqn: core.JaxprEqn, values) -> "DmaStart":
    dma = _pallas_ops.DmaOperands.of(eqn, values)
    avals = _pallas_ops.DmaOperands.of(eqn, [v.aval for v in eqn.invars])
    return cls(
      RefOperand.of(dma.src),
      RefOperand.of(dma.dst),
      None if dma.dst_sem is None else RefOperand.of(dma.dst_sem),
      None if dma.src_sem is None else RefOperand.of(dma.src_sem),
      dma.device_id,
      dma.device_id_type,
      dma.add,
      _pallas_ops.signalled_once(avals.dst_sem),
      _pallas_ops.signalled_once(avals.src_sem),
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


# Templates ``record_of`` keeps per kernel (past them, it reads anew).
MAX_TEMPLATES = 1 << 16


class _Slot:
  """Stands for the ``index``-th operand (a Ref) while a template is read:
  the record's views depend on the other operands only."""

  __slots__ = ("index",)

  def __init__(self, index: int):
    self.index = index


# numpy's integer and bool scalar types -> their dtypes.
_INTEGER_SCALARS = {
  t: np.dtype(t)
  for t in (
    np.bool_,
    *(getattr(np, f"int{b}") for b in (8, 16, 32, 64)),
    *(getattr(np, f"uint{b}") for b in (8, 16, 32, 64)),
  )
}


def scalar_key(values) -> list[Any] | None:
  """What identifies integer scalar ``values`` (numpy scalars and 0-d
  arrays, Python and JAX's typed integer literals, None), type and dtype
  included; None if one is something else (an array, a float)."""
  key: list[Any] = []
  for x in values:
    kind = type(x)
    if kind is int:
      key.append((int, None, x))
      continue
    dtype = _INTEGER_SCALARS.get(kind)
    if dtype is not None:  # (the common case, read off its type)
      key.append((kind, dtype, int(x)))
      continue
    if isinstance(x, (np.ndarray, np.generic)):
      if x.shape != () or x.dtype.kind not in "biu":
        return None
      key.append((type(x), x.dtype, int(x)))
    elif isinstance(x, int):  # bool, int, JAX's typed literals
      key.append((type(x), getattr(x, "dtype", None), int(x)))
    elif x is None:
      key.append(None)
    else:
      return None
  return key


def record_of(eqn: core.JaxprEqn, values, memo: dict):
  """The record of a synchronisation equation on its operand ``values``
  (Refs and integer scalars), as ``record_types()[eqn.primitive].of``
  reads it, made from a template remembered in ``memo`` per equation and
  scalar values: unflattening Pallas' pytree nodes costs far more than
  putting this launch's Refs into the fields that hold them."""
  found = memo.get(("record of", eqn))
  if found is None:
    refs = [isinstance(v.aval, state.AbstractRef) for v in eqn.invars]
    others = [i for i, is_ref in enumerate(refs) if not is_ref]
    found = (record_types()[eqn.primitive], refs, others)
    memo[("record of", eqn)] = found
  make, refs, others = found
  scalars = scalar_key([values[i] for i in others])
  if scalars is None:  # an index array: read it as it is
    return make.of(eqn, values)
  key = ("record", eqn, *scalars)
  template = memo.get(key)
  if template is None:
    template = _template(eqn, values, refs, make)
    if len(memo) < MAX_TEMPLATES:
      memo[key] = template
  if template is False:  # Refs somewhere else than a field's base
    return make.of(eqn, values)
  fields, slots = template
  fields = dict(fields)
  for name, i, transforms in slots:
    fields[name] = _made(
      RefOperand, {"ref": values[i], "transforms": transforms}
    )
  return _made(make, fields)


def _made(cls, fields: dict[str, Any]):
  """``cls(**fields)`` for a frozen dataclass ``cls`` with no
  ``__post_init__`` and ``fields`` all of its fields, in order: its
  ``__init__`` sets each through ``object.__setattr__``, which costs more
  than the record's other work (one record per synchronisation)."""
  made = object.__new__(cls)
  made.__dict__.update(fields)
  return made


def _template(eqn, values, refs, make):
  """(the record's fields by name, [(field, operand, views)] of its Ref
  fields), or False where a Ref is elsewhere than a field's base Ref.
  (Operands the record does not keep, such as the source of a
  ``dma_wait``, need no slot.)"""
  placeholders = [
    _Slot(i) if is_ref else x
    for i, (is_ref, x) in enumerate(zip(refs, values, strict=True))
  ]
  record = make.of(eqn, placeholders)
  names = [f.name for f in dataclasses.fields(record)]
  fields = [getattr(record, name) for name in names]
  slots = [
    (name, f.ref.index, Views(f.transforms))
    for name, f in zip(names, fields, strict=True)
    if isinstance(f, RefOperand) and isinstance(f.ref, _Slot)
  ]
  rest = [f for f in fields if not isinstance(f, RefOperand)]
  rest += [f.transforms for f in fields if isinstance(f, RefOperand)]
  rest += [f.ref for f in fields if isinstance(f, RefOperand)]
  if sum(isinstance(x, _Slot) for x in tree_util.tree_leaves(rest)) != len(
    slots
  ):
    return False
  return dict(zip(names, fields, strict=True)), slots
