"""The executor's loop and its synchronisation operations.

:func:`run` runs a launch on a :class:`machine.Machine`: at each step it
lists the options (programs whose next operation can go ahead, DMAs in
flight), lets the strategy pick one, and performs it. The oracles fire
where the condition shows: a deadlock when no option is left, leftovers
when the programs have ended, races and uninitialised reads at the access.
"""

import functools

import numpy as np

from mpmd._lowering import errors
from mpmd._lowering.check import interp, memory, records, schedule
from mpmd._lowering.check import machine as machine_lib
from mpmd._lowering.check.memory import View

Gate = tuple[np.ndarray, int, int] | bool  # (counts, element, need) or True


class _Waiting:
  """What a program's pending operation waits on, worked out once per
  operation (its operands do not change while it waits). (A plain class:
  one is made at every step.)"""

  __slots__ = ("sems", "bytes", "gate")

  def __init__(self):
    self.sems: dict[int, View] = {}  # by id()
    self.bytes: int | None = None
    self.gate: Gate | None = None


class _Program:
  def __init__(self, device, program, gen, ctx, option, comp):
    self.device = device
    self.program = program
    self.comp = comp  # its vector clock component (``Machine.comp``)
    self.option = option  # ("p", its index): how the scheduler names it
    self.gen = gen
    self.ctx = ctx
    self.pending: interp.Sync | None = None
    self.started = False
    self.done = False
    self.waiting = _Waiting()  # reset at each operation
    self.polled = False  # its last operation read a semaphore

  def next_sync(self) -> interp.Sync:
    """The operation a started program that has not exited waits at."""
    assert self.pending is not None, (self.device, self.program)
    return self.pending


def _element(view: View, describe: memory.Text) -> int:
  if view.ids.size != 1:
    raise ValueError(
      f"{describe}: a semaphore operation needs one semaphore, got a view "
      f"of shape {view.shape}"
    )
  return view.ids.item(0)


def _count(view: View) -> int:
  return int(view.buffer.flat[view.ids.item(0)])


def start(m, inputs, device: int, program: int, axis_values):
  """``(generator, context)`` of one program of the launch (the TPU and
  the GPU scheduling loops alike): its operands are views of its memory,
  a scalar input (a value a kernel closes over) the value itself."""
  plan = m.plan
  ctx = interp.Context(m, device, program, axis_values)
  mine = m.memory[(device, program)]
  args = [
    View(mine[("operand", k)], mine[("operand", k)].ids)
    if ("operand", k) in mine
    else (inputs[k][device] if plan.device_axes else inputs[k])
    for k in range(len(plan.jaxpr.invars))
  ]
  return interp.run_jaxpr(ctx, plan.jaxpr, [], args), ctx


def run(m: machine_lib.Machine, inputs) -> list[list[np.ndarray]]:
  """Runs the launch to its end; the outputs per device."""
  plan = m.plan
  m._operand_buffers(inputs)
  programs = []
  for d in range(plan.num_devices):
    axis_values = {
      a: (c, s)
      for (a, s), c in zip(
        plan.device_axes, plan.device_coords(d).values(), strict=True
      )
    }
    for g in range(plan.num_programs):
      values = {**axis_values, plan.super_axis: (g, plan.num_programs)}
      gen, ctx = start(m, inputs, d, g, values)
      option = ("p", len(programs))
      programs.append(_Program(d, g, gen, ctx, option, m.comp(d, g)))
  current = None
  while True:
    options, default = _options(m, programs, current)
    if default is None:  # (no options: every program is done)
      break
    if current is not None and programs[current].polled:
      default = _next_after(options, current, default)
    pick = m.pick(options, default, lambda: _spinning(m, programs))
    if pick[0] == "d":
      _dma_step(m, m.dmas[pick[1]])
    else:
      _advance(m, programs[pick[1]])
      current = pick[1]
  waiting = [p for p in programs if not p.done]
  if waiting:
    raise errors.DeadlockError(_deadlock_report(m, waiting))
  _check_leftovers(m)
  return m.outputs()


