"""The kernels' shared helpers: each check's error kind and message;
rows_dot's rows, rounded whatever rows surround them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpmd.kernels import _common

_X = jnp.zeros((2, 3), jnp.float32)


@pytest.mark.parametrize(
  "call, error, message",
  [
    (
      lambda: _common.check_array("f", "x", [1, 2], rank=2),
      TypeError,
      "f: expected 'x' to be an array, got list",
    ),
    (
      lambda: _common.check_array("f", "x", _X, rank=1, shape_doc="(n,)"),
      ValueError,
      r"f: expected 'x' of rank 1 \(n,\), got rank 2 with shape \(2, 3\)",
    ),
    (
      lambda: _common.check_array("f", "x", jnp.zeros((0, 3)), nonempty=True),
      ValueError,
      "with no zero-sized dimension, got shape",
    ),
    (
      lambda: _common.check_dtype("f", "x", _X, (jnp.bfloat16, jnp.float16)),
      TypeError,
      "f: expected 'x' of dtype bfloat16 or float16, got float32",
    ),
    (
      lambda: _common.as_dtype("f", "out", "nope", (jnp.float32,)),
      TypeError,
      "f: expected 'out' to be a dtype, got 'nope'",
    ),
    (
      lambda: _common.as_dtype("f", "out", jnp.int8, (jnp.float32,)),
      TypeError,
      "f: expected 'out' float32, got int8",
    ),
    (
      lambda: _common.check_bool("f", "flag", 1),
      TypeError,
      "f: expected 'flag' to be a bool, got 1",
    ),
    (
      lambda: _common.check_int("f", "n", True),
      TypeError,
      "f: expected 'n' to be an int, got True",
    ),
    (
      lambda: _common.check_int("f", "n", 0),
      ValueError,
      "f: expected 'n' >= 1, got 0",
    ),
    (
      lambda: _common.check_int("f", "n", 6, multiple_of=4, why="a tile"),
      ValueError,
      r"f: expected 'n' to be a multiple of 4 \(a tile\), got 6",
    ),
  ],
)
def test_check_errors(call, error, message):
  with pytest.raises(error, match=message):
    call()


def test_checks_pass_and_return_canonical_values():
  _common.check_array("f", "x", _X, rank=2, nonempty=True)
  assert _common.check_dtype("f", "x", _X, (jnp.float32,)) == jnp.float32
  assert _common.as_dtype("f", "o", "bfloat16", (jnp.bfloat16,)) == (
    jnp.bfloat16
  )
  assert _common.check_bool("f", "b", np.bool_(True)) is True
  assert type(_common.check_int("f", "n", np.int32(8), multiple_of=4)) is int


def test_out_type_varies_like_its_operands():
  mesh = jax.make_mesh((1,), ("x",))
  spec = jax.sharding.PartitionSpec

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=spec("x"), out_specs=spec("x"))
  def f(x):
    varying = _common.varying_axes(x)
    assert varying == {"x"}
    t = _common.out_type((2,), jnp.float32, varying)
    assert jax.typeof(x).manual_axis_type.varying == (
      t.manual_axis_type.varying
    )
    return x

  f(jax.device_put(jnp.zeros((2,)), jax.NamedSharding(mesh, spec("x"))))
  assert _common.varying_axes(_X) == frozenset()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
  "k,n,contract_w", [(16, 24, 0), (12, 8, 0), (8, 12, 1), (256, 512, 0)]
)
def test_rows_dot_rounds_a_row_whatever_rows_surround_it(
  rng, dtype, k, n, contract_w
):
  # XLA:CPU rounds a row of a few-row dot differently from a many-row one
  # (f32 16x24: up to 48 rows one way, from 56 the other); rows_dot must
  # not, wherever the rows start (the fused and unfused MoE layers agree
  # bit for bit only so).
  x = jnp.asarray(rng.standard_normal((600, k)), dtype)
  w_shape = (k, n) if contract_w == 0 else (n, k)
  w = jnp.asarray(rng.standard_normal(w_shape), dtype)
  dot = jax.jit(lambda x, w: _common.rows_dot(x, w, contract_w, jnp.float32))
  many = np.asarray(dot(x[:512], w))
  assert many.shape == (512, n)
  for m in (8, 40, 48, 56, 88, 120, 128, 136, 256, 264):
    for start in (0, 3, 77):
      few = np.asarray(dot(x[start : start + m], w))
      np.testing.assert_array_equal(few, many[start : start + m])
