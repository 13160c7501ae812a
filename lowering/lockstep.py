"""The lockstep path: SPMD collective kernels as XLA collectives.

A TPU kernel under ``jax.shard_map`` whose devices synchronise only through
remote DMAs, remote semaphore signals and the barrier semaphore, and issue
those unconditionally (straight-line code and loops of static trip count),
runs on every device as plain XLA: the kernel is discharged like on the
fast path, and remote operations become exchanges over the mesh axes the
kernel's device ids name, every device issuing them at the same point.
Operations issued in a row share one exchange (``Exchanges``: one
``all_gather``, large data by ring shift), since each exchange is a
rendezvous of every device; a wait on a pending operation's semaphore waits
for the exchange instead of forcing it, so that a handshake travels with the
first transfers. No Python runs per operation, unlike in the threaded TPU
simulator.

Faithfulness. A DMA lands when it starts, or later but before its receiver
can tell (before the receiver next touches what it writes): a valid order
of events for a race-free kernel (races are the simulator's job:
``interpret=pltpu.InterpretParams(detect_races=True)``). Semaphores count
bytes (DMA) and signals as int32, as on hardware. A wait that finds its
semaphore short would block on hardware; here the devices run in step, so
the semaphore is poisoned (set far below zero, and no later signal lifts
it) and the launch fails at the end with a ``DeadlockError`` naming device
and semaphore, instead of running on with missing data. A DMA whose window
leaves its buffer, or a wait that finds a ``pl.run_scoped`` semaphore
short, fails the launch too (``mpmd._lowering.bounds``).
"""

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpmd import _jax, _pallas_ops
from mpmd._jax import (
  callback,
  core,
  hlo_interpreter,
  mlir,
  state_primitives,
  state_types,
  tree_util,
)
from mpmd._lowering import (
  bounds,
  common,
  device_ids,
  errors,
  jaxpr_util,
  packing,
  paths,
  ranges,
  watchdog,
  words,
)
from mpmd._lowering.counts import (
  Once,
  dma_amount,
  is_count,
  once_by_eqn,
  once_flags,
  poisoned,
  ref_bytes,
  signal,
  wait,
  widen,
  with_transforms,
)
from mpmd._lowering.devices import Devices
from mpmd._lowering.exchange import Exchanges, remote_copy, remote_signal
from mpmd._pallas_ops import Sync
from mpmd._primitives import mpmd_map as prim


def sync_rule(
  checks: bounds.Checks,
  devices: Devices | None = None,
  barrier: tuple[Any, ...] = (),
  first: jaxpr_util.EqnRule | None = None,
  once: dict[core.JaxprEqn, Once] | None = None,
) -> jaxpr_util.EqnRule:
  """The rewrite of every synchronising operation (see module docstring),
  with ``checks`` of DMA windows and scoped waits; ``first`` (say an axis
  index rule) goes before it on every equation, nested ones included;
  ``once``: ``counts.once_by_eqn`` of the jaxpr it rewrites.

  The fast path uses it too, for its local DMAs and semaphores (no
  ``devices``): the same int32 byte counts, the same poisoned waits.
  """

  exchanges = None if devices is None else Exchanges(devices)

  def run_wait(sem, take):
    if exchanges is None:
      take()
    else:
      exchanges.wait(sem, take)

  def rule(eqn, invals):
    if first is not None:
      outs = first(eqn, invals)
      if outs is not None:
        return outs
    if eqn.primitive is _pallas_ops.CHECK_P:
      # A kernel's pl.debug_check: checked where Mosaic would assert it.
      if _jax.pallas_core.debug_checks_enabled():
        checks.user_check(eqn, invals)
      return []
    checks.access(eqn, invals)
    kind = _pallas_ops.kind(eqn)
    # A wait touches only its semaphore, and may wait for the exchange
    # (``Exchanges.wait``) rather than force it.
    if exchanges is not None and kind not in _WAITS:
      exchanges.flush_if_touched(eqn, invals)
    if kind is Sync.BARRIER_SEMAPHORE:
      return list(barrier)
    if kind in _ADDRESSED:
      checks.address(eqn, invals, devices)
    if kind is Sync.DMA_START:
      checks.dma(eqn, invals, devices)
      flags = (False, False) if once is None else once[eqn]
      _dma_start(eqn, invals, exchanges, flags)
      return []
    if kind is Sync.DMA_WAIT:
      buffer, sem = _pallas_ops.DmaOperands.of(eqn, invals).awaited
      operand = _pallas_ops.DmaOperands.of(eqn).awaited[1]
      run_wait(
        sem, lambda: checks.wait(eqn, operand, wait(sem, ref_bytes(buffer)))
      )
      return []
    if kind is Sync.SIGNAL:
      _signal(eqn, invals, exchanges)
      return []
    if kind is Sync.SEMAPHORE_WAIT:
      waits = _pallas_ops.SemaphoreWaitOperands.of(eqn, invals)
      operand = _pallas_ops.SemaphoreWaitOperands.of(eqn).sem

      def take():
        sem = with_transforms(waits.sem, waits.transforms)
        checks.wait(eqn, operand, wait(sem, waits.value, waits.decrement))

      run_wait(waits.sem, take)
      return []
    if kind is Sync.SEMAPHORE_READ:
      reads = _pallas_ops.SemaphoreReadOperands.of(eqn, invals)
      value = state_primitives.ref_get(
        with_transforms(reads.sem, reads.transforms), None
      )
      return [value.astype(eqn.outvars[0].aval.dtype)]
    if kind is Sync.RUN_SCOPED:
      with checks.inside(eqn):
        return _inline_scope(eqn, invals, framed, checks)
    return None

  # Nested scopes (``_inline_scope``) are rewritten in frames of their own.
  framed: jaxpr_util.EqnRule = (
    rule if exchanges is None else jaxpr_util.FramedRule(rule, exchanges.frame)
  )
  return framed