def _options(m, programs: list[_Program], current: int | None):
  """What can go on now: the programs that have not started, or whose
  pending operation's gate (``_gate``, worked out once per operation) is
  open, then the DMAs in flight; and ``schedule.default_choice`` of them
  (read off as they are listed: DMAs come last, oldest first, programs in
  order; ``tests/lowering/test_check_default.py`` holds the two to one
  rule). (The loop asks every program at every step: kept to a few
  Python steps per program.)"""
  options: list[schedule.Option] = []
  current_open = False
  for p in programs:
    if p.done:
      continue
    if p.started:
      gate = p.waiting.gate
      if gate is None:
        gate = p.waiting.gate = _gate(m, p)
      if type(gate) is tuple and gate[0][gate[1]] < gate[2]:
        continue
    if p.option[1] == current:
      current_open = True
    options.append(p.option)
  if m.dmas:
    first = len(options)
    # (Oldest first: DMAs join ``m.dmas`` in the order of their indices.)
    options += [dma.option for dma in m.dmas.values()]
    return options, options[first]
  if not options:
    return options, None
  if current_open and current is not None:
    return options, programs[current].option
  return options, options[0]


def _next_after(options, current, default):
  """After a semaphore read, let the others run (a spinning poll)."""
  programs = [o for o in options if o[0] == "p" and o[1] != current]
  if default[0] == "d" or not programs:
    return default
  later = [o for o in programs if o[1] > current]
  return min(later) if later else min(programs)


def _describe(m, p, op: str, where: str):
  return machine_lib.Describe(m, p.device, p.program, op, where)


def _gate(m, p: _Program) -> Gate:
  """What ``p``'s pending operation waits for, ``(counts, element,
  need)``: a semaphore's flat counts, which of them, and how many it
  needs (the counts change in place, the rest not until it goes on);
  True if it need not wait."""
  pending = p.pending  # (next_sync's check, without its call: every step)
  assert pending is not None
  op = pending.op
  if isinstance(op, records.DmaWait):
    view = _sem_view(m, p, op.sem)
    need = _wait_bytes(m, p, op)
  elif isinstance(op, records.SemWait):
    view = _sem_view(m, p, op.sem)
    need = int(np.asarray(op.value))
  else:
    return True
  return view.buffer.flat, view.ids.item(0), need


def _sem_view(m, p, operand) -> View:
  # The operand is the pending record's own field: alive while it waits.
  key = id(operand)
  view = p.waiting.sems.get(key)
  if view is None:
    describe = _describe(m, p, "semaphore", p.next_sync().where)
    view = m.resolve(operand, (), describe)
    _element(view, describe)
    p.waiting.sems[key] = view
  return view


def _wait_bytes(m, p, op: records.DmaWait) -> int:
  if p.waiting.bytes is None:
    describe = _describe(m, p, "dma_wait", p.next_sync().where)
    p.waiting.bytes = m.resolve(op.ref, (), describe).nbytes
  return p.waiting.bytes


def _advance(m, p: _Program) -> None:
  """Performs ``p``'s pending operation and runs it to its next one."""
  result = None
  if p.started:
    pending = p.pending
    assert pending is not None
    result = _perform(m, p, pending)
  p.started = True
  p.waiting = _Waiting()
  p.polled = isinstance(p.pending and p.pending.op, records.SemRead)
  try:
    p.pending = p.gen.send(result)
  except StopIteration:
    p.done = True
    p.pending = None
    m.events.append(
      machine_lib.Event(m.step, p.device, p.program, "exit", "kernel exit", "")
    )


def _perform(m, p: _Program, sync: interp.Sync):
  op, where = sync.op, sync.where
  # (The record types, most frequent first.)
  if isinstance(op, records.DmaWait):
    view = _sem_view(m, p, op.sem)
    need = _wait_bytes(m, p, op)
    return _take(m, p, view, need, True, "dma_wait", where)
  if isinstance(op, records.DmaStart):
    return _start(m, p, op, where)
  if isinstance(op, interp.ScopeEnd):
    return _end_scope(m, p, op, where)
  comp = p.comp
  clock = m.clocks[comp]
  if isinstance(op, records.SemWait):
    view = _sem_view(m, p, op.sem)
    need = int(np.asarray(op.value))
    return _take(m, p, view, need, op.decrement, "semaphore_wait", where)
  if isinstance(op, records.Signal):
    describe = _describe(m, p, "semaphore_signal", where)
    local = m.resolve(op.sem, (), describe)
    _element(local, describe)
    device, program = m.target(
      p.ctx, op.device_id, op.device_id_type, op.core_index, describe
    )
    target = m.peer(local, device, program, describe)
    event = _event(m, p, "signal", f"signal {target.buffer.label}", where)
    _add(target, int(np.asarray(op.inc)), clock, event)
    clock[comp] += 1
    return None
  if isinstance(op, records.SemRead):
    view = _sem_view(m, p, op.sem)
    for _, signal, _ in view.buffer.units[view.ids.item(0)]:
      clock = memory.join(clock, signal)  # the count shows every signal
    m.clocks[comp] = clock
    return _count(view)
  raise NotImplementedError(f"mpmd checker: operation {op!r}")


