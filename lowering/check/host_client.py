"""Compiling a kernel's pure segments for a CPU client of our own.

The checking executor runs inside a host callback of every device of a
multi-device program. On jax 0.10 the process's CPU client runs those
callbacks on the thread pool that runs its computations: while every
device's callback holds a thread of it, a computation dispatched from inside
one of them may never get one (seen at 4 devices and more). A client of our
own, executing on the caller's thread, has no such pool.
"""

import functools

import jax
import numpy as np

from mpmd import _jax
from mpmd._jax import core, mlir


@functools.cache
def _client():
  """One CPU device, executing on the caller's thread."""
  _, xla_client = _jax.xla_client_parts()
  return xla_client.make_cpu_client(asynchronous=False, num_devices=1)


def compile_on_host(fn, avals):
  """``fn`` (numpy arrays in, a list of them out) compiled for our own CPU
  client: safe to call from any host callback."""
  compiler, xla_client = _jax.xla_client_parts()
  client = _client()
  device = client.local_devices()[0]
  lowered = jax.jit(fn, keep_unused=True).trace(*avals)
  module = lowered.lower(lowering_platforms=("cpu",)).compiler_ir("stablehlo")
  assert module is not None  # None only for a dialect it does not know
  executable = client.compile_and_load(
    mlir.module_to_bytecode(module),
    xla_client.DeviceList((device,)),
    compiler.get_compile_options(num_replicas=1, num_partitions=1),
  )

  # Inputs go onto the device as jax.device_put would put them (a copy,
  # of the dtype the segment was traced for), by the call beneath it:
  # device_put's own dispatch cost three times the copy.
  sharding = jax.sharding.SingleDeviceSharding(device)
  shaped = [core.ShapedArray(a.shape, a.dtype) for a in avals]
  put = xla_client.batched_device_put

  def run(*values):
    inputs = [
      put(a, sharding, [np.asarray(v, a.dtype)], [device], True, True)
      for a, v in zip(shaped, values, strict=True)
    ]
    outs = executable.execute_sharded(inputs)
    return [
      np.asarray(o[0]) for o in outs.disassemble_into_single_device_arrays()
    ]

  return run
