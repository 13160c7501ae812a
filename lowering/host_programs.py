"""Simulated programs past XLA:CPU's limit run on the host, outside XLA.

Both Pallas simulators run each simulated program (a TPU core or subcore,
a GPU warpgroup) as an XLA computation of its own, in a thread of its own;
that computation blocks inside a host callback while its program waits on
a semaphore or a barrier. XLA:CPU runs at most 32 computations at once on
one device (measured on jaxlib 0.10.2 and 0.12: a 33rd call waits, before
it starts, until one ends), and every program's computation goes to the
default device. A launch of more programs than that (2 SparseCores x 16
vector subcores + 2 scalar subcores: 34) deadlocks as soon as the programs
that run wait on one that cannot start: their waits end short of their
count, as though signals had been lost.

So at most ``compiled_limit()`` programs run compiled at once (upstream's
way); the others run here, equation by equation: their host callbacks are
called directly, loops and branches that hold callbacks run in Python, and
everything else is bound eagerly, as a short XLA computation that never
waits on another program. Only our launches are routed; any other use of
the simulators runs as JAX wrote it.
"""

import contextlib
import functools
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any

import jax
import numpy as np

from mpmd import _jax, _patches
from mpmd._jax import callback, core, lax_control_flow, pjit, util
from mpmd._lowering import jaxpr_util, watchdog

# XLA:CPU's limit is 32 per device. The launch's own computation holds one
# on the default device while its programs run, and the programs that run
# here need room for their eager operations (and the process for its other
# work), so compiled programs take half.
_COMPILED_LIMIT = 16

# How many simulated programs run compiled now, in the whole process: the
# count of a process-wide resource (XLA:CPU's concurrent computations on
# the default device, which every launch's programs share, whichever
# thread started it), so it is one count, not one per launch or thread.
_compiled_now = 0
_lock = threading.Lock()


def _check_limit(limit) -> None:
  if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
    raise ValueError(f"limit_compiled: expected 'limit' >= 0, got {limit!r}")


@functools.cache
def _limit_state():
  """The ``mpmd_compiled_programs_limit`` JAX config state, defined on
  first use (``import mpmd`` adds nothing to JAX's config). Not in the jit
  key: it changes where programs run, never what they compute."""
  return _jax.config.int_state(
    name="mpmd_compiled_programs_limit",
    default=_COMPILED_LIMIT,
    help="jax-mpmd: how many simulated programs run compiled at once (the "
    "others run on the host); XLA:CPU runs at most 32 computations at once",
    validator=_check_limit,
  )


def compiled_limit() -> int:
  """How many simulated programs may run compiled at once."""
  # Read without defining (every simulated program reads it): a read must
  # not add to JAX's config (see ``mpmd.simulators.get_deadlock_timeout``).
  if _limit_state.cache_info().currsize == 0:
    return _COMPILED_LIMIT
  return _limit_state().value


@contextlib.contextmanager
def limit_compiled(limit: int) -> Generator[None, None, None]:
  """Inside: at most ``limit`` simulated programs run compiled at once (0:
  every program runs on the host).

  It sets the option's process-wide value (``jax.config.update``), not a
  value of this thread: the programs run in the simulators' threads, and
  share XLA:CPU's process-wide room for computations."""
  _check_limit(limit)
  state = _limit_state()
  previous = state.value
  jax.config.update("mpmd_compiled_programs_limit", limit)
  try:
    yield
  finally:
    jax.config.update("mpmd_compiled_programs_limit", previous)


def install() -> None:
  """Routes the simulators' programs through ``_run`` (on first use of a
  simulator)."""
  # Our compile-once adaptation of 0.10.2 first: the routing wraps it.
  _patches.cache_tpu_simulator_programs(watchdog.launch_running)
  _patches.route_simulator_programs(_run)


def _run(compiled: Callable[[], Any], jaxpr, consts, args) -> None:
  """Runs one simulated program: ``compiled()`` while there is room for
  it, here otherwise."""
  global _compiled_now
  if not watchdog.launch_running():
    compiled()
    return
  limit = compiled_limit()
  with _lock:
    room = _compiled_now < limit
    if room:
      _compiled_now += 1
  if not room:
    run_on_host(jaxpr, consts, args)
    return
  try:
    compiled()
  finally:
    with _lock:
      _compiled_now -= 1


# -- the evaluator -------------------------------------------------------------


def run_on_host(jaxpr: core.Jaxpr, consts: Sequence[Any], args) -> list:
  """``core.eval_jaxpr(jaxpr, consts, *args)``, with host callbacks called
  here, never inside an XLA computation."""
  return _eval(jaxpr, list(consts), list(args))


