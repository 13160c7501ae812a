"""``CheckParams(unwritten_outputs=True)``: output elements that no program
wrote are an ``mpmd.UninitializedError`` when the launch ends (hardware
would return garbage there; the CPU fallback's NaN is easy to miss)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd

ROWS, COLS = 16, 128
cores = mpmd.tensorcore_mesh("core", num_cores=2)
X = jnp.arange(ROWS * COLS, dtype=jnp.float32).reshape(ROWS, COLS)
CHECK = mpmd.CheckParams(unwritten_outputs=True)


def copy_halves(*, skip_core=None):
  """Each core copies its half of ``x`` to ``o``; ``skip_core`` forgets."""

  def kernel(x_hbm, o_hbm):
    c = jax.lax.axis_index("core")
    half = pl.ds(c * (ROWS // 2), ROWS // 2)

    @pl.when(c != skip_core if skip_core is not None else True)
    def _():
      pltpu.sync_copy(x_hbm.at[half], o_hbm.at[half])

  return kernel


def launch(kernel, interpret, **kw):
  return mpmd.mpmd_map(
    [(cores, kernel)],
    jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
    interpret=interpret,
    **kw,
  )


def test_an_unwritten_half_is_reported():
  f = launch(copy_halves(skip_core=1), CHECK)
  with pytest.raises(
    mpmd.UninitializedError,
    match=r"no program wrote output 'o_hbm' at element \(8, 0\) and 1023 "
    r"more of its 2048: the launch would return uninitialised memory",
  ):
    f(X)
  # Off by default: the same launch returns NaN where nothing wrote.
  out = np.asarray(launch(copy_halves(skip_core=1), mpmd.CheckParams())(X))
  np.testing.assert_array_equal(out[:8], np.asarray(X)[:8])
  assert np.isnan(out[8:]).all()


def test_a_fully_written_output_passes():
  out = launch(copy_halves(), CHECK)(X)
  np.testing.assert_array_equal(out, X)


def test_an_aliased_output_starts_written():
  def kernel(x_hbm, o_hbm, zeros):
    del x_hbm

    @pl.when(jax.lax.axis_index("core") == 0)
    def _():
      zeros[...] = jnp.zeros((8, COLS), jnp.float32)
      pltpu.sync_copy(zeros.at[0:1], o_hbm.at[0:1])

  scratch = [pltpu.VMEM((8, COLS), jnp.float32) @ cores]
  f = launch(kernel, CHECK, input_output_aliases={0: 0}, scratch_types=scratch)
  out = f(X)
  np.testing.assert_array_equal(out[1:], X[1:])
  np.testing.assert_array_equal(out[0], np.zeros(COLS, np.float32))


def test_a_dma_of_uninitialised_memory_does_not_count_as_a_write():
  def kernel(x_hbm, o_hbm, buf):
    del x_hbm

    @pl.when(jax.lax.axis_index("core") == 0)
    def _():
      pltpu.sync_copy(buf, o_hbm)  # buf was never written

  f = launch(
    kernel, CHECK, scratch_types=[pltpu.HBM((ROWS, COLS), jnp.float32)]
  )
  with pytest.raises(mpmd.UninitializedError, match="element \\(0, 0\\)"):
    f(X)


def test_the_device_is_named_under_shard_map():
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])

  def kernel(x_hbm, o_hbm):
    skip = jax.lax.axis_index("x") == 1

    @pl.when(jnp.logical_not(skip))
    def _():
      pltpu.sync_copy(x_hbm, o_hbm)

  def f(x):
    return mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      interpret=CHECK,
    )(x)

  g = jax.jit(
    jax.shard_map(
      f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False
    )
  )
  x = jax.device_put(X, NamedSharding(mesh, P("x")))
  with (
    pytest.raises(
      mpmd.UninitializedError, match=r"output 'o_hbm' \(device 1 \{'x': 1\}\)"
    ),
    mpmd.typed_errors(),
  ):
    g(x).block_until_ready()


def test_a_gpu_warpgroup_that_skips_its_columns_is_reported():
  mesh = plgpu.Mesh(num_threads=2, thread_name="wg")

  def kernel(x_ref, o_ref):
    wg = jax.lax.axis_index("wg")
    cols = pl.ds(wg * (COLS // 2), COLS // 2)

    @pl.when(wg == 0)
    def _():
      o_ref[:, cols] = x_ref[:, cols] + 1.0

  f = mpmd.mpmd_map(
    [(mesh, kernel)], jax.ShapeDtypeStruct(X.shape, X.dtype), interpret=CHECK
  )
  with pytest.raises(
    mpmd.UninitializedError, match=r"output 'o_ref' at element \(0, 64\)"
  ):
    f(X)


def test_the_option_is_a_bool():
  with pytest.raises(TypeError, match="'unwritten_outputs'.*'yes'"):
    mpmd.CheckParams(unwritten_outputs="yes")  # pyrefly: ignore
