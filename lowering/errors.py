"""The CPU fallback's errors, and how they reach the caller typed.

A kernel fails inside a host callback of an XLA execution. XLA keeps
only the text of a callback's exception (jaxlib 0.10.2 and 0.12 alike: no
cause, no notes) and hands the caller its own error quoting it: a
``JaxRuntimeError`` from JAX's Python dispatch (a computation's first
call), a ``ValueError`` from its C++ dispatch (later calls). So every
error we raise there is kept under a key of its own, and carries the key
(``[mpmd launch error 7]``): ``typed_errors`` (and an eager ``mpmd_map``
call, which uses it) finds the key in whatever XLA raised and raises the
kept error again as itself, its message as written, whichever way JAX
dispatched the call and whatever the message says. ``except
mpmd.DeadlockError`` matches. Each is a ``JaxRuntimeError`` too, so code
that catches JAX's runtime errors keeps working.
"""

import collections
import contextlib
import itertools
import re
import threading

import jax

from mpmd.errors import (
  DeadlockError as DeadlockError,
)
from mpmd.errors import (
  DebugCheckError as DebugCheckError,
)
from mpmd.errors import (
  LaunchError as LaunchError,
)
from mpmd.errors import (
  LeftoverError as LeftoverError,
)
from mpmd.errors import (
  NondeterminismError as NondeterminismError,
)
from mpmd.errors import (
  OutOfBoundsError as OutOfBoundsError,
)
from mpmd.errors import (
  RaceError as RaceError,
)
from mpmd.errors import (
  StaticOutOfBoundsError as StaticOutOfBoundsError,
)
from mpmd.errors import (
  UninitializedError as UninitializedError,
)

_KEPT = 256  # launch errors kept for typed_errors, the newest
_kept: collections.OrderedDict[int, LaunchError] = collections.OrderedDict()
_keys = itertools.count(1)
_lock = threading.Lock()
_KEY = re.compile(r" \[mpmd launch error (\d+)\]")


def remember(error: LaunchError) -> LaunchError:
  """Keeps ``error`` for ``typed_errors`` under a new key; returns a copy
  that carries the key, to raise into XLA."""
  message = _KEY.sub("", str(error.args[0])) if error.args else ""
  with _lock:
    key = next(_keys)
    _kept[key] = _copy(error, message)
    while len(_kept) > _KEPT:
      _kept.popitem(last=False)
  return _copy(error, f"{message} [mpmd launch error {key}]")


def _copy(error: LaunchError, *args) -> LaunchError:
  """A new error of the same type and attributes (``schedule``...)."""
  copy = type(error)(*args)
  for name, value in vars(error).items():
    # What the constructor set (the message, for JAX's runtime errors)
    # stays the copy's own.
    if name not in vars(copy):
      setattr(copy, name, value)
  return copy


def _typed(error: BaseException) -> LaunchError | None:
  """The launch error whose key ``error`` (XLA's report of it, or the
  error itself) carries, if any."""
  found = _KEY.findall(str(error))
  with _lock:
    known = _kept.get(int(found[-1])) if found else None
  if known is not None:
    return _copy(known, *known.args)
  return error if isinstance(error, LaunchError) else None


def launch_error(error: BaseException) -> LaunchError | None:
  """The typed launch error that ``error`` is or (XLA's report of it)
  carries, None if it is not a failed launch of ours."""
  return _typed(error)


def reports_launch(error: BaseException) -> bool:
  """Whether ``error`` is (XLA's report of) a failed launch of ours."""
  return _typed(error) is not None


class typed_errors(contextlib.ContextDecorator):  # noqa: N801 (reads as a function)
  """Re-raises a failed launch's error as its own type.

  A kernel fails inside XLA, which reports a ``JaxRuntimeError`` carrying
  the error's text. Around a call (or as a decorator), this raises the
  original ``mpmd.DeadlockError``, ``mpmd.RaceError`` or
  ``mpmd.OutOfBoundsError`` instead, with a short message. Eager
  ``mpmd_map`` calls do it by themselves; under ``jax.jit`` the error
  surfaces where the results are waited for, so wrap that. The typed
  error is raised as the block is left: catch it outside the block
  (``try: with mpmd.typed_errors(): ... except mpmd.RaceError:``), or
  use it as a decorator on the function that calls the kernel.

  Example (a DMA window computed at run time, past its buffer)::

    >>> def oob(start_hbm, x_hbm, o_hbm, start_smem):
    ...   pltpu.sync_copy(start_hbm, start_smem)
    ...   pltpu.sync_copy(x_hbm.at[pl.ds(start_smem[0], 8)], o_hbm)
    >>> f = jax.jit(mpmd.mpmd_map(
    ...     [(mpmd.tensorcore_mesh("core", num_cores=1), oob)],
    ...     jax.ShapeDtypeStruct((8, 128), jnp.float32),
    ...     scratch_types=[pltpu.SMEM((1,), jnp.int32)]))
    >>> with mpmd.typed_errors():
    ...   _ = jax.block_until_ready(
    ...       f(jnp.array([12], jnp.int32), jnp.zeros((16, 128))))
    Traceback (most recent call last):
    OutOfBoundsError: ...
  """

  def __enter__(self):
    return self

  def __exit__(self, kind, error, traceback):
    typed = None if error is None else _typed(error)
    if typed is None or typed is error:
      return False
    _forget_reported()
    raise typed.with_traceback(None) from None


def _forget_reported() -> None:
  """Drops JAX's copies of launch errors raised here already.

  JAX keeps each device's last failed execution for ``effects_barrier``
  (which it also runs at exit); reported once here, they need not be again.
  """
  try:
    jax.effects_barrier()
  except Exception as e:  # noqa: BLE001 (sorted below)
    others = [x for x in getattr(e, "exceptions", (e,)) if _typed(x) is None]
    if others:
      raise others[0] from None
