"""Settings of the CPU fallback's simulators (Pallas' threaded TPU and
Mosaic GPU simulators, run by ``interpret=pltpu.InterpretParams()`` or
``mpmd.GPUInterpretParams()``): how long a simulated program may wait, and
what a detected race does.

Both are JAX config options, defined when first set (``import mpmd`` adds
nothing to JAX's config), in the jit key: a launch takes the values in force
where it is traced, and their context managers act on their thread only.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Generator

import jax

from mpmd import _jax

DEFAULT_DEADLOCK_TIMEOUT_S = 10.0


def _check_timeout(seconds) -> None:
  if not isinstance(seconds, (int, float)) or not seconds > 0:
    raise ValueError(
      f"deadlock_timeout: expected 'seconds' > 0, got {seconds!r}"
    )


def jit_keyed_state(name: str, default, help: str, validator=None):
  """A JAX config state of ours, in the jit key and the trace context: a
  launch takes the value in force where it is traced (a change retraces)."""
  return _jax.config.string_or_object_state(
    name=name,
    default=default,
    help=f"jax-mpmd: {help}",
    validator=validator,
    include_in_jit_key=True,
    include_in_trace_context=True,
  )


def _defined(state_fn) -> bool:
  """Whether the cached ``state_fn`` has defined its config state yet."""
  return state_fn.cache_info().currsize > 0


@functools.cache
def _timeout_state():
  """The ``mpmd_deadlock_timeout`` JAX config state, defined when first set
  (``import mpmd`` adds nothing to JAX's config). In the jit key: a launch
  takes the timeout in force where it is lowered."""
  return jit_keyed_state(
    "mpmd_deadlock_timeout",
    DEFAULT_DEADLOCK_TIMEOUT_S,
    "seconds a simulated program may wait while nothing else of its launch "
    "moves",
    _check_timeout,
  )


def set_deadlock_timeout(seconds: float) -> None:
  """Sets how long a simulated program may wait before the launch fails.

  A JAX config option (``mpmd_deadlock_timeout``): a launch takes the
  value in force where it is traced, and a change recompiles it.

  Args:
    seconds: a positive number (default 10): how long a program may wait
      while no simulated operation of its launch completes.

  Example (a simulated program waiting longer raises
  ``mpmd.DeadlockError``)::

    >>> mpmd.set_deadlock_timeout(5.0)
    >>> mpmd.get_deadlock_timeout()
    5.0
    >>> mpmd.set_deadlock_timeout(10.0)  # back to the default
  """
  _check_timeout(seconds)
  _timeout_state()  # defined before it is set
  jax.config.update("mpmd_deadlock_timeout", float(seconds))


def get_deadlock_timeout() -> float:
  """The deadlock timeout now in force (in this thread), in seconds.

  Example::

    >>> mpmd.get_deadlock_timeout()  # the default
    10.0
  """
  # Read without defining: a read (every simulator launch does one) must
  # not add to JAX's config, or test suites that compare the config before
  # and after each test (jtu.JaxTestCase) fail the first launch's test.
  if not _defined(_timeout_state):
    return DEFAULT_DEADLOCK_TIMEOUT_S
  return float(_timeout_state().value)


@contextlib.contextmanager
def deadlock_timeout(seconds: float) -> Generator[None]:
  """Context manager form of ``set_deadlock_timeout``, for this thread
  only (as JAX's own config context managers).

  Example::

    >>> def hang(o_hbm, sem):
    ...   pl.semaphore_wait(sem, 1)  # nobody signals
    >>> f = mpmd.mpmd_map(
    ...     [(mpmd.tensorcore_mesh("core", num_cores=1), hang)],
    ...     jax.ShapeDtypeStruct((8, 128), jnp.float32),
    ...     scratch_types=[pltpu.SemaphoreType.REGULAR(())],
    ...     interpret=pltpu.InterpretParams())
    >>> with mpmd.deadlock_timeout(0.5):
    ...   f()
    Traceback (most recent call last):
    DeadlockError: mpmd_map deadlock: a simulated program waited more ...
  """
  _check_timeout(seconds)
  with _timeout_state()(float(seconds)):
    yield


@dataclasses.dataclass(frozen=True)
class Races:
  """The race detector's verdict on a simulator launch (``get_races``)."""

  races_found: bool


_RACE_POLICIES = ("raise", "record")
_DEFAULT_RACE_POLICY = "raise"
_races: list[Races] = []


def _check_policy(policy) -> None:
  if policy not in _RACE_POLICIES:
    raise ValueError(
      f"set_race_policy: expected 'policy' in {_RACE_POLICIES}, got {policy!r}"
    )


@functools.cache
def _policy_state():
  """The ``mpmd_race_policy`` JAX config state, defined when first set; in
  the jit key (a launch takes the policy in force where it is lowered)."""
  return jit_keyed_state(
    "mpmd_race_policy",
    _DEFAULT_RACE_POLICY,
    "what a simulator launch with detect_races=True does on a race: "
    "'raise' (mpmd.RaceError) or 'record' (mpmd.get_races())",
    _check_policy,
  )


def set_race_policy(policy: str) -> None:
  """What a simulator launch with ``detect_races=True`` does on a race.

  A JAX config option (``mpmd_race_policy``): a launch takes the policy in
  force where it is traced.

  Args:
    policy: "raise" (default): the launch raises ``mpmd.RaceError``.
      "record": it only records the race, for ``mpmd.get_races()`` (as
      upstream's simulators do on jax 0.10.2 and 0.11, and with
      ``on_race="warn"`` on 0.12, which we also honour).

  Example::

    >>> mpmd.set_race_policy("record")
    >>> mpmd.get_race_policy()
    'record'
    >>> mpmd.set_race_policy("raise")  # back to the default
  """
  _check_policy(policy)
  _policy_state()  # defined before it is set
  jax.config.update("mpmd_race_policy", policy)


def get_race_policy() -> str:
  """The race policy now in force (in this thread): "raise" or "record".

  Example::

    >>> mpmd.get_race_policy()  # the default
    'raise'
  """
  if not _defined(_policy_state):  # read without defining, as above
    return _DEFAULT_RACE_POLICY
  return _policy_state().value


@contextlib.contextmanager
def race_policy(policy: str) -> Generator[None]:
  """Context manager form of ``set_race_policy``, for this thread only.

  Example (two programs write one buffer, nothing orders them)::

    >>> def racy(o_hbm):
    ...   o_hbm[...] = jnp.full((8, 128), jax.lax.axis_index("wg"), jnp.float32)
    >>> f = mpmd.mpmd_map(
    ...     [(plgpu.Mesh(num_threads=2, thread_name="wg"), racy)],
    ...     jax.ShapeDtypeStruct((8, 128), jnp.float32),
    ...     interpret=mpmd.GPUInterpretParams(detect_races=True))
    >>> import contextlib, io  # jax 0.10.2's detector also prints the race
    >>> with mpmd.race_policy("record"):
    ...   with contextlib.redirect_stdout(io.StringIO()):
    ...     _ = jax.block_until_ready(f())
    >>> mpmd.get_races()
    Races(races_found=True)
  """
  _check_policy(policy)
  with _policy_state()(policy):
    yield


def record_races(found: bool) -> None:
  """The verdict of a simulator launch that ran the race detector."""
  _races[:] = [Races(found)]


def get_races() -> Races:
  """The race detector's verdict on the last simulator launch that ran it.

  Returns:
    ``mpmd.Races(races_found: bool)``, like upstream's race detection state.

  Raises:
    ValueError: no launch with ``detect_races=True`` has finished yet.

  Example (one program per row block: no race)::

    >>> def rows(o_hbm):
    ...   block = pl.ds(jax.lax.axis_index("wg") * 4, 4)
    ...   o_hbm[block, :] = jnp.ones((4, 128), jnp.float32)
    >>> f = mpmd.mpmd_map(
    ...     [(plgpu.Mesh(num_threads=2, thread_name="wg"), rows)],
    ...     jax.ShapeDtypeStruct((8, 128), jnp.float32),
    ...     interpret=mpmd.GPUInterpretParams(detect_races=True))
    >>> _ = jax.block_until_ready(f())
    >>> mpmd.get_races().races_found
    False
  """
  if not _races:
    raise ValueError(
      "get_races: no simulator launch with detect_races=True has finished "
      "yet (pass interpret=pltpu.InterpretParams(detect_races=True) or "
      "mpmd.GPUInterpretParams(detect_races=True))"
    )
  return _races[0]
