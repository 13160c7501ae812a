"""Upstream's warp-specialized pipeline programs that jax 0.10.2's Mosaic
GPU simulator could not run through ours: a compute context that lays out
its carry with ``plgpu.layout_cast`` (no CPU rule there; a no-op on values),
and any program after a failed launch (its leftover state failed the next
launch with a bare AssertionError)."""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest
from upstream_pipeline_util import WG, blocks_sum, ws, ws_mesh

import mpmd

BLOCK = (64, 64)


def _carry_accumulate(num_compute_wgs=2, m=256, n=256):
  """Upstream's test_carry_accumulate: the compute warpgroups sum the
  blocks of ``x`` into a carry laid out with ``plgpu.layout_cast``."""

  def kernel(x_gmem, acc_gmem, acc_smem):
    def compute_context(pipeline_fn):
      start = plgpu.layout_cast(
        jnp.zeros(BLOCK, jnp.float32),
        plgpu.Layout.WG_STRIDED(BLOCK, vec_size=2),
      )
      acc_smem[...] = pipeline_fn(start)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(acc_smem, acc_gmem)
      plgpu.wait_smem_to_gmem(0)

    def step(_, x_smem, carry):
      return x_smem[...] + carry

    ws(
      step,
      grid=(m // BLOCK[0], n // BLOCK[1]),
      max_concurrent_steps=2,
      num_compute_wgs=num_compute_wgs,
      compute_context=compute_context,
      in_specs=[pl.BlockSpec(BLOCK, lambda i, j: (i, j))],
      out_specs=[],
    )(x_gmem)

  return mpmd.kernel(
    kernel,
    jax.ShapeDtypeStruct(BLOCK, jnp.float32),
    mesh=ws_mesh(num_compute_wgs),
    scratch_types=[plgpu.SMEM(BLOCK, jnp.float32)],
  )


def test_carry_laid_out_with_layout_cast():
  x = jax.random.uniform(jax.random.key(0), (256, 256), jnp.float32)
  np.testing.assert_allclose(
    _carry_accumulate()(x), blocks_sum(x, BLOCK), rtol=1e-5, atol=1e-4
  )


def test_a_failed_launch_leaves_the_simulator_to_the_next():
  def reads_past(x_gmem, o_gmem):
    o_gmem[...] = x_gmem[pl.ds(jnp.int32(1) + x_gmem.shape[0] - 1, 1)]

  failing = mpmd.kernel(
    reads_past,
    jax.ShapeDtypeStruct((1, 128), jnp.float32),
    mesh=plgpu.Mesh(num_threads=3, thread_name=WG),
  )
  with pytest.raises(mpmd.OutOfBoundsError):
    with mpmd.typed_errors():
      jax.block_until_ready(failing(jnp.ones((8, 128), jnp.float32)))
  # A launch with another number of warpgroups, then the same one.
  x = jax.random.uniform(jax.random.key(1), (256, 256), jnp.float32)
  for num_compute_wgs in (1, 2):
    np.testing.assert_allclose(
      _carry_accumulate(num_compute_wgs)(x),
      blocks_sum(x, BLOCK),
      rtol=1e-5,
      atol=1e-4,
    )
