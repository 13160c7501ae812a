"""Integer ranges of a kernel's index arithmetic, proven before it runs: the
DMA windows whose bounds hold for every program and step need no run-time
check. Also the views a DMA's operands take (indexers, source and
destination)."""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from mpmd import _jax, _pallas_ops
from mpmd._jax import (
  core,
  state_indexing,
  state_primitives,
  state_types,
  tree_util,
)
from mpmd._lowering import jaxpr_util
from mpmd._pallas_ops import Sync


def ref_indexers(ref: Any) -> tuple[Any, list[state_indexing.NDIndexer]]:
  """A (transformed) Ref's root and its indexers, outermost first."""
  if isinstance(ref, state_types.TransformedRef):
    indexer = state_indexing.NDIndexer
    return ref.ref, [t for t in ref.transforms if isinstance(t, indexer)]
  return ref, []


def parts(index: Any) -> tuple[Any, Any, int, bool]:
  """(start, size, stride, is a slice) of one index of an indexer."""
  if isinstance(index, state_indexing.Slice):
    return index.start, index.size, index.stride, True
  return index, 1, 1, False


def dma_sides(eqn: core.JaxprEqn, invals: Sequence[Any] | None):
  """(role, operand, its traced value or None) of each window of a
  ``dma_start``: its source and destination, and the semaphores it
  signals (an index into an array of semaphores leaves it as a window
  leaves its buffer)."""
  dma = _pallas_ops.DmaOperands.of(eqn)
  values = None if invals is None else _pallas_ops.DmaOperands.of(eqn, invals)
  sides = []
  for role, field in _DMA_SIDES:
    static = getattr(dma, field)
    if static is not None:
      traced = None if values is None else getattr(values, field)
      sides.append((role, static, traced))
  return sides


_DMA_SIDES = (
  ("source", "src"),
  ("destination", "dst"),
  ("receive semaphore", "dst_sem"),
  ("send semaphore", "src_sem"),
)


def semaphore_side(eqn: core.JaxprEqn, invals: Sequence[Any] | None):
  """(role, semaphore operand, its traced value or None) of a
  ``dma_wait``, ``semaphore_signal``, ``semaphore_wait`` or
  ``semaphore_read`` (its semaphore seen through its indexers); None for
  any other equation."""
  kind = _pallas_ops.kind(eqn)
  if kind is Sync.DMA_WAIT:
    [static, traced] = [
      None if v is None else _pallas_ops.DmaOperands.of(eqn, v).awaited[1]
      for v in (eqn.invars, invals)
    ]
    return "awaited semaphore", static, traced
  operands = None if kind is None else _SEMAPHORE_OPERANDS.get(kind)
  if operands is None:
    return None
  static, traced = (
    None if v is None else _transformed(operands.of(eqn, v))
    for v in (eqn.invars, invals)
  )
  return "semaphore", static, traced


# Where the index operands of a Ref read or write (``x[i]``, ``x[i] = v``,
# ``x[i] += v``) begin, after the Ref (and the value stored).
_ACCESS_INDICES = {
  state_primitives.get_p: 1,
  state_primitives.swap_p: 2,
  state_primitives.addupdate_p: 2,
}


def access_side(eqn: core.JaxprEqn, invals: Sequence[Any] | None):
  """(role, the Ref seen through its indexers, its traced value or None)
  of a read or write of a Ref in place (``x_ref[i]``, ``x_ref[i] = v``);
  None for any other equation. (Pallas' masked loads and stores are not
  among them: a mask may keep lanes past the end from being touched.)"""
  first = _ACCESS_INDICES.get(eqn.primitive)
  if first is None:
    return None
  static, traced = (
    None if v is None else _indexed(eqn, v, first) for v in (eqn.invars, invals)
  )
  role = "load" if eqn.primitive is state_primitives.get_p else "store"
  return role, static, traced


def _indexed(eqn: core.JaxprEqn, values: Sequence[Any], first: int) -> Any:
  transforms = tree_util.tree_unflatten(eqn.params["tree"], values[first:])
  if not transforms:
    return values[0]
  return state_types.TransformedRef(values[0], tuple(transforms))


def _transformed(op) -> Any:
  """An operation's semaphore seen through its transforms, as a Ref."""
  if not op.transforms:
    return op.sem
  return state_types.TransformedRef(op.sem, tuple(op.transforms))


