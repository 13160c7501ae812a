"""What mpmd keeps between calls, JAX's cache utilities keep: after
``jax.clear_caches()`` nothing of ours holds the user's kernel functions."""

import gc
import weakref

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

import mpmd


def _kernel():
  def double(x_hbm, o_hbm, buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] = buf[...] * 2
    pltpu.sync_copy(buf, o_hbm)

  return double


def test_clear_caches_lets_go_of_kernel_functions():
  fn = _kernel()
  alive = weakref.ref(fn)
  f = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), fn)],
    jax.ShapeDtypeStruct((8, 128), jnp.float32),
    scratch_types=[pltpu.VMEM((8, 128), jnp.float32)],
  )
  x = jnp.ones((8, 128))
  assert float(f(x)[0, 0]) == 2.0
  assert float(jax.jit(f)(x)[0, 0]) == 2.0
  del f, fn
  gc.collect()
  assert alive() is not None  # kept for the next call of the same kernel
  jax.clear_caches()
  gc.collect()
  assert alive() is None
