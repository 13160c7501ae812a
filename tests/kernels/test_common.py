"""The kernels' shared checks: the error kind and message for each case."""

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