# The waits: they touch only their semaphore.
_WAITS = (Sync.DMA_WAIT, Sync.SEMAPHORE_WAIT)
# The operations that index a semaphore of their own (``Checks.address``).
_ADDRESSED = (*_WAITS, Sync.SIGNAL, Sync.SEMAPHORE_READ)


def _dma_start(eqn, invals, exchanges: Exchanges | None, once: Once) -> None:
  """A DMA: remote ones leave in the next exchange; local ones land now;
  ``once``: whether its receive and send semaphores count 1."""
  dma = _pallas_ops.DmaOperands.of(eqn, invals)
  if dma.device_id is not None:
    assert exchanges is not None, "a remote DMA off the lockstep path"
    names = _pallas_ops.DmaOperands.of(eqn).device_id
    remote_copy(exchanges, dma, exchanges.devices.static_shift(names), once)
    return
  data = state_primitives.ref_get(dma.src, None)
  if dma.add:
    data = data + state_primitives.ref_get(dma.dst, None)
  state_primitives.ref_set(dma.dst, None, data)
  if dma.dst_sem is not None:
    signal(dma.dst_sem, dma_amount(once[0], dma.dst))
  if dma.src_sem is not None:
    # The data has left: its send semaphore counts, as in Pallas' discharge
    # rule (a DMA to an external mesh's one program runs as a local one).
    signal(dma.src_sem, dma_amount(once[1], dma.src))


def _signal(eqn, invals, exchanges: Exchanges | None) -> None:
  """A signal: remote ones leave in the next exchange; local ones count
  now."""
  op = _pallas_ops.SignalOperands.of(eqn, invals)
  if op.device_id is None:
    signal(with_transforms(op.sem, op.transforms), op.inc)
    return
  assert exchanges is not None, "a remote signal off the lockstep path"
  names = _pallas_ops.SignalOperands.of(eqn).device_id
  shift = exchanges.devices.static_shift(names)
  remote_signal(exchanges, op, shift)