def _event(m, p, kind, what, where, dma=None, after=None) -> int:
  events = m.events
  events.append(
    machine_lib.Event(
      m.step, p.device, p.program, kind, what, where, dma, after
    )
  )
  return len(events) - 1


def _add(view: View, amount: int, clock, event: int | None) -> None:
  """A signal (or a DMA landing or reading its source) of ``amount``
  units with ``clock``."""
  e = view.ids.item(0)  # (a view of one element: ``_element``)
  b = view.buffer
  b.flat[e] += amount
  if amount > 0:  # (a copy: a signaller's clock ticks on)
    b.units[e].append([amount, dict(clock), event])
  _trim(b.units[e], int(b.flat[e]))
  b.signals[e] = event


def _trim(units, count: int) -> None:
  """Drops the oldest units down to ``count``: a negative signal takes
  units without ordering anyone after their signals."""
  extra = sum(u[0] for u in units) - max(count, 0)
  while extra > 0:
    if units[0][0] > extra:
      units[0][0] -= extra
      return
    extra -= units.popleft()[0]


def _take(m, p, view: View, need: int, decrement: bool, what, where):
  """A wait for ``need`` units: it is ordered after the signals of the
  oldest ``need`` units, not all of them. A count is not a queue on
  hardware either: a later signal may be what lets the wait pass, so
  what only that signal publishes is a race (``explore`` finds the
  order where it is)."""
  e = view.ids.item(0)
  b = view.buffer
  comp = p.comp
  clock, after, taken = m.clocks[comp], None, 0
  for amount, signal, event in b.units[e]:
    if taken >= need:
      break
    clock, after, taken = memory.join(clock, signal), event, taken + amount
  m.clocks[comp] = clock
  if decrement:
    b.flat[e] -= need
    _trim(b.units[e], int(b.flat[e]))
  _event(m, p, "wait", f"{what} {b.label} for {need}", where, after=after)
  return None


def _start(m, p, op: records.DmaStart, where: str):
  describe = _describe(m, p, "dma_start", where)
  src = m.resolve(op.src, (), describe)
  local_dst = m.resolve(op.dst, (), describe)
  device, program = m.target(
    p.ctx, op.device_id, op.device_id_type, None, describe
  )
  dst = m.peer(local_dst, device, program, describe)
  if src.shape != dst.shape:
    raise ValueError(
      f"{describe}: copies a window of shape {src.shape} into one of "
      f"shape {dst.shape}"
    )
  recv = send = None
  if op.recv_sem is not None:
    recv = m.peer(
      m.resolve(op.recv_sem, (), describe), device, program, describe
    )
    _element(recv, describe)
  if op.send_sem is not None:
    send = m.resolve(op.send_sem, (), describe)
    _element(send, describe)
  comp = p.comp
  index = m.num_dmas
  m.num_dmas += 1
  dma = machine_lib.Dma(
    index, op, src, dst, recv, send, dict(m.clocks[comp]), p, where
  )
  # Semaphores are read by identity: the machine keeps its buffers alive.
  sems = tuple(
    None if v is None else (id(v.buffer), v.ids.item(0)) for v in (recv, send)
  )
  # A lane for its reads and one for its writes: a send semaphore says
  # that the source was read, not that the data landed.
  read, dma.lane_time = m.lane(comp, ("read", *sems), "a DMA")
  dma.lane = (read, m.lane(comp, sems, "a DMA")[0])
  dma.event = _event(
    m,
    p,
    "dma_start",
    f"DMA #{index}: {src.buffer.label} -> {dst.buffer.label}",
    where,
    dma=index,
  )
  m.clocks[comp][comp] += 1
  m.dmas[index] = dma
  m.strategy.new_dma(index)
  return None


