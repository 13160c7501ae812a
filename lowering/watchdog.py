"""No hangs: a simulated program that waits too long ends the launch.

The Pallas simulators wait on semaphores (TPU) and barriers (GPU) forever
when nobody signals them. We record every wait (which program, on what,
where in the kernel) and a watchdog thread aborts a launch in which a wait
has lasted longer than the deadlock timeout *while nothing else of the
launch moved* (no simulated operation of it completed in that time), with
an error naming every program of that launch that is still waiting and
what each waits for now.

The default timeout (``DEFAULT_DEADLOCK_TIMEOUT_S``, 10 s) is short enough
for a test loop and stays correct for slow launches: a program that waits
while others work (every load, store, DMA and signal of the simulator is a
completed operation) is not timed out, however long it waits. Only a
launch in which some program waits and the others compute for longer than
the timeout without one simulated operation (a long stretch of pure math)
needs a longer one (``mpmd.deadlock_timeout``).

The simulators keep one global state per process, so their launches take
turns (``_Simulator``, the one object of the process): a run of a launch
holds the simulator from its first device's entry until every device has
left, having failed or not. Everything else belongs to the run
(``_Launch``): who took part, its failure, its programs' waits, and its
watchdog thread, which ends with it. Launches from several threads queue;
only the launch that hangs fails. A wait the watchdog ends is ended
cooperatively: the simulator's own failure path (TPU), or the barrier
woken and made to raise (GPU), never an exception injected into a thread.

How a device's part of a launch enters, runs and leaves is lowered in
``lowering/supervised.py`` (docs/design.md, "One launch at a time").
"""

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

from mpmd._lowering import errors
from mpmd.simulators import (
  DEFAULT_DEADLOCK_TIMEOUT_S as DEFAULT_DEADLOCK_TIMEOUT_S,
)

_POLL_S = 0.05


DeadlockError = errors.DeadlockError
RaceError = errors.RaceError
OutOfBoundsError = errors.OutOfBoundsError


# -- which program is which ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshRange:
  """Programs [offset, offset + size) of a launch belong to one mesh."""

  index: int
  shape: dict
  offset: int

  @property
  def size(self) -> int:
    n = 1
    for s in self.shape.values():
      n *= s
    return n


# A simulator's failure -> the launch's error in the user's terms (or None:
# the generic wording), for launches that say more than the simulator can.
Describe = Callable[[BaseException], errors.LaunchError | None]


@dataclasses.dataclass(frozen=True, eq=False)
class LaunchInfo:
  """What a lowered launch tells the watchdog: its meshes' programs, how to
  word its simulator's failures, and the settings it was lowered under.
  Held by the lowered launch's callbacks, by nothing global."""

  ranges: tuple[MeshRange, ...]
  describe: Describe | None
  timeout_s: float
  race_policy: str
  # A semaphore id -> the user's name of it (tpu_semaphores.Named), if known.
  semaphore_name: Callable[[int], Any] | None = None
  # Ends a device's part of the simulator's launch as failed (the other
  # devices stop waiting for it), for a device that leaves it outside the
  # simulator (in-computation launches), if the simulator has a way.
  abandon: Callable[[Exception, int], None] | None = None
  # Whether its devices' simulations are callbacks of the caller's
  # computation (jax 0.10, ``_in_computation``): a device whose
  # callback failed has then left (XLA runs none of its later ones).
  in_computation: bool = False
  # Lets the devices of a launch that the watchdog ends finish without
  # those that never began it (the simulator's clean-up after a failure
  # waits for every device), if the simulator needs it.
  release_absent: Callable[[], None] | None = None


@dataclasses.dataclass
class _Wait:
  who: str
  # What it waits for, worded when the deadlock is reported (a count it
  # holds is then the count that has reached it, not the one it began at).
  what: Callable[[], str]
  where: str
  since: float
  abort: Callable[[str], None]
  # A device waiting to begin another launch (``_wait_to_enter``), not a
  # program of this one.
  entering: bool = False