def _inline_scope(eqn, invals, rule, checks: bounds.Checks) -> list[Any]:
  """A ``pl.run_scoped`` rewritten with ``rule`` and run in place, its
  allocations discharged to values.

  Discharging the kernel would keep the ``run_scoped`` (with its scoped
  Refs), into which the threading of checks (``failures``) does not reach.
  """
  scope = eqn.params["jaxpr"]
  num_closed = len(scope.constvars)
  # Under jax.enable_checks, 0.10's convert_constvars_jaxpr typechecks the
  # scope, whose semaphores already count in int32 (``widen``), which
  # Pallas' dma_wait rejects.
  with jax.enable_checks(False):
    scope = _jax.pe.convert_constvars_jaxpr(scope)
  body = jaxpr_util.rewrite(scope, rule)
  allocated = [jaxpr_util.ref_type(v.aval) for v in body.invars[num_closed:]]
  pure, consts = _jax.open_jaxpr(
    _jax.discharge_state(
      _jax.closed_jaxpr(body),
      should_discharge=[False] * num_closed + [True] * len(allocated),
    )
  )
  # Scoped semaphores start at zero (Pallas' uninitialised int32 is a
  # sentinel); other allocations as Pallas leaves them.
  initial = [
    jnp.zeros(a.shape, jnp.int32)
    if is_count(a)
    else _pallas_ops.uninitialized(a.shape, a.dtype)
    for a in allocated
  ]
  outs = core.eval_jaxpr(pure, consts, *invals, *initial)
  # What the scope's allocations hold at its end: semaphores, zero.
  finals = outs[len(body.outvars) :]
  for k, (a, final) in enumerate(zip(allocated, finals, strict=True)):
    if is_count(a):
      checks.scope_leftover(eqn, k, final)
  return outs[: len(body.outvars)]


def _barrier_avals(jaxpr: core.Jaxpr) -> list[core.AbstractValue]:
  for eqn in jaxpr.eqns:
    if _pallas_ops.kind(eqn) is Sync.BARRIER_SEMAPHORE:
      return [eqn.outvars[0].aval]
  return []


def _physical(aval: core.AbstractValue) -> core.AbstractValue:
  return _jax.interpret_mode_aval(aval)


def lower(
  ctx: mlir.LoweringRuleContext, *in_nodes, kernel, axes, **params
) -> Sequence[Any]:
  """Lowers the launch for every device in step.

  ``kernel``: the launch's only jaxpr, aliased inputs already resolved to
  their outputs; ``axes``: the enclosing shard_map's manual axes.
  """
  [mesh] = params["meshes"]
  num_in, num_out = len(in_nodes), len(params["out_avals"])
  sizes = paths.mesh_sizes(ctx.module_context.axis_context)
  devices = Devices(paths.exchange_axes(kernel, axes), sizes, axes)
  barrier_avals = _barrier_avals(kernel)
  traced = params["jaxprs"][0]  # as the user wrote it: names, arguments
  with prim.tracing_context(mesh, params["meshes"]):
    values = jaxpr_util.literal_axis_values(dict(mesh.shape), 0)
    jaxpr = jaxpr_util.rewrite_axis_indices(kernel, values.get, mesh.shape)
    # Semaphores as plain integer refs (int16), then widened to int32.
    flags = once_flags(jaxpr)
    jaxpr, consts = hlo_interpreter.resolve_physical_types(jaxpr, ())
    if consts:
      raise NotImplementedError("mpmd_map: kernel captured constants")
    jaxpr = jaxpr_util.map_avals(jaxpr, widen)
    once = once_by_eqn(jaxpr, flags)
    operand_names = bounds.operand_names(
      traced, num_in, num_out, params["input_output_aliases"]
    )
    checks = bounds.Checks(
      traced.debug_info.func_src_info,
      bounds.trace_refs(jaxpr, operand_names),
      ranges.prove(jaxpr, {**mesh.shape, **sizes}, once),
      path="lockstep path (devices run in step)",
      where=functools.partial(_where, devices.all_axes),
    )

    if devices.axes == devices.all_axes:
      devices.known = device_ids.Known(jaxpr, devices.axes, sizes)

    def make_rule(barrier):
      devices.top_trace = core.unsafe_get_current_trace()
      return sync_rule(checks, devices, barrier, once=once)

    jaxpr = jaxpr_util.rewrite_with_inputs(
      jaxpr,
      [widen(_physical(a)) for a in barrier_avals],
      make_rule,
      finish=devices.forget,
    )
    program = _jax.discharge_state(_jax.closed_jaxpr(jaxpr))
  kernel_avals = [v.aval for v in traced.invars] + barrier_avals
  semaphores = [k for k, a in enumerate(kernel_avals) if paths.is_semaphore(a)]
  names = [
    _Semaphore(
      operand_names[k] if k < len(traced.invars) else "the barrier semaphore",
      tuple(kernel_avals[k].shape),
      not _pallas_ops.signalled_once(kernel_avals[k]),
    )
    for k in semaphores
  ]
  run = functools.partial(
    _run,
    program=program,
    is_ref=[isinstance(v.aval, state_types.AbstractRef) for v in jaxpr.invars],
    num_in=num_in,
    num_out=num_out,
    out_sources={o: i for i, o in params["input_output_aliases"].items()},
    semaphores=semaphores,
    names=names,
    devices=devices,
    num_checks=checks.count,
    kernel=traced.debug_info.func_src_info,
  )
  # The kernel's values carry no varying-axes types: check none here.
  with _jax.no_vma_check():
    outs = mlir.lower_fun(run, multiple_results=True)(
      ctx.replace(avals_in=common.plain_avals(ctx.avals_in)), *in_nodes
    )
  if ctx.tokens_out is None and ctx.tokens_in is not None:
    ctx.set_tokens_out(ctx.tokens_in)
  return outs


