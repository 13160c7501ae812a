"""Pallas' synchronisation equations, read into named records.

Pallas binds its DMA and semaphore primitives with their operands flattened
(the tree that unflattens them is a param of the equation), in an order of
its own that has changed between releases. This module is the one place
that knows that order: the rest of jax-mpmd reads an equation into a record
(``DmaOperands.of(eqn)``, ``SignalOperands.of(eqn)``, ...) and tells
primitives apart by object (``kind(eqn) is Sync.DMA_START``), never by
position or by name. Part of the door to JAX internals: it takes what it
needs from ``mpmd._jax`` and imports nothing from ``jax._src`` itself.
"""

import enum
import functools
import sys
from typing import Any, NamedTuple

import jax.numpy as jnp

from mpmd import _jax
from mpmd._jax import core, pallas_primitives, state_types, tree_util


class Sync(enum.Enum):
  """The Pallas primitives through which programs synchronise (or scope
  memory), whichever module of Pallas defines them."""

  DMA_START = "dma_start"
  DMA_WAIT = "dma_wait"
  SIGNAL = "semaphore_signal"
  SEMAPHORE_WAIT = "semaphore_wait"
  SEMAPHORE_READ = "semaphore_read"
  BARRIER_SEMAPHORE = "get_barrier_semaphore"
  RUN_SCOPED = "run_scoped"
  # SparseCore synchronisation of subcores (no simulator runs these).
  SUBCORE_BARRIER = "barrier"
  FETCH_AND_ADD = "sc_fetch_and_add"


@functools.cache
def _primitives() -> dict[core.Primitive, Sync]:
  """Primitive object -> its kind, for Pallas' core and TPU primitives."""
  tpu = _jax.tpu().primitives
  sc = _jax.sparsecore_primitives()
  return {
    tpu.dma_start_p: Sync.DMA_START,
    tpu.dma_wait_p: Sync.DMA_WAIT,
    tpu.get_barrier_semaphore_p: Sync.BARRIER_SEMAPHORE,
    pallas_primitives.semaphore_signal_p: Sync.SIGNAL,
    pallas_primitives.semaphore_wait_p: Sync.SEMAPHORE_WAIT,
    pallas_primitives.semaphore_read_p: Sync.SEMAPHORE_READ,
    pallas_primitives.run_scoped_p: Sync.RUN_SCOPED,
    sc.barrier_p: Sync.SUBCORE_BARRIER,
    sc.fetch_and_add_p: Sync.FETCH_AND_ADD,
  }


# Where Mosaic GPU's primitives live: an equation holds one of them only if
# this module is loaded (and ``kind`` imports it no sooner).
_GPU_PRIMITIVES_MODULE = "jax._src.pallas.mosaic_gpu.primitives"


@functools.cache
def _gpu_primitives() -> dict[core.Primitive, Sync]:
  """Mosaic GPU's own semaphore signal and wait (the operands of Pallas'
  ones, one more param), once its module is loaded: an equation can only
  hold them if it is."""
  try:
    gpu = _jax.gpu().primitives
  except ImportError:  # loaded, but the rest of the backend is missing
    return {}
  return {
    gpu.semaphore_signal_p: Sync.SIGNAL,
    gpu.semaphore_wait_p: Sync.SEMAPHORE_WAIT,
  }


def primitive(of_kind: Sync) -> core.Primitive:
  """The primitive of Pallas' core or TPU modules of a kind (Mosaic GPU's
  own semaphore primitives are matched by ``kind``, never bound)."""
  [p] = [p for p, k in _primitives().items() if k is of_kind]
  return p


def kind(eqn_or_primitive: core.JaxprEqn | core.Primitive) -> Sync | None:
  """Which synchronisation primitive an equation binds (None if another)."""
  p = (
    eqn_or_primitive.primitive
    if isinstance(eqn_or_primitive, core.JaxprEqn)
    else eqn_or_primitive
  )
  found = _primitives().get(p)
  if found is None and _GPU_PRIMITIVES_MODULE in sys.modules:
    found = _gpu_primitives().get(p)
  return found


