"""No hangs: a simulated program that waits too long ends the launch.

The Pallas simulators wait on semaphores (TPU) and barriers (GPU) forever
when nobody signals them. We record every wait (which program, on what,
where in the kernel) and a watchdog thread aborts a launch in which a wait
has lasted longer than the deadlock timeout, with an error naming every
program that is still waiting.
"""

import contextlib
import ctypes
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

from mpmd._jax import callback, config, mlir

DEFAULT_DEADLOCK_TIMEOUT_S = 60.0
_POLL_S = 0.05

_timeout_s = DEFAULT_DEADLOCK_TIMEOUT_S


class DeadlockError(RuntimeError):
  """A simulated program waited longer than the deadlock timeout."""


class RaceError(RuntimeError):
  """A simulator's race detector saw two programs race on a buffer."""


class OutOfBoundsError(IndexError):
  """A DMA's window reached past its buffer (hardware would fault).

  An ``IndexError``, as the simulators' own out-of-bounds reports are.
  """


def set_deadlock_timeout(seconds: float) -> None:
  """Sets how long a simulated program may wait before the launch fails.

  Args:
    seconds: a positive number (default 60).
  """
  global _timeout_s
  if not seconds > 0:
    raise ValueError(
      f"deadlock_timeout: expected 'seconds' > 0, got {seconds!r}"
    )
  _timeout_s = float(seconds)


def get_deadlock_timeout() -> float:
  return _timeout_s


@contextlib.contextmanager
def deadlock_timeout(seconds: float) -> Iterator[None]:
  """Context manager form of ``set_deadlock_timeout``.

  Example::

    with mpmd.deadlock_timeout(5.0):
      f(x)  # a program waiting > 5 s raises an error naming it
  """
  previous = _timeout_s
  set_deadlock_timeout(seconds)
  try:
    yield
  finally:
    set_deadlock_timeout(previous)


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


_launches: dict[int, tuple[MeshRange, ...]] = {}
_current_launch: list[int] = [0]


def register_launch(ranges: tuple[MeshRange, ...]) -> int:
  """Remembers a launch's meshes; returns a key for ``enter_launch``."""
  key = len(_launches) + 1
  _launches[key] = ranges
  return key


def enter_launch(key: int) -> None:
  _current_launch[0] = int(key)


def describe_program(program: int) -> str:
  """``"mesh 1 program 0 (core=0)"`` for a flat program index."""
  for r in _launches.get(_current_launch[0], ()):
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


@dataclasses.dataclass
class _Wait:
  who: str
  what: str
  where: str
  since: float
  abort: Callable[[str], None]


_waits: dict[int, _Wait] = {}
_lock = threading.Lock()
_watchdog: list[threading.Thread] = []


@contextlib.contextmanager
def waiting(who: str, what: str, where: str, abort: Callable[[str], None]):
  """Records that the calling simulator thread waits, while it does."""
  ident = threading.get_ident()
  with _lock:
    _waits[ident] = _Wait(who, what, where, time.monotonic(), abort)
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


def _watch() -> None:
  while True:
    time.sleep(_POLL_S)
    now = time.monotonic()
    with _lock:
      stuck = [w for w in _waits.values() if now - w.since > _timeout_s]
      if not stuck:
        continue
      waits = list(_waits.values())
      _waits.clear()
    lines = "\n".join(
      f"  {w.who} waits {w.what}" + (f" at {w.where}" if w.where else "")
      for w in waits
    )
    message = (
      f"mpmd_map deadlock: a simulated program waited more than "
      f"{_timeout_s:g} s and nothing can wake it. Still waiting:\n{lines}\n"
      "(set the limit with mpmd.set_deadlock_timeout)"
    )
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
def reraise_with_message() -> Iterator[None]:
  try:
    yield
  except DeadlockError as e:
    message = _messages.pop(threading.get_ident(), None)
    if message is None or e.args:
      raise
    raise DeadlockError(message) from None


def lower_supervised(
  ctx, in_nodes, *, ranges, run, reset, races_found, detect_races, orders
):
  """Lowers a simulator ``run`` between two ordered bookkeeping callbacks.

  Before: ``reset()`` (a launch that failed leaves the simulator's state
  behind for post-mortem inspection; the next one starts clean) and naming
  the launch's programs for deadlock messages. After: the race detector's
  verdict as a ``RaceError``, when ``detect_races``.
  """
  key = register_launch(ranges)

  def enter():
    reset()
    enter_launch(key)

  def leave():
    if detect_races and races_found():
      raise RaceError(
        "mpmd_map: the simulator's race detector found programs racing on "
        f"a buffer (accesses not ordered by {orders})"
      )

  def launch(*args):
    callback.io_callback(enter, None, ordered=True)
    # The simulators evaluate the kernel as ordinary JAX code; inside a
    # shard_map(check_vma=True) its device-index arithmetic would mix varying
    # and invariant values, which kernels (traced without vma) may do.
    with config._check_vma(False):
      results = run(*args)
    callback.io_callback(leave, None, ordered=True)
    return results

  return mlir.lower_fun(launch, multiple_results=True)(ctx, *in_nodes)
