"""The checking executor: every program of a launch, one at a time.

A :class:`Machine` holds one launch's whole state (memory, semaphores, DMAs
in flight, vector clocks, the event log): nothing outlives it. (What its
plan remembers for the kernel's next launches is what no launch changes:
steps, records' templates, the ``arange`` ids of buffers and the windows
cut from them.) Programs are generators (``interp``) that stop at each
synchronisation point; the machine offers the scheduler every program that
can go on and every DMA in flight, runs the pick, and repeats until all
programs have ended (or none can go on: a deadlock, reported at once).
"""

import dataclasses
import functools
import math
from collections.abc import Hashable
from typing import Any

import numpy as np

from mpmd import _jax
from mpmd._jax import core
from mpmd._lowering import errors, jaxpr_util, paths
from mpmd._lowering.check import memory, records, schedule
from mpmd._lowering.check.memory import Buffer, View

# A launch that takes more steps than this spins on a semaphore read that
# never changes (a livelock), or is far beyond what the checker is for.
MAX_STEPS = 1_000_000


@dataclasses.dataclass
class Plan:
  """What the executor needs of a launch, fixed when it is lowered."""

  jaxpr: core.Jaxpr  # the merged kernel: inputs, outputs, scratch
  num_in: int
  out_avals: tuple[Any, ...]
  aliases: dict[int, int]  # output -> the input it aliases
  device_axes: tuple[tuple[Hashable, int], ...]  # the shard_map's, in order
  super_axis: Hashable  # the merged kernel's program axis
  program_names: tuple[str, ...]  # per program: its mesh and coordinates
  kernel: str
  labels: tuple[str, ...]  # per kernel operand
  memo: dict = dataclasses.field(default_factory=dict)
  # Whether unordered writes of the same bytes race (CheckParams).
  identical_writes_race: bool = True
  # Whether output elements that nothing wrote are an error (CheckParams).
  unwritten_outputs: bool = False
  # Whether kernels' pl.debug_check run (pl.enable_debug_checks, read when
  # the launch is lowered, as Mosaic reads it).
  debug_checks: bool = False

  @property
  def num_devices(self) -> int:
    return math.prod(s for _, s in self.device_axes)

  @property
  def num_programs(self) -> int:
    return len(self.program_names)

  def device_coords(self, device: int) -> dict[Hashable, int]:
    """``{axis: coordinate}`` of a device (a new dict: callers edit it)."""
    key = ("coords", device)
    if key not in self.memo:
      sizes = [s for _, s in self.device_axes]
      coords = np.unravel_index(device, sizes) if sizes else ()
      self.memo[key] = {
        a: int(c) for (a, _), c in zip(self.device_axes, coords, strict=True)
      }
    return dict(self.memo[key])

  def device_name(self, device: int) -> str:
    if not self.device_axes:
      return ""
    key = ("device name", device)
    name = self.memo.get(key)
    if name is None:
      name = self.memo[key] = f"device {device} {self.device_coords(device)} "
    return name

  def name(self, device: int, program: int) -> str:
    """``device 1 {'x': 1} mesh 0 program {'core': 0}``."""
    return f"{self.device_name(device)}{self.program_names[program]}"


# Windows of remembered views a kernel keeps (``Machine.resolve``).
MAX_WINDOWS = 1 << 16


class Dma:
  """A DMA in flight."""

  def __init__(self, index, start, src, dst, recv, send, clock, issuer, where):
    self.index = index
    self.start = start  # the DmaStart record
    self.src, self.dst = src, dst  # Views
    self.recv, self.send = recv, send  # semaphore Views (or None)
    self.clock, self.issuer, self.where = clock, issuer, where
    self.event = None
    self.lane, self.lane_time = (0, 0), 0  # (read, write) ``Machine.lane``s
    self.option = ("d", index)  # how the scheduler names it
    self.staged = None  # (data, init) once a two-step DMA read its source