def uninitialized(shape: tuple[int, ...], dtype: Any) -> Any:
  """Memory as Pallas leaves it before a kernel writes it (NaN floats, the
  smallest ints), complex numbers included (NaN + NaN j), which Pallas'
  own helper refuses."""
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return jnp.full(shape, complex(float("nan"), float("nan")), dtype)
  return pallas_primitives.uninitialized_value(shape, dtype)


def is_dma(eqn: core.JaxprEqn) -> bool:
  """A ``dma_start`` or ``dma_wait`` equation."""
  return kind(eqn) in (Sync.DMA_START, Sync.DMA_WAIT)


def signalled_once(sem: Any) -> bool:
  """Whether a DMA adds 1 to semaphore ``sem`` (an aval, or a view of one)
  rather than its bytes: Mosaic accepts a REGULAR (or barrier) semaphore
  as a DMA's semaphore and signals it once, when the copy is done
  (upstream's ``test_remote_dma_regular_semaphore`` waits for 1), while
  a DMA semaphore counts the bytes that ``dma_wait`` then waits for."""
  base, _ = split_ref(sem)
  dtype = getattr(base, "dtype", None)
  if dtype is None or not jnp.issubdtype(
    dtype, _jax.pallas_core.semaphore_dtype
  ):
    return False  # a physical count (int): the kind is no longer known
  return not jnp.issubdtype(dtype, _jax.tpu().core.dma_semaphore)


def split_ref(ref: Any) -> tuple[Any, tuple[Any, ...]]:
  """(the Ref, its views) of a Ref operand (a ``TransformedRef`` or not)."""
  if isinstance(ref, state_types.TransformedRef):
    return ref.ref, tuple(ref.transforms)
  return ref, ()


class DmaOperands(NamedTuple):
  """The operands of a ``dma_start`` or ``dma_wait``, as the copy defines
  them: a wait of the send side's swap is undone. Refs come as Pallas
  passes them (a ``TransformedRef`` where a view is taken: ``split_ref``);
  values are the equation's variables or the values bound to them."""

  src: Any
  dst: Any
  dst_sem: Any  # signalled where the data lands (None: not signalled)
  src_sem: Any  # signalled here once the source is read (None: local copy)
  device_id: Any  # the receiving device (None: this one)
  device_id_type: Any
  add: bool  # the copy adds to the destination (``dma_start`` only)
  waits_send: bool  # a ``dma_wait`` of the send side (``wait_send``)

  @classmethod
  def of(cls, eqn: core.JaxprEqn, values: Any = None) -> "DmaOperands":
    values = eqn.invars if values is None else values
    first, second, sem, other_sem, device_id = eqn.params["tree"].unflatten(
      values
    )
    waits_send = kind(eqn) is Sync.DMA_WAIT and _waits_send(eqn.params)
    if waits_send:  # bound with source and destination swapped
      first, second, sem, other_sem = second, first, other_sem, sem
    return cls(
      first,
      second,
      sem,
      other_sem,
      device_id,
      eqn.params["device_id_type"],
      bool(eqn.params.get("add", False)),
      waits_send,
    )

  @property
  def awaited(self) -> tuple[Any, Any]:
    """(buffer, semaphore) a ``dma_wait`` waits on: the destination and
    its semaphore, or for the send side the source and its semaphore."""
    if self.waits_send:
      return self.src, self.src_sem
    return self.dst, self.dst_sem

  def flatten(self) -> tuple[list[Any], tree_util.PyTreeDef]:
    """(flat operands, tree) to bind the equation's primitive with these
    operands, in the order it takes them."""
    if self.waits_send:
      refs = (self.dst, self.src, self.src_sem, self.dst_sem)
    else:
      refs = (self.src, self.dst, self.dst_sem, self.src_sem)
    return _jax.dma_flatten(*refs, self.device_id)