@dataclasses.dataclass(eq=False)
class _Launch:
  """One run of a lowered launch, on the devices of a shard_map of axis
  sizes ``sizes``: who took part, who left, its failure, its programs'
  waits and its watchdog."""

  info: LaunchInfo
  sizes: tuple[int, ...]
  original_failure: Callable[[], BaseException | None]
  devices: set = dataclasses.field(default_factory=set)  # those that entered
  left: int = 0
  reports: int = 0  # device threads that reported a failure
  # In-computation launches: the devices each thread runs a part of now
  # (XLA:CPU may run several devices' computations on one thread; the
  # simulator may run a device's programs on threads of its own), and the
  # devices whose part failed.
  threads: dict = dataclasses.field(default_factory=dict)
  failed_devices: set = dataclasses.field(default_factory=set)

  def part_failed(self, ident: int, device: tuple | None = None) -> None:
    """The part of ``device`` (default: the last one ``ident`` entered)
    failed: XLA runs none of its later callbacks."""
    parts = self.threads.get(ident, [])
    if device is None and parts:
      device = parts[-1]
    if device in parts:
      parts.remove(device)
    if device is not None:
      self.failed_devices.add(device)
      _end_if_over(self)

  idle_since: float = dataclasses.field(default_factory=time.monotonic)
  failure: errors.LaunchError | None = None
  waits: dict[int, _Wait] = dataclasses.field(default_factory=dict)
  over: threading.Event = dataclasses.field(default_factory=threading.Event)

  @property
  def num_devices(self) -> int:
    return math.prod(self.sizes)

  def absent(self) -> list[int]:
    """The devices (as the simulators number them) that have not begun
    this run."""
    began = {flat_index(d, self.sizes) for d in self.devices}
    return [i for i in range(self.num_devices) if i not in began]

  def admits(self, info: LaunchInfo, device: tuple) -> bool:
    """Whether ``device``'s part of a run of ``info`` belongs to this run
    (a device that took part in it already starts the next one)."""
    return (
      self.info is info
      and device not in self.devices
      and len(self.devices) < self.num_devices
    )


class _Simulator:
  """Which launch holds the simulator. Upstream's simulators keep one state
  per process, so this is one object per process; all else belongs to the
  launch that holds it (``_Launch``)."""

  def __init__(self):
    self.turn = threading.Condition()
    self.launch: _Launch | None = None

  def running(self) -> _Launch | None:
    with self.turn:
      return self.launch


_SIMULATOR = _Simulator()


def flat_index(coords: tuple, sizes: tuple) -> int:
  """The simulators' number of the device at ``coords`` (row-major) of a
  shard_map of axis sizes ``sizes``."""
  index = 0
  for c, n in zip(coords, sizes, strict=True):
    index = index * n + c
  return index


def enter(
  info: LaunchInfo,
  sizes: tuple[int, ...],
  reset: Callable[[], None],
  original_failure: Callable[[], BaseException | None],
  device: tuple = (),
) -> None:
  """Device ``device`` (its coordinates in a shard_map of axis sizes
  ``sizes``) starts launch ``info``: it waits for the simulator.

  A new launch starts from a clean simulator (``reset``: a failed one
  leaves its state behind for post-mortem inspection), with a watchdog of
  its own, which ends with it.
  """
  sim = _SIMULATOR
  with sim.turn:
    while True:
      if sim.launch is None:
        reset()
        sim.launch = _Launch(info, sizes, original_failure)
        threading.Thread(
          target=_watch,
          args=(sim.launch,),
          name="mpmd-deadlock-watchdog",
          daemon=True,
        ).start()
      launch = sim.launch
      if launch.admits(info, device):
        launch.devices.add(device)
        if info.in_computation:
          launch.threads.setdefault(threading.get_ident(), []).append(device)
        return
      if launch.threads.get(threading.get_ident()):
        # This thread's part of the running launch is not over, and never
        # will be: it went on in its computation (in-computation launches).
        raise Abandoned(launch, launch.failure or _interleaved(launch))
      if info.in_computation:
        ended = _wait_to_enter(launch, device)
        if ended is not None:
          raise Abandoned(launch, ended)
        continue
      sim.turn.wait()


