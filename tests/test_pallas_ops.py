"""``mpmd._pallas_ops``: Pallas' synchronisation equations read into named
records, on the kernels' own jaxprs, on every supported jax."""

import jax
import jax.extend
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mpmd import _jax, _pallas_ops
from mpmd._pallas_ops import Sync

SHAPE = (8, 128)


def _ref(memory_space, shape=SHAPE, dtype=jnp.float32):
  return memory_space(shape, dtype).get_ref_aval()


def _remote_copy_eqns():
  """start, wait_send, wait_recv of a remote copy of a view."""

  def kernel(x, o, send, recv):
    copy = pltpu.make_async_remote_copy(
      x.at[:4], o.at[4:], send, recv, device_id={"x": 1}
    )
    copy.start()
    copy.wait_send()
    copy.wait_recv()

  avals = [_ref(pltpu.VMEM), _ref(pltpu.HBM)] + [
    pltpu.SemaphoreType.DMA(()).get_ref_aval() for _ in range(2)
  ]
  closed = jax.make_jaxpr(kernel)(*avals)
  eqns = [e for e in closed.jaxpr.eqns if _pallas_ops.kind(e) is not None]
  return eqns, closed


def test_dma_operands_name_the_copy():
  (start, wait_send, wait_recv), closed = _remote_copy_eqns()
  x, o, send, recv = closed.jaxpr.invars
  assert [_pallas_ops.kind(e) for e in (start, wait_send, wait_recv)] == [
    Sync.DMA_START,
    Sync.DMA_WAIT,
    Sync.DMA_WAIT,
  ]
  for eqn in (start, wait_send, wait_recv):
    dma = _pallas_ops.DmaOperands.of(eqn)
    # The views' Refs, whichever side the wait is on (its swap undone).
    assert _pallas_ops.split_ref(dma.src)[0] is x
    assert _pallas_ops.split_ref(dma.dst)[0] is o
    assert _pallas_ops.split_ref(dma.dst_sem)[0] is recv
    assert _pallas_ops.split_ref(dma.src_sem)[0] is send
    assert dma.device_id == {"x": dma.device_id["x"]}
  assert not _pallas_ops.DmaOperands.of(start).waits_send
  assert _pallas_ops.DmaOperands.of(wait_send).waits_send
  assert not _pallas_ops.DmaOperands.of(wait_recv).waits_send


def test_a_wait_awaits_its_side():
  (_, wait_send, wait_recv), closed = _remote_copy_eqns()
  x, o, send, recv = closed.jaxpr.invars
  buffer, sem = _pallas_ops.DmaOperands.of(wait_send).awaited
  assert (_pallas_ops.split_ref(buffer)[0], sem) == (x, send)
  buffer, sem = _pallas_ops.DmaOperands.of(wait_recv).awaited
  assert (_pallas_ops.split_ref(buffer)[0], sem) == (o, recv)


def test_dma_operands_flatten_as_bound():
  """``flatten`` gives back the operands in the order the primitive was
  bound with (a send-side wait's swap redone) and the same tree."""
  eqns, _ = _remote_copy_eqns()
  for eqn in eqns:
    flat, tree = _pallas_ops.DmaOperands.of(eqn).flatten()
    assert list(flat) == list(eqn.invars)
    assert tree == eqn.params["tree"]


def test_signal_and_wait_operands():
  def kernel(sem):
    pl.semaphore_signal(sem.at[1], 2, device_id={"x": 0})
    pl.semaphore_wait(sem.at[0], 3)
    pl.semaphore_read(sem.at[1])

  sems = pltpu.SemaphoreType.REGULAR((2,)).get_ref_aval()
  closed = jax.make_jaxpr(kernel)(sems)
  [sem] = closed.jaxpr.invars
  signal, wait, read = (e for e in closed.jaxpr.eqns if _pallas_ops.kind(e))
  op = _pallas_ops.SignalOperands.of(signal)
  assert op.sem is sem and len(op.transforms) == 1
  assert op.inc.val == 2 and op.core_index is None
  assert list(op.device_id) == ["x"]
  assert op.device_id_type is _jax.pallas_primitives.DeviceIdType.MESH
  flat, tree = op.flatten()
  assert flat == list(signal.invars) and tree == signal.params["args_tree"]
  op = _pallas_ops.SemaphoreWaitOperands.of(wait)
  assert op.sem is sem and op.value.val == 3
  assert bool(getattr(op.decrement, "val", op.decrement))
  op = _pallas_ops.SemaphoreReadOperands.of(read)
  assert op.sem is sem and len(op.transforms) == 1


def test_primitives_are_matched_by_object():
  """A primitive of another module with the same name is none of Pallas'."""
  impostor = jax.extend.core.Primitive("dma_start")
  assert _pallas_ops.kind(impostor) is None
  assert _pallas_ops.kind(_jax.pallas_primitives.run_scoped_p) is (
    Sync.RUN_SCOPED
  )
  for k in Sync:
    assert _pallas_ops.kind(_pallas_ops.primitive(k)) is k
