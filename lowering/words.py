"""16-bit float buffers held as uint16 words, for jaxlib 0.10.2's XLA:CPU.

That XLA runs a dynamic slice or update of a bf16 / f16 buffer in f32: it
converts the whole buffer there and back for each one (later versions work
in place). As unsigned integers of the same width it does not, so the CPU
fallback moves such windows as words (``_jax.FLOAT16_DYNAMIC_OPS_CONVERT``).

Converting a buffer to words at each window still copies it whole, once per
window, wherever XLA cannot hoist the conversion: out of a branch, say
(``gmm`` in bf16 converted its lhs in each group's branch, and took 5-11%
longer for it). So a 16-bit float buffer that no computing operation reads
is held as words for the whole program, through loop carries, branches,
calls and in-place updates: converted where the program starts and ends. A
buffer that something computes on stays a float, and each window of it is
moved as words and converted back at the window, as before.

Which form a value takes changes no result: every operation converts its
operands to the form it runs in, bit for bit. The analysis only picks the
form that converts least.
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from mpmd import _jax
from mpmd._jax import core, lax_control_flow, lu, pe, pjit
from mpmd._lowering import jaxpr_util

# Operations that only move elements: they run on words as on floats (their
# operands that are no 16-bit floats, indices and predicates, as they are).
_MOVES = frozenset(
  [
    lax.broadcast_in_dim_p,
    lax.concatenate_p,
    lax.copy_p,
    lax.dynamic_slice_p,
    lax.dynamic_update_slice_p,
    lax.pad_p,
    lax.reshape_p,
    lax.rev_p,
    lax.select_n_p,
    lax.slice_p,
    lax.squeeze_p,
    lax.transpose_p,
  ]
)


def evaluate(program: Any, *args) -> list[Any]:
  """``core.eval_jaxpr`` of a discharged (closed) kernel program; where XLA
  would convert 16-bit float buffers whole for each window
  (``_jax.FLOAT16_DYNAMIC_OPS_CONVERT``), with ``evaluate_words``."""
  jaxpr, consts = _jax.open_jaxpr(program)
  if not _jax.FLOAT16_DYNAMIC_OPS_CONVERT:
    return core.eval_jaxpr(jaxpr, consts, *args)
  return evaluate_words(jaxpr, consts, args)


def evaluate_words(jaxpr: core.Jaxpr, consts: Sequence[Any], args) -> list:
  """``core.eval_jaxpr``, holding the 16-bit float buffers that nothing
  computes on as words (see the module docstring)."""
  forms = _Forms(jaxpr)
  ins = [
    _convert(x, v.aval, False, forms.words(v))
    for x, v in zip(args, jaxpr.invars, strict=True)
  ]
  return forms.eval(jaxpr, consts, ins, [False] * len(jaxpr.outvars))


def _is_half(aval: core.AbstractValue) -> bool:
  """A 16-bit float array (not a Ref)."""
  if not isinstance(aval, core.ShapedArray):
    return False
  # Floating first: extended dtypes (PRNG keys) have no numpy dtype.
  return jnp.issubdtype(aval.dtype, jnp.floating) and aval.dtype.itemsize == 2


def _convert(x: Any, aval: Any, words: bool, to_words: bool) -> Any:
  """``x`` (of ``aval``, as words or not) as words or not."""
  if words == to_words:
    return x
  if to_words:
    return lax.bitcast_convert_type(jnp.asarray(x, aval.dtype), jnp.uint16)
  return lax.bitcast_convert_type(x, aval.dtype)


class _Sub(NamedTuple):
  """A nested jaxpr of a loop, branch or call, and where it connects."""

  key: str  # its param
  index: int | None  # its place in a tuple param (cond's branches)
  closed: Any
  ins: Sequence[int]  # per input: the operand it receives
  # Per output: the result it gives, or None (a loop's condition).
  outs: Sequence[int | None]


def _subs(eqn: core.JaxprEqn) -> list[_Sub] | None:
  """The nested jaxprs of a loop, branch or call; None for other ops."""
  prim, params = eqn.primitive, eqn.params
  n_in, n_out = len(eqn.invars), len(eqn.outvars)
  if prim is lax_control_flow.cond_p:
    branches = params["branches"]
    return [
      _Sub("branches", b, branch, range(1, n_in), range(n_out))
      for b, branch in enumerate(branches)
    ]
  if prim is lax_control_flow.while_p:
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    carry = range(nc + nb, n_in)
    return [
      _Sub(
        "cond_jaxpr", None, params["cond_jaxpr"], [*range(nc), *carry], [None]
      ),
      _Sub(
        "body_jaxpr",
        None,
        params["body_jaxpr"],
        [*range(nc, nc + nb), *carry],
        range(n_out),
      ),
    ]
  key = {
    lax_control_flow.scan_p: "jaxpr",
    pjit.jit_p: "jaxpr",
    core.closed_call_p: "call_jaxpr",
  }.get(prim)
  if key is None:
    return None
  return [_Sub(key, None, params[key], range(n_in), range(n_out))]


def _carries(eqn: core.JaxprEqn) -> list[tuple[int, int]]:
  """(operand, result) pairs of a loop's carried values."""
  if eqn.primitive is lax_control_flow.while_p:
    first = eqn.params["cond_nconsts"] + eqn.params["body_nconsts"]
    return [(first + j, j) for j in range(len(eqn.outvars))]
  if eqn.primitive is lax_control_flow.scan_p:
    first, carried = _jax.scan_layout(eqn.params)
    return [(first + j, j) for j in range(carried)]
  return []


