"""Built-in demos: the smallest kernels that show each platform works."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

from mpmd import meshes
from mpmd.api import mpmd_map
from mpmd.registry import Demo, register_demo


def _axpy_kernel(x_hbm, y_hbm, o_hbm, x_vmem, y_vmem):
  pltpu.sync_copy(x_hbm, x_vmem)
  pltpu.sync_copy(y_hbm, y_vmem)
  x_vmem[...] = 2.0 * x_vmem[...] + y_vmem[...]
  pltpu.sync_copy(x_vmem, o_hbm)


def axpy(x: jax.Array, y: jax.Array) -> jax.Array:
  """``2 * x + y`` as a one-core TPU kernel (f32 ``(8k, 128m)`` operands)."""
  mesh = meshes.tensorcore_mesh("core", num_cores=1)
  return mpmd_map(
    [(mesh, _axpy_kernel)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[pltpu.VMEM(x.shape, x.dtype)] * 2,
  )(x, y)


@register_demo("quickstart")
def _quickstart() -> Demo:
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  y = jnp.ones((8, 128), jnp.float32)
  return Demo(axpy, (x, y), ("tpu", "cpu"), reference=lambda x, y: 2 * x + y)


def gpu_add_one(x: jax.Array) -> jax.Array:
  """``x + 1`` over two warpgroups, each taking half the rows."""
  mesh = plgpu.Mesh(num_threads=2, thread_name="wg")

  def body(x_ref, o_ref):
    half = x_ref.shape[0] // 2
    rows = pl.ds(jax.lax.axis_index("wg") * half, half)
    o_ref[rows, :] = x_ref[rows, :] + 1.0

  return mpmd_map([(mesh, body)], jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


@register_demo("gpu_quickstart")
def _gpu_quickstart() -> Demo:
  x = jnp.arange(128 * 128, dtype=jnp.float32).reshape(128, 128)
  return Demo(gpu_add_one, (x,), ("cuda", "cpu"), reference=lambda x: x + 1)
