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

from mpmd import _jax, _pallas_ops
from mpmd._jax import (
  core,
  lax_control_flow,
  pallas_primitives,
  pjit,
  state,
  state_primitives,
)
from mpmd._lowering import debug_checks, errors, jaxpr_util
from mpmd._lowering.check import (
  records,
  refs,
  scalars,
  segments,
)
from mpmd._lowering.check.segments import Segment

_custom = _jax.custom_derivatives


@dataclasses.dataclass
class Sync:
  """A synchronisation point a program reached: the operation (a record of
  ``records``) and where in the kernel it is."""

  op: Any
  where: str


Program = Generator[Sync, Any, None]


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
      bool(machine.plan.device_axes) and _jax.CALLBACKS_FILL_POOL
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
          f"mpmd checker: axis_index of unknown axis {n!r} at "
          f"{jaxpr_util.line(eqn)}"
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


def _steps(jaxpr: core.Jaxpr, memo: dict) -> list[Any]:
  """``jaxpr``'s equations as steps: equations to interpret and compiled
  segments of the pure equations between them (on variables)."""
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
        steps.append(e)
      if part:
        steps.append(segment(part))
    run.clear()

  for i, eqn in enumerate(jaxpr.eqns):
    if _pure(eqn, memo):
      run.append((i, eqn))
      continue
    flush()
    steps.append(eqn)
  flush()
  return steps


class _Code:
  """A jaxpr as ``run_jaxpr`` runs it, worked out once per kernel: every
  variable has a fixed slot of a list (the environment), each step names
  the slots it reads and writes, and the bodies of control flow are
  opened and compiled ahead (nothing is looked up per iteration)."""

  __slots__ = ("size", "params", "steps", "outs")

  def __init__(self, jaxpr: core.Jaxpr, memo: dict):
    slots: dict[Any, int] = {}

    def slot(v) -> int:
      k = slots.get(v)
      if k is None:
        k = slots[v] = len(slots)
      return k

    # (Operand k has slot k: an empty body's outputs index its operands.)
    self.params = [slot(v) for v in (*jaxpr.constvars, *jaxpr.invars)]
    self.steps: list[Any] = []
    for step in _steps(jaxpr, memo):
      if type(step) is Segment:
        ins = [slot(v) for v in step.invars]
        outs = [slot(v) for v in step.outvars]
        self.steps.append(_SegmentStep(step, ins, outs))
      else:
        self.steps.append(_Step(step, slot, memo))
    self.outs = _operands(jaxpr.outvars, slot)
    self.size = len(slots)


def _code(jaxpr: core.Jaxpr, memo: dict) -> _Code:
  key = ("code", jaxpr)  # jaxprs hash by identity; the memo keeps them
  found = memo.get(key)
  if found is None:
    found = memo[key] = _Code(jaxpr, memo)
  return found


def _operands(invars, slot) -> list[tuple[bool, Any]]:
  """(True, a literal's value on the host) or (False, a variable's slot)."""
  return [
    (True, segments.host(v.val))
    if isinstance(v, core.Literal)
    else (False, slot(v))
    for v in invars
  ]


