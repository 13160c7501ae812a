"""Mosaic GPU operations on the checking executor, as hardware runs them.

* **Barriers** (``mbarrier``): a phase completes when ``num_arrivals``
  arrivals came and the bytes of the TMA copies expected on it landed; a
  warpgroup's ``barrier_wait`` waits for the phase of the parity it tracks
  (its own count of waits on that barrier, as Mosaic GPU's lowering keeps
  it), so a waiter two phases behind blocks, as on hardware.
* **TMA copies** are asynchronous: ``copy_gmem_to_smem`` arrives on its
  barrier and expects the copy's bytes at once; the data lands (and the
  bytes complete) when the scheduler lands the copy. ``copy_smem_to_gmem``
  copies join commit groups; ``wait_smem_to_gmem(n)`` waits until at most
  ``n`` of the warpgroup's groups are in flight. A copy whose group nobody
  awaited when its warpgroup exits is an error.
* ``commit_smem`` fences a warpgroup's SMEM writes for the async proxy: a
  TMA store or a WGMMA reading SMEM the warpgroup wrote since its last
  fence is an error (hardware may read stale data).
* **WGMMA** is asynchronous: it reads its operands and updates the
  accumulator when it lands, no later than the ``wgmma_wait`` that covers
  it; reading the accumulator before is a race.

Everything else that touches a Ref or synchronises is refused by name.
"""

import dataclasses
import enum
from typing import Any

import numpy as np

from mpmd._lowering import errors
from mpmd._lowering.check import memory
from mpmd._lowering.check.memory import Clock, View


@dataclasses.dataclass
class Barrier:
  """One ``mbarrier``: arrivals and bytes of its current phase, and how
  many phases completed."""

  num_arrivals: int
  arrived: int = 0
  pending_bytes: int = 0
  completed: int = 0
  clock: Clock = dataclasses.field(default_factory=dict)  # this phase's
  done_clock: Clock = dataclasses.field(default_factory=dict)  # last phase's
  done_event: int | None = None


class AsyncKind(enum.StrEnum):
  """What an ``Async`` is, named as the operation that issues it. Each
  warpgroup's TMA loads, TMA stores and WGMMAs run on their own units: one
  clock component (lane) per warpgroup and kind (and barrier, for loads),
  ticking once per operation issued there."""

  TMA_LOAD = "copy_gmem_to_smem"
  TMA_STORE = "copy_smem_to_gmem"
  WGMMA = "wgmma"


class Async:
  """A TMA copy or a WGMMA in flight."""

  def __init__(
    self, index, kind: AsyncKind, issuer, clock, lane, time, where, **parts
  ):
    self.index, self.kind, self.issuer = index, kind, issuer
    self.clock, self.where = clock, where
    self.lane, self.lane_time = lane, time  # (``Machine.lane``)
    self.landed = False
    self.land_clock: Clock = {}
    # A copy's source View, or a WGMMA's (a, b) operand Views.
    self.src: Any = parts["src"]
    self.dst: View = parts["dst"]  # a WGMMA's accumulator
    self.barrier: tuple[int, int] | None = parts.get("barrier")


class Warpgroup:
  """What one program tracks itself: barrier parities, store groups,
  WGMMAs in flight, SMEM writes not yet fenced."""

  def __init__(self):
    self.waits: dict[tuple[int, int], int] = {}
    self.uncommitted: list[Async] = []
    self.groups: list[list[Async]] = []
    self.wgmmas: list[Async] = []
    # Per SMEM buffer: elements written (reads) through the generic proxy
    # since the last commit_smem, and where the latest was.
    self.unfenced: dict[int, tuple[np.ndarray, str]] = {}
    self.unfenced_reads: dict[int, tuple[np.ndarray, str]] = {}


