"""A launch's run-time checks, threaded through it as one small value.

The CPU paths check at run time what they cannot prove when tracing (DMA
windows, waits on scoped semaphores, a kernel's own ``pl.debug_check``):
``bounds.Checks`` stages each as a ``check_p`` equation, and ``checked``
makes them a value the launch returns. That value is fixed before the
launch is walked: the code of the first check that failed (0: none), and
that check's values as 32-bit words, in a buffer as long as the longest
check's. Loops carry it as they carry anything else, so each nested
jaxpr is walked once, and only where it holds a check: the rest of the
launch is bound as it is. (``checkify`` discovers which checks a loop may
report by walking its body, then walks it again; nested loops multiply
that into most of a kernel's compile time.)

The codes' messages stay in Python (``Failure.sites``): only a failure
costs anything at run time, and only its values travel.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpmd import _jax, _pallas_ops
from mpmd._jax import api_util, core, lu, pe, tree_util
from mpmd._lowering import jaxpr_util


class Site(NamedTuple):
  """A check's message format and the (shape, dtype) of each of its
  positional values, then of its named ones (``names``)."""

  fmt: str
  layouts: tuple[tuple[tuple[int, ...], np.dtype], ...]
  names: tuple[str, ...]


@tree_util.register_pytree_node_class
class Failure:
  """Which check failed first (``code``: 1 + its index in ``sites``; 0 if
  none did) and its values (``words``, uint32). The sites are static."""

  def __init__(self, code, words, sites: tuple[Site, ...]):
    self.code, self.words, self.sites = code, words, sites

  def tree_flatten(self):
    return (self.code, self.words), self.sites

  @classmethod
  def tree_unflatten(cls, sites, children):
    code, words = children
    return cls(code, words, sites)

  def message(self) -> tuple[str, tuple, dict] | None:
    """(format, positional values, named values) of the failed check, or
    None: on concrete leaves (in the callback that raises it)."""
    code = int(np.asarray(self.code))
    if not code:
      return None
    site = self.sites[code - 1]
    words, values = np.asarray(self.words, np.uint32), []
    for shape, dtype in site.layouts:
      value, used = _unpack(words, shape, dtype)
      values.append(value)
      words = words[used:]
    num_args = len(site.layouts) - len(site.names)
    named = dict(zip(site.names, values[num_args:], strict=True))
    return site.fmt, tuple(values[:num_args]), named


def checked(fn: Callable[..., Any]) -> Callable[..., tuple[Failure, Any]]:
  """``fn`` (whose trace holds ``check_p`` equations) returning
  ``(Failure, outputs)``."""

  def run(*args):
    out_tree = []

    def flat(*xs):
      out, tree = tree_util.tree_flatten(fn(*xs))
      out_tree.append(tree)
      return out

    avals = [core.typeof(x) for x in args]
    debug = api_util.debug_info("mpmd_map checks", fn, avals, {})
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
      lu.wrap_init(flat, debug_info=debug), avals
    )
    walk = _Walk(jaxpr)
    state = (jnp.int32(0), jnp.zeros((walk.width,), jnp.uint32))
    state, outs = walk.run(jaxpr, consts, state, args)
    (code, words), sites = state, tuple(walk.sites)
    failure = Failure(code, words, sites)
    return failure, tree_util.tree_unflatten(out_tree[0], outs)

  return run


class _Walk:
  """Evaluates a launch's jaxpr with its checks threaded (``run``)."""

  def __init__(self, jaxpr: core.Jaxpr):
    # Jaxprs and equations hash by identity: these tables live as long as
    # the walk, and the jaxpr they index with it.
    self.codes: dict[core.JaxprEqn, int] = {}  # check equation -> code
    self.sites: list[Site] = []
    self.holds: dict[core.Jaxpr, bool] = {}  # jaxpr -> whether it checks
    self.width = 0
    self._collect(jaxpr)

  def _collect(self, jaxpr: core.Jaxpr) -> bool:
    """Numbers the checks of ``jaxpr`` (nested ones too); whether it has
    any."""
    if jaxpr in self.holds:
      return self.holds[jaxpr]
    found = False
    for eqn in jaxpr.eqns:
      if eqn.primitive is _pallas_ops.CHECK_P:
        self._site(eqn)
        found = True
      for sub in jaxpr_util.sub_jaxprs(eqn.params):
        found = self._collect(sub) or found
    self.holds[jaxpr] = found
    return found

  def _site(self, eqn: core.JaxprEqn) -> None:
    check = _pallas_ops.CheckOperands.of(eqn)
    values = [*check.args, *check.kwargs.values()]
    layouts = tuple((tuple(v.aval.shape), v.aval.dtype) for v in values)
    self.codes[eqn] = len(self.sites) + 1
    self.sites.append(Site(check.fmt, layouts, tuple(check.kwargs)))
    words = sum(_num_words(shape, dtype) for shape, dtype in layouts)
    self.width = max(self.width, words)

  def has_check(self, eqn: core.JaxprEqn) -> bool:
    subs = jaxpr_util.sub_jaxprs(eqn.params)
    return any(self.holds[sub] for sub in subs)

  def run(self, jaxpr: core.Jaxpr, consts, state, args) -> tuple[Any, list]:
    """``jaxpr`` evaluated on ``args`` from check state ``state``: the
    state after it, and its outputs."""
    cell = [state]

    def rule(eqn, invals):
      if eqn.primitive is _pallas_ops.CHECK_P:
        cell[0] = self._record(eqn, invals, cell[0])
        return []
      if not self.has_check(eqn):
        return _bind(eqn, invals)
      thread = _THREAD.get(eqn.primitive.name)
      if thread is None:
        raise NotImplementedError(
          f"mpmd_map: a run-time check inside a {eqn.primitive.name} (at "
          f"{jaxpr_util.line(eqn) or 'a line JAX made'}) on the CPU "
          "fallback: checks are threaded through while, cond, scan and "
          "calls only"
        )
      cell[0], outs = thread(self, eqn, cell[0], invals)
      return outs

    outs = jaxpr_util.eval_with_rule(jaxpr, consts, args, rule)
    return cell[0], outs

  def _record(self, eqn, invals, state):
    check = _pallas_ops.CheckOperands.of(eqn, invals)
    code, words = state
    values = [*check.args, *check.kwargs.values()]
    packed = jnp.concatenate(
      [_pack(v) for v in values] + [jnp.zeros((0,), jnp.uint32)]
    )
    packed = jnp.pad(packed, (0, self.width - packed.shape[0]))
    first = (code == 0) & jnp.asarray(check.failed)
    return (
      jnp.where(first, jnp.int32(self.codes[eqn]), code),
      jnp.where(first, packed, words),
    )

  def closed(self, closed_jaxpr, state, args) -> tuple[Any, list]:
    jaxpr, consts = _jax.open_jaxpr(closed_jaxpr)
    return self.run(jaxpr, consts, state, args)


