"""The checking executor rounds a kernel's floating-point math as XLA does
when it compiles it, from a segment's first run on: its numbers do not
depend on how often the segment ran before in the process."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd._lowering.check import segments


def _math(x, activation):
  return activation(x * 1.7 + 0.3) * 0.9 - x


def _launch(activation):
  def kernel(x_hbm, o_hbm, buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] = _math(buf[...], activation)
    pltpu.sync_copy(buf, o_hbm)

  return mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    jax.ShapeDtypeStruct((64, 128), jnp.float32),
    scratch_types=[pltpu.VMEM((64, 128), jnp.float32)],
    interpret=mpmd.CheckParams(),
  )


@pytest.mark.parametrize(
  "activation",
  [jax.nn.gelu, functools.partial(jax.nn.gelu, approximate=False)],
  ids=["gelu_tanh", "gelu_erf"],
)
def test_first_run_rounds_as_compiled_xla(activation):
  jax.clear_caches()  # every segment text starts from zero runs
  x = jnp.asarray(
    np.random.default_rng(0).standard_normal((64, 128)), jnp.float32
  )
  expected = np.asarray(jax.jit(_math, static_argnums=1)(x, activation))
  f = jax.jit(_launch(activation))
  for _ in range(segments.COMPILE_AFTER + 2):
    np.testing.assert_array_equal(np.asarray(f(x)), expected)


def test_one_rounding_runs_eagerly_until_compiled():
  # One rounding operation (what most segments of index arithmetic and
  # data movement come to) has nothing to fuse with: it runs one by one
  # until the segment has run often enough to pay for a compile.
  jaxpr = jax.make_jaxpr(lambda x: (x * 2.0).reshape(-1))(jnp.ones((2, 4)))
  one = segments.Segment(jaxpr.eqns, jaxpr.jaxpr.invars, jaxpr.jaxpr.outvars)
  jaxpr = jax.make_jaxpr(lambda x: x * 2.0 + 1.0)(jnp.ones((2, 4)))
  two = segments.Segment(jaxpr.eqns, jaxpr.jaxpr.invars, jaxpr.jaxpr.outvars)
  assert (one.compile_now, two.compile_now) == (False, True)


def _segment(fn, *args):
  closed = jax.make_jaxpr(fn)(*args)
  return segments.Segment(
    closed.eqns, closed.jaxpr.invars, closed.jaxpr.outvars
  )


def test_bfloat16_math_counts_and_key_values_do_not_crash():
  # numpy's dtype test knows neither bfloat16 nor PRNG key types.
  assert _segment(lambda x: x * 2 + 1, jnp.ones(4, jnp.bfloat16)).compile_now
  folded = _segment(lambda k: jax.random.fold_in(k, 1), jax.random.key(0))
  assert not folded.compile_now


def test_a_kernel_drawing_random_numbers_runs_checked():
  def kernel(x_hbm, o_hbm, buf):
    pltpu.sync_copy(x_hbm, buf)
    key = jax.random.fold_in(jax.random.key(0), 3)
    buf[...] = buf[...] + jax.random.uniform(key, (8, 128))
    pltpu.sync_copy(buf, o_hbm)

  f = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    jax.ShapeDtypeStruct((8, 128), jnp.float32),
    scratch_types=[pltpu.VMEM((8, 128), jnp.float32)],
    interpret=mpmd.CheckParams(),
  )
  want = jax.random.uniform(jax.random.fold_in(jax.random.key(0), 3), (8, 128))
  got = jax.jit(f)(jnp.zeros((8, 128)))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
