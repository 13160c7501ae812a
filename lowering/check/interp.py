"""One program of a launch, evaluated equation by equation as a generator.

The program runs eagerly until it reaches a synchronisation point (a DMA
start or wait, a semaphore signal, wait or read); there it yields a
:class:`Sync` to the scheduler, which decides when it goes on and sends back
the operation's result. Everything between two synchronisation points runs
without interruption: loads and stores go to the launch's simulated memory
(``memory.Memory``), which checks them; pure equations run as JAX runs them.
"""

import dataclasses
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from mpmd import _jax
from mpmd._jax import (
  core,
  lax_control_flow,
  pallas_primitives,
  pjit,
  source_info_util,
  state,
  state_primitives,
)
from mpmd._lowering import jaxpr_util
from mpmd._lowering.check import host_client, records, scalars, segments
from mpmd._lowering.check.segments import Segment

_custom = _jax.custom_derivatives()


@dataclasses.dataclass
class Sync:
  """A synchronisation point a program reached: the operation (a record of
  ``records``) and where in the kernel it is."""

  op: Any
  where: str


Program = Generator[Sync, Any, None]


def where(eqn: core.JaxprEqn) -> str:
  """``file.py:12 (fn)``: the kernel source line of an equation."""
  return source_info_util.summarize(eqn.source_info)


class Context:
  """What a program's equations need from the launch: its axis indices,
  its memory, and the Refs that are not operands (the barrier semaphore,
  ``run_scoped`` allocations)."""

  def __init__(self, machine, device: int, program: int, axis_values):
    self.machine = machine
    self.device = device
    self.program = program
    self.axis_values = axis_values
    self.scope_depth = 0
    # Segments compile for a client of our own (see ``Segment``).
    self.own_client = (
      bool(machine.plan.device_axes) and host_client.CALLBACKS_FILL_POOL
    )
    # The kernel source line of the equation running now (or of the
    # nearest enclosing one that has a line of the user's).
    self.where = ""

  def axis_index(self, eqn):
    name = eqn.params["axis_name"]
    names = name if isinstance(name, tuple) else (name,)
    flat = 0
    for n in names:
      if n not in self.axis_values:
        raise NotImplementedError(
          f"mpmd checker: axis_index of unknown axis {n!r} at {where(eqn)}"
        )
      value, size = self.axis_values[n]
      flat = flat * size + value
    return np.int32(flat)


def _needs_interpretation(jaxpr: core.Jaxpr, memo: dict) -> bool:
  """Whether equations of ``jaxpr`` touch Refs, synchronise or ask for axis
  indices (else JAX can run the whole equation that holds it)."""
  if jaxpr in memo:  # jaxprs hash by identity; the memo keeps them alive
    return memo[jaxpr]
  needs = False
  for eqn in jaxpr.eqns:
    if _eqn_needs(eqn, memo):
      needs = True
      break
  memo[jaxpr] = needs
  return needs


def _eqn_needs(eqn: core.JaxprEqn, memo: dict) -> bool:
  if eqn.effects or eqn.primitive is _jax.lax_parallel.axis_index_p:
    return True
  if any(isinstance(v.aval, state.AbstractRef) for v in eqn.invars):
    return True
  return any(
    _needs_interpretation(sub, memo)
    for sub in jaxpr_util.sub_jaxprs(eqn.params)
  )


def _steps(jaxpr: core.Jaxpr, memo: dict) -> tuple[list[Any], list[Any]]:
  """``jaxpr`` as steps: equations to interpret (with their source line)
  and compiled segments of the pure equations between them; and its
  outputs, as (True, a literal's value) or (False, the variable)."""
  key = ("steps", jaxpr)
  found = memo.get(key)
  if found is not None:
    return found
  last_use: dict[Any, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, core.Literal):
        last_use[v] = i
  for v in jaxpr.outvars:
    if not isinstance(v, core.Literal):
      last_use[v] = len(jaxpr.eqns)
  steps: list[Any] = []
  run: list[tuple[int, Any]] = []

  def segment(part) -> Segment:
    defined = {v for _, e in part for v in e.outvars}
    free, seen = [], set()
    for _, e in part:
      for v in e.invars:
        if isinstance(v, core.Literal) or v in defined or v in seen:
          continue
        seen.add(v)
        free.append(v)
    end = part[-1][0]
    outs = [
      v
      for _, e in part
      for v in e.outvars
      if not isinstance(v, core.DropVar) and last_use.get(v, -1) > end
    ]
    return Segment([e for _, e in part], free, outs)

  def flush():
    if not run:
      return
    whole = segment(run)
    if whole.in_numpy is not None or all(
      e.primitive is not pjit.jit_p for _, e in run
    ):
      steps.append(whole)
    else:
      # Not numpy's alone (floats): the calls stay steps of their own, so
      # that XLA computes the rest in the same segments as ever.
      part: list[tuple[int, Any]] = []
      for i, e in run:
        if e.primitive is not pjit.jit_p:
          part.append((i, e))
          continue
        if part:
          steps.append(segment(part))
          part = []
        steps.append(_Step(e))
      if part:
        steps.append(segment(part))
    run.clear()

  for i, eqn in enumerate(jaxpr.eqns):
    if _pure(eqn, memo):
      run.append((i, eqn))
      continue
    flush()
    steps.append(_Step(eqn))
  flush()
  outs = [
    (True, segments.host(v.val)) if isinstance(v, core.Literal) else (False, v)
    for v in jaxpr.outvars
  ]
  memo[key] = steps, outs
  return steps, outs


