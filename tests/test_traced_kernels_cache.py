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


def test_clear_caches_empties_the_launch_and_gmm_caches():
  # The eager launch's jit (keyed by the kernels' jaxprs) and gmm / tgmm's
  # per-configuration functions are kept by JAX's cache utility.
  from mpmd._primitives import mpmd_map as prim
  from mpmd.kernels.grouped_matmul import api

  f = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), _kernel())],
    jax.ShapeDtypeStruct((8, 128), jnp.float32),
    scratch_types=[pltpu.VMEM((8, 128), jnp.float32)],
  )
  f(jnp.ones((8, 128)))
  lhs, sizes = jnp.ones((16, 8)), jnp.array([10, 6], jnp.int32)
  mpmd.kernels.gmm(lhs, jnp.ones((2, 8, 4)), sizes)
  mpmd.kernels.tgmm(lhs.T, jnp.ones((16, 4)), sizes)
  caches = (
    prim._jitted_launch,
    api._differentiable_gmm,
    api._jitted,
    api._jitted_tgmm,
  )
  assert all(c.cache_info().currsize >= 1 for c in caches)
  jax.clear_caches()
  assert [c.cache_info().currsize for c in caches] == [0] * len(caches)