_SEMAPHORE_OPERANDS = {
  Sync.SIGNAL: _pallas_ops.SignalOperands,
  Sync.SEMAPHORE_WAIT: _pallas_ops.SemaphoreWaitOperands,
  Sync.SEMAPHORE_READ: _pallas_ops.SemaphoreReadOperands,
}


Range = tuple[int, int]


def _union(a: Range | None, b: Range | None) -> Range | None:
  if a is None or b is None:
    return None
  return min(a[0], b[0]), max(a[1], b[1])


def _mul(a: Range, b: Range) -> Range:
  products = [x * y for x in a for y in b]
  return min(products), max(products)


def _rem(a: Range, b: Range) -> Range | None:
  if b[0] != b[1] or b[0] <= 0:
    return None
  n = b[0] - 1
  # lax.rem takes the dividend's sign.
  return (0 if a[0] >= 0 else -n), (n if a[1] > 0 else 0)


def _div(a: Range, b: Range) -> Range | None:
  if b[0] != b[1] or b[0] <= 0:
    return None
  return int(a[0] / b[0]), int(a[1] / b[0])  # rounds towards zero


def _clamp(lo: Range, x: Range, hi: Range) -> Range:
  return min(max(x[0], lo[0]), hi[1]), max(min(x[1], hi[1]), lo[0])


_ARITHMETIC: dict[str, Callable[..., Range | None]] = {
  "add": lambda a, b: (a[0] + b[0], a[1] + b[1]),
  "sub": lambda a, b: (a[0] - b[1], a[1] - b[0]),
  "mul": _mul,
  "neg": lambda a: (-a[1], -a[0]),
  "max": lambda a, b: (max(a[0], b[0]), max(a[1], b[1])),
  "min": lambda a, b: (min(a[0], b[0]), min(a[1], b[1])),
  "rem": _rem,
  "div": _div,
  "clamp": _clamp,
  "convert_element_type": lambda a: a,
}


# Equations that call their jaxpr with their operands, in order.
CALLS = (
  "pjit",
  "jit",
  "closed_call",
  "core_call",
  "remat",
  "checkpoint",
  "custom_jvp_call",
  "custom_vjp_call",
  "custom_vjp_call_jaxpr",
)


_INT32 = (-(2**31), 2**31 - 1)


