"""Warp specialization as MPMD: a memory warpgroup feeds compute warpgroups.

Two GPU meshes share one kernel launch: the ``memory`` mesh (1 warpgroup)
streams row blocks of ``x`` into a 2-slot SMEM ring with TMA copies; the
``compute`` mesh (2 warpgroups) waits on each slot's load barrier, writes
``2 * x + 1`` for its half of the columns, and releases the slot through a
consumed barrier. SMEM and barriers are shared by both meshes.

Runs in the Mosaic GPU simulator on CPU and cross-lowers for CUDA:

    python examples/warp_specialized_copy.py
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import mpmd
from mpmd import registry

BLOCK_ROWS, SLOTS, COMPUTE_WGS = 64, 2, 2
memory = plgpu.Mesh(num_threads=1, thread_name="memory")
compute = plgpu.Mesh(num_threads=COMPUTE_WGS, thread_name="compute")


def _steps(x_ref):
  return x_ref.shape[0] // BLOCK_ROWS


def stream_in(x_ref, o_ref, ring, loaded, consumed):
  del o_ref

  @pl.loop(0, _steps(x_ref))
  def _(step):
    slot = step % SLOTS

    @pl.when(step >= SLOTS)
    def _():  # the slot's previous block must have been consumed
      plgpu.barrier_wait(consumed.at[slot])

    rows = pl.ds(step * BLOCK_ROWS, BLOCK_ROWS)
    plgpu.copy_gmem_to_smem(x_ref.at[rows], ring.at[slot], loaded.at[slot])

  # Drain: observe the last release of each slot before the kernel ends.
  for slot in range(min(SLOTS, _steps(x_ref))):
    plgpu.barrier_wait(consumed.at[slot])


def transform(x_ref, o_ref, ring, loaded, consumed):
  wg = jax.lax.axis_index("compute")
  cols = pl.ds(
    wg * (x_ref.shape[1] // COMPUTE_WGS), x_ref.shape[1] // COMPUTE_WGS
  )

  @pl.loop(0, _steps(x_ref))
  def _(step):
    slot = step % SLOTS
    plgpu.barrier_wait(loaded.at[slot])
    rows = pl.ds(step * BLOCK_ROWS, BLOCK_ROWS)
    o_ref[rows, cols] = ring[slot, :, cols] * 2.0 + 1.0
    # The next TMA copy into the slot writes through the async proxy: only
    # this fence orders the reads above before it.
    plgpu.commit_smem()
    plgpu.barrier_arrive(consumed.at[slot])


def warp_specialized_copy(x: jax.Array) -> jax.Array:
  """``2 * x + 1`` for f32 ``x`` of shape ``(64 * k, 128)``."""
  return mpmd.mpmd_map(
    [(memory, stream_in), (compute, transform)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[
      plgpu.SMEM((SLOTS, BLOCK_ROWS, x.shape[1]), x.dtype),
      plgpu.Barrier(num_arrivals=1, num_barriers=SLOTS),
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=SLOTS),
    ],
  )(x)


def demo() -> registry.Demo:
  """For ``mpmd lower examples/warp_specialized_copy.py --platform cuda``."""
  x = jnp.arange(4 * BLOCK_ROWS * 128, dtype=jnp.float32).reshape(-1, 128)
  return registry.Demo(
    warp_specialized_copy,
    (x,),
    ("cuda", "cpu"),
    reference=lambda x: 2.0 * x + 1.0,
  )


def main():
  run = demo()
  f = jax.jit(run.fn)
  np.testing.assert_allclose(f(*run.args), run.reference(*run.args))
  print("warp-specialized copy in the GPU simulator: OK")
  text = f.trace(*run.args).lower(lowering_platforms=("cuda",)).as_text()
  print("CUDA lowering:", "OK" if "mosaic_gpu" in text else "FAIL")


if __name__ == "__main__":
  main()