def _dma_step(m, dma: machine_lib.Dma) -> None:
  """A DMA in flight takes its next step. One with a send semaphore (a
  remote DMA) takes two, each an option of the scheduler: it reads its
  source and signals ``wait_send``, then writes its destination and
  signals the receiver, so a sender may go on, even start its next DMA,
  before the data lands. Any other DMA reads and writes in one step."""
  if dma.send is not None and dma.staged is None:
    _read(m, dma)
  else:
    del m.dmas[dma.index]
    _land(m, dma)


def _dma_describe(m, dma: machine_lib.Dma) -> memory.Lazy:
  # The text's parts, not the DMA or the machine: buffers keep it (their
  # last access), and it must not lead back to the machine (a cycle).
  index, where, plan = dma.index, dma.where, m.plan
  device, program = dma.issuer.device, dma.issuer.program
  return memory.Lazy(
    lambda: f"DMA #{index} issued by {plan.name(device, program)} at {where}"
  )


def _dma_event(m, dma: machine_lib.Dma, kind: str, what: str) -> int:
  m.events.append(
    machine_lib.Event(
      m.step, dma.issuer.device, -1, kind, what, dma.where, dma.index
    )
  )
  return len(m.events) - 1


def _read(m, dma: machine_lib.Dma) -> None:
  """A two-step DMA's first step: it reads its source (what it will
  write, whatever the source holds later) and signals its sender."""
  (reads, _), time, src = dma.lane, dma.lane_time, dma.src
  describe = _dma_describe(m, dma)
  memory.check_access(
    src, reads, time, dma.clock, False, describe, None, m.name_comp
  )
  dma.staged = (src.read(), src.init_of().copy())
  event = _dma_event(m, dma, "dma_read", f"DMA #{dma.index} reads its source")
  # The sender's semaphore says only that the source has been read.
  amount = 1 if dma.start.send_once else src.nbytes
  _add(dma.send, amount, memory.join(dma.clock, {reads: time}), event)


def _copied(dma: machine_lib.Dma) -> np.ndarray:
  """What the DMA writes: what it read (``_read``), or its source now."""
  return dma.src.read() if dma.staged is None else dma.staged[0]


def _copied_init(dma: machine_lib.Dma) -> np.ndarray:
  return dma.src.init_of() if dma.staged is None else dma.staged[1]


def _lands_unchanged(dma: machine_lib.Dma) -> bool:
  """Whether the DMA's destination holds what it copies already."""
  return memory.same_bytes(dma.dst, _copied(dma))


def _land(m, dma: machine_lib.Dma) -> None:
  """The DMA writes its destination now (reading its source first unless
  ``_read`` did) and signals its receiver."""
  (reads, writes), time = dma.lane, dma.lane_time
  describe = _dma_describe(m, dma)
  src, dst, start, staged = dma.src, dma.dst, dma.start, dma.staged
  if staged is None:  # (one step: it reads its source now)
    memory.check_access(
      src, reads, time, dma.clock, False, describe, None, m.name_comp
    )
  unchanged = None
  if not start.add and not m.plan.identical_writes_race:
    unchanged = functools.partial(_lands_unchanged, dma)
  memory.check_access(
    dst, writes, time, dma.clock, True, describe, None, m.name_comp, unchanged
  )
  if start.add:
    memory.check_initialized(dst, describe)
    dst.write(dst.read() + _copied(dma))
    dst.set_init(_copied_init(dma))
  elif staged is None and src.slab is not None and dst.slab is not None:
    # Window to window, with no copy in between (numpy copies first where
    # a local DMA's windows overlap).
    dst.buffer.writable()
    dst.buffer.flat[dst.slab] = src.buffer.flat[src.slab]
    dst.buffer.init[dst.slab] = src.buffer.init[src.slab]
  else:
    dst.write(_copied(dma))
    dst.set_init(_copied_init(dma))
  event = _dma_event(m, dma, "dma_land", f"DMA #{dma.index} lands")
  # The receiver's semaphore says the data has landed.
  if dma.recv is not None:
    landed = memory.join(dma.clock, {reads: time, writes: time})
    _add(dma.recv, 1 if start.recv_once else src.nbytes, landed, event)