class _SegmentStep:
  __slots__ = ("fn", "ins", "outs")

  def __init__(self, segment: Segment, ins, outs):
    self.fn, self.ins, self.outs = segment.fn, ins, outs


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
  its source line, operands (literals on the host already, else slots),
  the slots of the outputs it defines (None: dropped), for control
  flow, its bodies compiled (``_Flow``), and ``plain``: ``_sync`` for a
  synchronisation, the plain function of a rule that never synchronises
  (``_PLAIN``), else None. (Other rules are looked up as the step runs:
  the GPU rules join the table when a GPU launch is first lowered, and
  replace none of these.)"""

  __slots__ = ("eqn", "place", "ins", "outs", "flow", "plain")

  def __init__(self, eqn: core.JaxprEqn, slot, memo: dict):
    self.eqn = eqn
    self.place = jaxpr_util.line(eqn)
    self.ins = _operands(eqn.invars, slot)
    self.outs = [
      None if isinstance(v, core.DropVar) else slot(v) for v in eqn.outvars
    ]
    self.flow = _flow(eqn, memo)
    rule = RULES.get(eqn.primitive)
    self.plain = rule if rule is _sync or rule is None else _PLAIN.get(rule)


def run_jaxpr(
  ctx: Context, jaxpr: core.Jaxpr, consts, args
) -> Generator[Sync, Any, list[Any]]:
  """Evaluates ``jaxpr`` for one program; yields at synchronisation points;
  returns its outputs."""
  code = _code(jaxpr, ctx.machine.plan.memo)
  return (yield from _run(ctx, code, [*consts, *args]))


def _run(ctx: Context, code: _Code, values) -> Generator[Sync, Any, list[Any]]:
  env: list[Any] = [None] * code.size
  for k, x in zip(code.params, values, strict=True):
    env[k] = x
  own_client = ctx.own_client
  enclosing = ctx.where
  for step in code.steps:
    if type(step) is _SegmentStep:
      outs = step.fn(own_client, *[env[k] for k in step.ins])
      for k, x in zip(step.outs, outs, strict=True):
        env[k] = x
      continue
    ctx.where = step.place or enclosing
    invals = [x if literal else env[x] for literal, x in step.ins]
    flow = step.flow
    if flow is not None:
      if type(flow) is _Cond:  # the taken branch, with no rule between
        body, consts = flow.branches[int(invals[0])]
        args = [*consts, *invals[1:]]
        if body.steps:
          values = yield from _run(ctx, body, args)
        else:  # (``when`` not taken) its outputs are operands: no frame
          values = [x if literal else args[x] for literal, x in body.outs]
      else:
        values = yield from flow.run(ctx, invals)
    else:
      eqn = step.eqn
      plain = step.plain
      if plain is _sync:  # no generator of its own per operation
        record = records.record_of(eqn, invals, ctx.machine.plan.memo)
        result = yield Sync(record, ctx.where)
        values = _synced(eqn, result)
      elif plain is not None:
        values = plain(ctx, eqn, invals)
      elif (rule := RULES.get(eqn.primitive)) is None:  # pure: segments
        raise NotImplementedError(
          f"mpmd checker: {eqn.primitive.name!r} (at {ctx.where}) is "
          "not supported by the checking executor; run the launch with "
          "interpret=None (the CPU fallback's default paths) or "
          "pltpu.InterpretParams()"
        )
      else:
        plain = _PLAIN.get(rule)
        if plain is not None:
          values = plain(ctx, eqn, invals)
        else:
          values = yield from rule(ctx, eqn, invals)
    for k, x in zip(step.outs, values, strict=True):
      if k is not None:
        env[k] = x
    ctx.where = enclosing
  return [x if literal else env[x] for literal, x in code.outs]


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


def _sync(ctx, eqn, invals):
  record = records.record_of(eqn, invals, ctx.machine.plan.memo)
  result = yield Sync(record, ctx.where)
  return _synced(eqn, result)


def _synced(eqn, result) -> list[Any]:
  """A synchronisation's outputs, from what the scheduler sent back."""
  if eqn.primitive is pallas_primitives.semaphore_read_p:
    return [np.int32(result)]
  return []


@_plain
def _axis_index(ctx, eqn, invals):
  return [ctx.axis_index(eqn)]


@_plain
def _nothing(ctx, eqn, invals):
  return [] if eqn.primitive.multiple_results else [None]


_get = _plain(refs.get)
_swap = _plain(refs.swap)
_addupdate = _plain(refs.addupdate)
_masked_load = _plain(refs.masked_load)
_masked_swap = _plain(refs.masked_swap)


@_plain
def _debug_check(ctx, eqn, invals):
  """A kernel's ``pl.debug_check``: checked where Mosaic asserts it (with
  ``pl.enable_debug_checks`` on when the launch was lowered)."""
  m = ctx.machine
  if not m.plan.debug_checks:
    return []
  failed, fmt, args, kwargs = _pallas_ops.CheckOperands.of(eqn, invals)
  if np.asarray(failed):
    raise errors.DebugCheckError(
      f"{debug_checks.DEBUG_CHECK} in kernel {m.plan.kernel}, "
      f"{m.name(ctx.device, ctx.program)} at {ctx.where}: "
      f"{debug_checks.user_message(fmt, args, kwargs)}"
    )
  return []


@_plain
def _barrier_semaphore(ctx, eqn, invals):
  return [ctx.machine.barrier_semaphore(ctx)]