def _pure(eqn: core.JaxprEqn, memo: dict) -> bool:
  """Whether ``eqn`` joins a segment: an equation that no rule interprets
  and that touches no Ref, or a ``jit`` call of integer scalar arithmetic
  (``jnp.floor_divide``, ``remainder``, ``where`` on indices: numpy runs
  its equations inside the segment, as it ran them in the call's own
  segments, with no step of its own)."""
  if _eqn_needs(eqn, memo):
    return False
  if RULES.get(eqn.primitive) is None:
    return True
  if eqn.primitive is not pjit.jit_p:
    return False
  ins = [v for v in eqn.invars if not isinstance(v, core.Literal)]
  return scalars.plan([eqn], ins, eqn.outvars) is not None


class _Step:
  """An equation to interpret, with what running it needs looked up once:
  its source line, operands (literals on the host already) and the
  outputs it defines. (Its rule is looked up as it runs: the GPU rules
  join the table when a GPU launch is first lowered.)"""

  __slots__ = ("eqn", "place", "ins", "outs")

  def __init__(self, eqn: core.JaxprEqn):
    self.eqn = eqn
    self.place = where(eqn)
    self.ins = [
      (True, segments.host(v.val))
      if isinstance(v, core.Literal)
      else (False, v)
      for v in eqn.invars
    ]
    self.outs = [
      None if isinstance(v, core.DropVar) else v for v in eqn.outvars
    ]


def run_jaxpr(ctx: Context, jaxpr: core.Jaxpr, consts, args) -> Program:
  """Evaluates ``jaxpr`` for one program; yields at synchronisation points;
  returns its outputs."""
  env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  steps, outs = _steps(jaxpr, ctx.machine.plan.memo)
  own_client = ctx.own_client
  enclosing = ctx.where
  for step in steps:
    if type(step) is Segment:
      values = step.fn(own_client, *[env[v] for v in step.invars])
      env.update(zip(step.outvars, values, strict=True))
      continue
    ctx.where = step.place or enclosing
    invals = [x if literal else env[x] for literal, x in step.ins]
    rule = RULES.get(step.eqn.primitive)
    if rule is None:  # pure equations are segments
      raise NotImplementedError(
        f"mpmd checker: {step.eqn.primitive.name!r} (at {ctx.where}) is "
        "not supported by the checking executor; run the launch with "
        "interpret=None (the CPU fallback's default paths) or "
        "pltpu.InterpretParams()"
      )
    plain = _PLAIN.get(rule)
    if plain is not None:
      values = plain(ctx, step.eqn, invals)
    else:
      values = yield from rule(ctx, step.eqn, invals)
    for v, x in zip(step.outs, values, strict=True):
      if v is not None:
        env[v] = x
    ctx.where = enclosing
  return [x if literal else env[x] for literal, x in outs]


def unsupported(jaxpr: core.Jaxpr) -> str | None:
  """The first operation of ``jaxpr`` (nested ones included) that the
  executor cannot run, None if it runs them all."""
  for eqn in jaxpr_util.iter_eqns(jaxpr):
    if eqn.primitive in RULES:
      if eqn.primitive is pallas_primitives.run_scoped_p and eqn.params.get(
        "collective_axes"
      ):
        return "run_scoped(collective_axes=...)"
    elif eqn.effects or any(
      isinstance(v.aval, state.AbstractRef) for v in eqn.invars
    ):
      return repr(eqn.primitive.name)
  return None