@dataclasses.dataclass
class Event:
  """One entry of the event log (the timeline's source)."""

  step: int
  device: int
  program: int  # -1: a DMA's landing (or a remote DMA's source read)
  kind: str
  what: str
  where: str
  dma: int | None = None
  after: int | None = None  # the event that released this wait


class Machine:
  """One launch on the checking executor (see the module docstring)."""

  def __init__(self, plan: Plan, strategy: schedule.Strategy):
    self.plan = plan
    self.strategy = strategy
    # (``comp`` runs at every access: the plan's count, read once.)
    self.num_programs = plan.num_programs
    self.step = 0
    self.preemptions: list[tuple[int, schedule.Option]] = []
    self.events: list[Event] = []
    self.dmas: dict[int, Dma] = {}
    self.num_dmas = 0
    n = plan.num_devices * plan.num_programs
    # Vector clock components of programs; lanes (``lane``) after them.
    self.num_comps = n
    self.lane_comps: dict[tuple, int] = {}
    self.lane_names: list[tuple[int, str]] = []  # (issuer, what) per lane
    self.lane_times: dict[int, int] = {}
    self.clocks: list[memory.Clock] = [{p: 1} for p in range(n)]
    self.memory: dict[tuple[int, int], dict[memory.Key, Buffer]] = {}
    self.semaphores: list[Buffer] = []
    # Shared by the kernel's launches: a window's ids, cut once, serve
    # every launch (``resolve``).
    self.aranges = plan.memo.setdefault(("aranges",), memory.Aranges())
    # Whether the inputs are the launch's own copies, which its buffers
    # take as their arrays rather than copy (``Launch.finish``).
    self.inputs_owned = False

  def release(self) -> None:
    """Drops the views each buffer keeps of itself (they name it back):
    then nothing of the machine is in a reference cycle, and refcounting
    frees it all, the cyclic collector never walking it. (What it has to
    show after its launch, events and errors, holds no view.) Buffers
    give their arrays to the next launches (``pool.POOL``; the
    outputs' data only once XLA has copied it)."""
    outputs = range(
      self.plan.num_in, self.plan.num_in + len(self.plan.out_avals)
    )
    kept = {
      id(mine[("operand", k)])
      for mine in self.memory.values()
      for k in outputs
      if ("operand", k) in mine
    }
    for mine in self.memory.values():
      for b in mine.values():
        if b.data is not None:  # (not done already: buffers are shared)
          b.recycle(output=id(b) in kept)

  def outputs(self) -> list[list[np.ndarray]]:
    """The launch's outputs per device, once every program has ended;
    with ``Plan.unwritten_outputs``, an ``UninitializedError`` where an
    output (not aliased to an input) has elements that nothing wrote."""
    plan = self.plan
    keys = [("operand", plan.num_in + k) for k in range(len(plan.out_avals))]
    if plan.unwritten_outputs:
      for d in range(plan.num_devices):
        for k, key in enumerate(keys):
          if k not in plan.aliases:
            _check_written(plan, self.memory[(d, 0)][key])
    return [
      [self.memory[(d, 0)][key].data for key in keys]
      for d in range(plan.num_devices)
    ]

  def pick(self, options, default, stuck=lambda: "") -> schedule.Option:
    """The strategy's pick among ``options`` for the next step (one other
    than ``default`` is a preemption, which the schedule string keeps).
    ``stuck()``: what a launch past ``MAX_STEPS`` is likely doing."""
    pick = self.strategy.choose(self.step, options, default)
    if pick != default:
      self.preemptions.append((self.step, pick))
    self.step += 1
    if self.step > MAX_STEPS:
      raise errors.DeadlockError(
        f"kernel {self.plan.kernel}: no progress in {MAX_STEPS} steps{stuck()}"
      )
    return pick

  # -- naming ----------------------------------------------------------------

  def comp(self, device: int, program: int) -> int:
    return device * self.num_programs + program

  def name(self, device: int, program: int) -> str:
    return self.plan.name(device, program)

  def name_comp(self, comp: int) -> str:
    n = self.num_comps
    if comp >= n:
      issuer, what = self.lane_names[comp - n]
      return f"{what} issued by {self.name_comp(issuer)}"
    return self.name(*divmod(comp, self.plan.num_programs))

  def lane(self, issuer: int, key: tuple, what: str) -> tuple[int, int]:
    """``(clock component, time)`` of an asynchronous operation that the
    program of component ``issuer`` starts: one lane per issuer and ``key``
    (what completes it: semaphores, a barrier), ticking once per operation.
    A wait covers the operations that signal what it waits on, not the
    issuer's others: hardware completes them in any order."""
    key = (issuer, *key)
    comp = self.lane_comps.get(key)
    if comp is None:
      comp = self.lane_comps[key] = self.num_comps + len(self.lane_names)
      self.lane_names.append((issuer, what))
    self.lane_times[comp] = time = self.lane_times.get(comp, 0) + 1
    return comp, time

  def describe(self, ctx, op: str, where: str) -> "Describe":
    return Describe(self, ctx.device, ctx.program, op, where)

  # -- memory ----------------------------------------------------------------

  def _operand_buffers(self, inputs):
    plan = self.plan
    avals = [v.aval for v in plan.jaxpr.invars]
    for d in range(plan.num_devices):
      shared: dict[memory.Key, Buffer] = {}
      for k, aval in enumerate(avals[: plan.num_in + len(plan.out_avals)]):
        if not hasattr(aval, "inner_aval"):
          continue  # a scalar value (closed over by a kernel): no memory
        key = ("operand", k)
        data = None
        if k < plan.num_in:
          data = inputs[k][d] if plan.device_axes else inputs[k]
        elif k - plan.num_in in plan.aliases:
          shared[key] = shared[("operand", plan.aliases[k - plan.num_in])]
          continue
        inner = aval.inner_aval
        shared[key] = Buffer(
          self._label(k, d),
          key,
          inner.shape,
          inner.dtype,
          self.aranges,
          data=data,
          adopt=self.inputs_owned,
        )
      scratch = avals[plan.num_in + len(plan.out_avals) :]
      base = plan.num_in + len(plan.out_avals)
      for j, aval in enumerate(scratch):
        if _private(aval) or not hasattr(aval, "inner_aval"):
          continue  # private: each program gets its own copy, below
        key = ("operand", base + j)
        inner = aval.inner_aval
        shared[key] = Buffer(
          self._label(base + j, d),
          key,
          inner.shape,
          inner.dtype,
          self.aranges,
        )
      for g in range(plan.num_programs):
        mine = dict(shared)
        for j, aval in enumerate(scratch):
          if _private(aval):
            key = ("operand", base + j)
            mine[key] = self._new(self._label(base + j, d, g), key, aval)
        self.memory[(d, g)] = mine

  def _label(self, k, device, program=None) -> str:
    where = self.plan.device_name(device)
    if program is not None:
      where += self.plan.program_names[program]
    where = where.strip()
    return f"{self.plan.labels[k]!r}" + (f" ({where})" if where else "")

  def _new(self, label, key, aval) -> Buffer:
    inner = aval.inner_aval
    sem = paths.is_semaphore(aval)
    buffer = Buffer(
      label, key, inner.shape, inner.dtype, self.aranges, semaphore=sem
    )
    if sem:
      self.semaphores.append(buffer)
    return buffer

  def view(self, ctx, ref, transforms, eqn) -> View:
    """The elements a Ref operand (and its views) names."""
    return self.resolve(
      ref, transforms, self.describe(ctx, eqn.primitive.name, ctx.where)
    )

  def resolve(self, ref, transforms, describe: memory.Text) -> View:
    if isinstance(ref, records.RefOperand):
      if transforms:
        ref, transforms = ref.ref, (*ref.transforms, *transforms)
      else:
        ref, transforms = ref.ref, ref.transforms
    if not isinstance(ref, View):
      raise NotImplementedError(
        f"mpmd checker: a Ref of type {type(ref).__name__} ({describe})"
      )
    b = ref.buffer
    viewed = getattr(b, "viewed", None)
    if type(transforms) is not records.Views or viewed is None:
      return self._narrow(ref, transforms, describe)
    if ref.ids is not b.ids:
      return self._narrow(ref, transforms, describe)
    # The same remembered views of the whole buffer: the same window, in
    # this launch (``viewed``) and in every launch of the kernel (its
    # buffers' ``ids`` are the kernel's aranges).
    found = viewed.get(id(transforms))
    if found is None:
      key = ("window", id(transforms), id(b.ids))
      ids = self.plan.memo.get(key)
      if ids is None:
        view = self._narrow(ref, transforms, describe)
        if len(self.plan.memo) < MAX_WINDOWS:
          self.plan.memo[key] = (transforms, b.ids, view.ids)
      else:
        view = View(b, ids[2])
      found = (transforms, view)
      if len(viewed) < memory.MAX_WINDOWS:
        viewed[id(transforms)] = found
    return found[1]

  def _narrow(self, ref: View, transforms, describe: memory.Text) -> View:
    view = ref
    for t in transforms or ():
      if hasattr(t, "indices") and hasattr(t, "int_indexer_shape"):
        view = memory.index_view(view, t, describe)
      elif type(t).__name__ in ("RefReshaper", "ReshapeTransform"):
        view = View(view.buffer, view.ids.reshape(t.shape))
      else:
        raise NotImplementedError(
          f"mpmd checker: Ref transform {type(t).__name__} ({describe})"
        )
    return view

  def load(self, ctx, view: View, eqn, check_init=True, mask=None, read=True):
    """The view's values, once the load is checked (None if not ``read``:
    a swap whose old values nobody uses)."""
    describe = self.describe(ctx, "load", ctx.where)
    if check_init:
      memory.check_initialized(view, describe, mask)
    comp = self.comp(ctx.device, ctx.program)
    clock = self.clocks[comp]
    memory.check_access(
      view, comp, clock[comp], clock, False, describe, mask, self.name_comp
    )
    return view.read() if read else None

  def store(self, ctx, view: View, value, eqn, mask=None):
    describe = self.describe(ctx, "store", ctx.where)
    comp = self.comp(ctx.device, ctx.program)
    clock = self.clocks[comp]
    b = view.buffer
    value = np.broadcast_to(np.asarray(value, b.data.dtype), view.shape)
    unchanged = None
    if mask is None and not self.plan.identical_writes_race:
      unchanged = functools.partial(memory.same_bytes, view, value)
    memory.check_access(
      view,
      comp,
      clock[comp],
      clock,
      True,
      describe,
      mask,
      self.name_comp,
      unchanged=unchanged,
    )
    if mask is None:
      view.write(value)
      view.set_init(True)
    else:
      mask = np.broadcast_to(np.asarray(mask), view.shape)
      b.writable()
      b.flat[view.ids[mask]] = value[mask]
      b.init[view.ids[mask]] = True

  def barrier_semaphore(self, ctx) -> View:
    key = ("barrier",)
    mine = self.memory[(ctx.device, ctx.program)]
    if key not in mine:
      for (d, g), m in self.memory.items():
        label = f"the barrier semaphore ({self.name(d, g)})"
        buffer = Buffer(label, key, (), np.int32, self.aranges, semaphore=True)
        self.semaphores.append(buffer)
        m[key] = buffer
    b = mine[key]
    return b.whole

  def allocate_scoped(self, ctx, eqn, avals_vars) -> tuple[View, ...]:
    mine = self.memory[(ctx.device, ctx.program)]
    views = []
    for k, v in enumerate(avals_vars):
      # Scoped memory sits at a fixed place of each program's memory: a
      # scope entered again finds it as it was left, and another program
      # may DMA or signal into it before this one enters (a remote DMA
      # into the peer's scoped buffer).
      key = ("scoped", eqn, k, ctx.scope_depth)
      if key in mine:
        views.append(mine[key].whole)
        continue
      label = memory.Lazy(
        lambda k=k, d=ctx.device, g=ctx.program, at=ctx.where, p=self.plan: (
          f"{jaxpr_util.scoped_names(eqn)[k]} at {at} ({p.name(d, g)})"
        )
      )
      buffer = self._new(label, key, v.aval)
      mine[key] = buffer
      views.append(buffer.whole)
    return tuple(views)

  def _like(self, buffer: Buffer, device: int, program: int) -> Buffer:
    """Program ``(device, program)``'s copy of a scoped buffer that it has
    not allocated yet (a peer DMAs or signals into it first)."""
    plan = self.plan  # not self: a label must not keep the machine alive
    label = memory.Lazy(
      lambda: f"{buffer.label} (the copy of {plan.name(device, program)})"
    )
    copy = Buffer(
      label,
      buffer.key,
      buffer.data.shape,
      buffer.data.dtype,
      self.aranges,
      semaphore=buffer.semaphore,
    )
    if copy.semaphore:
      self.semaphores.append(copy)
    return copy

  # -- addressing ------------------------------------------------------------

  def target(self, ctx, device_id, id_type, core_index, describe):
    """(device, program) that ``device_id`` / ``core_index`` name: worked
    out once per kernel for the same program and integer scalars (a ring
    names the same neighbour at every step)."""
    key = _target_key(ctx, device_id, id_type, core_index)
    if key is None:
      return self._target(ctx, device_id, id_type, core_index, describe)
    memo = self.plan.memo
    found = memo.get(key)
    if found is None:
      found = self._target(ctx, device_id, id_type, core_index, describe)
      if len(memo) < MAX_WINDOWS:
        memo[key] = found
    return found

  def _target(self, ctx, device_id, id_type, core_index, describe):
    plan = self.plan
    coords = plan.device_coords(ctx.device)
    program = ctx.program
    if core_index is not None:
      program = int(np.asarray(core_index))
    if device_id is not None:
      logical = id_type is _jax.pallas_primitives.DeviceIdType.LOGICAL
      if isinstance(device_id, dict):
        for axis, value in device_id.items():
          if axis == plan.super_axis:
            program = int(np.asarray(value))
            continue
          names = axis if isinstance(axis, tuple) else (axis,)
          sizes = [dict(plan.device_axes)[a] for a in names]
          flat = int(np.asarray(value))
          if not 0 <= flat < math.prod(sizes):
            raise errors.OutOfBoundsError(
              f"{describe}: device_id {axis!r}={flat} is outside the mesh "
              f"(its {'axes' if len(names) > 1 else 'axis'} {axis!r} "
              f"{'have' if len(names) > 1 else 'has'} {math.prod(sizes)} "
              "devices)"
            )
          for a, c in zip(names, np.unravel_index(flat, sizes), strict=True):
            coords[a] = int(c)
      elif isinstance(device_id, (tuple, list)):
        for (a, _), value in zip(plan.device_axes, device_id, strict=True):
          coords[a] = int(np.asarray(value))
      elif logical or len(plan.device_axes) != 1:
        flat = int(np.asarray(device_id))
        if not 0 <= flat < plan.num_devices:
          raise errors.OutOfBoundsError(
            f"{describe}: device_id {flat} is outside the "
            f"{plan.num_devices} devices"
          )
        coords = plan.device_coords(flat)
      else:
        coords[plan.device_axes[0][0]] = int(np.asarray(device_id))
    sizes = [s for _, s in plan.device_axes]
    for a, s in plan.device_axes:
      if not 0 <= coords[a] < s:
        raise errors.OutOfBoundsError(
          f"{describe}: device_id names {a!r}={coords[a]}, outside the "
          f"mesh (its axis {a!r} has size {s})"
        )
    if program < 0:  # (merge._program_of: a coordinate past its axis)
      raise errors.OutOfBoundsError(
        f"{describe}: device_id names a program outside its target mesh "
        "(a coordinate past the mesh's axis)"
      )
    if program >= plan.num_programs:
      raise errors.OutOfBoundsError(
        f"{describe}: names program {program}, outside the launch's "
        f"{plan.num_programs} programs"
      )
    device = (
      int(np.ravel_multi_index([coords[a] for a, _ in plan.device_axes], sizes))
      if sizes
      else 0
    )
    return device, program

  def peer(self, view: View, device: int, program: int, describe) -> View:
    """``view``'s elements in the copy of its buffer that program
    ``(device, program)`` has."""
    theirs = self.memory[(device, program)]
    other = theirs.get(view.buffer.key)
    if other is view.buffer:  # its own (a local DMA): the view itself
      return view
    if other is None and view.buffer.key[0] == "scoped":
      other = theirs[view.buffer.key] = self._like(view.buffer, device, program)
    if other is None:
      raise errors.OutOfBoundsError(
        f"{describe}: {view.buffer.label} does not exist on "
        f"{self.name(device, program)} now (a run_scoped buffer outside "
        "its scope)"
      )
    return view.on(other)