def _eval(jaxpr: core.Jaxpr, consts: list, args: list) -> list:
  env: dict[core.Var, Any] = {}

  def read(a):
    return a.val if isinstance(a, core.Literal) else env[a]

  binders = [*jaxpr.constvars, *jaxpr.invars]
  for v, x in zip(binders, [*consts, *args], strict=True):
    env[v] = x
  for eqn in jaxpr.eqns:
    outs = _eval_eqn(eqn, [read(a) for a in eqn.invars])
    for v, x in zip(eqn.outvars, outs, strict=True):
      if not isinstance(v, core.DropVar):
        env[v] = x
  return [read(a) for a in jaxpr.outvars]


def _eval_eqn(eqn: core.JaxprEqn, invals: list) -> list:
  prim = eqn.primitive
  if prim is callback.io_callback_p:
    # Through JAX's implementation (where ours routes the simulators'
    # callbacks), without the XLA computation around it.
    return list(callback.io_callback_impl(*map(_host, invals), **eqn.params))
  rule = _RULES.get(prim) if _calls_back(eqn) else None
  if rule is None:
    # No callback inside: a short computation that waits on nobody. (A
    # primitive without a rule here that holds callbacks is bound whole
    # too, as a compiled program would be.)
    outs = prim.bind(*invals, **prim.get_bind_params(eqn.params))
    return list(outs) if prim.multiple_results else [outs]
  return rule(eqn, invals)


def _host(x):
  """A callback argument as numpy (what XLA would hand it)."""
  return x if isinstance(x, np.generic) else np.asarray(x)


# Per jaxpr, held weakly, in a cache that jax.clear_caches() empties.
@util.weakref_lru_cache
def _jaxpr_calls_back(jaxpr: core.Jaxpr) -> bool:
  return any(
    e.primitive is callback.io_callback_p for e in jaxpr_util.iter_eqns(jaxpr)
  )


def _calls_back(eqn: core.JaxprEqn) -> bool:
  return any(_jaxpr_calls_back(j) for j in jaxpr_util.sub_jaxprs(eqn.params))


def _eval_sub(j, args: Sequence[Any]) -> list:
  jaxpr, consts = _jax.open_jaxpr(j)
  return _eval(jaxpr, consts, list(args))


def _cond(eqn, invals):
  index, *ops = invals
  branches = eqn.params["branches"]
  chosen = int(np.clip(int(_host(index)), 0, len(branches) - 1))
  return _eval_sub(branches[chosen], ops)


def _while(eqn, invals):
  p = eqn.params
  num_cond, num_body = p["cond_nconsts"], p["body_nconsts"]
  cond_consts = invals[:num_cond]
  body_consts = invals[num_cond : num_cond + num_body]
  carry = invals[num_cond + num_body :]
  while bool(_host(_eval_sub(p["cond_jaxpr"], [*cond_consts, *carry])[0])):
    carry = _eval_sub(p["body_jaxpr"], [*body_consts, *carry])
  return carry


def _scan(eqn, invals):
  p = eqn.params
  num_consts, num_carry = _jax.scan_layout(p)
  consts = invals[:num_consts]
  carry = invals[num_consts : num_consts + num_carry]
  # Scanned operands have a leading axis: arrays, never numpy scalars.
  xs = [np.asarray(x) for x in invals[num_consts + num_carry :]]
  length = p["length"]
  ys = [
    np.empty(aval.shape, aval.dtype)
    for aval in (jaxpr_util.shaped(v.aval) for v in eqn.outvars[num_carry:])
  ]
  steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
  for i in steps:
    outs = _eval_sub(p["jaxpr"], [*consts, *carry, *(x[i] for x in xs)])
    carry = outs[:num_carry]
    for y, out in zip(ys, outs[num_carry:], strict=True):
      y[i] = _host(out)
  return [*carry, *ys]


def _call(eqn, invals):
  """A call of one jaxpr on the equation's operands (jit, custom rules)."""
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    if key in eqn.params:
      return _eval_sub(eqn.params[key], invals)
  raise AssertionError(f"no jaxpr to call in '{eqn.primitive}'")


_RULES: dict[core.Primitive, Callable[[core.JaxprEqn, list], list]] = {
  lax_control_flow.cond_p: _cond,
  lax_control_flow.while_p: _while,
  lax_control_flow.scan_p: _scan,
  pjit.jit_p: _call,
  core.closed_call_p: _call,
}
