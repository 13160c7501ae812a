"""The checker's pool of buffer arrays: a launch whose buffers reuse the
arrays of an earlier launch sees nothing of what that launch wrote."""

import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd._lowering.check import pool as pools

# A shape no other test's buffer has: its pooled arrays are this file's.
SHAPE = (24, 136)


def _launch(kernel):
  return jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
      jax.ShapeDtypeStruct(SHAPE, jnp.float32),
      scratch_types=[pltpu.VMEM(SHAPE, jnp.float32)],
      interpret=mpmd.CheckParams(),
    )
  )


def _writes_then_copies(x_hbm, o_hbm, scratch):
  pltpu.sync_copy(x_hbm, scratch)
  scratch[...] = scratch[...] + 1.0
  pltpu.sync_copy(scratch, o_hbm)


def _copies_unwritten(x_hbm, o_hbm, scratch):
  del x_hbm
  pltpu.sync_copy(scratch, o_hbm)


def _reads_unwritten(x_hbm, o_hbm, scratch):
  del x_hbm
  scratch[...] = scratch[...] + 1.0
  pltpu.sync_copy(scratch, o_hbm)


def _held(value: float) -> bool:
  """Whether the pool holds a SHAPE array that is all ``value``."""
  kept = pools.POOL.free.get((SHAPE, np.dtype(np.float32)), [])
  return any(np.all(a == value) for a in kept)


def test_reused_scratch_reads_as_garbage_not_the_last_launch():
  x = jnp.ones(SHAPE, jnp.float32)
  np.testing.assert_array_equal(_launch(_writes_then_copies)(x), 2.0)
  # The scratch's array went to the pool with what the launch wrote ...
  assert _held(2.0)
  # ... and the next launch's scratch, made from it, is unwritten again:
  # copying it out copies garbage (NaN), not the 2s.
  out = np.asarray(_launch(_copies_unwritten)(x))
  assert np.isnan(out).all()


def test_reused_scratch_is_uninitialised_for_the_oracle():
  x = jnp.ones(SHAPE, jnp.float32)
  _launch(_writes_then_copies)(x).block_until_ready()
  assert _held(2.0)
  with pytest.raises(mpmd.UninitializedError, match="nothing wrote"):
    with mpmd.typed_errors():
      jax.block_until_ready(_launch(_reads_unwritten)(x))


def test_pool_keeps_arrays_by_shape_and_dtype_up_to_its_bytes():
  pool = pools.Pool(max_bytes=2 * 4 * 8)
  a, b, c = (np.zeros((8,), np.float32) for _ in range(3))
  pool.give([a, b, c])  # the third does not fit
  assert pool.held == 2 * a.nbytes
  assert pool.take((8,), np.int32) is not a  # another dtype: a new array
  taken = [pool.take((8,), np.float32) for _ in range(3)]
  assert {id(t) for t in taken[:2]} == {id(a), id(b)}
  assert all(taken[2] is not kept for kept in (a, b, c))  # a new one
  assert pool.held == 0


def test_jax_clear_caches_empties_the_pool():
  pool = pools.Pool(max_bytes=1 << 10)
  pool.give([np.zeros((8,), np.float32)])
  assert pool.cache_info().currsize == 32 and pool.cache_keys()
  jax.clear_caches()
  assert pool.cache_info().currsize == 0 and not pool.cache_keys()
  assert pool.take((8,), np.float32) is not None  # a new array
  assert pool.cache_info().misses == 1


def test_outputs_are_lent_and_reused_only_once_xla_copied_them():
  x = jnp.ones(SHAPE, jnp.float32)
  first = _launch(_writes_then_copies)(x)
  np.testing.assert_array_equal(first, 2.0)
  # The launch's output array was lent to the pool (XLA has copied it),
  # the newest lent (earlier launches' may still be there): watched
  # without a reference, which would keep it lent.
  lent = [a for a in pools.POOL.lent if a.shape == SHAPE]
  output = weakref.ref(lent[-1])
  del lent
  assert np.all(output() == 2.0)
  second = _launch(_copies_unwritten)(x)
  assert np.isnan(np.asarray(second)).all()
  # The next launch's buffers took it and wrote it (garbage, then copies):
  assert np.isnan(output()).all()
  # ... and what the first call returned is untouched.
  np.testing.assert_array_equal(first, 2.0)


def test_a_lent_array_still_referred_to_is_not_taken():
  pool = pools.Pool(max_bytes=1 << 10)
  a = np.zeros((8,), np.float32)
  pool.lend([a])  # ``a`` is still ours
  assert pool.take((8,), np.float32) is not a and pool.lent
  lent = weakref.ref(a)
  del a
  assert pool.take((8,), np.float32) is lent() and not pool.lent


def test_scoped_buffers_are_named_by_the_scope_functions_parameters():
  def kernel(x_hbm, o_hbm, scratch):
    def scoped(sem, staged):
      del sem
      scratch[...] = staged[...]  # nothing wrote ``staged``

    pl.run_scoped(
      scoped, pltpu.SemaphoreType.DMA(()), pltpu.VMEM(SHAPE, jnp.float32)
    )
    pltpu.sync_copy(scratch, o_hbm)

  with pytest.raises(
    mpmd.UninitializedError, match=r"pl.run_scoped's 'staged' at \S+:\d+"
  ):
    with mpmd.typed_errors():
      jax.block_until_ready(_launch(kernel)(jnp.ones(SHAPE, jnp.float32)))