class State:
  """The GPU part of a launch's state."""

  def __init__(self):
    self.barriers: dict[tuple[int, int], Barrier] = {}
    self.asyncs: dict[int, Async] = {}
    self.count = 0
    self.warpgroups: dict[int, Warpgroup] = {}

  def new_barrier(self, buffer, num_arrivals: int) -> None:
    for e in range(buffer.flat.size):
      self.barriers[(id(buffer), e)] = Barrier(int(num_arrivals))

  def wg(self, comp: int) -> Warpgroup:
    if comp not in self.warpgroups:
      self.warpgroups[comp] = Warpgroup()
    return self.warpgroups[comp]

  def touched_smem(self, comp, buffer, ids, where, write: bool) -> None:
    wg = self.wg(comp)
    table = wg.unfenced if write else wg.unfenced_reads
    mask, _ = table.get(id(buffer), (None, ""))
    if mask is None:
      mask = np.zeros(buffer.flat.size, bool)
    mask[np.asarray(ids).reshape(-1)] = True
    table[id(buffer)] = (mask, where)

  def fence(self, comp) -> None:
    wg = self.wg(comp)
    wg.unfenced.clear()
    wg.unfenced_reads.clear()


def _where(m, p) -> str:
  return p.pending.where if p.pending is not None else ""


def _barrier(m, view: View, describe) -> tuple[tuple[int, int], Barrier]:
  if view.ids.size != 1:
    raise ValueError(
      f"{describe}: a barrier operation needs one barrier, got a view of "
      f"shape {view.shape}"
    )
  key = (id(view.buffer), int(view.ids.reshape(-1)[0]))
  if key not in m.gpu.barriers:
    raise TypeError(f"{describe}: {view.buffer.label} is not a barrier")
  return key, m.gpu.barriers[key]


def _complete_if_done(m, b: Barrier, event: int | None) -> None:
  if b.arrived >= b.num_arrivals and b.pending_bytes == 0:
    b.completed += 1
    b.arrived = 0
    b.done_clock, b.clock = b.clock, {}
    b.done_event = event


def _arrive(m, b: Barrier, clock: Clock, event, expect_bytes=0) -> None:
  b.arrived += 1
  b.pending_bytes += expect_bytes
  b.clock = memory.join(b.clock, clock)
  _complete_if_done(m, b, event)


def _event(m, p, kind, what, where, **extra) -> int:
  from mpmd._lowering.check import machine

  m.events.append(
    machine.Event(m.step, p.device, p.program, kind, what, where, **extra)
  )
  return len(m.events) - 1


def _describe(m, p, op, where):
  from mpmd._lowering.check import machine

  return machine.Describe(m, p.device, p.program, op, where)


def _release(m, p) -> Clock:
  """The program's clock for a release (then ticks it)."""
  comp = m.comp(p.device, p.program)
  clock = dict(m.clocks[comp])
  m.clocks[comp][comp] += 1
  return clock


def _acquire(m, p, clock: Clock) -> None:
  comp = m.comp(p.device, p.program)
  m.clocks[comp] = memory.join(m.clocks[comp], clock)


# -- operations (the ``op`` of an ``interp.Sync``) -----------------------------


class GpuOp:
  """An operation a warpgroup stops at on the checking executor (the ``op``
  of the ``interp.Sync`` it yields), as ``gpu_launch`` schedules it: it may
  go ahead once ``enabled``; ``perform`` does it; ``blocked`` says what it
  waits for when the launch deadlocks. ``m``: the ``GpuMachine``; ``p``:
  the warpgroup's program."""

  def enabled(self, m, p) -> bool:
    del m, p  # most operations never wait
    return True

  def perform(self, m, p, where: str) -> None:
    raise NotImplementedError(f"{type(self).__name__}.perform")

  def blocked(self, m, p) -> str:
    del m, p
    return "an operation"


@dataclasses.dataclass(frozen=True)
class BarrierArrive(GpuOp):
  barrier: View

  def perform(self, m, p, where: str) -> None:
    describe = _describe(m, p, "barrier_arrive", where)
    _, b = _barrier(m, self.barrier, describe)
    event = _event(m, p, "signal", f"arrive {self.barrier.buffer.label}", where)
    _arrive(m, b, _release(m, p), event)