def opened(j):
  """(jaxpr, consts) of a closed or open jaxpr of an equation's params."""
  return _jax.open_jaxpr(j)


# -- rules: each returns a generator of Sync that returns the outputs -------


# The rules of operations that never synchronise -> the plain functions
# behind them, which ``run_jaxpr`` calls directly (no generator to make and
# run). Filled once, as the rules are defined.
_PLAIN: dict[Callable, Callable] = {}


def _plain(fn):
  """The rule of an operation that never synchronises: ``fn`` as a
  generator (the table's form), ``fn`` itself in ``_PLAIN``."""

  def rule(ctx, eqn, invals):
    return fn(ctx, eqn, invals)
    yield

  _PLAIN[rule] = fn
  return rule


def _remembered(ctx, eqn, values, make):
  """``make()``, a function of ``eqn`` and integer scalar ``values`` (an
  unflattened pytree of indexers), made once per kernel for the same
  values: Pallas' pytree nodes cost far more to build than to look up.
  Other values are not remembered. A remembered tuple of views is a
  ``records.Views`` (a launch finds the window it cuts by its id)."""
  scalars = records.scalar_key(values)
  if scalars is None:
    return make()
  key = (id(eqn), *scalars)
  table = ctx.machine.plan.memo
  entry = table.get(key)
  if entry is None:
    made = make()
    if type(made) is tuple:
      made = records.Views(made)
    entry = (made, eqn)  # eqn: its id stays its own
    if len(table) < MAX_REMEMBERED:
      table[key] = entry
  return entry[0]


# Entries ``_remembered`` keeps per kernel (past them, it makes anew).
MAX_REMEMBERED = 1 << 16


def _sync(ctx, eqn, invals):
  record = records.record_of(eqn, invals, ctx.machine.plan.memo)
  result = yield Sync(record, ctx.where)
  if eqn.primitive is pallas_primitives.semaphore_read_p:
    return [np.int32(result)]
  return []


@_plain
def _axis_index(ctx, eqn, invals):
  return [ctx.axis_index(eqn)]


@_plain
def _nothing(ctx, eqn, invals):
  return [] if eqn.primitive.multiple_results else [None]


def _transforms(ctx, eqn, flat):
  tree = eqn.params["tree"]
  return _remembered(ctx, eqn, flat, lambda: tree.unflatten(flat))


@_plain
def _get(ctx, eqn, invals):
  ref, *flat = invals
  transforms = _transforms(ctx, eqn, flat)
  view = ctx.machine.view(ctx, ref, transforms, eqn)
  return [ctx.machine.load(ctx, view, eqn)]


@_plain
def _swap(ctx, eqn, invals):
  ref, value, *flat = invals
  transforms = _transforms(ctx, eqn, flat)
  view = ctx.machine.view(ctx, ref, transforms, eqn)
  old = ctx.machine.load(ctx, view, eqn, check_init=False)
  ctx.machine.store(ctx, view, value, eqn)
  return [old]


@_plain
def _addupdate(ctx, eqn, invals):
  ref, value, *flat = invals
  transforms = _transforms(ctx, eqn, flat)
  view = ctx.machine.view(ctx, ref, transforms, eqn)
  old = ctx.machine.load(ctx, view, eqn)
  ctx.machine.store(ctx, view, np.asarray(old + np.asarray(value)), eqn)
  return []


def _masked_operands(ctx, eqn, ref, transforms, mask):
  """(view, mask as numpy) of a masked load / swap."""
  ref, own = records.split_ref(ref)
  view = ctx.machine.view(ctx, ref, (*own, *(transforms or ())), eqn)
  return view, None if mask is None else np.asarray(mask)


@_plain
def _masked_load(ctx, eqn, invals):
  ref, transforms, mask, other = eqn.params["args_tree"].unflatten(invals)
  view, mask = _masked_operands(ctx, eqn, ref, transforms, mask)
  value = ctx.machine.load(ctx, view, eqn, mask=mask)
  if mask is not None:
    fill = 0 if other is None else np.asarray(other)
    value = np.where(mask, value, fill).astype(value.dtype)
  return [value]


@_plain
def _masked_swap(ctx, eqn, invals):
  ref, transforms, value, mask = eqn.params["args_tree"].unflatten(invals)
  view, mask = _masked_operands(ctx, eqn, ref, transforms, mask)
  old = ctx.machine.load(ctx, view, eqn, check_init=False)
  ctx.machine.store(ctx, view, value, eqn, mask=mask)
  return [old]


@_plain
def _barrier_semaphore(ctx, eqn, invals):
  return [ctx.machine.barrier_semaphore(ctx)]


