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
turns: a launch holds the simulator from its first device's entry until
every device has left or failed (``_Launch``). Launches from several
threads queue there; only the launch that hangs fails.
"""

import contextlib
import ctypes
import dataclasses
import functools
import math
import threading
import time
from collections.abc import Callable, Generator

from mpmd import _jax, simulators
from mpmd._jax import callback, core, mlir
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


@dataclasses.dataclass(eq=False)
class _Launch:
  """One run of a lowered launch, on ``num_devices`` device threads."""

  info: LaunchInfo
  num_devices: int
  original_failure: Callable[[], BaseException | None]
  entered: int = 0
  left: int = 0
  active: int = 0  # simulator callbacks running now
  reports: int = 0  # device threads that reported a failure
  idle_since: float = dataclasses.field(default_factory=time.monotonic)
  failure: errors.LaunchError | None = None

  def over(self) -> bool:
    """Every device left; or it failed and no callback of it ran lately
    (a failure ends each device's part in some callback of the simulator,
    and the device threads of several simulated cores may fail at once)."""
    if self.left >= self.num_devices:
      return True
    return (
      self.failure is not None
      and self.active == 0
      and time.monotonic() - self.idle_since > _SETTLE_S
    )


_SETTLE_S = 0.2
_REPORTS_S = 5.0
_turn = threading.Condition()
_running: list[_Launch] = []  # the launch holding the simulator, if any
_last_failure: list[errors.LaunchError] = []


def enter(
  info: LaunchInfo,
  num_devices: int,
  reset: Callable[[], None],
  original_failure: Callable[[], BaseException | None],
) -> None:
  """A device thread starts launch ``info``: it waits for the simulator.

  A new launch starts from a clean simulator (``reset``: a failed one
  leaves its state behind for post-mortem inspection).
  """
  with _turn:
    while True:
      if _running and _running[0].over():
        _running.clear()
      if not _running:
        reset()
        _last_failure.clear()
        _running.append(_Launch(info, num_devices, original_failure))
      launch = _running[0]
      if launch.info is info and launch.entered < launch.num_devices:
        launch.entered += 1
        return
      _turn.wait(_POLL_S)


def leave(info: LaunchInfo, failure: errors.LaunchError | None):
  """A device thread finished its part of launch ``info``; returns the
  launch's failure (``failure``, or an earlier one), if any."""
  with _turn:
    if not _running or _running[0].info is not info:
      return failure
    launch = _running[0]
    launch.failure = launch.failure or failure
    launch.left += 1
    if launch.over():
      _running.clear()
      _turn.notify_all()
    return launch.failure


def launch_running() -> bool:
  """Whether a launch of ours holds the simulator."""
  return bool(_running)


@contextlib.contextmanager
def callback_running() -> Generator[None]:
  """Marks a simulator callback of the running launch as running."""
  with _turn:
    launch = _running[0] if _running else None
    if launch is not None:
      launch.active += 1
  try:
    yield
  finally:
    if launch is not None:
      with _turn:
        launch.active -= 1
        launch.idle_since = time.monotonic()


def failed(error: BaseException) -> errors.LaunchError:
  """A simulator callback of the running launch raised ``error``.

  Returns the launch's failure as a ``LaunchError`` (the first one, or the
  watchdog's), which the callback raises instead of the simulator's
  wrapping of it.
  """
  with _turn:
    if not _running:
      return _last_failure[0] if _last_failure else _as_launch_error(error)
    launch = _running[0]
    launch.reports += 1
    if launch.failure is None:
      original = launch.original_failure()
      if original is not None or not _follows_another_failure(error):
        launch.failure = _as_launch_error(original or error, launch.info)
    # A device that only saw another device's failure (the simulator's
    # barrier broken, or its "computation failed" check) waits for that
    # device's report: the simulator may have cleared its record of it.
    _turn.notify_all()
    _turn.wait_for(
      lambda: (
        launch.failure is not None or launch.reports >= launch.num_devices
      ),
      _REPORTS_S,
    )
    if launch.failure is None:
      launch.failure = _as_launch_error(error, launch.info)
    _last_failure[:] = [launch.failure]
    _turn.notify_all()
    return launch.failure


def _follows_another_failure(error: BaseException) -> bool:
  return isinstance(error, threading.BrokenBarrierError) or (
    isinstance(error, RuntimeError)
    and str(error).startswith("Computation failed")
  )


def _as_launch_error(
  error: BaseException, info: LaunchInfo | None = None
) -> errors.LaunchError:
  if isinstance(error, errors.LaunchError):
    return error
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


def _fail_running(error: errors.LaunchError) -> None:
  with _turn:
    if _running and _running[0].failure is None:
      _running[0].failure = error
      _last_failure[:] = [error]
      _turn.notify_all()


def describe_program(program: int) -> str:
  """``"mesh 1 program 0 (core=0)"`` for a flat program index."""
  for r in _running[0].info.ranges if _running else ():
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


# -- races --------------------------------------------------------------------


# -- waits --------------------------------------------------------------------


@dataclasses.dataclass
class _Wait:
  who: str
  # What it waits for, worded when the deadlock is reported (a count it
  # holds is then the count that has reached it, not the one it began at).
  what: Callable[[], str]
  where: str
  since: float
  abort: Callable[[str], None]


_waits: dict[int, _Wait] = {}
_lock = threading.Lock()
_watchdog: list[threading.Thread] = []