@dataclasses.dataclass(frozen=True)
class BarrierWait(GpuOp):
  barrier: View

  def _state(self, m, p):
    describe = _describe(m, p, "barrier_wait", _where(m, p))
    key, b = _barrier(m, self.barrier, describe)
    wg = m.gpu.wg(m.comp(p.device, p.program))
    return key, b, wg, wg.waits.get(key, 0)

  def enabled(self, m, p) -> bool:
    _, b, _, k = self._state(m, p)
    return (b.completed - k) % 2 == 1  # the parity of phase k completed

  def perform(self, m, p, where: str) -> None:
    key, b, wg, k = self._state(m, p)
    wg.waits[key] = k + 1
    _acquire(m, p, b.done_clock)
    label = self.barrier.buffer.label
    _event(
      m,
      p,
      "wait",
      f"barrier_wait {label} (phase {k})",
      where,
      after=b.done_event,
    )

  def blocked(self, m, p) -> str:
    _, b, _, k = self._state(m, p)
    return (
      f"barrier_wait on {self.barrier.buffer.label} for its phase {k} "
      f"({k % 2} parity); {b.completed} phases completed, the current one "
      f"has {b.arrived} of {b.num_arrivals} arrivals and waits for "
      f"{b.pending_bytes} bytes{_behind(b.completed - k)}"
    )


def _behind(phases: int) -> str:
  """Why a waiter blocks on a barrier that is two or more phases ahead of
  it: its parity wait now needs a phase that comes later."""
  if phases < 2:
    return ""
  return (
    f": it is {phases} phases behind, so more warpgroups arrive on the "
    "barrier than its num_arrivals counts, or this warpgroup skipped a wait"
  )


def _check_fenced(m, p, view: View, what, where, write=False) -> None:
  """The async proxy reads (writes) SMEM: every warpgroup's generic-proxy
  writes (and another warpgroup's reads) of it must be fenced by that
  warpgroup first. (The issuer's own earlier reads are not flagged: its
  loads have returned before it issues, as CUTLASS's mainloops rely on.)"""
  issuer = m.comp(p.device, p.program)
  for comp, wg in m.gpu.warpgroups.items():
    tables = [(wg.unfenced, "wrote")]
    if write and comp != issuer:
      tables.append((wg.unfenced_reads, "read"))
    for table, did in tables:
      mask, at = table.get(id(view.buffer), (None, ""))
      if mask is not None and mask[view.ids.reshape(-1)].any():
        raise errors.RaceError(
          f"{_describe(m, p, what, where)} {'writes' if write else 'reads'} "
          f"{view.buffer.label}, which {m.name_comp(comp)} {did} at {at} "
          "and has not fenced with commit_smem() since: the generic and "
          "the async proxy (TMA, WGMMA) are ordered only by that fence"
        )


def _new_async(m, p, kind: AsyncKind, where, **parts) -> Async:
  # TMA loads complete on their barriers, in any order; TMA stores and
  # WGMMAs in the order they were issued (their waits count groups).
  key = (kind, parts.get("barrier") if kind is AsyncKind.TMA_LOAD else None)
  lane, time = m.lane(m.comp(p.device, p.program), key, kind.value)
  index = m.gpu.count
  m.gpu.count += 1
  op = Async(index, kind, p, _release(m, p), lane, time, where, **parts)
  m.gpu.asyncs[index] = op
  m.strategy.new_dma(index)
  return op