def _where(axes, args: list[Any]) -> str:
  """``bounds.Checks``' ``where``: the device a check runs on."""
  coords = []
  for a in axes:
    args.append(lax.axis_index(a))
    coords.append(f"{a}={{0[{len(args) - 1}]}}")
  return f", device ({', '.join(coords)})"


def _run(
  *args,
  program,
  is_ref,
  num_in,
  num_out,
  out_sources,
  semaphores,
  names,
  devices,
  num_checks,
  kernel,
):
  avals = [v.aval for v in program.jaxpr.invars]

  def fresh(k):
    if k in semaphores:
      return jnp.zeros(avals[k].shape, avals[k].dtype)
    return _pallas_ops.uninitialized(avals[k].shape, avals[k].dtype)

  def launch(*operands):
    # The discharged program returns the final value of each Ref operand.
    updated = iter(words.evaluate(program, *operands))
    return [
      next(updated) if r else x for x, r in zip(operands, is_ref, strict=True)
    ]

  operands = [
    *args,
    *(
      args[out_sources[o]] if o in out_sources else fresh(num_in + o)
      for o in range(num_out)
    ),
    *map(fresh, range(num_in + num_out, len(avals))),
  ]
  error, final = bounds.checked(launch, num_checks)(*operands)
  if semaphores or error is not None:
    _report_verdicts(
      final, error, semaphores, num_in + num_out, names, devices, kernel
    )
  return final[num_in : num_in + num_out]


def _report_verdicts(
  final, error, semaphores, num_operands, names, devices, kernel: str
):
  """Raises, on every device run in step, what went wrong on any of them:
  a semaphore wait that came up short or scratch left counting
  (``semaphores``: their positions in ``final``, the launch's final Ref
  values), or a failed bounds check (``error``)."""
  # Per semaphore (verdict, flat index, count there): SHORT where a wait
  # came up short (it would hang), LEFTOVER where scratch still counts at
  # the end (a signal or DMA nobody waited for; operands carry their
  # counts to the next launch), at the first such element of an array.
  verdicts = [_verdict(final[k], k >= num_operands) for k in semaphores]
  if error is not None:
    failed = bounds.failed(error).astype(jnp.int32)
    verdicts.append(jnp.stack([failed, jnp.int32(0), jnp.int32(0)]))
  coords = jnp.stack([lax.axis_index(a) for a in devices.all_axes])
  short = jnp.stack(verdicts)
  leaves, treedef = tree_util.tree_flatten(error)
  # The verdicts of every device this one runs in step with (those along
  # the axes it exchanges over; a launch under a condition on another
  # axis runs on some rows only), in one collective: each then holds the
  # same reports, so the error names the same devices whatever the
  # threads' timing, and no device waits on the host for another's
  # report. Python runs only when one of them failed, and then on each of
  # them, raising the same error (none runs on into a later collective).
  mine = [coords, short, *leaves]
  if devices.axes:
    gathered = packing.Gathered(devices.axes, mine)
    # A static leaf (a Python int) is the same on every device.
    count = devices.count
    stacked = [
      x if (x := gathered.stacked(i)) is not None else jnp.full(count, leaf)
      for i, leaf in enumerate(mine)
    ]
  else:
    stacked = [jnp.stack([leaf]) for leaf in mine]
  report = functools.partial(
    _report,
    functools.partial(
      _raise_for_reports,
      kernel,
      names,
      devices.all_axes,
      treedef if leaves else None,
    ),
  )
  lax.cond(
    jnp.any(stacked[1][..., 0] != 0),
    lambda: callback.io_callback(report, None, *stacked),
    lambda: None,
  )