def _target_key(ctx, device_id, id_type, core_index):
  """What identifies a ``target`` question (None where an operand is not
  integer scalars: it is worked out anew)."""
  if isinstance(device_id, dict):
    names: Any = tuple(device_id)
    values = list(device_id.values())
  elif isinstance(device_id, (tuple, list)):
    names, values = len(device_id), list(device_id)
  else:
    names, values = None, [device_id]
  scalars = records.scalar_key([*values, core_index])
  if scalars is None:
    return None
  return ("target", ctx.device, ctx.program, id_type, names, *scalars)


class Describe(memory.Deferred):
  """``device 1 {'x': 1} mesh 0 program {'core': 0}: load at k.py:12``,
  formatted only when a message needs it (accesses are many, errors few).
  It keeps the machine's plan, not the machine: buffers keep descriptions
  of their last accesses, and a machine that they led back to would be a
  reference cycle, freed only by the cyclic collector."""

  __slots__ = ("plan", "device", "program", "op", "where")

  def __init__(self, machine, device, program, op, where):
    self.plan, self.device, self.program = machine.plan, device, program
    self.op, self.where = op, where

  def __str__(self):
    who = self.plan.name(self.device, self.program)
    return f"{who}: {self.op} at {self.where}"


def _check_written(plan: Plan, b: memory.Buffer) -> None:
  missing = ~b.init
  count = int(np.count_nonzero(missing))
  if not count:
    return
  first = np.unravel_index(int(np.argmax(missing)), b.data.shape)
  element = tuple(int(i) for i in first)
  more = f" and {count - 1} more" if count > 1 else ""
  raise errors.UninitializedError(
    f"kernel {plan.kernel}: no program wrote output {b.label} at element "
    f"{element}{more} of its {b.data.size}: the launch would return "
    "uninitialised memory there (NaN or the most negative integer on the "
    "CPU fallback, garbage on hardware)"
  )


def _private(aval) -> bool:
  """Scratch each program has its own copy of (VMEM, SMEM, semaphores);
  HBM / ANY scratch is one buffer per device, shared by its programs."""
  space = getattr(aval, "memory_space", None)
  tpu_spaces = _jax.tpu().core.MemorySpace
  shared = (None, _jax.pallas_core.MemorySpace.ANY, tpu_spaces.HBM)
  return space not in shared