def _run_scoped(ctx, eqn, invals):
  jaxpr = eqn.params["jaxpr"]
  if eqn.params.get("collective_axes"):
    raise NotImplementedError(
      "mpmd checker: run_scoped(collective_axes=...) (memory allocated "
      f"across programs, at {jaxpr_util.line(eqn)})"
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


def _control(ctx, eqn, invals):
  """The rule of control flow (cond, while, scan, calls): its compiled
  form (``_flow``) run; ``_run`` runs it itself, with no rule between."""
  flow = _flow(eqn, ctx.machine.plan.memo)
  return (yield from flow.run(ctx, invals))


def _flow(eqn: core.JaxprEqn, memo: dict):
  """The compiled form of a control flow equation (its bodies' code), made
  once per kernel; None for any other equation."""
  make = _FLOWS.get(eqn.primitive)
  if make is None or RULES.get(eqn.primitive) is not _control:
    return None
  key = ("flow", eqn)
  found = memo.get(key)
  if found is None:
    found = memo[key] = make(eqn, memo)
  return found


def _opened_code(j, memo: dict) -> tuple[_Code, list[Any]]:
  jaxpr, consts = opened(j)
  return _code(jaxpr, memo), consts


class _Cond:
  __slots__ = ("branches",)

  def __init__(self, eqn, memo):
    self.branches = [_opened_code(b, memo) for b in eqn.params["branches"]]

  def run(self, ctx, invals):
    body, consts = self.branches[int(invals[0])]
    return (yield from _run(ctx, body, [*consts, *invals[1:]]))


class _Call:
  """A ``jit`` or ``custom_jvp`` call that is no segment."""

  __slots__ = ("body",)

  def __init__(self, eqn, memo):
    name = "jaxpr" if eqn.primitive is pjit.jit_p else "call_jaxpr"
    self.body = _opened_code(eqn.params[name], memo)

  def run(self, ctx, invals):
    body, consts = self.body
    return (yield from _run(ctx, body, [*consts, *invals]))


class _While:
  __slots__ = ("cond", "body", "nc", "nb")

  def __init__(self, eqn, memo):
    p = eqn.params
    self.cond = _opened_code(p["cond_jaxpr"], memo)
    self.body = _opened_code(p["body_jaxpr"], memo)
    self.nc, self.nb = p["cond_nconsts"], p["body_nconsts"]

  def run(self, ctx, invals):
    nc, nb = self.nc, self.nb
    cconsts, bconsts = invals[:nc], invals[nc : nc + nb]
    carry = invals[nc + nb :]
    (cond, cond_consts), (body, body_consts) = self.cond, self.body
    while True:
      [go] = yield from _run(ctx, cond, [*cond_consts, *cconsts, *carry])
      if not bool(go):
        return carry
      carry = yield from _run(ctx, body, [*body_consts, *bconsts, *carry])


class _Scan:
  __slots__ = ("num_consts", "num_carry", "body", "length", "reverse", "ys")

  def __init__(self, eqn, memo):
    p = eqn.params
    # (0.12 unpacks a flat tree for the layout: once, here.)
    self.num_consts, self.num_carry = _jax.scan_layout(p)
    self.body = _opened_code(p["jaxpr"], memo)
    self.length, self.reverse = p["length"], p["reverse"]
    self.ys = [v.aval for v in eqn.outvars[self.num_carry :]]

  def run(self, ctx, invals):
    num_consts, num_carry, length = self.num_consts, self.num_carry, self.length
    body, jconsts = self.body
    consts = invals[:num_consts]
    carry = invals[num_consts : num_consts + num_carry]
    xs = [np.asarray(x) for x in invals[num_consts + num_carry :]]
    steps = range(length - 1, -1, -1) if self.reverse else range(length)
    ys_steps: dict[int, list[Any]] = {}
    for i in steps:
      outs = yield from _run(
        ctx, body, [*jconsts, *consts, *carry, *(x[i] for x in xs)]
      )
      carry, ys_steps[i] = outs[:num_carry], outs[num_carry:]
    ys = []
    for k, aval in enumerate(self.ys):
      if length:
        ys.append(np.stack([np.asarray(ys_steps[i][k]) for i in range(length)]))
      else:
        ys.append(np.zeros(aval.shape, aval.dtype))
    return [*carry, *ys]


_FLOWS = {
  lax_control_flow.cond_p: _Cond,
  lax_control_flow.while_p: _While,
  lax_control_flow.scan_p: _Scan,
  pjit.jit_p: _Call,
  _custom.custom_jvp_call_p: _Call,
}


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
      _pallas_ops.CHECK_P: _debug_check,
      tpu.get_barrier_semaphore_p: _barrier_semaphore,
      lax_control_flow.cond_p: _control,
      lax_control_flow.while_p: _control,
      lax_control_flow.scan_p: _control,
      pjit.jit_p: _control,
      _custom.custom_jvp_call_p: _control,
    }
  )
  for name in ("trace_value_p", "prng_seed_p"):
    if hasattr(tpu, name):
      rules[getattr(tpu, name)] = _nothing
  return rules


RULES = _rules()
