"""Quickstart: a single-mesh mpmd_map kernel, run on CPU, lowered for TPU/CUDA.

python examples/quickstart.py
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd import registry
from mpmd.demos import gpu_add_one

mesh = mpmd.tensorcore_mesh("core", num_cores=1)


def axpy_kernel(x_hbm, y_hbm, o_hbm, x_vmem, y_vmem):
  # mpmd_map does not pipeline: the kernel moves its data HBM <-> VMEM.
  pltpu.sync_copy(x_hbm, x_vmem)
  pltpu.sync_copy(y_hbm, y_vmem)
  x_vmem[...] = 2.0 * x_vmem[...] + y_vmem[...]
  pltpu.sync_copy(x_vmem, o_hbm)


def axpy(x, y):
  return mpmd.mpmd_map(
    [(mesh, axpy_kernel)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[pltpu.VMEM(x.shape, x.dtype)] * 2,
  )(x, y)


def demo() -> registry.Demo:
  """For ``mpmd lower examples/quickstart.py --platform tpu``."""
  x = jnp.arange(8 * 256, dtype=jnp.float32).reshape(8, 256)
  return registry.Demo(axpy, (x, jnp.ones_like(x)), ("tpu", "cpu"))


def main():
  x = jnp.arange(8 * 256, dtype=jnp.float32).reshape(8, 256)
  y = jnp.ones_like(x)
  out = jax.jit(axpy)(x, y)  # interpret=None: the CPU fallback runs it
  np.testing.assert_allclose(out, 2.0 * x + y)
  print("CPU fallback: OK (matches 2 * x + y)")

  tpu = jax.jit(axpy).trace(x, y).lower(lowering_platforms=("tpu",))
  print("TPU lowering:", "OK" if "tpu_custom_call" in tpu.as_text() else "FAIL")

  z = jnp.ones((128, 128), jnp.float32)
  np.testing.assert_allclose(gpu_add_one(z), z + 1.0)
  cuda = jax.jit(gpu_add_one).trace(z).lower(lowering_platforms=("cuda",))
  print(
    "GPU simulator: OK;",
    "CUDA lowering:",
    "OK" if "mosaic_gpu" in cuda.as_text() else "FAIL",
  )


if __name__ == "__main__":
  main()
