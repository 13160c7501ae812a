"""Where upstream's tests match an error by its text, ours says it too
(issue 36, item 5): our message first, then upstream's words for the same
condition, so that code and tests written against upstream still match.
Each pattern below is the one upstream's test uses (jax 0.10.2 and the
newest stored test files), matched against our error for the same program.
"""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import tpu_sc as plsc

import mpmd
from mpmd.kernels import gpu

ROWS = (8, 128)


def _tc():
  return mpmd.tensorcore_mesh("tc_core", num_cores=1)


def test_the_same_ref_passed_twice():
  """tpu_pallas_mpmd_test: test_passing_in_duplicate_refs_errors."""

  @jax.jit
  def f(x):
    x_ref = jax.new_ref(x)
    mpmd.kernel(body=lambda *_: None, mesh=_tc())(x_ref, x_ref)

  with pytest.raises(
    NotImplementedError,
    match="Cannot pass the same ref into a mpmd map multiple times",
  ):
    f(jnp.zeros(ROWS, jnp.int32))


def test_a_ref_closed_over_and_passed():
  @jax.jit
  def f(x):
    x_ref = jax.new_ref(x)

    def body(passed):
      pltpu.sync_copy(x_ref, passed)

    mpmd.kernel(body=body, mesh=_tc())(x_ref)

  with pytest.raises(
    NotImplementedError,
    match="Closed-over ref aliases with a passed-in ref is not supported.",
  ):
    f(jnp.zeros(ROWS, jnp.int32))


def test_scratch_without_an_owner_in_a_launch_of_several_meshes():
  """tpu_pallas_mpmd_test: one mesh takes an unowned semaphore, two do
  not (upstream's order: before any kernel is traced)."""
  with mpmd.tpu_target("v6e"):
    v_mesh = plsc.VectorSubcoreMesh(
      core_axis_name="s_core",
      subcore_axis_name="subcore",
      num_cores=1,
      num_subcores=1,
    )
    s_mesh = plsc.ScalarSubcoreMesh(axis_name="s_core", num_cores=1)
    traced = []

    def dummy_fn(*_):
      traced.append(True)

    out = jax.ShapeDtypeStruct([8], jnp.int32)
    mpmd.kernel(
      body=[dummy_fn],
      mesh=[v_mesh],
      out_type=out,
      scratch_types=[pltpu.SemaphoreType.REGULAR(())],
    )()
    traced.clear()
    with pytest.raises(
      NotImplementedError,
      match=r"MPMD map with more than one mesh requires scratch_type to have",
    ):
      mpmd.kernel(
        body=[dummy_fn, dummy_fn],
        mesh=[v_mesh, s_mesh],
        out_type=out,
        scratch_types=[pltpu.SemaphoreType.REGULAR(())],
      )()
    assert not traced


def _pipeline_kernel(**emit_kwargs):
  def body(o_smem):
    o_smem[...] = jnp.zeros((128, 128), jnp.float32)

  def kernel(o_gmem):
    gpu.emit_pipeline(body, **emit_kwargs)(o_gmem)

  return mpmd.kernel(
    kernel,
    out_type=jax.ShapeDtypeStruct((256, 256), jnp.float32),
    mesh=plgpu.Mesh(num_threads=1, thread_name="wg"),
  )


@pytest.mark.parametrize("grid", [(0, 2), (2, -1)])
def test_an_empty_grid(grid):
  """mosaic_gpu_test: test_emit_with_empty_grid."""
  spec = pl.BlockSpec((128, 128), lambda i, j: (i, j))
  with pytest.raises(
    ValueError, match="All elements in the grid must be strictly positive"
  ):
    _pipeline_kernel(out_specs=[spec], grid=grid)()


def test_pipeline_mode():
  """mosaic_gpu_test: a BlockSpec with pipeline_mode=pl.Buffered(...)."""
  spec = pl.BlockSpec(
    (128, 128), lambda i, j: (i, j), pipeline_mode=pl.Buffered(2)
  )
  with pytest.raises(
    NotImplementedError, match="pipeline_mode= is not supported"
  ):
    _pipeline_kernel(out_specs=[spec], grid=(2, 2))()


CLUSTER_MESH = dict(
  cluster=(2, 2), cluster_names=("c0", "c1"), num_threads=2, thread_name="t"
)


def _scoped(collective_axes):
  def kernel(o_gmem):
    pl.run_scoped(
      lambda ref: None,
      plgpu.GMEM((2,), jnp.int32),
      collective_axes=collective_axes,
    )

  return mpmd.kernel(
    kernel,
    out_type=jax.ShapeDtypeStruct((), jnp.int32),
    mesh=plgpu.Mesh(**CLUSTER_MESH),
  )


@pytest.mark.parametrize(
  "collective_axes, match",
  [
    # gpu_pallas_interpret_test: cluster axes first, then the thread axis.
    (
      ("c0",),
      r"Collective allocations along cluster axes are not supported\.",
    ),
    (
      ("c1", "t"),
      r"Collective allocations along cluster axes are not supported\.",
    ),
    (
      (),
      None,  # no collective axes: allowed
    ),
    (
      ("unknown_axis",),
      r"Collective axis `unknown_axis` not found among axes "
      r"`\['c0', 'c1', 't'\]`",
    ),
  ],
)
def test_run_scoped_collective_axes(collective_axes, match):
  f = _scoped(collective_axes)
  if match is None:
    jax.jit(f).trace()
    return
  with pytest.raises(ValueError, match=match):
    jax.jit(f).trace()


def test_run_scoped_without_the_thread_axis():
  mesh = plgpu.Mesh(
    grid=(2,), grid_names=("blk",), num_threads=2, thread_name="t"
  )

  def kernel(o_gmem):
    pl.run_scoped(
      lambda ref: None, plgpu.GMEM((2,), jnp.int32), collective_axes=("blk",)
    )

  f = mpmd.kernel(
    kernel, out_type=jax.ShapeDtypeStruct((), jnp.int32), mesh=mesh
  )
  with pytest.raises(
    ValueError,
    match=r"Scoped allocation must have the thread axis in its collective"
    r" axes\.",
  ):
    jax.jit(f).trace()