def _wait_to_enter(launch: _Launch, device: tuple):
  """Waits (with the turn held) while ``launch`` holds the simulator, as a
  wait of it that its watchdog sees: in one computation on jax 0.10, the
  thread of ``device`` may be the one that ``launch`` waits for. Returns
  the error to raise if the watchdog ended ``launch`` and with it this
  wait, else None (once the simulator may be free)."""
  sim, ident = _SIMULATOR, threading.get_ident()
  ended: list[str] = []

  def abort(message: str) -> None:
    with sim.turn:
      ended.append(message)
      sim.turn.notify_all()

  def what() -> str:
    return (
      "to begin another launch while this one has not begun on "
      f"device {device}. If both are launches of one computation that do "
      "not depend on each other, XLA:CPU interleaved them (jax 0.10 runs "
      "the simulation inside the caller's computation): make one take the "
      "other's results, call them from separate jax.jit calls, or use "
      "jax >= 0.11"
    )

  launch.waits[ident] = _Wait(
    f"device {device}", what, "", time.monotonic(), abort, entering=True
  )
  try:
    while sim.launch is launch and not ended:
      sim.turn.wait()
  finally:
    launch.waits.pop(ident, None)
  return errors.DeadlockError(ended[0]) if ended else None


def _interleaved(launch: _Launch) -> errors.LaunchError:
  """The calling thread, still in ``launch``'s simulation, starts another
  launch (jax 0.10 only, see ``_in_computation``): neither can go on. Sets
  and returns ``launch``'s failure (call with the turn held)."""
  failure = errors.remember(
    DeadlockError(
      "mpmd_map deadlock: two simulator launches of one computation that "
      "do not depend on each other ran interleaved on one thread, each "
      "waiting for the other (XLA:CPU on jax 0.10 runs one computation's "
      "host callbacks on one thread). Make the second launch's operands "
      "depend on the first one's results, call them from separate jax.jit "
      "calls, or use jax >= 0.11, where they run one after the other."
    )
  )
  launch.failure = launch.failure or failure
  return failure


class Abandoned(Exception):
  """A device's thread cannot take (or go on with) its part of ``launch``:
  ``error`` says why (in-computation launches)."""

  def __init__(self, launch: _Launch, error: errors.LaunchError):
    super().__init__(str(error))
    self.launch, self.error = launch, error


def abandon(
  abandoned: Abandoned, device: tuple, device_id: int
) -> errors.LaunchError:
  """Ends the calling device thread's part of ``abandoned.launch`` (the
  simulator's failure path first, without the turn held: it waits for the
  other devices); returns the error to raise."""
  launch = abandoned.launch
  if launch.info.abandon is not None:
    launch.info.abandon(abandoned.error, device_id)
  with _SIMULATOR.turn:
    launch.failure = launch.failure or abandoned.error
    if _SIMULATOR.launch is launch:
      launch.part_failed(threading.get_ident(), device)
  return abandoned.error


def leave(
  info: LaunchInfo,
  failure: errors.LaunchError | None,
  device: tuple | None = None,
):
  """A device thread finished its part of launch ``info``, having failed
  or not; returns the launch's failure (``failure``, or an earlier one)."""
  sim = _SIMULATOR
  with sim.turn:
    launch = sim.launch
    if launch is None or launch.info is not info:
      return failure
    launch.failure = launch.failure or failure
    launch.left += 1
    parts = launch.threads.get(threading.get_ident(), [])
    if device in parts:
      parts.remove(device)
    _end_if_over(launch)
    sim.turn.notify_all()  # a failure now set wakes those in ``failed``
    return launch.failure


def _end_if_over(launch: _Launch) -> None:
  """Hands the simulator to the next launch once every device of
  ``launch`` has left (call with the turn held)."""
  if launch.left + len(launch.failed_devices) >= launch.num_devices:
    launch.over.set()
    _SIMULATOR.launch = None
    _SIMULATOR.turn.notify_all()


def launch_running() -> bool:
  """Whether a launch of ours holds the simulator."""
  return _SIMULATOR.running() is not None