def _issue_tma(m, p, where, src, dst, kind: AsyncKind, *, smem, barrier=None):
  """Checks a TMA copy ``src -> dst`` of ``kind`` (shapes, the barrier it
  completes on, the fence before its ``smem`` side), then issues it.
  Returns the operation, its start event and the barrier's state."""
  describe = _describe(m, p, kind, where)
  _shapes(src, dst, describe)
  parts, state = {}, None
  if barrier is not None:
    parts["barrier"], state = _barrier(m, barrier, describe)
  # A load writes its SMEM side, a store reads it.
  _check_fenced(m, p, smem, kind, where, write=smem is dst)
  op = _new_async(m, p, kind, where, src=src, dst=dst, **parts)
  event = _event(
    m,
    p,
    "dma_start",
    f"TMA #{op.index}: {src.buffer.label} -> {dst.buffer.label}",
    where,
    dma=op.index,
  )
  return op, event, state


@dataclasses.dataclass(frozen=True)
class TmaLoad(GpuOp):
  src: View
  dst: View
  barrier: View

  def perform(self, m, p, where: str) -> None:
    op, event, b = _issue_tma(
      m,
      p,
      where,
      self.src,
      self.dst,
      AsyncKind.TMA_LOAD,
      smem=self.dst,
      barrier=self.barrier,
    )
    assert b is not None  # a load always names its barrier
    _arrive(m, b, op.clock, event, expect_bytes=self.dst.nbytes)


@dataclasses.dataclass(frozen=True)
class TmaStore(GpuOp):
  src: View
  dst: View
  commit: bool

  def perform(self, m, p, where: str) -> None:
    op, _, _ = _issue_tma(
      m, p, where, self.src, self.dst, AsyncKind.TMA_STORE, smem=self.src
    )
    wg = m.gpu.wg(m.comp(p.device, p.program))
    wg.uncommitted.append(op)
    if self.commit:
      commit_group(wg)


def commit_group(wg: Warpgroup) -> None:
  if wg.uncommitted:
    wg.groups.append(wg.uncommitted)
    wg.uncommitted = []


def _in_flight(groups) -> list:
  return [g for g in groups if any(not c.landed for c in g)]


def _older_done(groups, n: int) -> bool:
  """All groups but the newest ``n`` have landed (``wait_group n``: the
  newest n may still be pending, every older one is complete)."""
  older = groups[: max(len(groups) - n, 0)]
  return all(c.landed for g in older for c in g)


@dataclasses.dataclass(frozen=True)
class WaitStores(GpuOp):
  n: int

  def enabled(self, m, p) -> bool:
    wg = m.gpu.wg(m.comp(p.device, p.program))
    return _older_done(wg.groups, self.n)

  def perform(self, m, p, where: str) -> None:
    wg = m.gpu.wg(m.comp(p.device, p.program))
    # Groups complete in order: all but the newest n are done.
    done = wg.groups[: max(len(wg.groups) - self.n, 0)]
    for group in done:
      for c in group:
        _acquire(m, p, c.land_clock)
    wg.groups = wg.groups[len(done) :]
    _event(m, p, "wait", f"wait_smem_to_gmem({self.n})", where)

  def blocked(self, m, p) -> str:
    wg = m.gpu.wg(m.comp(p.device, p.program))
    return (
      f"wait_smem_to_gmem({self.n}) with {len(_in_flight(wg.groups))} "
      "groups in flight"
    )


@dataclasses.dataclass(frozen=True)
class Wgmma(GpuOp):
  acc: View
  a: View
  b: View

  def perform(self, m, p, where: str) -> None:
    for v in (self.a, self.b):
      if id(v.buffer) in m.smem:
        _check_fenced(m, p, v, "wgmma", where)
    op = _new_async(
      m, p, AsyncKind.WGMMA, where, src=(self.a, self.b), dst=self.acc
    )
    _event(m, p, "dma_start", f"WGMMA #{op.index}", where, dma=op.index)
    m.gpu.wg(m.comp(p.device, p.program)).wgmmas.append(op)


