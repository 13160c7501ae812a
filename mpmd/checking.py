"""Every schedule, not one: explore, replay and draw a function's launches.

``mpmd.explore(f, *args)`` calls ``f`` again and again, each time with every
``mpmd_map`` launch inside it on the checking executor under another
schedule, and reports each distinct failure with a schedule string that
``mpmd.replay`` runs again, exactly. ``mpmd.timeline`` writes one run's
event log as a Chrome / Perfetto trace.
"""

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mpmd._lowering import errors
from mpmd._lowering.check import params as params_lib
from mpmd._lowering.check import schedule as schedule_lib
from mpmd._lowering.check import timeline as timeline_lib


@dataclasses.dataclass(frozen=True)
class CheckParams:
  """Runs a launch on the CPU fallback's checking executor.

  Every program of the launch (all meshes; every device under a
  ``shard_map``) runs under one deterministic scheduler that switches
  programs only at synchronisation points, with oracles for deadlocks,
  data races, reads of uninitialised memory, leftover semaphores and DMAs,
  and out-of-bounds accesses, each a typed ``mpmd.LaunchError``.

  Args:
    schedule: which schedule runs: ``"default"`` (DMAs land at once, no
      preemption), ``"random:SEED"``, ``"pctD:SEED"`` (PCT of depth D) or
      a ``"steps:..."`` string from ``mpmd.explore``; an int is
      ``"random:SEED"``.
    per_call: each call of the launch takes a schedule of its own, derived
      from the seed and the call's number (what ``MPMD_CHECK`` does).
    trace: a path: each launch writes its timeline there (Chrome trace
      events; ``mpmd.timeline`` says more).
    identical_writes_race: whether two unordered writes that store the same
      bytes are a data race (True, the default). False reports only the
      races whose result can depend on the order: a write that changes
      nothing (each program copying the same data to one place, as on
      hardware) is not one. The CPU fallback's default path, which runs a
      launch on this executor without being asked, uses False, so that a
      program means what it means on upstream's simulator. (False keeps
      the later of two such writes only: a third write ordered after it
      but not after the earlier one is not reported.)
    unwritten_outputs: whether an output element that no program wrote
      (one the launch would return uninitialised: garbage on hardware) is
      an ``mpmd.UninitializedError`` when the launch ends (False, the
      default: a kernel may leave parts of an output it never reads).
      Outputs aliased to inputs start written.

  Example (a program that waits for a signal nobody sends: on the checker
  a ``DeadlockError`` at once, naming the wait and its count)::

    >>> def kernel(x_hbm, o_hbm, sem):
    ...   pl.semaphore_wait(sem, 1)
    ...   pltpu.sync_copy(x_hbm, o_hbm)
    >>> f = mpmd.mpmd_map(
    ...     [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    ...     jax.ShapeDtypeStruct((8, 128), jnp.float32),
    ...     scratch_types=[pltpu.SemaphoreType.REGULAR],
    ...     interpret=mpmd.CheckParams(schedule="random:3"))
    >>> f(jnp.ones((8, 128), jnp.float32))
    Traceback (most recent call last):
    DeadlockError: kernel ... deadlocks: ... it holds 0 now ...
  """

  schedule: str | int = "default"
  per_call: bool = False
  trace: str | None = None
  identical_writes_race: bool = True
  unwritten_outputs: bool = False

  def __post_init__(self):
    if isinstance(self.schedule, bool) or not isinstance(
      self.schedule, (str, int)
    ):
      raise TypeError(
        "mpmd.CheckParams: expected 'schedule' to be a schedule string or "
        f"an int seed, got {self.schedule!r}"
      )
    for name in ("identical_writes_race", "unwritten_outputs"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(
          f"mpmd.CheckParams: expected {name!r} to be a bool, "
          f"got {getattr(self, name)!r}"
        )
    schedule = self.schedule
    if isinstance(schedule, int):
      schedule = f"random:{schedule}"
      object.__setattr__(self, "schedule", schedule)
    schedule_lib.parse(schedule)

  def owner(self) -> params_lib.Owner:
    return params_lib.owners(self)


KINDS = {
  errors.DeadlockError: "deadlock",
  errors.RaceError: "race",
  errors.UninitializedError: "uninitialized",
  errors.LeftoverError: "leftover",
  errors.OutOfBoundsError: "out_of_bounds",
  errors.NondeterminismError: "nondeterministic",
  errors.DebugCheckError: "debug_check",
}

# How many reruns shrinking a failing schedule may take.
MAX_SHRINK_RUNS = 48


def kind_of(error: BaseException) -> str:
  for cls, kind in KINDS.items():
    if isinstance(error, cls):
      return kind
  return "error"


@dataclasses.dataclass
class Failure:
  """One distinct failure ``explore`` found.

  Attributes:
    kind: ``"deadlock"``, ``"race"``, ``"uninitialized"``, ``"leftover"``,
      ``"out_of_bounds"``, ``"nondeterministic"`` or ``"debug_check"`` (a
      kernel's ``pl.debug_check``, with ``pl.enable_debug_checks`` on).
    schedule: the schedule that fails, shrunk to few preemptions: pass it
      to ``mpmd.replay`` (or paste it into a test).
    error: the typed error (an ``mpmd.LaunchError``) that schedule raises.
    found_by: the schedule that found it first.
  """

  kind: str
  schedule: str
  error: BaseException
  found_by: str

  def __str__(self):
    first = str(self.error).splitlines()[0] if str(self.error) else ""
    return f"{self.kind} (schedule {self.schedule!r}): {first}"


@dataclasses.dataclass
class Report:
  """What ``explore`` found: ``schedules_run`` and ``failures`` (one per
  distinct failure, in the order found); ``unchecked``: the simulators in
  which launches ran instead, unexplored (their ``interpret=`` names one)."""

  schedules_run: int
  failures: list[Failure]
  unchecked: tuple[str, ...] = ()

  @property
  def ok(self) -> bool:
    return not self.failures

  def __str__(self):
    lines = [f"{self.schedules_run} schedules, {len(self.failures)} failures"]
    if self.unchecked:
      lines.append(
        "  (not explored: launches run in "
        f"{', '.join(self.unchecked)}, as their interpret= asks)"
      )
    lines += [f"  {f}" for f in self.failures]
    return "\n".join(lines)


def _schedule_text(i: int, seed: int, depth: int, steps: int) -> str:
  if i == 0:
    return "default"
  if i % 2:
    return f"random:{seed + i}"
  return f"pct{depth}:{seed + i}:{steps}"


def _call(session, f, args, kwargs, text, keep=None):
  """Runs ``f`` under ``text``: (flat numpy outputs, None) or (None, the
  launch's error). Errors that are not a launch's propagate. ``keep``: a
  list that receives ``f``'s outputs as they are."""
  session.start(text)
  try:
    with params_lib.config_state()(session):
      out = jax.block_until_ready(f(*args, **kwargs))
  except Exception as e:  # noqa: BLE001 (sorted below)
    failed = [err for _, err in session.runs if err is not None]
    if failed:
      if not isinstance(failed[0], errors.LaunchError):
        # Not a failure of the kernel (an operation the executor does not
        # run, a bug of ours): the caller hears of it as it is.
        raise failed[0] from None
      return None, failed[0]
    typed = errors.launch_error(e)
    if typed is not None:
      return None, typed
    raise
  if not session.runs:
    name = getattr(f, "__name__", f)
    if session.elsewhere:
      raise ValueError(
        f"mpmd: {name!r} ran no mpmd_map launch on the checking executor, "
        "so no schedule of one could be checked: its launches run in the "
        f"simulator their interpret= names ({', '.join(session.elsewhere)}"
        "); give them interpret=None to check them"
      )
    raise ValueError(
      f"mpmd: {name!r} ran no mpmd_map launch, so no schedule of one could "
      "be checked (under jit, a launch whose outputs are unused is dropped)"
    )
  if keep is not None:
    keep.append(out)
  return [np.asarray(x) for x in jax.tree.leaves(out)], None


def _differs(outputs, reference, text: str, against: str):
  for k, (a, b) in enumerate(zip(outputs, reference, strict=True)):
    if a.shape != b.shape or a.tobytes() != b.tobytes():
      same = (
        (a == b) | (np.isnan(a) & np.isnan(b))
        if a.dtype.kind == "f"
        else (a == b)
      )
      where = np.argwhere(~np.asarray(same))
      at = tuple(int(i) for i in where[0]) if len(where) else ()
      return errors.NondeterminismError(
        f"output {k} depends on the schedule: schedule {text!r} gives "
        f"{a[at] if at else a!r} at {at}, schedule {against!r} gives "
        f"{b[at] if at else b!r} (a missing wait or signal lets programs "
        "read data before it is ready, or write it in either order)"
      )
  return None


# A failure's kind and the places (file.py:line) its message names.
Signature = tuple[str, tuple[str, ...]]


def _signature(kind: str, error: BaseException) -> Signature:
  places = sorted(set(re.findall(r"[\w./-]+\.py:\d+", str(error))))
  return kind, tuple(places)


def _preemptions(session) -> str:
  return schedule_lib.encode(
    {
      launch: list(m.preemptions)
      for launch, (m, _) in enumerate(session.runs)
      if m is not None
    }
  )


def _items(text: str) -> list[str]:
  body = text.partition(":")[2]
  return [x for x in body.split(",") if x]


def _fails(session, f, args, kwargs, text, kind, reference):
  outputs, error = _call(session, f, args, kwargs, text)
  if error is None and kind == "nondeterministic":
    error = _differs(outputs, reference, text, "default")
  return error if error is not None and kind_of(error) == kind else None


def _shrink(session, f, args, kwargs, text, kind, reference):
  """The failing ``steps:`` schedule with as few preemptions as we find
  (greedy: drop chunks, then single items, while it still fails)."""
  items = _items(text)
  runs = 0
  best_error, best = None, text
  chunk = max(len(items) // 2, 1)
  while chunk >= 1 and runs < MAX_SHRINK_RUNS:
    i = 0
    while i < len(items) and runs < MAX_SHRINK_RUNS:
      trial = items[:i] + items[i + chunk :]
      runs += 1
      error = _fails(
        session, f, args, kwargs, "steps:" + ",".join(trial), kind, reference
      )
      if error is not None:
        # The picks that happened (a dropped item can leave a later one
        # naming no option): every item of the result replays as written.
        items, best_error, best = trial, error, _preemptions(session)
        if best == "steps:":  # no preemption left
          best = "default"
      else:
        i += chunk
    if chunk == 1:
      break
    chunk //= 2
  return best, best_error


def _failure(session, call, text, error, reference, shrink) -> Failure:
  """The failure ``error`` of ``call`` (``f, args, kwargs``) under schedule
  ``text``, the session's last run, its schedule shrunk if ``shrink``."""
  f, args, kwargs = call
  preempted = _preemptions(session) if session.runs else text
  kind = kind_of(error)
  schedule = text  # what produced ``error``, exactly
  if shrink:
    shrunk, shrunk_error = _shrink(
      session, f, args, kwargs, preempted, kind, reference
    )
    if shrunk_error is not None:
      schedule, error = shrunk, shrunk_error
  return Failure(kind, schedule, error, text)


def explore(
  f: Callable[..., Any],
  *args,
  schedules: int = 100,
  seed: int = 0,
  depth: int = 3,
  shrink: bool = True,
  max_failures: int | None = None,
  **kwargs,
) -> Report:
  """Runs ``f(*args, **kwargs)`` under ``schedules`` schedules of its
  launches and reports every distinct failure.

  Every ``mpmd_map`` launch on TPU meshes that ``f`` makes (jitted or not,
  under ``shard_map`` or not) runs on the checking executor: all programs
  of all meshes and devices under one scheduler. The first schedule is the
  default one; then seeded random walks and PCT (depth ``depth``)
  alternate. A failure is a typed error of a launch, or outputs that
  differ from the default schedule's (``"nondeterministic"``). Each
  failing schedule is shrunk to few preemptions (``shrink``).

  Args:
    f: the function; its launches' kernels are what is checked.
    *args: its arguments (arrays; shapes and dtypes as it wants them).
    schedules: how many schedules to run (at least 1).
    seed: the first random seed.
    depth: the PCT depth (bugs needing up to ``depth`` ordering
      constraints are found with good probability).
    shrink: shrink failing schedules (a few dozen reruns each).
    max_failures: stop after this many distinct failures (None: run every
      schedule).

  Returns:
    A :class:`Report`: ``schedules_run``, ``failures`` and ``unchecked``.

  Example: program 0 stages ``x`` in shared HBM, program 1 copies it out;
  unsynchronised, program 1 may read before program 0 has written:

    >>> mesh = mpmd.tensorcore_mesh("core", num_cores=2)
    >>> def staged_copy(x, synchronised=True):
    ...   def kernel(x_hbm, o_hbm, staged, ready):
    ...     core = jax.lax.axis_index("core")
    ...     @pl.when(core == 0)
    ...     def _():
    ...       pltpu.sync_copy(x_hbm, staged)
    ...       if synchronised:
    ...         pl.semaphore_signal(ready, 1, core_index=1)
    ...     @pl.when(core == 1)
    ...     def _():
    ...       if synchronised:
    ...         pl.semaphore_wait(ready, 1)
    ...       pltpu.sync_copy(staged, o_hbm)
    ...   return mpmd.mpmd_map(
    ...       [(mesh, kernel)], jax.ShapeDtypeStruct(x.shape, x.dtype),
    ...       scratch_types=[pltpu.HBM(x.shape, x.dtype),
    ...                      pltpu.SemaphoreType.REGULAR])(x)
    >>> x = jnp.ones((8, 128), jnp.float32)
    >>> mpmd.explore(staged_copy, x, schedules=8).failures
    []
    >>> racy = functools.partial(staged_copy, synchronised=False)
    >>> [failure] = mpmd.explore(racy, x, schedules=8).failures
    >>> failure.kind
    'race'
    >>> mpmd.replay(racy, x, schedule=failure.schedule)
    Traceback (most recent call last):
    RaceError: data race on 'staged' ...
  """
  _check_count("schedules", schedules)
  _check_count("depth", depth)
  if max_failures is not None:
    _check_count("max_failures", max_failures)
  session = params_lib.Session()
  reference = None
  found: dict[Signature, Failure] = {}
  run = 0
  steps = schedule_lib.DEFAULT_STEPS
  for run in range(schedules):
    text = _schedule_text(run, seed, depth, steps)
    outputs, error = _call(session, f, args, kwargs, text)
    if run == 0:  # PCT's change points: among as many steps as it took
      steps = max([m.step for m, _ in session.runs if m is not None] or [1])
    if error is None:
      if reference is None:
        reference = outputs
        continue
      error = _differs(outputs, reference, text, "default")
      if error is None:
        continue
    kind = kind_of(error)
    key = _signature(kind, error)
    if key in found:
      continue
    failure = _failure(
      session, (f, args, kwargs), text, error, reference, shrink
    )
    # (Shrunk to a schedule already reported: the same failure, told
    # differently by another schedule.)
    if any(
      (x.kind, x.schedule) == (failure.kind, failure.schedule)
      for x in found.values()
    ):
      continue
    found[key] = failure
    if max_failures is not None and len(found) >= max_failures:
      break
  return Report(run + 1, list(found.values()), tuple(session.elsewhere))


def _check_count(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(
      f"mpmd.explore: expected {name!r} to be an int, got "
      f"{type(value).__name__}"
    )
  if value < 1:
    raise ValueError(
      f"mpmd.explore: expected {name!r} to be at least 1, got {value}"
    )


def replay(f: Callable[..., Any], *args, schedule: str, **kwargs):
  """Runs ``f(*args, **kwargs)`` with its launches under ``schedule`` (a
  string from ``explore``) and returns its outputs, or raises the typed
  error that schedule produces, every time.

  A ``"nondeterministic"`` failure is replayed by running the default
  schedule too and raising ``mpmd.NondeterminismError`` when the outputs
  differ.

  Example (a kernel whose programs copy each other's blocks around a
  ring of 4 devices, under a random schedule)::

    >>> from mpmd import demos
    >>> mesh = jax.make_mesh((4,), ("x",))
    >>> x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    >>> x = jax.device_put(x, NamedSharding(mesh, P("x")))
    >>> f = jax.jit(functools.partial(demos.ring_shift, mesh=mesh))
    >>> out = mpmd.replay(f, x, schedule="random:4")
    >>> import numpy as np
    >>> np.array_equal(out, np.roll(np.asarray(x), 2, axis=0))
    True
  """
  spec = schedule_lib.parse(schedule)
  session = params_lib.Session()
  kept: list[Any] = []
  outputs, error = _call(session, f, args, kwargs, schedule, kept)
  _check_applied(spec, session, schedule)
  if error is not None:
    raise error
  if schedule != "default":
    reference, error = _call(session, f, args, kwargs, "default")
    if error is None:
      error = _differs(outputs, reference, schedule, "default")
    if error is not None:
      raise error
  return kept[0]


def _check_applied(spec, session, text: str) -> None:
  """A ``steps:`` schedule whose items did not all happen (a launch or
  step the run does not have, an option not offered there) is a
  ``ValueError``: the run was not the one the schedule describes."""
  if spec.kind is not schedule_lib.Kind.STEPS:
    return
  problems = []
  for launch, picks in sorted(spec.picks.items()):
    if launch >= len(session.runs):
      problems.append(
        f"launch {launch}: the function ran {len(session.runs)} launches "
        "on the checking executor"
      )
      continue
    m = session.runs[launch][0]
    if m is None:  # (it failed before its first step)
      continue
    for step, offered in m.strategy.unapplied().items():
      item = f"{launch}/{step}:{''.join(map(str, picks[step]))}"
      problems.append(
        f"{item}: launch {launch} ended after {m.step} steps"
        if offered is None
        else f"{item}: step {step} offered "
        + ", ".join("".join(map(str, o)) for o in offered)
      )
  if problems:
    raise ValueError(
      f"mpmd.replay: schedule {text!r} names picks the run did not offer, "
      "so it would not replay what it says:\n  " + "\n  ".join(problems)
    )


def timeline(
  f: Callable[..., Any],
  *args,
  path: str,
  schedule: str = "default",
  **kwargs,
):
  """Runs ``f(*args, **kwargs)`` under ``schedule`` and writes its launches'
  event log to ``path`` as Chrome trace-event JSON (open it in Perfetto or
  chrome://tracing): a process per device, a thread per program; compute
  between synchronisation points, DMAs from start to landing (a remote
  DMA's source read between), blocked
  waits, and arrows from each signal to the wait it released. Time is in
  scheduler steps (one step per microsecond on the trace's axis), not a
  model of hardware time. Returns ``f``'s outputs (or raises its error,
  after writing the trace).

  Example::

    >>> import json, tempfile
    >>> from mpmd import demos
    >>> mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    >>> x = jax.device_put(jnp.ones((16, 128), jnp.float32),
    ...                    NamedSharding(mesh, P("x")))
    >>> f = jax.jit(functools.partial(demos.ring_shift, mesh=mesh))
    >>> path = tempfile.mktemp(suffix=".json")
    >>> _ = mpmd.timeline(f, x, path=path, schedule="random:1")
    >>> with open(path) as trace:
    ...   events = json.load(trace)["traceEvents"]
    >>> sorted({e["cat"] for e in events if "cat" in e})
    ['dma', 'dma_start', 'exit', 'program', 'sync', 'wait']
  """
  schedule_lib.parse(schedule)
  session = params_lib.Session()
  session.start(schedule)
  try:
    with params_lib.config_state()(session):
      return jax.block_until_ready(f(*args, **kwargs))
  finally:
    machines = [m for m, _ in session.runs if m is not None]
    timeline_lib.write(path, machines)