class _Prover:
  """Finds the ``dma_start``s whose windows stay in bounds and the waits on
  ``pl.run_scoped`` semaphores that are satisfied, whatever the program and
  the values the kernel reads (``proven``; equations hash by identity)."""

  def __init__(self, axis_sizes: dict[core.AxisName, int], once):
    self.axis_sizes = axis_sizes
    self.once = once
    self.ranges: dict[core.Var, Range] = {}
    # A jaxpr may be called from several places (a jitted helper): what it
    # does must hold for every call.
    self.held: set[core.JaxprEqn] = set()
    self.failed: set[core.JaxprEqn] = set()
    # The same for the semaphore operations' addresses (``Proven``).
    self.addressed: set[core.JaxprEqn] = set()
    self.misaddressed: set[core.JaxprEqn] = set()
    # The same for run_scoped semaphores back at zero at their scope's end.
    self.settled: set[tuple[core.JaxprEqn, int]] = set()
    self.unsettled: set[tuple[core.JaxprEqn, int]] = set()

  @property
  def proven(self) -> "Proven":
    return Proven(
      frozenset(self.held - self.failed),
      frozenset(self.addressed - self.misaddressed),
      frozenset(self.settled - self.unsettled),
    )

  def verdict(self, eqn: core.JaxprEqn, holds: bool) -> None:
    (self.held if holds else self.failed).add(eqn)

  def address_verdict(self, eqn: core.JaxprEqn, holds: bool) -> None:
    (self.addressed if holds else self.misaddressed).add(eqn)

  def device_in_range(self, device_id: Any) -> bool:
    """Whether every coordinate of a ``device_id`` dict is within its
    axis (an index alone, or an unknown axis: not known)."""
    if device_id is None:
      return True
    if not isinstance(device_id, dict):
      return False
    for axis, index in device_id.items():
      size, got = self.axis_sizes.get(axis), self.range(index)
      if size is None or got is None or got[0] < 0 or got[1] >= size:
        return False
    return True

  def set(self, v: core.Var, r: Range | None) -> None:
    if r is None:
      self.ranges.pop(v, None)  # left from another call of its jaxpr
    else:
      self.ranges[v] = r

  def range(self, x: Any) -> Range | None:
    if isinstance(x, core.Var):
      return self.ranges.get(x)
    if isinstance(x, core.Literal):
      x = x.val
    if isinstance(x, core.Tracer) or np.ndim(x):
      return None
    value = np.asarray(x)
    if not np.issubdtype(value.dtype, np.integer):
      return None
    return int(value), int(value)

  def bind(self, variables, operands) -> None:
    for v, x in zip(variables, operands, strict=True):
      self.set(v, self.range(x))

  def walk(self, jaxpr: core.Jaxpr) -> None:
    for eqn in jaxpr.eqns:
      self.eqn(eqn)

  def eqn(self, eqn: core.JaxprEqn) -> None:
    name = eqn.primitive.name
    params = eqn.params
    out = None
    if name in _ARITHMETIC and _is_int_scalar(eqn.outvars[0].aval):
      args = [self.range(x) for x in eqn.invars]
      if all(a is not None for a in args):
        out = _ARITHMETIC[name](*args)
    elif name == "select_n" and _is_int_scalar(eqn.outvars[0].aval):
      cases = [self.range(x) for x in eqn.invars[1:]]
      out = functools.reduce(_union, cases)
    elif name == "axis_index":
      axes = params["axis_name"]
      axes = axes if isinstance(axes, tuple) else (axes,)
      if all(a in self.axis_sizes for a in axes):
        out = (0, math.prod(self.axis_sizes[a] for a in axes) - 1)
    elif name == "program_id":
      sizes = list(self.axis_sizes.values())
      out = (0, sizes[params["axis"]] - 1)
    elif name == "cond":
      out = self.cond(eqn)
    elif name == "scan":
      self.scan(eqn)
    elif name == "while":
      self.while_loop(eqn)
    elif _pallas_ops.kind(eqn) is Sync.RUN_SCOPED:
      [scope] = jaxpr_util.sub_jaxprs(params)
      self.bind(scope.constvars, eqn.invars)
      self.walk(scope)
      self.scoped_waits(eqn, scope)
    elif _pallas_ops.kind(eqn) is Sync.DMA_START:
      sides = dma_sides(eqn, None)
      device_id = _pallas_ops.DmaOperands.of(eqn).device_id
      self.verdict(
        eqn,
        all(self.window_in_bounds(r) for _, r, _ in sides)
        and self.device_in_range(device_id),
      )
    elif (side := access_side(eqn, None)) is not None:
      self.verdict(eqn, self.window_in_bounds(side[1]))
    elif (side := semaphore_side(eqn, None)) is not None:
      device_id = None
      if _pallas_ops.kind(eqn) is Sync.SIGNAL:
        device_id = _pallas_ops.SignalOperands.of(eqn).device_id
      self.address_verdict(
        eqn,
        self.window_in_bounds(side[1]) and self.device_in_range(device_id),
      )
    else:
      for sub in jaxpr_util.sub_jaxprs(params):
        call = name in CALLS and len(sub.invars) == len(eqn.invars)
        if call:
          self.bind(sub.invars, eqn.invars)
        else:
          # Nested DMAs are looked at either way (unproven without ranges).
          for v in (*sub.constvars, *sub.invars):
            self.set(v, None)
        self.walk(sub)
        if call and len(sub.outvars) == len(eqn.outvars) == 1:
          out = self.range(sub.outvars[0])
    # Beyond int32 a value may wrap around: nothing is known of it.
    if out is not None and not (_INT32[0] <= out[0] and out[1] <= _INT32[1]):
      out = None
    for v in eqn.outvars:
      self.set(v, out if len(eqn.outvars) == 1 else None)

  def cond(self, eqn) -> Range | None:
    outs = []
    for branch in eqn.params["branches"]:
      branch, _ = _jax.open_jaxpr(branch)
      self.bind(branch.invars, eqn.invars[1:])
      self.walk(branch)
      outs.append(self.range(branch.outvars[0]) if branch.outvars else None)
    return functools.reduce(_union, outs) if len(eqn.outvars) == 1 else None

  def scan(self, eqn) -> None:
    body, _ = _jax.open_jaxpr(eqn.params["jaxpr"])
    num_consts, num_carry = _jax.scan_layout(eqn.params)
    length = eqn.params["length"]
    self.bind(body.invars[:num_consts], eqn.invars[:num_consts])
    for k in range(num_carry):
      carry = body.invars[num_consts + k]
      init = self.range(eqn.invars[num_consts + k])
      step = _step(body, carry, body.outvars[k])
      if init is None or step is None:
        self.set(carry, None)
        continue
      # A counter moves by `step` each of `length` iterations.
      reach = step * max(length - 1, 0)
      self.set(carry, (init[0] + min(reach, 0), init[1] + max(reach, 0)))
    for v in body.invars[num_consts + num_carry :]:
      self.set(v, None)
    self.walk(body)

  def while_loop(self, eqn) -> None:
    params = eqn.params
    body, _ = _jax.open_jaxpr(params["body_jaxpr"])
    cond, _ = _jax.open_jaxpr(params["cond_jaxpr"])
    num_cond, num_body = params["cond_nconsts"], params["body_nconsts"]
    carries = eqn.invars[num_cond + num_body :]
    self.bind(
      body.invars[:num_body], eqn.invars[num_cond : num_cond + num_body]
    )
    inits = [self.range(x) for x in carries]
    # Carries the body passes on unchanged keep their initial value.
    fixed = {
      k: r
      for k, r in enumerate(inits)
      if r is not None and body.outvars[k] is body.invars[num_body + k]
    }
    for k in range(len(carries)):
      self.set(body.invars[num_body + k], fixed.get(k))
    bound = self.loop_bound(cond, num_cond, eqn.invars[:num_cond], fixed)
    if bound is not None:
      k, limit = bound
      step = _step(body, body.invars[num_body + k], body.outvars[k])
      if inits[k] is not None and step is not None and step > 0:
        # The body runs while the counter is below the limit.
        self.set(
          body.invars[num_body + k], (min(inits[k][0], limit - 1), limit - 1)
        )
    self.walk(body)

  def loop_bound(self, cond, num_cond, cond_consts, fixed):
    """(carry k, limit) when the loop runs while carry k < limit."""
    [pred] = cond.outvars
    producer = next((e for e in cond.eqns if pred in e.outvars), None)
    if producer is None or producer.primitive.name != "lt":
      return None
    counter, limit = producer.invars
    if counter not in cond.invars[num_cond:]:
      return None
    k = cond.invars[num_cond:].index(counter)
    if limit in cond.invars[num_cond:]:
      limit_range = fixed.get(cond.invars[num_cond:].index(limit))
    elif limit in cond.invars[:num_cond]:
      limit_range = self.range(cond_consts[cond.invars.index(limit)])
    else:
      limit_range = self.range(limit)
    return None if limit_range is None else (k, limit_range[1])

  def window_in_bounds(self, ref: Any) -> bool:
    _, indexers = ref_indexers(ref)
    for indexer in indexers:
      for index, bound in zip(indexer.indices, indexer.shape, strict=True):
        start, size, stride, _ = parts(index)
        start, size = self.range(start), self.range(size)
        if start is None or size is None:
          return False
        if size[1] > 0 and (
          start[0] < 0 or start[1] + (size[1] - 1) * stride >= bound
        ):
          return False
    return True

  def scoped_waits(self, scope_eqn: core.JaxprEqn, scope: core.Jaxpr) -> None:
    """Proves the waits on the scope's own semaphores that its straight-line
    code signals (or DMAs into) enough before (a ``sync_copy``), and the
    semaphores that it brings back to zero by its end."""
    counts: dict[core.Var, int] = {v: 0 for v in scope.invars}
    for eqn in scope.eqns:
      op = _semaphore_op(eqn, self.range, self.once)
      if op is None:
        # Anything else that takes a semaphore (a loop, a branch): its count
        # is not followed any more.
        for x in eqn.invars:
          if isinstance(x, core.Var):
            counts.pop(x, None)
        continue
      sem, amount, wait, decrement = op
      if sem not in counts:
        if wait:
          self.verdict(eqn, False)
        continue
      if not wait:
        counts[sem] += amount
      elif counts[sem] >= amount:
        self.verdict(eqn, True)
        counts[sem] -= amount if decrement else 0
      else:
        self.verdict(eqn, False)
        del counts[sem]
    for k, v in enumerate(scope.invars):
      settled = counts.get(v) == 0
      (self.settled if settled else self.unsettled).add((scope_eqn, k))


