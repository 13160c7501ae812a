"""A DMA whose semaphore is a REGULAR semaphore counts 1 when it lands.

Mosaic accepts a ``pltpu.SemaphoreType.REGULAR`` semaphore as a DMA's
semaphore (TPU v6 on) and signals it once, when the copy is done; a DMA
semaphore counts the copy's bytes. Every CPU path counts the same way;
Pallas' TPU simulator (which counts bytes) refuses such a DMA; Mosaic's own
rules for DMA semaphores hold at trace time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P
from launches import kernel_path

import mpmd

ROWS = (8, 128)
CORE = mpmd.tensorcore_mesh("core", num_cores=1)
REGULAR = pltpu.SemaphoreType.REGULAR


def _local_copy(waits: int):
  """Copies its input through VMEM, the first DMA on a REGULAR
  semaphore, then waits ``waits`` on it."""

  def kernel(x_hbm, o_hbm, buf, sem, dma_sem):
    pltpu.async_copy(x_hbm, buf, sem)
    pl.semaphore_wait(sem, waits)
    pltpu.async_copy(buf, o_hbm, dma_sem).wait()

  return kernel


def _local(waits: int, interpret=None):
  return mpmd.kernel(
    _local_copy(waits),
    mesh=CORE,
    out_type=jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[
      pltpu.VMEM(ROWS, jnp.float32),
      REGULAR,
      pltpu.SemaphoreType.DMA,
    ],
    interpret=interpret,
  )


def _x(rows=ROWS[0]):
  return jnp.arange(rows * ROWS[1], dtype=jnp.float32).reshape(rows, ROWS[1])


@pytest.mark.parametrize(
  "interpret, kind", [(None, "fast"), (mpmd.CheckParams(), "check")]
)
def test_local_dma_adds_one_to_a_regular_semaphore(interpret, kind):
  f = _local(1, interpret)
  x = _x()
  assert kernel_path(f, x).kind == kind
  np.testing.assert_array_equal(f(x), x)


@pytest.mark.parametrize("interpret", [None, mpmd.CheckParams()])
def test_waiting_for_more_than_one_fails(interpret):
  # Had the DMA counted its 4096 bytes, a wait for 2 would pass (and leave
  # the rest behind: a LeftoverError).
  with pytest.raises(mpmd.errors.DeadlockError):
    jax.block_until_ready(_local(2, interpret)(_x()))


def _swap(x_ref, y_ref, ready, send, recv):
  """Two devices swap blocks by remote DMAs on REGULAR semaphores, each
  awaited by a wait for 1."""
  other = 1 - jax.lax.axis_index("x")
  pl.semaphore_signal(ready, device_id={"x": other})
  pl.semaphore_wait(ready)
  pltpu.async_remote_copy(x_ref, y_ref, send, recv, device_id={"x": other})
  pl.semaphore_wait(send, 1)
  pl.semaphore_wait(recv, 1)


def _swapped(interpret):
  kernel = mpmd.kernel(
    _swap,
    mesh=CORE,
    out_type=jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[REGULAR] * 3,
    interpret=interpret,
  )
  mesh = jax.sharding.Mesh(jax.devices()[:2], ["x"])
  return jax.jit(
    jax.shard_map(
      kernel, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False
    )
  )


@pytest.mark.parametrize(
  "interpret, kind", [(None, "lockstep"), (mpmd.CheckParams(), "check")]
)
def test_remote_dma_adds_one_to_regular_semaphores(interpret, kind):
  x = _x(2 * ROWS[0])
  f = _swapped(interpret)
  assert kernel_path(f, x).kind == kind
  expected = jnp.concatenate([x[ROWS[0] :], x[: ROWS[0]]])
  np.testing.assert_array_equal(f(x), expected)


def test_tpu_simulator_refuses_a_dma_on_a_regular_semaphore():
  with pytest.raises(NotImplementedError, match="adds the copy's bytes"):
    _swapped(pltpu.InterpretParams())(_x(2 * ROWS[0]))


def _traced(kernel, scratch):
  f = mpmd.kernel(
    kernel,
    mesh=CORE,
    out_type=jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=scratch,
  )
  return jax.jit(f).trace(_x())


def test_mixed_semaphore_kinds_are_rejected():
  def kernel(x_hbm, o_hbm, regular, dma):
    pltpu.async_remote_copy(
      x_hbm, o_hbm, regular, dma, device_id={"core": 0}
    ).wait_recv()

  with pytest.raises(ValueError, match="must have the same type"):
    _traced(kernel, [REGULAR, pltpu.SemaphoreType.DMA])


def test_regular_semaphore_with_smem_is_rejected():
  def kernel(x_hbm, o_hbm, scalars, sem):
    pltpu.async_copy(x_hbm.at[0, pl.ds(0, 8)], scalars, sem)
    pl.semaphore_wait(sem, 1)

  with pytest.raises(ValueError, match="Non-DMA semaphores are not supported"):
    _traced(kernel, [pltpu.SMEM((8,), jnp.float32), REGULAR])