def _waits_send(params) -> bool:
  """A ``dma_wait`` of the send side (``wait_send`` / ``wait_read``), bound
  with its operands swapped: 0.12 says so by ``is_wait_send``, 0.10 by
  ``insert_dummy_device`` (set only by ``wait_send``)."""
  if "is_wait_send" in params:
    return bool(params["is_wait_send"])
  return bool(params.get("insert_dummy_device", False))  # drop with jax 0.10


class SignalOperands(NamedTuple):
  """The operands of a ``semaphore_signal``: add ``inc`` to ``sem`` (seen
  through ``transforms``) of the device ``device_id`` names and the core
  ``core_index`` names (this one where None)."""

  sem: Any
  transforms: Any
  inc: Any
  device_id: Any
  core_index: Any
  device_id_type: Any

  @classmethod
  def of(cls, eqn: core.JaxprEqn, values: Any = None) -> "SignalOperands":
    values = eqn.invars if values is None else values
    sem, transforms, inc, device_id, core_index = eqn.params[
      "args_tree"
    ].unflatten(values)
    return cls(
      sem, transforms, inc, device_id, core_index, eqn.params["device_id_type"]
    )

  def flatten(self) -> tuple[list[Any], tree_util.PyTreeDef]:
    """(flat operands, ``args_tree``) to bind a signal with these operands
    (its ``device_id_type`` is a param of its own)."""
    return tree_util.tree_flatten(
      [self.sem, self.transforms, self.inc, self.device_id, self.core_index]
    )

  def bind(self, eqn: core.JaxprEqn) -> list[Any]:
    """Binds ``eqn``'s primitive (and its other params) with these
    operands."""
    flat, tree = self.flatten()
    params = dict(eqn.params, args_tree=tree)
    params["device_id_type"] = self.device_id_type
    return eqn.primitive.bind(*flat, **params)


class SemaphoreWaitOperands(NamedTuple):
  """The operands of a ``semaphore_wait``: wait until ``sem`` (seen
  through ``transforms``) holds ``value``, then take it if ``decrement``."""

  sem: Any
  transforms: Any
  value: Any
  decrement: Any  # a bool (or the variable or literal that holds it)

  @classmethod
  def of(
    cls, eqn: core.JaxprEqn, values: Any = None
  ) -> "SemaphoreWaitOperands":
    values = eqn.invars if values is None else values
    sem, transforms, value, decrement = eqn.params["args_tree"].unflatten(
      values
    )
    return cls(sem, transforms, value, decrement)


class SemaphoreReadOperands(NamedTuple):
  """The operands of a ``semaphore_read``: ``sem`` seen through
  ``transforms``."""

  sem: Any
  transforms: Any

  @classmethod
  def of(
    cls, eqn: core.JaxprEqn, values: Any = None
  ) -> "SemaphoreReadOperands":
    values = eqn.invars if values is None else values
    sem, transforms = eqn.params["args_tree"].unflatten(values)
    return cls(sem, transforms)


CHECK_P = _jax.checkify_internal.check_p  # what pl.debug_check binds


class CheckOperands(NamedTuple):
  """What a ``check_p`` equation (a ``pl.debug_check``) asks: whether the
  check fails (the equation carries the negated condition), its message
  format, and the format's positional and keyword values."""

  failed: Any
  fmt: str
  args: tuple[Any, ...]
  kwargs: dict[str, Any]

  @classmethod
  def of(cls, eqn: core.JaxprEqn, values: Any = None) -> "CheckOperands":
    values = eqn.invars if values is None else values
    error = tree_util.tree_unflatten(eqn.params["err_tree"], values)
    failed, tree, payload = _jax.checkify_check(error)
    exception = tree_util.tree_unflatten(tree, payload)
    return cls(
      failed, exception.fmt_string, tuple(exception.args), exception.kwargs
    )


def remote_target(eqn: core.JaxprEqn) -> Any:
  """The ``device_id`` (variables) of a ``dma_start`` or a
  ``semaphore_signal``: None for any other equation and a local one."""
  k = kind(eqn)
  if k is Sync.DMA_START:
    return DmaOperands.of(eqn).device_id
  if k is Sync.SIGNAL:
    return SignalOperands.of(eqn).device_id
  return None
