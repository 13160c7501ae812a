"""The ring kernels' one move, shared by the lowering tests (imported by
module name: tests/ is on pytest's pythonpath)."""

import jax
from jax.experimental.pallas import tpu as pltpu


def copy_to_right(src, dst, send, recv, size, axis="x"):
  """Starts a remote DMA of ``src`` into ``dst`` on the next device of the
  ring ``axis`` (``size`` devices, the last sends to the first).

  Returns the started copy, for the caller's waits: ``.wait()``, or
  ``.wait_send()`` / ``.wait_recv()`` one by one.
  """
  right = jax.lax.rem(jax.lax.axis_index(axis) + 1, size)
  copy = pltpu.make_async_remote_copy(
    src, dst, send, recv, device_id={axis: right}
  )
  copy.start()
  return copy
