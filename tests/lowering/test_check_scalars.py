"""The checker's numpy evaluation of integer scalar arithmetic gives exactly
what XLA gives, and hands XLA the cases it defines its own way."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from mpmd._lowering.check import scalars

BINARY = [
  lax.add, lax.sub, lax.mul, lax.max, lax.min, lax.div, lax.rem,
  lax.bitwise_and, lax.bitwise_or, lax.bitwise_xor,
  lax.eq, lax.ne, lax.lt, lax.le, lax.gt, lax.ge,
]  # fmt: skip
UNARY = [lax.neg, lax.sign, lax.bitwise_not, lax.abs]


def _edges(dtype):
  info = np.iinfo(dtype)
  values = {info.min, info.max, 0, 1, 2, 7, info.max - 1, info.min + 1}
  if info.min < 0:
    values |= {-1, -2, -7}
  return [np.asarray(v, dtype) for v in sorted(values)]


def _numpy(fn, *args):
  """numpy's result of ``fn`` on scalars, None where it falls back."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  run = scalars.plan(jaxpr.eqns, jaxpr.invars, jaxpr.outvars)
  assert run is not None, jaxpr
  try:
    return run(*args)
  except scalars.Fallback:
    return None


def _both(fn, *args):
  """(numpy's result or None where it falls back, XLA's result)."""
  return _numpy(fn, *args), [np.asarray(x) for x in jax.jit(fn)(*args)]


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint32, np.int16])
def test_binary_and_unary_match_xla_bit_for_bit(dtype):
  edges = _edges(dtype)
  pairs = list(itertools.product(edges, edges))
  a, b = np.stack([x for x, _ in pairs]), np.stack([y for _, y in pairs])
  fallbacks = 0
  for op in BINARY:
    want = np.asarray(jax.jit(op)(a, b))  # elementwise: the same semantics
    for k, (x, y) in enumerate(pairs):
      got = _numpy(lambda x, y, op=op: [op(x, y)], x, y)
      if got is None:
        fallbacks += 1
        assert op in (lax.div, lax.rem), (op, x, y)
        continue
      assert got[0].dtype == want.dtype, (op, x, y)
      assert got[0] == want[k], (op.__name__, x, y, got, want[k])
  unary = UNARY if np.issubdtype(dtype, np.signedinteger) else UNARY[:3]
  for op in unary:
    want = np.asarray(jax.jit(op)(np.stack(edges)))
    for k, x in enumerate(edges):
      got = _numpy(lambda x, op=op: [op(x)], x)
      assert got[0].dtype == want.dtype and got[0] == want[k], (op, x)
  assert fallbacks >= 2 * len(edges)  # x / 0 and x % 0 went to XLA


def test_select_convert_and_literals_match_xla():
  def fn(i, p):
    slot = lax.rem(i + 1, jnp.int32(3))
    wide = lax.convert_element_type(slot, jnp.int8) * jnp.int8(100)
    pick = lax.select_n(p, i, slot * 7)
    return [slot, wide, pick, lax.convert_element_type(i, jnp.bool_), ~p]

  for i, p in itertools.product([-5, 0, 2, 2**31 - 1], [False, True]):
    args = (np.int32(i), np.bool_(p))
    got, want = _both(fn, *args)
    for g, w in zip(got, want, strict=True):
      assert g.dtype == w.dtype and g == w, (i, p, g, w)


def test_floats_and_arrays_stay_with_xla():
  for fn, args in [
    (lambda x: [x + 1.0], (np.float32(1),)),
    (lambda x: [x + 1], (np.zeros(3, np.int32),)),
    (lambda x: [lax.shift_left(x, x)], (np.int32(1),)),
  ]:
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    assert scalars.plan(jaxpr.eqns, jaxpr.invars, jaxpr.outvars) is None


def test_nested_jit_calls_are_inlined_and_match_xla():
  # jnp's floor_divide, remainder and where are jit calls (nested ones
  # too): numpy runs their equations, with no step of their own.
  def fn(i, n):
    return [
      jnp.floor_divide(i, n),
      jnp.remainder(i - 7, n),
      jnp.where(i > n, i, n),
    ]

  n = np.int32(3)
  jaxpr = jax.make_jaxpr(fn)(np.int32(0), n).jaxpr
  assert any(e.primitive.name in ("jit", "pjit") for e in jaxpr.eqns), jaxpr
  for i in [np.int32(v) for v in (-8, -1, 0, 2, 5, 2**31 - 1)]:
    got, want = _both(fn, i, n)
    assert got is not None
    for g, w in zip(got, want, strict=True):
      assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), (i, g, w)
  assert _numpy(fn, np.int32(5), np.int32(0)) is None  # x % 0: XLA's


def test_jit_calls_of_floats_are_not_planned():
  jaxpr = jax.make_jaxpr(lambda x: jnp.floor_divide(x, 2.0))(1.0).jaxpr
  assert scalars.plan(jaxpr.eqns, jaxpr.invars, jaxpr.outvars) is None