def _spinning(m, programs) -> str:
  """What a launch past ``MAX_STEPS`` is doing: each program that has not
  ended, and what the one it reads holds."""
  live = [p for p in programs if not p.done and p.pending is not None]
  return (
    ": programs spinning on semaphore reads that never change? (a loop "
    "that polls semaphore_read until a signal nobody sends)\n"
    + "\n".join(_waiting_lines(m, live))
  )


def _deadlock_report(m, waiting) -> str:
  return (
    f"kernel {m.plan.kernel} deadlocks: no program can go on and no DMA is "
    f"in flight ({m.step} steps in):\n" + "\n".join(_waiting_lines(m, waiting))
  )


def _waiting_lines(m, waiting) -> list[str]:
  lines = []
  for p in waiting:
    op = p.pending.op
    if isinstance(op, records.SemRead):
      view = _sem_view(m, p, op.sem)
      lines.append(
        f"  {m.name(p.device, p.program)} reads {view.buffer.label} "
        f"(semaphore_read at {p.pending.where}); it holds {_count(view)}"
      )
    elif isinstance(op, (records.DmaWait, records.SemWait)):
      view = _sem_view(m, p, op.sem)
      need = (
        _wait_bytes(m, p, op)
        if isinstance(op, records.DmaWait)
        else int(np.asarray(op.value))
      )
      kind = "dma_wait" if isinstance(op, records.DmaWait) else "semaphore_wait"
      unit = " bytes" if isinstance(op, records.DmaWait) else ""
      lines.append(
        f"  {m.name(p.device, p.program)} waits ({kind} at "
        f"{p.pending.where}) on {view.buffer.label} for {need}{unit}; it "
        f"holds {_count(view)} now"
      )
    else:
      lines.append(f"  {m.name(p.device, p.program)} at {p.pending.where}")
  return lines


def _end_scope(m, p, op: interp.ScopeEnd, where: str):
  buffers = {id(v.buffer) for v in op.buffers}
  for dma in m.dmas.values():
    touched = [dma.dst, dma.recv]
    if dma.staged is None:  # (once read, its source and send are free)
      touched += [dma.src, dma.send]
    if any(v is not None and id(v.buffer) in buffers for v in touched):
      raise errors.LeftoverError(
        f"{_describe(m, p, 'run_scoped ends', where)}: DMA #{dma.index} "
        f"(started at {dma.where}) still uses its memory; wait for it "
        "inside the scope"
      )
  _check_semaphores(
    m,
    [v.buffer for v in op.buffers if v.buffer.semaphore],
    memory.Lazy(lambda: f"{_describe(m, p, 'run_scoped ends', where)}: "),
  )
  return None


def _check_semaphores(m, buffers, prefix: memory.Text) -> None:
  left = [
    (
      f"{b.label} holds {b.data.reshape(-1).tolist()}"
      if b.data.size > 1
      else f"{b.label} holds {int(b.data.reshape(-1)[0])}"
    )
    + _last_count(m, b)
    for b in buffers
    if b.data.any()
  ]
  if left:
    raise errors.LeftoverError(
      f"{prefix}semaphores not back to zero (a signal nobody waited for, "
      "a DMA whose completion nobody awaited, or a negative signal): "
      + "; ".join(left)
    )


def _last_count(m, b) -> str:
  """`` (last counted by ...)``: the latest signal, DMA landing or DMA
  source read among the semaphore's elements that still count."""
  events = [b.signals[e] for e in np.flatnonzero(b.flat)]
  events = [e for e in events if e is not None]
  if not events:
    return ""
  event = m.events[max(events)]
  what = event.what if event.dma is None else f"{event.what}, started"
  return f" (last counted by {what} at {event.where})"


def _check_leftovers(m) -> None:
  if m.dmas:
    dma = m.dmas[min(m.dmas)]
    raise errors.LeftoverError(
      f"kernel {m.plan.kernel}: DMA #{dma.index} started at {dma.where} by "
      f"{m.name(dma.issuer.device, dma.issuer.program)} never landed: "
      "nobody waited for it before the kernel ended"
    )
  _check_semaphores(m, m.semaphores, f"kernel {m.plan.kernel} ends with ")