class _Slot(NamedTuple):
  """An operand or result of a loop, branch or call (a node of the
  classes; equations hash by identity)."""

  eqn: core.JaxprEqn
  side: str
  index: int


class _Forms:
  """Which 16-bit float variables of a jaxpr (nested ones included) are
  held as words: those whose class -- the values tied together by loops,
  branches, calls and in-place updates -- no computing operation reads."""

  def __init__(self, jaxpr: core.Jaxpr):
    self._parent: dict[core.Var | _Slot, core.Var | _Slot] = {}
    computed: list[core.Var] = []
    self._walk(jaxpr, computed)
    self._computed = {self._find(v) for v in computed}

  def words(self, v: core.Atom) -> bool:
    """Whether variable ``v`` is held as words (literals never are)."""
    return (
      isinstance(v, core.Var)
      and _is_half(v.aval)
      and self._find(v) not in self._computed
    )

  def _find(self, x: core.Var | _Slot) -> core.Var | _Slot:
    parent = self._parent
    root = x
    while (up := parent.get(root, root)) != root:
      root = up
    while (up := parent.get(x, x)) != root:
      parent[x], x = root, up
    return root

  def _tie(self, a: core.Atom | _Slot, b: core.Atom | _Slot) -> None:
    if isinstance(a, core.Literal) or isinstance(b, core.Literal):
      return
    ra, rb = self._find(a), self._find(b)
    if ra != rb:
      self._parent[ra] = rb

  def _walk(self, jaxpr: core.Jaxpr, computed: list[core.Var]) -> None:
    for eqn in jaxpr.eqns:
      prim, subs = eqn.primitive, _subs(eqn)
      if prim is lax.dynamic_update_slice_p:
        self._tie(eqn.invars[0], eqn.outvars[0])  # in place
      elif subs is not None:
        # Each operand and result of the op is a slot, that the nested
        # jaxprs' inputs and outputs (and a loop's carry) tie to.
        ins = [_Slot(eqn, "in", i) for i in range(len(eqn.invars))]
        outs = [_Slot(eqn, "out", j) for j in range(len(eqn.outvars))]
        for v, slot in zip(eqn.invars, ins, strict=True):
          self._tie(v, slot)
        for v, slot in zip(eqn.outvars, outs, strict=True):
          self._tie(v, slot)
        for i, j in _carries(eqn):
          self._tie(ins[i], outs[j])
        for sub in subs:
          inner = _jax.open_jaxpr(sub.closed)[0]
          for v, i in zip(inner.invars, sub.ins, strict=True):
            self._tie(v, ins[i])
          for v, j in zip(inner.outvars, sub.outs, strict=True):
            if j is not None:
              self._tie(v, outs[j])
          self._walk(inner, computed)
      elif prim not in _MOVES:
        computed.extend(v for v in eqn.invars if isinstance(v, core.Var))

  def eval(self, jaxpr, consts, args, out_words: Sequence[bool]) -> list[Any]:
    """Evaluates ``jaxpr`` on ``args`` (each in its variable's form); its
    results as words where ``out_words`` says."""
    consts = [
      _convert(x, v.aval, False, self.words(v))
      for x, v in zip(consts, jaxpr.constvars, strict=True)
    ]
    outs = jaxpr_util.eval_with_rule(jaxpr, consts, args, self._bind)
    return [
      _convert(x, a.aval, self.words(a), w)
      for x, a, w in zip(outs, jaxpr.outvars, out_words, strict=True)
    ]

  def _bind(self, eqn: core.JaxprEqn, invals: list[Any]) -> list[Any]:
    prim, params = eqn.primitive, eqn.params
    halves = [_is_half(v.aval) for v in eqn.invars]
    subs = _subs(eqn)
    if subs is not None:
      # Each operand in its nested inputs' form: the same as its own, as
      # they share a class, except for literals.
      ins = [self.words(v) for v in eqn.invars]
      for sub in subs:
        inner = _jax.open_jaxpr(sub.closed)[0]
        for v, i in zip(inner.invars, sub.ins, strict=True):
          ins[i] = self.words(v)
      params = dict(params)
      for sub in subs:
        out_words = [
          j is not None and self.words(eqn.outvars[j]) for j in sub.outs
        ]
        new = self._words_jaxpr(sub.closed, out_words)
        if sub.index is None:
          params[sub.key] = new
        else:
          params[sub.key] = (
            *params[sub.key][: sub.index],
            new,
            *params[sub.key][sub.index + 1 :],
          )
      outs_words = [self.words(v) for v in eqn.outvars]  # as traced
    elif _is_window(eqn):
      ins, outs_words = halves, [True]
    elif prim in _MOVES:
      # As words if its result is, or any operand: a slice of a buffer held
      # as words converts the slice, not the buffer.
      as_words = self.words(eqn.outvars[0]) or any(map(self.words, eqn.invars))
      ins, outs_words = [h and as_words for h in halves], [as_words]
    else:
      ins, outs_words = [False] * len(halves), [False] * len(eqn.outvars)
    invals = [
      _convert(x, v.aval, self.words(v), w)
      for x, v, w in zip(invals, eqn.invars, ins, strict=True)
    ]
    outs = prim.bind(*invals, **prim.get_bind_params(params))
    outs = outs if prim.multiple_results else [outs]
    return [
      _convert(x, v.aval, w, self.words(v))
      for x, v, w in zip(outs, eqn.outvars, outs_words, strict=True)
    ]

  def _words_jaxpr(self, closed: Any, out_words: Sequence[bool]) -> Any:
    """``closed`` re-traced with its inputs and outputs in their forms."""
    jaxpr, consts = _jax.open_jaxpr(closed)
    avals = [
      v.aval.update(dtype=jnp.dtype(jnp.uint16), weak_type=False)
      if self.words(v)
      else v.aval
      for v in jaxpr.invars
    ]
    fun = lu.wrap_init(
      lambda *args: self.eval(jaxpr, consts, args, out_words),
      debug_info=jaxpr.debug_info,
    )
    new, _, new_consts = pe.trace_to_jaxpr_dynamic(fun, avals)
    return _jax.closed_jaxpr(new, new_consts)


def _is_window(eqn: core.JaxprEqn) -> bool:
  """A dynamic slice or update of a 16-bit float buffer, of static sizes."""
  if eqn.primitive not in (lax.dynamic_slice_p, lax.dynamic_update_slice_p):
    return False
  operand = eqn.invars[0].aval
  if not _is_half(operand):
    return False
  if eqn.primitive is lax.dynamic_update_slice_p:
    return True
  return len(eqn.invars) == 1 + jaxpr_util.shaped(operand).ndim
