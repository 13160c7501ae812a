"""16-bit float buffers held as uint16 words on the CPU fallback, where
jaxlib 0.10.2's XLA would convert them whole for each window moved
(``lowering/words.py``): the same results, bit for bit, and a buffer that
nothing computes on converted once, at the start, not inside the loops and
branches that move its windows."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpmd import _jax
from mpmd._lowering import jaxpr_util, words


def _in_words(f, *args):
  """``f`` traced, then evaluated through ``words.evaluate_words``: its results,
  and the jaxpr of that evaluation."""
  jaxpr, consts = _jax.open_jaxpr(jax.make_jaxpr(f)(*args))

  def run(*a):
    return words.evaluate_words(jaxpr, consts, a)

  return jax.jit(run)(*args), jax.make_jaxpr(run)(*args)


def _conversions_of(jaxpr, shape) -> tuple[int, int]:
  """bitcast_convert_type equations on arrays of ``shape``: at the top
  level, and nested in loops and branches."""
  jaxpr = _jax.open_jaxpr(jaxpr)[0]
  whole = lambda e: (
    e.primitive is lax.bitcast_convert_type_p
    and e.invars[0].aval.shape == shape
  )
  top = sum(map(whole, jaxpr.eqns))
  return top, sum(map(whole, jaxpr_util.iter_eqns(jaxpr))) - top


def _bf16(shape, seed=0):
  x = np.random.default_rng(seed).standard_normal(shape)
  return jnp.asarray(x, jnp.bfloat16)


def test_a_buffer_only_sliced_is_converted_once_at_the_start():
  """gmm's shape: windows of a bf16 input read in a branch inside a loop."""

  def windows(x, starts):
    def body(i, acc):
      def take(acc):
        w = lax.dynamic_slice(x, (starts[i], 0), (8, 128))
        return acc + w.astype(jnp.float32)

      return lax.cond(starts[i] >= 0, take, lambda a: a, acc)

    return lax.fori_loop(0, 4, body, jnp.zeros((8, 128), jnp.float32))

  x, starts = _bf16((64, 128)), jnp.array([0, 5, -1, 56], jnp.int32)
  (got,), evaluation = _in_words(windows, x, starts)
  np.testing.assert_array_equal(got, windows(x, starts))
  # Once on the way in; none per window (each window converts back alone).
  assert _conversions_of(evaluation, (64, 128)) == (1, 0)


def test_a_static_slice_of_words_converts_the_slice():
  def rows(x):
    return x[8:16].astype(jnp.float32) * 2

  x = _bf16((64, 128))
  (got,), evaluation = _in_words(rows, x)
  np.testing.assert_array_equal(got, rows(x))
  # x is only sliced: words from the start, and only its slice converted.
  assert _conversions_of(evaluation, (64, 128)) == (1, 0)
  assert _conversions_of(evaluation, (8, 128)) == (1, 0)


def test_which_buffers_are_words():
  """Only moved (sliced, updated in place, carried): words. Read by a
  computing operation anywhere, through carries and updates: a float."""

  def program(x, y, z, i):
    def body(j, c):
      a, b = c
      a = lax.dynamic_update_slice(a, b[:1], (j, 0))
      return a, b

    a, b = lax.fori_loop(0, 2, body, (x, y))
    return a, lax.dynamic_slice(b, (i, 0), (1, 128)), z * 2

  args = _bf16((4, 128)), _bf16((4, 128), 1), _bf16((4, 128), 2), 1
  jaxpr = _jax.open_jaxpr(jax.make_jaxpr(program)(*args))[0]
  forms = words._Forms(jaxpr)
  assert [forms.words(v) for v in jaxpr.invars] == [True, True, False, False]

  def computed_later(x, y):
    x = lax.fori_loop(0, 2, lambda j, x: x.at[j].set(y[j]), x)
    return jnp.sum(x)

  jaxpr = _jax.open_jaxpr(jax.make_jaxpr(computed_later)(*args[:2]))[0]
  forms = words._Forms(jaxpr)
  # x reaches the sum through the loop: a float; y is only indexed.
  assert forms.words(jaxpr.invars[0]) is False


def test_loops_branches_scans_and_calls_give_the_same_bits():
  """Carries that start as literals, a branch that returns a literal, a
  scan over bf16 rows, a nested jit, f16 next to bf16, a PRNG key (an
  extended dtype)."""

  def mixed(x, y, h):
    def body(i, buf):
      window = lax.dynamic_slice(x, (i * 4, 0), (4, 128))
      buf = lax.dynamic_update_slice(buf, window, (i * 4, 0))
      return lax.cond(
        i % 2 == 0, lambda b: b, lambda b: jnp.full_like(b, 1.5), buf
      )

    buf = lax.fori_loop(0, 4, body, jnp.zeros((16, 128), jnp.bfloat16))

    def step(carry, row):
      return carry + row, jnp.concatenate([row, row])[::-1]

    total, rows = lax.scan(step, jnp.zeros((8, 128), jnp.bfloat16), y)
    halves = lax.while_loop(
      lambda c: c[0] < 3,
      lambda c: (c[0] + 1, lax.dynamic_update_slice(c[1], h[:1], (c[0], 0))),
      (0, jnp.zeros_like(h)),
    )[1]
    noise = jax.random.uniform(jax.random.key(0), (128, 8), jnp.bfloat16)
    return buf, jax.jit(lambda t: t.T)(total) + noise, rows, halves

  x, y = _bf16((16, 128)), _bf16((4, 8, 128), 1)
  h = jnp.asarray(np.arange(4 * 128).reshape(4, 128), jnp.float16)
  got, _ = _in_words(mixed, x, y, h)
  for a, b in zip(got, mixed(x, y, h), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