def _semaphore_op(
  eqn: core.JaxprEqn, range_of, once: dict[core.JaxprEqn, tuple[bool, bool]]
) -> tuple | None:
  """(semaphore, amount, is a wait, decrements) of a local signal or wait on
  a whole semaphore by a static amount; None for anything else. ``once``:
  ``counts.once_by_eqn`` (a DMA adds 1 to a REGULAR semaphore)."""
  kind = _pallas_ops.kind(eqn)
  if kind in (Sync.DMA_START, Sync.DMA_WAIT):
    dma = _pallas_ops.DmaOperands.of(eqn)
    if dma.device_id is not None and kind is Sync.DMA_START:
      return None  # it signals the receiver's semaphore
    # What the semaphore counts: the destination's bytes (a wait of the
    # send side: the source's).
    wait = kind is Sync.DMA_WAIT
    by_avals = _pallas_ops.DmaOperands.of(eqn, [v.aval for v in eqn.invars])
    if wait:
      _, sem = dma.awaited
      counted, _ = by_avals.awaited
    else:
      sem, counted = dma.dst_sem, by_avals.dst
    amount = math.prod(counted.shape) * np.dtype(counted.dtype).itemsize
    if not wait and once.get(eqn, (False, False))[0]:
      amount = 1
    decrement = True
  elif kind is Sync.SIGNAL:
    op = _pallas_ops.SignalOperands.of(eqn)
    sem, transforms, inc = op.sem, op.transforms, op.inc
    if transforms or op.device_id is not None or op.core_index is not None:
      return None
    amount, wait, decrement = range_of(inc), False, True
  elif kind is Sync.SEMAPHORE_WAIT:
    op = _pallas_ops.SemaphoreWaitOperands.of(eqn)
    sem, transforms, value, decrement = (
      op.sem,
      op.transforms,
      op.value,
      op.decrement,
    )
    if isinstance(decrement, core.Literal):
      decrement = decrement.val
    if transforms or not isinstance(decrement, (bool, np.bool_)):
      return None
    amount, wait = range_of(value), True
  else:
    return None
  if isinstance(amount, tuple):
    if amount[0] != amount[1]:
      return None
    amount = amount[0]
  if amount is None or not isinstance(sem, core.Var):
    return None
  return sem, amount, wait, bool(decrement)