@contextlib.contextmanager
def waiting(
  who: str,
  what: str | Callable[[], str],
  where: str,
  abort: Callable[[str], None],
):
  """Records that the calling simulator thread waits, while it does;
  ``what`` (or ``what()``, called when a deadlock is reported) says on
  what."""
  ident = threading.get_ident()
  describe = what if callable(what) else (lambda: what)
  with _lock:
    _waits[ident] = _Wait(who, describe, where, time.monotonic(), abort)
    if not _watchdog:
      thread = threading.Thread(
        target=_watch, name="mpmd-deadlock-watchdog", daemon=True
      )
      _watchdog.append(thread)
      thread.start()
  try:
    yield
  finally:
    with _lock:
      _waits.pop(ident, None)


def _running_launch() -> tuple[float, float] | None:
  """(when a simulated operation of the running launch last completed,
  its deadlock timeout), if one runs."""
  with _turn:
    if not _running:
      return None
    return _running[0].idle_since, _running[0].info.timeout_s


def _watch() -> None:
  while True:
    time.sleep(_POLL_S)
    now = time.monotonic()
    running = _running_launch()
    if running is None:
      continue
    progress, timeout_s = running
    if now - progress <= timeout_s:
      continue  # the launch moves: whoever waits may still be woken
    with _lock:
      stuck = [w for w in _waits.values() if now - w.since > timeout_s]
      if not stuck:
        continue
      waits = list(_waits.values())
      _waits.clear()
    lines = "\n".join(
      f"  {w.who} waits {w.what()}" + (f" at {w.where}" if w.where else "")
      for w in waits
    )
    message = (
      f"mpmd_map deadlock: a simulated program waited more than "
      f"{timeout_s:g} s while nothing else of its launch moved, and nothing "
      f"can wake it. Still waiting:\n{lines}\n"
      "(set the limit with mpmd.set_deadlock_timeout)"
    )
    _fail_running(errors.remember(DeadlockError(message)))
    for w in waits:
      w.abort(message)


_messages: dict[int, str] = {}


def raise_in_thread(ident: int, notify: Callable[[], None]) -> Callable:
  """An ``abort`` for a thread blocked on a condition variable.

  Python can only raise an exception class asynchronously in another thread;
  it fires when ``notify`` wakes the thread, and ``reraise_with_message``
  (around the wait) gives it the message.
  """

  def abort(message: str) -> None:
    _messages[ident] = message
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
      ctypes.c_ulong(ident), ctypes.py_object(DeadlockError)
    )
    notify()

  return abort


@contextlib.contextmanager
def reraise_with_message() -> Generator[None]:
  try:
    yield
  except DeadlockError as e:
    message = _messages.pop(threading.get_ident(), None)
    if message is None or e.args:
      raise
    raise DeadlockError(message) from None


def lower_supervised(
  ctx,
  in_nodes,
  *,
  ranges,
  run,
  reset,
  original_failure,
  races_found,
  detect_races,
  races_are_errors,
  orders,
  simulator_effects,
  describe: Describe | None = None,
):
  """Lowers a simulator ``run`` between two ordered bookkeeping callbacks.

  Before: waiting for the simulator (``enter``), and naming the launch's
  programs for deadlock messages. After: the race detector's verdict, when
  ``detect_races`` (for ``get_races``, and as a ``RaceError`` when
  ``races_are_errors`` and the race policy is "raise"), and leaving the
  simulator to the next launch. A device thread that fails in between
  leaves through ``failed``; ``describe`` (if given) words its failure in
  the user's terms where it can.
  """
  info = LaunchInfo(
    ranges,
    describe,
    simulators.get_deadlock_timeout(),
    simulators.get_race_policy(),
  )

  def finish():
    failure = None
    if detect_races:
      found = races_found()
      simulators.record_races(found)
      if found and races_are_errors and info.race_policy == "raise":
        failure = RaceError(
          "mpmd_map: the simulator's race detector found programs racing on "
          f"a buffer (accesses not ordered by {orders}); "
          "mpmd.set_race_policy('record') records races for "
          "mpmd.get_races() instead"
        )
    failure = leave(info, failure)
    if failure is not None:
      raise failure

  def launch(*args):
    # As the simulators count them: one device thread per device of the
    # enclosing shard_map.
    num_devices = math.prod(core.get_axis_env().axis_sizes.values())
    callback.io_callback(
      functools.partial(enter, info, num_devices, reset, original_failure),
      None,
      ordered=True,
    )
    results = run(*args)
    callback.io_callback(finish, None, ordered=True)
    return results

  # The launch's ordered callbacks (ours and the simulator's) run on a token
  # chain of their own, started here. Were they on JAX's runtime token, a
  # failed launch would leave that token failed, and every later launch
  # and ordered callback of the process would re-raise its error.
  ordered = {_jax.ordered_io_effect(), *simulator_effects}
  own = mlir.TokenSet({e: mlir.create_token() for e in ordered})
  inner = ctx.replace(tokens_in=own, tokens_out=None)
  # The simulators evaluate the kernel as ordinary JAX code; inside a
  # shard_map(check_vma=True) its device-index arithmetic would mix varying
  # and invariant values, which kernels (traced without vma) may do. So it
  # is traced without vma, and type-checked (jax_enable_checks) so too:
  # checked with vma, the simulator's axis_index would read as mistyped.
  with _jax.no_vma_check():
    return mlir.lower_fun(launch, multiple_results=True)(inner, *in_nodes)