@contextlib.contextmanager
def callback_running() -> Generator[None]:
  """Marks a simulator callback of the running launch as running: its end
  is progress (the watchdog times out only a launch that does not move)."""
  launch = _SIMULATOR.running()
  try:
    yield
  finally:
    if launch is not None:
      with _SIMULATOR.turn:
        launch.idle_since = time.monotonic()


def failed(error: BaseException) -> errors.LaunchError:
  """A simulator callback of the running launch raised ``error``.

  Returns the launch's failure as a ``LaunchError`` (the first one, or the
  watchdog's), which the callback raises instead of the simulator's
  wrapping of it.
  """
  sim = _SIMULATOR
  with sim.turn:
    launch = sim.launch
    if launch is None:
      return _as_launch_error(error)
    launch.reports += 1
    if launch.failure is None:
      original = launch.original_failure()
      if original is not None or not _follows_another_failure(error):
        launch.failure = _as_launch_error(original or error, launch.info)
    # A device that only saw another device's failure (the simulator's
    # barrier broken, or its "computation failed" check) waits for that
    # device's report (the simulator may have cleared its record of it), as
    # long as a program may wait: the launch's deadlock timeout.
    sim.turn.notify_all()
    sim.turn.wait_for(
      lambda: (
        launch.failure is not None or launch.reports >= launch.num_devices
      ),
      launch.info.timeout_s,
    )
    if launch.failure is None:
      launch.failure = _as_launch_error(error, launch.info)
    failure = launch.failure
    ident = threading.get_ident()
    if launch.info.in_computation:
      launch.part_failed(ident)
    sim.turn.notify_all()
    return failure


def _follows_another_failure(error: BaseException) -> bool:
  return isinstance(error, threading.BrokenBarrierError) or (
    isinstance(error, RuntimeError)
    and str(error).startswith("Computation failed")
  )


def _as_launch_error(
  error: BaseException, info: LaunchInfo | None = None
) -> errors.LaunchError:
  known = errors.launch_error(error)  # ours, as XLA reported it, or None
  if known is not None:
    return known
  describe = None if info is None else info.describe
  described = None if describe is None else describe(error)
  if described is not None:
    return described
  if isinstance(error, IndexError):  # the simulators' out-of-bounds reports
    return errors.OutOfBoundsError(
      f"mpmd_map: a simulated access out of bounds (hardware faults): {error}"
    )
  return errors.LaunchError(
    f"mpmd_map: the simulated kernel failed: {type(error).__name__}: {error}"
  )


def describe_program(program: int) -> str:
  """``"mesh 1 program 0 (core=0)"`` for a flat program index."""
  launch = _SIMULATOR.running()
  for r in launch.info.ranges if launch is not None else ():
    if r.offset <= program < r.offset + r.size:
      local, coords = program - r.offset, []
      for name, size in reversed(r.shape.items()):
        coords.append(f"{name}={local % size}")
        local //= size
      return (
        f"mesh {r.index} program {program - r.offset} "
        f"({', '.join(reversed(coords))})"
      )
  return f"program {program}"


# -- waits --------------------------------------------------------------------


@contextlib.contextmanager
def waiting(
  who: str,
  what: str | Callable[[], str],
  where: str,
  abort: Callable[[str], None],
):
  """Records that the calling simulator thread waits, while it does, in
  the running launch; ``what`` (or ``what()``, called when a deadlock is
  reported) says on what, ``abort(message)`` ends the wait."""
  ident = threading.get_ident()
  describe = what if callable(what) else (lambda: what)
  wait = _Wait(who, describe, where, time.monotonic(), abort)
  sim = _SIMULATOR
  with sim.turn:
    launch = sim.launch
    if launch is not None:
      launch.waits[ident] = wait
  try:
    yield
  finally:
    if launch is not None:
      with sim.turn:
        launch.waits.pop(ident, None)


