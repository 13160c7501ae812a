"""A ring all-reduce written by hand: remote DMAs around a ring of devices.

Each of the ``D`` devices of a ``jax.shard_map`` holds ``x`` of shape
``(D * ROWS, COLS)``, split into ``D`` chunks. The kernel sums ``x`` over
the devices, as ``lax.psum`` does, in two phases of ``D - 1`` steps each,
every step a remote DMA of one chunk to the right-hand neighbour:

* reduce-scatter: at step ``s`` device ``d`` sends its partial sum of chunk
  ``d - s`` and adds the chunk ``d - s - 1`` that its left neighbour sent;
  after ``D - 1`` steps it holds the full sum of chunk ``d + 1``;
* all-gather: at step ``s`` it passes on the full chunk ``d + 1 - s`` and
  keeps the one ``d - s`` that arrives.

What the kernel shows:

* ``pltpu.make_async_remote_copy`` to ``device_id={"ring": right}``: device
  ids are MESH coordinates, a dict from mesh axis to index. That is what
  replaces the deprecated ``device_id_type=`` (``DeviceIdType.MESH`` was its
  default; ``DeviceIdType.LOGICAL`` flat ids are written as the coordinates
  of the device along each named axis instead);
* semaphore arrays, ``pltpu.SemaphoreType.DMA((steps,))``: one (send,
  receive) semaphore pair and one receive slot per ring step, so that no
  step waits on, or overwrites, another step's transfer;
* the barrier handshake: each device signals both neighbours on
  ``pltpu.get_barrier_semaphore()`` and waits for both, so that no remote
  DMA lands in a device that has not entered the kernel yet (on TPU the
  barrier needs a ``collective_id`` in the compiler params).

On CPU the CPU fallback runs it (remote DMAs between the simulated devices);
``MPMD_CHECK=random:0 python examples/ring_all_reduce.py`` runs it on the
checking executor, which reports races, deadlocks and leftover semaphores.

Run: ``python examples/ring_all_reduce.py`` (CPU, 4 devices).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

NUM_DEVICES = 4
jax.config.update("jax_num_cpu_devices", NUM_DEVICES)

import functools  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mpmd  # noqa: E402

AXIS = "ring"
ROWS, COLS = 8, 128  # one chunk: a (8, 128) f32 tile


def ring_all_reduce_kernel(
  x_hbm, o_hbm, acc, recv, send_sems, recv_sems, *, num_devices: int
):
  """``o_hbm = sum over the ring of x_hbm``, chunk by chunk.

  Args:
    x_hbm: ``(D, ROWS, COLS)`` this device's operand, in HBM.
    o_hbm: ``(D, ROWS, COLS)`` the sum over all devices.
    acc: ``(D, ROWS, COLS)`` VMEM: this device's partial sums.
    recv: ``(2 * (D - 1), ROWS, COLS)`` VMEM: one slot per ring step, that
      the left neighbour's DMA of that step lands in.
    send_sems, recv_sems: ``DMA((2 * (D - 1),))``: one pair per ring step.
    num_devices: ``D``, the ring's size.
  """
  d = num_devices
  me = lax.axis_index(AXIS)
  right = lax.rem(me + 1, d)
  left = lax.rem(me + d - 1, d)

  # Handshake: both neighbours are in the kernel before any DMA to them.
  barrier = pltpu.get_barrier_semaphore()
  for neighbour in (left, right):
    pl.semaphore_signal(barrier, 1, device_id={AXIS: neighbour})
  pl.semaphore_wait(barrier, 2)

  pltpu.sync_copy(x_hbm, acc)

  def chunk(offset):
    return lax.rem(me + offset + 2 * d, d)

  def step(s, send_chunk, recv_chunk, combine):
    """Sends ``acc[send_chunk]`` to the right neighbour's slot ``s``;
    combines what the left neighbour sent into ``acc[recv_chunk]``."""
    copy = pltpu.make_async_remote_copy(
      src_ref=acc.at[send_chunk],
      dst_ref=recv.at[s],
      send_sem=send_sems.at[s],
      recv_sem=recv_sems.at[s],
      device_id={AXIS: right},
    )
    copy.start()
    copy.wait_recv()  # the left neighbour's DMA of this step has landed
    acc[recv_chunk] = combine(acc[recv_chunk], recv[s])
    copy.wait_send()  # acc[send_chunk] may be read by the DMA until here

  # Static Python loops: every step has its own slot and semaphores.
  for s in range(d - 1):  # reduce-scatter
    step(s, chunk(-s), chunk(-s - 1), lambda mine, theirs: mine + theirs)
  for s in range(d - 1):  # all-gather
    step(d - 1 + s, chunk(1 - s), chunk(-s), lambda mine, theirs: theirs)

  pltpu.sync_copy(acc, o_hbm)


def ring_all_reduce(x: jax.Array) -> jax.Array:
  """``lax.psum(x, AXIS)`` for ``x`` of ``(D, ROWS, COLS)``, inside a
  ``jax.shard_map`` over the ring's axis."""
  d = lax.axis_size(AXIS)
  steps = 2 * (d - 1)
  chunk = (ROWS, COLS)
  return mpmd.mpmd_map(
    [
      (
        mpmd.tensorcore_mesh("core", num_cores=1),
        functools.partial(ring_all_reduce_kernel, num_devices=d),
      )
    ],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[
      pltpu.VMEM((d, *chunk), x.dtype),
      pltpu.VMEM((steps, *chunk), x.dtype),
      pltpu.SemaphoreType.DMA((steps,)),
      pltpu.SemaphoreType.DMA((steps,)),
    ],
    compiler_params=pltpu.CompilerParams(collective_id=0),
    name="ring_all_reduce",
  )(x)


def main() -> None:
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))
  spec = P(AXIS)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((NUM_DEVICES * NUM_DEVICES, ROWS, COLS))
  x = jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, spec))

  def on_ring(f):
    return jax.jit(
      jax.shard_map(
        f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
      )
    )

  got = on_ring(ring_all_reduce)(x)
  want = on_ring(lambda v: lax.psum(v, AXIS))(x)
  # The ring adds in another order than psum: equal up to f32 rounding.
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
  print(
    f"ring all-reduce over {NUM_DEVICES} devices matches lax.psum: OK "
    f"(max abs difference {float(jnp.max(jnp.abs(got - want))):.2e})"
  )
  text = (
    on_ring(ring_all_reduce).trace(x).lower(lowering_platforms=("tpu",))
  ).as_text()
  print(
    "lowered for TPU (Mosaic):",
    "OK" if "tpu_custom_call" in text else "FAIL",
  )


if __name__ == "__main__":
  main()
