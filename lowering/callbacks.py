"""Trap 3: simulator callbacks hang with many simulated devices.

``jax.io_callback`` places its numpy arguments on a CPU device
(``device_put``) before calling the Python function. The Pallas simulators
call back from every device thread at once; with 4+ simulated devices and
buffers past a few KB, converting those device arrays back to numpy needs
the very CPU threads that are blocked in callbacks, and the launch hangs.
The simulators only want numpy, so their callbacks (and ours) get the
numpy arguments as XLA hands them over. Every other callback is untouched.
"""

import functools

import numpy as np

from mpmd._jax import callback, tree_util

_SIMULATOR_MODULES = (
  "jax._src.pallas.mosaic.interpret.",
  "jax._src.pallas.mosaic_gpu.interpret.",
  "mpmd.lowering.",
)


def _is_simulator(flat_callback) -> bool:
  fn = getattr(flat_callback, "callback_func", None)
  while isinstance(fn, functools.partial):
    fn = fn.func
  module = getattr(fn, "__module__", "") or ""
  return module.startswith(_SIMULATOR_MODULES)


@functools.cache
def install() -> None:
  original = callback.io_callback_impl

  @functools.wraps(original)
  def io_callback_impl(*args, callback, **params):
    if _is_simulator(callback):
      return tree_util.tree_map(np.asarray, callback(*args))
    return original(*args, callback=callback, **params)

  callback.io_callback_impl = io_callback_impl