def _watch(launch: _Launch) -> None:
  """The watchdog of ``launch``: ends it once a program has waited longer
  than its timeout while nothing else of it moved. Ends with the launch.

  It ends its programs' waits first. Devices that wait to begin another
  launch (in-computation launches) it ends only if the launch is still
  stuck one more timeout later without program waits (or at once, once it
  has failed): then the launch waits for one of them (two launches of one
  computation interleaved), while a launch of another thread's call merely
  queues behind it. A failed launch that nothing moves or waits in for a
  timeout, but for devices that came to begin another launch after it
  failed, has lost a device that never comes (its computation failed
  before its part began): it hands the simulator on to them."""
  timeout_s = launch.info.timeout_s
  queued_stuck = False  # only devices of other launches waited, once
  failed_at = None  # when this watchdog first saw the launch failed
  while not launch.over.wait(_POLL_S):
    now = time.monotonic()
    with _SIMULATOR.turn:
      if launch.failure is not None and failed_at is None:
        failed_at = now
      if now - launch.idle_since <= timeout_s:
        continue  # the launch moves: whoever waits may still be woken
      stuck = {
        i: w
        for i, w in launch.waits.items()
        if failed_at is None or not w.entering or w.since < failed_at
      }
      if failed_at is not None and not stuck:
        _give_up(launch)
        return
      if not any(now - w.since > timeout_s for w in stuck.values()):
        continue
      programs = [i for i, w in stuck.items() if not w.entering]
      if not programs and not queued_stuck and failed_at is None:
        queued_stuck, launch.idle_since = True, now
        continue
      queued = len(programs) < len(stuck)
      waits = [launch.waits.pop(i) for i in programs or list(stuck)]
      launch.idle_since = now  # what ends now moves the launch
      absent = launch.absent()
    lines = "\n".join(
      f"  {w.who} waits {w.what()}" + (f" at {w.where}" if w.where else "")
      for w in waits
    )
    message = (
      f"mpmd_map deadlock: a simulated program waited more than "
      f"{timeout_s:g} s while nothing else of its launch moved, and nothing "
      f"can wake it. Still waiting:\n{lines}\n"
      f"{_never_began(absent, queued and launch.info.in_computation)}"
      "(set the limit with mpmd.set_deadlock_timeout)"
    )
    with _SIMULATOR.turn:
      if launch.failure is None:
        launch.failure = errors.remember(DeadlockError(message))
        _SIMULATOR.turn.notify_all()
      failure = launch.failure
    if absent and launch.info.release_absent is not None:
      launch.info.release_absent()
    for w in waits:
      # The failure's own words, with its key: whoever reports the ended
      # wait (the simulator's wrapping of it included) reports it typed.
      w.abort(str(failure))


def _never_began(absent: list[int], queued: bool) -> str:
  """The deadlock message's line on the devices that have not begun the
  launch, if any (``queued``: devices of an in-computation launch wait to
  begin another one)."""
  if not absent:
    return ""
  which = ", ".join(map(str, absent))
  interleaved = (
    ", or waits to begin another launch of the same computation that "
    "XLA:CPU interleaved with this one (jax 0.10 runs the simulation "
    "inside the caller's computation: make one launch take the other's "
    "results, call them from separate jax.jit calls, or use jax >= 0.11)"
  )
  return (
    f"Device{'s' if len(absent) > 1 else ''} {which} never began this "
    "launch: its computation failed before it (a failed host callback, "
    "say), or computes for longer than the timeout before it"
    f"{interleaved if queued else ''}.\n"
  )


def _give_up(launch: _Launch) -> None:
  """Hands the simulator on from a failed ``launch`` that some device will
  never leave (call with the turn held)."""
  launch.over.set()
  if _SIMULATOR.launch is launch:
    _SIMULATOR.launch = None
    _SIMULATOR.turn.notify_all()


def name_semaphore(semaphore_id: int) -> Any:
  """The running launch's name of a simulator semaphore, if it has one."""
  launch = _SIMULATOR.running()
  if launch is None or launch.info.semaphore_name is None:
    return None
  return launch.info.semaphore_name(semaphore_id)


def running_deadlock() -> DeadlockError | None:
  """The running launch's failure, if the watchdog ended it."""
  launch = _SIMULATOR.running()
  failure = None if launch is None else launch.failure
  if not isinstance(failure, DeadlockError):
    return None
  # A copy: several simulated programs may raise it at once.
  return DeadlockError(*failure.args)
