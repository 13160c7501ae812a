"""The CPU fallback's host callbacks: numpy in, typed errors out.

Trap 3: simulator callbacks hang with many simulated devices.

``jax.io_callback`` places its numpy arguments on a CPU device
(``device_put``) before calling the Python function. The Pallas simulators
call back from every device thread at once; with 4+ simulated devices and
buffers past a few KB, converting those device arrays back to numpy needs
the very CPU threads that are blocked in callbacks, and the launch hangs.
The simulators only want numpy, so their callbacks (and ours) get the
numpy arguments as XLA hands them over. Every other callback is untouched.

Errors: a callback of a simulator that fails ends its device thread's part
of the launch (``watchdog.failed``), and raises the launch's own error
(``errors.LaunchError``) rather than the simulator's wrapping of it, from
here: XLA quotes the traceback, which is then a few lines long.
"""

import functools
from contextlib import nullcontext

import numpy as np

from mpmd import _patches, targets
from mpmd._jax import tree_util
from mpmd._lowering import errors, watchdog

_SIMULATOR_MODULES = (
  "jax._src.pallas.mosaic.interpret.",
  "jax._src.pallas.mosaic_gpu.interpret.",
)
_OUR_MODULES = ("mpmd._lowering.", "mpmd.kernels.")


def _module(flat_callback) -> str:
  fn = _patches.callback_function(flat_callback)
  while isinstance(fn, functools.partial):
    fn = fn.func
  return getattr(fn, "__module__", "") or ""


def _call(callback, args):
  """Runs an ``_OUR_MODULES`` or ``_SIMULATOR_MODULES`` callback."""
  simulator = _module(callback).startswith(_SIMULATOR_MODULES)
  running = watchdog.callback_running() if simulator else nullcontext()
  try:
    # The TPU simulator asks for the TPU's tiling at run time too
    # (buffer_bounds="padded" allocates padded buffers).
    with running, targets.answering():
      return tree_util.tree_map(np.asarray, callback(*args))
  except Exception as e:
    failure = watchdog.failed(e) if simulator else None
    if failure is None and isinstance(e, errors.LaunchError):
      failure = e
    if failure is None:
      raise
    # A copy: several device threads may raise one launch's failure at once.
    raise errors.remember(type(failure)(*failure.args)) from None


def _choose(flat_callback):
  """``run(args)`` for a simulator's callback or ours, else None."""
  if _module(flat_callback).startswith(_SIMULATOR_MODULES + _OUR_MODULES):
    return functools.partial(_call, flat_callback)
  return None


def install() -> None:
  """Routes the simulators' callbacks and ours through ``_call`` (on first
  use of a simulator); every other ``io_callback`` runs as JAX wrote it.
  A failed launch's error ends with its call, a computation's first call
  included (``_patches.end_launch_errors_with_their_call``)."""
  _patches.route_io_callbacks(_choose)
  _patches.end_launch_errors_with_their_call(errors.reports_launch)
