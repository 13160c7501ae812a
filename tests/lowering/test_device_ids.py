"""Device ids known when the kernel is traced (``lowering.device_ids``)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpmd import _jax
from mpmd._lowering import device_ids

N = 4


def _known(fn, *args):
  closed = jax.make_jaxpr(fn, axis_env=[("x", N)])(*args)
  known = device_ids.Known(closed.jaxpr, ("x",), {"x": N})
  return [known.value(v) for v in closed.jaxpr.outvars]


def test_values_computed_from_the_coordinates_are_known_on_every_device():
  def fn():
    me = lax.axis_index("x")
    return (
      me,
      lax.rem(me + 1, N),
      (me + N - 1) % N,  # jnp's remainder: a nested jit
      jnp.where(me == 0, N - 1, me - 1),
      jnp.int32(2),
    )

  me, right, left, left_too, two = _known(fn)
  devices = np.arange(N)
  np.testing.assert_array_equal(me, devices)
  np.testing.assert_array_equal(right, (devices + 1) % N)
  np.testing.assert_array_equal(left, (devices - 1) % N)
  np.testing.assert_array_equal(left_too, (devices - 1) % N)
  np.testing.assert_array_equal(two, [2] * N)


def test_values_read_at_run_time_are_not():
  def fn(table, scale):
    me = lax.axis_index("x")
    return table[me], me * scale, lax.rem(me + 1, N).astype(jnp.float32)

  table, scaled, floating = _known(
    fn, jnp.arange(N, dtype=jnp.int32), jnp.int32(2)
  )
  assert table is None and scaled is None
  assert floating is None  # only integer scalars are followed


def test_a_loop_knows_its_invariants_not_its_carries():
  def fn():
    right = lax.rem(lax.axis_index("x") + 1, N)

    def body(t, carry):
      return carry + lax.rem(right + t, N)

    return lax.fori_loop(0, 3, body, jnp.int32(0))

  closed = jax.make_jaxpr(fn, axis_env=[("x", N)])()
  known = device_ids.Known(closed.jaxpr, ("x",), {"x": N})
  # A fori_loop of static trip count: a scan, whose consts are invariants.
  [loop] = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
  body = loop.params["jaxpr"]
  body = getattr(body, "jaxpr", body)
  n_consts, _ = _jax.scan_layout(loop.params)
  values = [known.value(v) for v in body.invars]
  [invariant] = values[:n_consts]
  np.testing.assert_array_equal(invariant, (np.arange(N) + 1) % N)
  assert all(v is None for v in values[n_consts:])  # the counter and sum
  assert known.value(closed.jaxpr.outvars[0]) is None


def test_a_primitive_without_a_batching_rule_is_left_to_run_time():
  unbatched = _jax.core.Primitive("mpmd_test_unbatched")
  unbatched.def_impl(lambda x: x + 1)
  unbatched.def_abstract_eval(lambda x: x)

  def fn():
    return unbatched.bind(lax.axis_index("x")), lax.axis_index("x") + 1

  unknown, known = _known(fn)
  assert unknown is None
  np.testing.assert_array_equal(known, np.arange(N) + 1)
