"""Integer and boolean scalar arithmetic of a kernel, evaluated in numpy.

Most pure segments of a kernel between two synchronisation points compute
indices: a slot ``(step + 1) % 2``, a neighbour ``(me + 1) % n``, whether
this is the last step. Dispatching each to XLA costs a millisecond; numpy
does it in microseconds. Only operations whose numpy form gives exactly
what XLA gives are here (integers wrap, division truncates); where XLA
defines a result numpy would not (division by zero, ``INT_MIN / -1``),
evaluation gives up (``Fallback``) and the segment runs in XLA.
"""

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from mpmd import _jax
from mpmd._jax import core, pjit
from mpmd._lowering import jaxpr_util

# Input values a segment remembers its outputs for (past them, it computes).
MAX_SEEN = 4096


class Fallback(Exception):
  """Operands whose result numpy does not compute as XLA does."""


def _division(a, b, op):
  x, y = int(a), int(b)  # exact: Python integers do not wrap
  signed = np.issubdtype(a.dtype, np.signedinteger)
  if y == 0 or (signed and y == -1 and x == np.iinfo(a.dtype).min):
    raise Fallback  # XLA defines x / 0, x % 0 and INT_MIN / -1 its own way
  quotient = abs(x) // abs(y)  # truncated towards zero, as C and XLA
  if (x < 0) != (y < 0):
    quotient = -quotient
  return quotient if op == "div" else x - quotient * y


def _select(params, which, *cases):
  del params
  return cases[int(which)]


def _convert(params, x):
  return x.astype(params["new_dtype"])


_BINARY: dict[str, Callable[[Any, Any], Any]] = {
  "add": np.add,
  "sub": np.subtract,
  "mul": np.multiply,
  "max": np.maximum,
  "min": np.minimum,
  "and": np.bitwise_and,
  "or": np.bitwise_or,
  "xor": np.bitwise_xor,
  "eq": np.equal,
  "ne": np.not_equal,
  "lt": np.less,
  "le": np.less_equal,
  "gt": np.greater,
  "ge": np.greater_equal,
}
_UNARY: dict[str, Callable[[Any], Any]] = {
  "neg": np.negative,
  "sign": np.sign,
  "not": np.invert,  # logical for bool, bitwise for integers, as lax.not
  "abs": np.abs,
}


def _rule(eqn: core.JaxprEqn):
  name = eqn.primitive.name
  if name in _BINARY:
    return _BINARY[name]
  if name in _UNARY:
    return _UNARY[name]
  if name in ("div", "rem"):
    return lambda a, b: _division(a, b, name)
  if name == "select_n":
    return lambda *xs: _select(eqn.params, *xs)
  if name == "convert_element_type":
    return lambda x: _convert(eqn.params, x)
  return None


def _exact(aval) -> bool:
  """An integer or boolean scalar (one element: no layout to speak of)."""
  dtype = getattr(aval, "dtype", None)
  return (
    getattr(aval, "shape", None) == ()
    and dtype is not None
    # jnp's test: numpy's cannot read PRNG key types.
    and (dtype == np.bool_ or jnp.issubdtype(dtype, jnp.integer))
  )


class _Numbering:
  """Slots of a plan's values while its steps are read: the inputs by
  position, literals numbered from -1 down (placed after the inputs once
  all are known), each step's output after the inputs."""

  def __init__(self, invars):
    self.num_in = len(invars)
    self.literals: list[np.ndarray] = []
    self.slots: dict[Any, int] = {v: k for k, v in enumerate(invars)}
    self.steps: list[Any] = []

  def slot(self, v) -> int:
    if isinstance(v, core.Literal):
      value = np.asarray(v.val, dtype=jaxpr_util.shaped(v.aval).dtype)
      value.setflags(write=False)
      self.literals.append(value)
      return -len(self.literals)
    return self.slots[v]

  def add(self, eqns) -> bool:
    """Appends the steps of ``eqns``, the equations of nested ``jit``
    calls inlined (``jnp.floor_divide``, ``remainder`` and ``where`` on
    indices are such calls); False where one is not scalar arithmetic."""
    slots, steps = self.slots, self.steps
    for eqn in eqns:
      avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
      if not all(_exact(a) for a in avals):
        return False
      if eqn.primitive is pjit.jit_p:
        body, consts = _jax.open_jaxpr(eqn.params["jaxpr"])
        if consts or body.constvars:
          return False
        for inner, outer in zip(body.invars, eqn.invars, strict=True):
          slots[inner] = self.slot(outer)
        if not self.add(body.eqns):
          return False
        for outer, inner in zip(eqn.outvars, body.outvars, strict=True):
          slots[outer] = self.slot(inner)
        continue
      rule = _rule(eqn)
      if rule is None or len(eqn.outvars) != 1:
        return False
      ins = [self.slot(v) for v in eqn.invars]
      out = eqn.outvars[0]
      slots[out] = self.num_in + len(steps)  # literals shift it, later
      steps.append((rule, ins, len(steps), out.aval.dtype))
    return True


def plan(eqns, invars, outvars) -> Callable[..., list] | None:
  """``eqns`` as a numpy function of ``invars``' values (a list of
  ``outvars``' values out, that may raise ``Fallback``); None where some
  equation or value is not integer / boolean scalar arithmetic.

  Values sit in a list by slot: the inputs, then the literals (made once,
  read-only: every run shares them), then one per equation."""
  numbering = _Numbering(invars)
  if not numbering.add(eqns):
    return None
  outs = [numbering.slot(v) for v in outvars]
  literals, steps = numbering.literals, numbering.steps
  num_in, num_lit = len(invars), len(literals)
  first_step = num_in + num_lit

  def place(k: int) -> int:
    if k < 0:  # literal -1 is the first made
      return num_in - k - 1
    return k if k < num_in else k + num_lit

  steps = [
    (rule, [place(k) for k in ins], first_step + j, dtype)
    for rule, ins, j, dtype in steps
  ]
  outs = [place(k) for k in outs]
  template = [None] * num_in + literals + [None] * len(steps)
  dtypes = [v.aval.dtype for v in invars]

  # Inputs (as Python integers) -> outputs: a segment runs again and again
  # on the same few values (a slot, a neighbour), and its outputs depend
  # on its inputs only. They are read-only: every caller shares them.
  seen: dict[tuple[int, ...], list[np.ndarray]] = {}

  def run(*values):
    ins = [np.asarray(x, dtype=d) for x, d in zip(values, dtypes, strict=True)]
    key = tuple(int(x) for x in ins)
    found = seen.get(key)
    if found is not None:
      return list(found)
    env = template.copy()
    env[:num_in] = ins
    with np.errstate(over="ignore"):  # integers wrap, as in XLA
      for rule, ins, out, dtype in steps:
        env[out] = np.asarray(rule(*[env[k] for k in ins]), dtype=dtype)
    results = [np.array(env[k]) for k in outs]
    for x in results:
      x.setflags(write=False)
    if len(seen) < MAX_SEEN:
      seen[key] = results
    return list(results)

  return run
