"""How a launch asks for the checking executor, and whose run it is.

* ``interpret=mpmd.CheckParams(schedule=...)`` on one ``mpmd_map``
  (``CheckParams`` is defined in ``mpmd/checking.py``);
* the ``mpmd_check`` JAX config state (``MPMD_CHECK`` in the environment,
  or ``mpmd.explore`` / ``mpmd.replay`` for the launches of a function):
  every TPU-mesh launch traced under it runs on the executor.

The state is part of JAX's jit and tracing cache keys, so a function traced
before is traced again under it.
"""

import functools
import os
import threading
from typing import Any

from mpmd import _jax, simulators
from mpmd._lowering.check import schedule as schedule_lib

ENV = "MPMD_CHECK"


class Run:
  """One launch's run: its schedule and who hears how it ended."""

  def __init__(self, owner, spec, text: str, launch: int):
    self.owner, self.spec, self.text, self.launch = owner, spec, text, launch

  def strategy(self, plan):
    del plan
    return self.spec.strategy(self.launch)

  def finish(self, machine, error) -> None:
    self.owner.finished(self, machine, error)


class Owner:
  """Runs of launches lowered with one ``CheckParams``."""

  def __init__(self, params):
    self.params = params
    self.lock = threading.Lock()
    self.calls = 0

  def begin_launch(self) -> Run:
    text = self.params.schedule
    assert isinstance(text, str)  # __post_init__ made a seed a string
    spec = schedule_lib.parse(text)
    with self.lock:
      call = self.calls
      self.calls += 1
    seeded = (schedule_lib.Kind.RANDOM, schedule_lib.Kind.PCT)
    if self.params.per_call and spec.kind in seeded:
      seed = schedule_lib.mix(spec.seed, call) % 2**31
      text = f"{text.partition(':')[0]}:{seed}"
      spec = schedule_lib.parse(text)
    return Run(self, spec, text, 0)

  def finished(self, run, machine, error) -> None:
    del run, error
    if self.params.trace:
      from mpmd._lowering.check import timeline

      timeline.write(self.params.trace, [machine])


@_jax.util.cache(max_size=4096, trace_context_in_key=False)
def owners(params) -> Owner:
  # One per CheckParams (its calls counted); jax.clear_caches() reaches it.
  return Owner(params)


class Session:
  """The launches of one function call under ``mpmd.explore`` / ``replay``
  / ``timeline``: the schedule they share and what each did."""

  def __init__(self):
    self.lock = threading.Lock()
    self.text = "default"
    self.spec = schedule_lib.parse("default")
    self.runs: list[tuple[Any, BaseException | None]] = []
    # Launches lowered for a simulator their interpret= names instead.
    self.elsewhere: list[str] = []

  def start(self, text: str) -> None:
    with self.lock:
      self.spec = schedule_lib.parse(text)
      self.text = text
      self.runs = []

  def ran_elsewhere(self, simulator: str) -> None:
    """A launch lowered for the simulator its interpret= names."""
    with self.lock:
      if simulator not in self.elsewhere:
        self.elsewhere.append(simulator)

  def owner(self) -> "Session":
    return self

  def begin_launch(self) -> Run:
    with self.lock:
      launch = len(self.runs)
      self.runs.append((None, None))
    return Run(self, self.spec, self.text, launch)

  def finished(self, run, machine, error) -> None:
    with self.lock:
      self.runs[run.launch] = (machine, error)


@functools.cache
def config_state():
  """The ``mpmd_check`` JAX config state, defined on first use (``import
  mpmd`` adds nothing to JAX's config)."""
  return simulators.jit_keyed_state(
    "mpmd_check",
    None,
    "run every TPU-mesh mpmd_map launch on the checking executor: a "
    "CheckParams, a session of mpmd.explore, or a schedule string "
    "('random:SEED' gives each call a schedule of its own)",
  )


def forced() -> Any:
  """What the config state asks for (None: nothing): a ``CheckParams``, a
  ``Session``, or a schedule string (``"random:0"`` for ``"1"``...), which
  gives each call a schedule of its own."""
  if ENV not in os.environ and config_state.cache_info().currsize == 0:
    return None
  value = config_state().value
  if value is None or value == "":
    return None
  if isinstance(value, str):
    return "random:0" if value in ("1", "true", "random") else value
  return value