def _is_int_scalar(aval: Any) -> bool:
  return getattr(aval, "shape", None) == () and np.issubdtype(
    aval.dtype, np.integer
  )


def _step(body: core.Jaxpr, carry: core.Var, out: Any) -> int | None:
  """``c`` when ``body`` returns ``carry + c`` for this carry (literal c)."""
  producer = next((e for e in body.eqns if out in e.outvars), None)
  if producer is None or producer.primitive.name != "add":
    return None
  a, b = producer.invars
  other = b if a is carry else a if b is carry else None
  if not isinstance(other, core.Literal):
    return None
  return int(other.val)


class Proven(NamedTuple):
  """The equations whose run-time checks cannot fail (``prove``)."""

  # dma_starts: windows in bounds (semaphores too), device ids in the
  # mesh; waits on scoped semaphores: satisfied.
  checks: frozenset[core.JaxprEqn]
  # Signals, waits and reads of semaphores: the semaphore's index in
  # bounds, a signal's device id in the mesh.
  addresses: frozenset[core.JaxprEqn]
  # (run_scoped, allocation): a semaphore back at zero at the scope's end.
  settled: frozenset[tuple[core.JaxprEqn, int]] = frozenset()


def prove(
  jaxpr: core.Jaxpr,
  axis_sizes: dict[core.AxisName, int],
  once: dict[core.JaxprEqn, tuple[bool, bool]] | None = None,
) -> Proven:
  """The equations of ``jaxpr`` (nested ones too) whose run-time
  checks cannot fail (``Proven``).

  ``axis_sizes``: the kernel mesh's axes, in order (``program_id`` counts
  them), then any device axes of an enclosing ``shard_map``; ``once``:
  ``counts.once_by_eqn`` of ``jaxpr``.
  """
  prover = _Prover(axis_sizes, {} if once is None else once)
  prover.walk(jaxpr)
  return prover.proven