@dataclasses.dataclass(frozen=True)
class WgmmaWait(GpuOp):
  n: int

  def enabled(self, m, p) -> bool:
    wg = m.gpu.wg(m.comp(p.device, p.program))
    return _older_done([[c] for c in wg.wgmmas], self.n)

  def perform(self, m, p, where: str) -> None:
    wg = m.gpu.wg(m.comp(p.device, p.program))
    done = wg.wgmmas[: max(len(wg.wgmmas) - self.n, 0)]
    for c in done:
      _acquire(m, p, c.land_clock)
    wg.wgmmas = wg.wgmmas[len(done) :]
    _event(m, p, "wait", f"wgmma_wait({self.n})", where)

  def blocked(self, m, p) -> str:
    return f"wgmma_wait({self.n})"


def _shapes(src: View, dst: View, describe) -> None:
  if src.shape != dst.shape:
    raise ValueError(
      f"{describe}: copies a window of shape {src.shape} into one of "
      f"shape {dst.shape}"
    )


def land(m, op: Async) -> None:
  """A TMA copy or a WGMMA reads and writes its memory now."""
  lane = op.lane
  who = m.name(op.issuer.device, op.issuer.program)
  # Not ``op`` (it leads back to the machine): buffers keep the text.
  text = (op.kind, op.index, op.where)
  describe = memory.Lazy(
    lambda: f"{text[0]} #{text[1]} issued by {who} at {text[2]}"
  )

  # TMA loads complete in any order; stores and WGMMAs in issue order.
  clock = op.clock
  if op.kind is not AsyncKind.TMA_LOAD:
    clock = memory.join(clock, {lane: op.lane_time})

  def access(view, write):
    memory.check_access(
      view,
      lane,
      op.lane_time,
      clock,
      write,
      describe,
      describe_comp=m.name_comp,
    )

  if op.kind is AsyncKind.WGMMA:
    a, b = op.src
    for v in (a, b):
      memory.check_initialized(v, describe)
      access(v, False)
    access(op.dst, False)
    access(op.dst, True)
    acc = op.dst.buffer.flat[op.dst.ids]
    x = a.buffer.flat[a.ids].astype(np.float32)
    y = b.buffer.flat[b.ids].astype(np.float32)
    op.dst.buffer.writable()
    op.dst.buffer.flat[op.dst.ids] = (acc + x @ y).astype(acc.dtype)
  else:
    access(op.src, False)
    access(op.dst, True)
    src, dst = op.src, op.dst
    dst.buffer.writable()
    dst.buffer.flat[dst.ids] = src.buffer.flat[src.ids]
    dst.buffer.init[dst.ids] = src.buffer.init[src.ids]
  op.landed = True
  op.land_clock = memory.join(op.clock, {lane: op.lane_time})
  m.events.append(_land_event(m, op))
  if op.barrier is not None:
    b = m.gpu.barriers[op.barrier]
    b.pending_bytes -= op.dst.nbytes
    b.clock = memory.join(b.clock, op.land_clock)
    _complete_if_done(m, b, len(m.events) - 1)


def _land_event(m, op):
  from mpmd._lowering.check import machine

  return machine.Event(
    m.step,
    op.issuer.device,
    -1,
    "dma_land",
    f"{op.kind} #{op.index} lands",
    op.where,
    dma=op.index,
  )


def check_exit(m, p) -> None:
  """A warpgroup exits: its TMA stores must have been awaited."""
  wg = m.gpu.wg(m.comp(p.device, p.program))
  left = [*wg.uncommitted, *(c for g in wg.groups for c in g)]
  if left:
    c = left[0]
    raise errors.LeftoverError(
      f"kernel {m.plan.kernel}: {m.name(p.device, p.program)} exits with "
      f"copy_smem_to_gmem #{c.index} (at {c.where}) not awaited: "
      "wait_smem_to_gmem(0) before the kernel ends (else its SMEM source "
      "may be gone before the copy read it)"
    )
  pending = [c for c in wg.wgmmas if not c.landed]
  if pending:
    raise errors.LeftoverError(
      f"kernel {m.plan.kernel}: {m.name(p.device, p.program)} exits with "
      f"WGMMA #{pending[0].index} (at {pending[0].where}) not awaited "
      "(wgmma_wait)"
    )
