"""A kernel with an ordered effect (an ordered ``io_callback`` in its body)
makes its launch ordered-effectful; the CPU lowering passes JAX's tokens on,
whichever path runs it (the simulators order the kernel's callbacks on a
token chain of their own)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd import _jax

SHAPE = (8, 128)


def _tpu_kernel(seen):
  def kernel(x_ref, o_ref, v_ref):
    io_callback(lambda: seen.append("kernel"), None, ordered=True)
    pltpu.sync_copy(x_ref, v_ref)
    v_ref[...] = v_ref[...] + 1.0
    pltpu.sync_copy(v_ref, o_ref)

  return kernel


def _gpu_kernel(seen):
  def kernel(x_ref, o_ref):
    io_callback(lambda: seen.append("kernel"), None, ordered=True)
    o_ref[...] = x_ref[...] + 1.0

  return kernel


def _tpu_launch(kernel, interpret):
  return mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    jax.ShapeDtypeStruct(SHAPE, jnp.float32),
    scratch_types=[pltpu.VMEM(SHAPE, jnp.float32)],
    interpret=interpret,
  )


def _gpu_launch(kernel, interpret):
  return mpmd.mpmd_map(
    [(plgpu.Mesh(), kernel)],
    jax.ShapeDtypeStruct(SHAPE, jnp.float32),
    interpret=interpret,
  )


@pytest.mark.parametrize(
  "make_kernel, launch, interpret",
  [
    (_tpu_kernel, _tpu_launch, None),
    (_tpu_kernel, _tpu_launch, pltpu.InterpretParams()),
    (_gpu_kernel, _gpu_launch, None),
  ],
  ids=["tpu-fallback", "tpu-simulator", "gpu-simulator"],
)
def test_an_ordered_io_callback_in_a_kernel_runs(
  make_kernel, launch, interpret
):
  seen = []
  f = launch(make_kernel(seen), interpret)
  x = jnp.zeros(SHAPE, jnp.float32)
  effects = jax.make_jaxpr(f)(x).effects
  assert any(e == _jax.ordered_io_effect() for e in effects)
  np.testing.assert_array_equal(jax.jit(f)(x), np.ones(SHAPE, np.float32))
  assert seen == ["kernel"]