def _bind(eqn: core.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
  p = eqn.primitive
  outs = p.bind(*invals, **p.get_bind_params(eqn.params))
  return outs if p.multiple_results else [outs]


def _while(walk: _Walk, eqn, state, invals):
  p = eqn.params
  cond_consts, body_consts, carry = _split(
    invals, p["cond_nconsts"], p["body_nconsts"]
  )

  def body(c):
    return walk.closed(p["body_jaxpr"], c[0], [*body_consts, *c[1]])

  if not walk.holds[_jax.open_jaxpr(p["cond_jaxpr"])[0]]:

    def cond(c):
      return core.jaxpr_as_fun(p["cond_jaxpr"])(*cond_consts, *c[1])[0]

    return lax.while_loop(cond, body, (state, list(carry)))

  # A check in the condition (a loop that reads a Ref to decide): the
  # condition runs before the loop and after each body, its checks in
  # execution order, and the loop carries its verdict.
  def test(s, c):
    s, [go] = walk.closed(p["cond_jaxpr"], s, [*cond_consts, *c])
    return s, c, go

  def body_then_test(c):
    return test(*body(c[:2]))

  state, carry, _ = lax.while_loop(
    lambda c: c[2], body_then_test, test(state, list(carry))
  )
  return state, carry


def _cond(walk: _Walk, eqn, state, invals):
  index, *ops = invals
  branches = [
    lambda s, xs, b=b: walk.closed(b, s, xs) for b in eqn.params["branches"]
  ]
  return lax.switch(index, branches, state, ops)


def _scan(walk: _Walk, eqn, state, invals):
  p = eqn.params
  num_consts, num_carry = _jax.scan_counts(p)
  consts, carry, xs = _split(invals, num_consts, num_carry)

  def body(c, x):
    s, outs = walk.closed(p["jaxpr"], c[0], [*consts, *c[1], *x])
    return (s, outs[:num_carry]), outs[num_carry:]

  (state, carry), ys = lax.scan(
    body,
    (state, list(carry)),
    list(xs),
    length=p["length"],
    reverse=p["reverse"],
    unroll=p["unroll"],
  )
  return state, [*carry, *ys]


def _inline(walk: _Walk, eqn, state, invals):
  """A call (jit, closed_call, jax.checkpoint, custom_jvp/vjp): its body
  inlined (the checks' values are the same either way)."""
  # One jaxpr each (``_THREAD`` lists no other): on jax >= 0.11 every
  # jaxpr is closed, on 0.10 checkpoint's is open.
  [sub] = [v for v in eqn.params.values() if _jax.is_jaxpr(v)]
  if _jax.is_closed(sub):
    return walk.closed(sub, state, invals)
  return walk.run(sub, (), state, invals)


_THREAD = {
  "while": _while,
  "cond": _cond,
  "scan": _scan,
  "jit": _inline,
  "pjit": _inline,
  "closed_call": _inline,
  "eval_jaxpr": _inline,  # 0.12's closed_call
  "remat2": _inline,  # jax.checkpoint's
  "custom_jvp_call": _inline,
  "custom_vjp_call": _inline,
}


def _split(xs: Sequence[Any], *sizes: int) -> list[list[Any]]:
  parts, start = [], 0
  for size in sizes:
    parts.append(list(xs[start : start + size]))
    start += size
  return [*parts, list(xs[start:])]


def _num_words(shape: tuple[int, ...], dtype) -> int:
  dtype = np.dtype(dtype)
  return int(np.prod(shape, dtype=int)) * max(1, dtype.itemsize // 4)


def _pack(value) -> jax.Array:
  """``value``'s bits as uint32 words (one per element; two for 64-bit
  and complex64 elements, four for complex128)."""
  x = jnp.asarray(value)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([x.real, x.imag], axis=-1)
  if x.dtype == jnp.bool_ or _sub_byte(x.dtype):
    return x.astype(jnp.int32).view(jnp.uint32).ravel()
  if x.dtype.itemsize < 4:
    unsigned = jnp.uint8 if x.dtype.itemsize == 1 else jnp.uint16
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()
  return lax.bitcast_convert_type(x, jnp.uint32).ravel()


def _sub_byte(dtype) -> bool:
  """int4, uint2 and the like: packed by value, not by bits."""
  return jnp.issubdtype(dtype, jnp.integer) and jnp.iinfo(dtype).bits < 8


def _unpack(words: np.ndarray, shape, dtype) -> tuple[np.ndarray, int]:
  """The value ``_pack`` made of the first words, and how many it used."""
  dtype = np.dtype(dtype)
  size = int(np.prod(shape, dtype=int))
  used = _num_words(shape, dtype)
  if dtype.kind == "c":
    part = np.dtype(f"f{dtype.itemsize // 2}")
    pairs, _ = _unpack(words, (*shape, 2), part)
    return (pairs[..., 0] + 1j * pairs[..., 1]).astype(dtype), used
  if dtype == np.bool_:
    value = words[:size] != 0
  elif _sub_byte(dtype):
    value = words[:size].view(np.int32).astype(dtype)
  elif dtype.itemsize < 4:
    value = words[:size].astype(f"u{dtype.itemsize}").view(dtype)
  else:
    value = words[:used].view(dtype)
  return value.reshape(shape), used
