"""Views of a Ref as operands of a launch (issue 36, item 4): as upstream's
mpmd_map (jax 0.12), ``x_ref.at[i]`` and ``x_ref.reshape(...)`` may be
passed, and the kernels see the view; reads and writes through it reach
the Ref. Beyond upstream's jax 0.10.2, which rejects them, the same holds
there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd import _jax

ROWS = (4, 8, 128)
MESH = mpmd.tensorcore_mesh("core", num_cores=1)


def _copy(src, dst):
  pltpu.sync_copy(src, dst)


def _copy_out(kernel, shape):
  return kernel(
    _copy, out_type=jax.ShapeDtypeStruct(shape, jnp.float32), mesh=MESH
  )


def _views(kernel):
  """Copies out window ``i`` of ``x`` (``.at[i]``, a traced index) and
  half ``i // 2`` of it seen as two blocks of 16 rows (a reshape, then
  ``.at``)."""

  def f(x, i):
    x_ref = jax.new_ref(x)
    row = _copy_out(kernel, ROWS[1:])(x_ref.at[i])
    half = _copy_out(kernel, (16, 128))(x_ref.reshape(2, 16, 128).at[i // 2])
    return row, half

  return f


def _x():
  return jnp.arange(np.prod(ROWS), dtype=jnp.float32).reshape(ROWS)


@pytest.mark.parametrize("i", [0, 1, 3])
def test_a_kernel_reads_the_view_it_is_passed(i):
  x = _x()
  row, half = jax.jit(_views(mpmd.kernel))(x, i)
  np.testing.assert_array_equal(row, x[i])
  np.testing.assert_array_equal(half, x.reshape(2, 16, 128)[i // 2])


def test_a_kernel_writes_through_the_view_into_the_ref():
  def fill(x_hbm, o_view):
    pltpu.sync_copy(x_hbm, o_view)

  put = mpmd.kernel(fill, out_type=(), mesh=MESH)

  @jax.jit
  def f(x, i):
    o_ref = jax.new_ref(jnp.zeros(ROWS, jnp.float32))
    put(x, o_ref.at[i])
    put(x + 1, o_ref.at[3])
    return jax.freeze(o_ref)

  x = jnp.ones(ROWS[1:], jnp.float32)
  expected = np.zeros(ROWS, np.float32)
  expected[1], expected[3] = 1, 2
  np.testing.assert_array_equal(f(x, 1), expected)


def test_a_static_view_of_a_multi_mesh_launch():
  """Both meshes' kernels see the same view (here a fixed ``.at[2]``)."""
  other = mpmd.tensorcore_mesh("other", num_cores=1)

  def first(x_view, o_hbm):
    pltpu.sync_copy(x_view.at[:4], o_hbm.at[:4])

  def second(x_view, o_hbm):
    pltpu.sync_copy(x_view.at[4:], o_hbm.at[4:])

  f = mpmd.mpmd_map(
    [(MESH, first), (other, second)],
    jax.ShapeDtypeStruct(ROWS[1:], jnp.float32),
  )

  @jax.jit
  def g(x):
    return f(jax.new_ref(x).at[2])

  x = _x()
  np.testing.assert_array_equal(g(x), x[2])


def test_two_views_of_one_ref_are_one_ref_passed_twice():
  def two(a, b, o_hbm):
    pltpu.sync_copy(a, o_hbm)

  f = mpmd.kernel(
    two, out_type=jax.ShapeDtypeStruct(ROWS[1:], jnp.float32), mesh=MESH
  )

  def g(x):
    x_ref = jax.new_ref(x)
    return f(x_ref.at[0], x_ref.at[1])

  with pytest.raises(NotImplementedError, match="inputs 0 and 1 are one Ref"):
    jax.jit(g)(_x())


def _operand_types(kernel) -> list[str]:
  with mpmd.tpu_target("v5e"):
    text = (
      jax.jit(_views(kernel))
      .trace(_x(), 1)
      .lower(lowering_platforms=("tpu",))
      .as_text()
    )
  return [
    line.rsplit(" : ", 1)[1].split(" -> ")[0]
    for line in text.splitlines()
    if "tpu_custom_call" in line
  ]


def test_views_lower_for_tpu():
  """Mosaic gets the whole Ref and the view's index, as from upstream."""
  ours = _operand_types(mpmd.kernel)
  assert ours == ["(tensor<4x8x128xf32>, tensor<1xi32>)"] * 2
  if _jax.JAX_VERSION >= (0, 11):  # upstream's 0.10.2 takes no views
    assert ours == _operand_types(pl.kernel)