def _run_scoped(ctx, eqn, invals):
  jaxpr = eqn.params["jaxpr"]
  if eqn.params.get("collective_axes"):
    raise NotImplementedError(
      "mpmd checker: run_scoped(collective_axes=...) (memory allocated "
      f"across programs, at {where(eqn)})"
    )
  allocations = ctx.machine.allocate_scoped(ctx, eqn, jaxpr.invars)
  ctx.scope_depth += 1
  try:
    outs = yield from run_jaxpr(ctx, jaxpr, invals, allocations)
  finally:
    ctx.scope_depth -= 1
  yield Sync(ScopeEnd(allocations), ctx.where)
  return outs


@dataclasses.dataclass(frozen=True)
class ScopeEnd:
  """A ``run_scoped`` scope ends: its buffers are freed (a synchronisation
  point: DMAs or signals still aimed at them are a bug)."""

  buffers: tuple[Any, ...]


def _cond(ctx, eqn, invals):
  index, *args = invals
  branch = eqn.params["branches"][int(index)]
  jaxpr, consts = opened(branch)
  return (yield from run_jaxpr(ctx, jaxpr, consts, args))


def _while(ctx, eqn, invals):
  p = eqn.params
  cond_jaxpr, cond_consts = opened(p["cond_jaxpr"])
  body_jaxpr, body_consts = opened(p["body_jaxpr"])
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts, carry = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
  while True:
    [go] = yield from run_jaxpr(
      ctx, cond_jaxpr, cond_consts, [*cconsts, *carry]
    )
    if not bool(go):
      return carry
    carry = yield from run_jaxpr(
      ctx, body_jaxpr, body_consts, [*bconsts, *carry]
    )


def _scan(ctx, eqn, invals):
  p = eqn.params
  memo = ctx.machine.plan.memo
  if ("scan", id(eqn)) not in memo:  # 0.12 unpacks a flat tree for it
    memo[("scan", id(eqn))] = (_jax.scan_layout(p), eqn)  # eqn: keep id
  (num_consts, num_carry), _ = memo[("scan", id(eqn))]
  jaxpr, jconsts = opened(p["jaxpr"])
  consts = invals[:num_consts]
  carry = invals[num_consts : num_consts + num_carry]
  xs = invals[num_consts + num_carry :]
  length = p["length"]
  steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
  ys_steps: dict[int, list[Any]] = {}
  for i in steps:
    outs = yield from run_jaxpr(
      ctx, jaxpr, jconsts, [*consts, *carry, *(np.asarray(x)[i] for x in xs)]
    )
    carry, ys_steps[i] = outs[:num_carry], outs[num_carry:]
  num_ys = len(eqn.outvars) - num_carry
  ys = []
  for k in range(num_ys):
    aval = eqn.outvars[num_carry + k].aval
    if length:
      ys.append(np.stack([np.asarray(ys_steps[i][k]) for i in range(length)]))
    else:
      ys.append(np.zeros(aval.shape, aval.dtype))
  return [*carry, *ys]


def _call(ctx, eqn, invals):
  jaxpr, consts = opened(eqn.params["jaxpr"])
  return (yield from run_jaxpr(ctx, jaxpr, consts, invals))


def _custom_call(ctx, eqn, invals):
  jaxpr, consts = opened(eqn.params["call_jaxpr"])
  return (yield from run_jaxpr(ctx, jaxpr, consts, invals))


def _rules() -> dict[Any, Any]:
  tpu = _jax.tpu().primitives
  rules = {p: _sync for p in records.record_types()}
  rules.update(
    {
      _jax.lax_parallel.axis_index_p: _axis_index,
      state_primitives.get_p: _get,
      state_primitives.swap_p: _swap,
      state_primitives.addupdate_p: _addupdate,
      pallas_primitives.load_p: _masked_load,
      pallas_primitives.swap_p: _masked_swap,
      pallas_primitives.run_scoped_p: _run_scoped,
      pallas_primitives.delay_p: _nothing,
      tpu.get_barrier_semaphore_p: _barrier_semaphore,
      lax_control_flow.cond_p: _cond,
      lax_control_flow.while_p: _while,
      lax_control_flow.scan_p: _scan,
      pjit.jit_p: _call,
      _custom.custom_jvp_call_p: _custom_call,
    }
  )
  for name in ("trace_value_p", "prng_seed_p"):
    if hasattr(tpu, name):
      rules[getattr(tpu, name)] = _nothing
  return rules


RULES = _rules()
