"""``failures.checked``: a launch's run-time checks threaded through its
control flow, reporting the first that failed with its values exact."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.experimental import checkify
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd._lowering import failures


def _report(fn, *args):
  """(format, values, named values) of the first failed check, or None,
  from a jitted run of ``fn``."""
  failure, out = jax.jit(failures.checked(fn))(*args)
  return jax.tree.map(np.asarray, failure).message(), out


def test_no_failure_reports_none_and_keeps_the_outputs():
  def fn(x):
    checkify.debug_check(x > 0, "x was {}", x)
    return {"double": 2 * x}

  message, out = _report(fn, jnp.int32(3))
  assert message is None
  assert int(out["double"]) == 6


def test_the_first_failure_in_execution_order_wins():
  # Two sites in a loop body: the second site fails at i == 2, the first
  # at i == 4; the report is the second's, with its i.
  def fn(n):
    def body(i, c):
      checkify.debug_check(i < 4, "first site at {}", i)
      checkify.debug_check(i != 2, "second site at {}", i)
      return c + i

    return lax.fori_loop(0, n, body, jnp.int32(0))

  message, total = _report(fn, jnp.int32(6))
  fmt, args, named = message
  assert fmt.format(*args, **named) == "second site at 2"
  assert int(total) == 15  # the launch runs on: the report comes after


@pytest.mark.parametrize("where", ["while", "scan", "cond", "jit", "nested"])
def test_checks_in_control_flow_are_seen(where):
  def check(x):
    checkify.debug_check(x != 7, "hit {} in " + where, x)
    return x

  def fn(x):
    if where == "while":
      return lax.while_loop(lambda c: c < 10, lambda c: check(c) + 1, x)
    if where == "scan":
      return lax.scan(lambda c, y: (check(c + y), None), x, jnp.arange(5))[0]
    if where == "cond":
      return lax.cond(x > 0, check, lambda y: y, x)
    if where == "jit":
      return jax.jit(check)(x)
    inner = lambda c: lax.fori_loop(0, 3, lambda j, d: check(d + j), c)  # noqa: E731
    return lax.fori_loop(0, 3, lambda i, c: inner(c), x)

  start = {"while": 0, "scan": 1, "cond": 7, "jit": 7, "nested": 0}[where]
  fmt, args, named = _report(fn, jnp.int32(start))[0]
  assert fmt.format(*args, **named) == f"hit 7 in {where}"


@pytest.mark.parametrize(
  "dtype",
  [
    np.bool_,
    np.int8,
    np.uint8,
    np.int16,
    np.float16,
    ml_dtypes.bfloat16,
    np.int32,
    np.uint32,
    np.float32,
    np.complex64,
    ml_dtypes.int4,
    ml_dtypes.uint4,
  ],
)
def test_values_of_every_dtype_come_back_exactly(dtype):
  values = np.array([[1, 0], [3, 5]]).astype(dtype)
  if np.issubdtype(dtype, np.floating) or dtype is ml_dtypes.bfloat16:
    values = (values / 3).astype(dtype)  # not exact in binary: all bits matter
  if dtype is np.complex64:
    values = values / 3 + 1j * values.real / 7

  def fn(x, y):
    checkify.debug_check(False, "{} and {k}", y, k=x)
    return x

  fmt, (got_y,), named = _report(fn, values, jnp.int32(-9))[0]
  assert got_y == -9
  assert named["k"].dtype == values.dtype
  np.testing.assert_array_equal(named["k"], values)


def test_64_bit_values_come_back_exactly():
  with jax.enable_x64(True):
    values = np.array([1 / 3, -2.5e300])
    big = np.int64(-(2**40) - 3)

    def fn(x, y):
      checkify.debug_check(False, "{} {}", x, y)
      return x

    _, (got_x, got_y), _ = _report(fn, values, big)[0]
  np.testing.assert_array_equal(got_x, values)
  assert got_y == big and got_y.dtype == np.int64


def test_a_check_in_a_loop_condition_runs_before_each_test():
  # A loop that reads a Ref to decide has its window check in the
  # condition: checked before the first body and after each one.
  def fn(x):
    def cond(c):
      checkify.debug_check(c < 3, "condition at {}", c)
      return c < 10

    def body(c):
      checkify.debug_check(c < 2, "body at {}", c)
      return c + 1

    return lax.while_loop(cond, body, x)

  for start, expected in [(0, "body at 2"), (5, "condition at 5")]:
    (fmt, args, named), out = _report(fn, jnp.int32(start))
    assert fmt.format(*args, **named) == expected
    assert int(out) == 10


def test_a_check_under_jax_checkpoint_is_seen():
  def fn(x):
    def step(c):
      checkify.debug_check(c != 4, "hit {}", c)
      return c + 1

    return lax.fori_loop(0, 6, lambda i, c: jax.checkpoint(step)(c), x)

  fmt, args, named = _report(fn, jnp.int32(0))[0]
  assert fmt.format(*args, **named) == "hit 4"


def test_a_kernel_loop_that_reads_a_ref_to_decide_is_checked():
  # The condition's load at a loop counter has a run-time window check.
  def kernel(x_hbm, o_hbm, s):
    pltpu.sync_copy(x_hbm, s)
    s[0] = lax.while_loop(
      lambda i: (i < 8) & (s[i] != 0), lambda i: i + 1, jnp.int32(0)
    )
    pltpu.sync_copy(s, o_hbm)

  f = jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
      jax.ShapeDtypeStruct((8,), jnp.int32),
      scratch_types=[pltpu.SMEM((8,), jnp.int32)],
    )
  )
  first_zero = jnp.array([5, 4, 3, 0, 1, 1, 1, 1], jnp.int32)
  np.testing.assert_array_equal(f(first_zero)[0], 3)
  for _ in range(2):  # typed on every call
    with (
      pytest.raises(mpmd.OutOfBoundsError, match=r"a load's window \.at\[8\]"),
      mpmd.typed_errors(),
    ):
      f(jnp.ones((8,), jnp.int32)).block_until_ready()
