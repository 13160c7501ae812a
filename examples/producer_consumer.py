"""Producer / consumer on two TPU meshes in one kernel launch.

One program (the producer mesh) stages ``2 * x`` into shared HBM scratch and
signals every program of the consumer mesh; each consumer waits, then adds
its index and writes its slice of the output. The consumer mesh is listed
first: the launch only works if both meshes really run concurrently.

    python examples/producer_consumer.py
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd import registry

NUM_CONSUMERS = 2
producer = mpmd.tensorcore_mesh("producer", num_cores=1)
consumers = mpmd.tensorcore_mesh("consumer", num_cores=NUM_CONSUMERS)


def produce(x_hbm, o_hbm, staged, ready, buf):
  del o_hbm
  pltpu.sync_copy(x_hbm, buf)
  buf[...] = buf[...] * 2.0
  pltpu.sync_copy(buf, staged)  # shared HBM scratch: every program sees it
  for c in range(NUM_CONSUMERS):
    # Programs of another mesh are named by that mesh's axes.
    pl.semaphore_signal(ready, 1, device_id={"consumer": c})


def consume(x_hbm, o_hbm, staged, ready, buf):
  del x_hbm
  c = jax.lax.axis_index("consumer")
  pl.semaphore_wait(ready, 1)
  pltpu.sync_copy(staged, buf)
  buf[...] = buf[...] + c.astype(jnp.float32)
  pltpu.sync_copy(buf, o_hbm.at[c])


def producer_consumer(x: jax.Array) -> jax.Array:
  """``out[c] = 2 * x + c`` for each consumer ``c``; x is f32 ``(8, 128)``."""
  return mpmd.mpmd_map(
    [(consumers, consume), (producer, produce)],
    jax.ShapeDtypeStruct((NUM_CONSUMERS, *x.shape), x.dtype),
    scratch_types=[
      pltpu.HBM(x.shape, x.dtype),  # shared by all programs
      pltpu.SemaphoreType.REGULAR @ consumers,  # the consumers' semaphore
      pltpu.VMEM(x.shape, x.dtype) @ consumers,
    ],
  )(x)


def reference(x):
  return 2.0 * x[None] + jnp.arange(NUM_CONSUMERS, dtype=x.dtype)[:, None, None]


def demo() -> registry.Demo:
  """For ``mpmd lower examples/producer_consumer.py --platform tpu``."""
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  return registry.Demo(
    producer_consumer, (x,), ("tpu", "cpu"), reference=reference
  )


def main():
  run = demo()
  f = jax.jit(run.fn)
  np.testing.assert_allclose(f(*run.args), run.reference(*run.args))
  print("producer/consumer on the CPU fallback: OK")
  text = f.trace(*run.args).lower(lowering_platforms=("tpu",)).as_text()
  print("TPU lowering:", "OK" if "tpu_custom_call" in text else "FAIL")


if __name__ == "__main__":
  main()