# Per-semaphore verdicts of a device's end-of-launch report.
SHORT, LEFTOVER = 1, 2


def _verdict(count: jax.Array, scratch: bool) -> jax.Array:
  """(verdict, flat index, count there) of a semaphore (array)'s final
  count: SHORT, LEFTOVER (``scratch`` only) or 0, about its first such
  element. An array gathered in one collective with the others."""
  if not count.size:
    return jnp.zeros((3,), jnp.int32)
  flat = jnp.ravel(count).astype(jnp.int32)
  short = poisoned(flat)
  left = (flat != 0) & ~short & scratch
  verdict = jnp.where(
    jnp.any(short), SHORT, jnp.where(jnp.any(left), LEFTOVER, 0)
  )
  where = jnp.argmax(jnp.where(jnp.any(short), short, left)).astype(jnp.int32)
  return jnp.stack([verdict.astype(jnp.int32), where, flat[where]])


def _report(raise_error, coords, short, *leaves) -> None:
  """Raises the launch's error from every device's report (gathered:
  ``coords``, ``short`` and the check error's ``leaves``, each stacked
  over the devices), on each device alike."""
  reports = [
    (coords[d], short[d], *(np.asarray(x)[d] for x in leaves))
    for d in range(len(coords))
  ]
  raise_error(sorted(reports, key=lambda r: tuple(r[0])))


def _raise_for_reports(kernel, names, axes, treedef, reports) -> None:
  """Raises the first failed check of the lowest failing device, else the
  deadlock of every device whose waits came up short."""
  for _, _, *leaves in reports:
    failure = bounds.first_failure(treedef, leaves)
    if failure is not None:
      raise failure
  _raise_if_short(
    kernel,
    names,
    axes,
    [(coords, short[: len(names)]) for coords, short, *_ in reports],
  )


class _Semaphore(NamedTuple):
  """How a report names a semaphore operand."""

  name: str  # ``'sems' (scratch 2, semaphore[2])``
  shape: tuple[int, ...]
  counts_bytes: bool  # a DMA semaphore: DMAs add their bytes


def _said(sem: _Semaphore, verdict) -> str:
  """A semaphore named with the (first) element a verdict is about, and
  what is left there (``'sems' (scratch 2, semaphore[2]) .at[1] (count
  1)``)."""
  kind, index, count = (int(x) for x in verdict)
  text = sem.name
  if sem.shape:
    at = ", ".join(str(int(i)) for i in np.unravel_index(index, sem.shape))
    text += f" .at[{at}]"
  if kind == SHORT:  # the wait left a sentinel there, not a count
    return text
  if sem.counts_bytes and count > 0:
    return f"{text} ({count} bytes of DMAs not awaited)"
  return f"{text} (count {count})"


def _raise_if_short(kernel: str, names, axes, reports) -> None:
  """``names``: per semaphore, a ``_Semaphore``; ``reports``: per
  device, its coordinates along ``axes`` and its semaphores' verdicts
  (``_verdict``)."""
  lines, left = [], []
  for device, row in reports:
    where = ", ".join(
      f"{a}={int(c)}" for a, c in zip(axes, device, strict=True)
    )
    verdicts = list(zip(names, row, strict=True))
    waited = [_said(sem, v) for sem, v in verdicts if v[0] == SHORT]
    if waited:
      lines.append(f"  device ({where}) waits on {', '.join(waited)}")
    counting = [_said(sem, v) for sem, v in verdicts if v[0] == LEFTOVER]
    if counting:
      left.append(f"  device ({where}): {', '.join(counting)}")
  if not lines:
    raise errors.LeftoverError(
      f"mpmd_map: on the CPU lockstep path, kernel {kernel} ended with "
      "scratch semaphores not back to zero (a signal nobody waited for, a "
      "DMA whose completion nobody awaited, or a negative signal):\n"
      + "\n".join(left)
    )
  raise watchdog.DeadlockError(
    f"mpmd_map deadlock: on the CPU lockstep path (devices run in step), in "
    f"kernel {kernel}, these waits asked for more than had been signalled "
    "when every device had reached them, so on hardware they would wait "
    "forever:\n"
    + "\n".join(lines)
    + "\n(unless the devices must run out of step, which this path cannot "
    "show: interpret=mpmd.CheckParams() runs every device's programs under "
    "one scheduler, in any order, and names the line of each wait)"
  )
