"""A device id or a semaphore index past its range fails on the CPU paths,
as it does on hardware (a fault, or a wait that never ends), with an
``mpmd.OutOfBoundsError`` that names the kernel, the device, the Ref or the
axis, and the line of the operation. On the lockstep path a remote DMA or
signal to a device outside the mesh used to reach nobody (no error, wrong
results), and an index past an array of semaphores counted on a clamped
one (a ``LeftoverError`` naming the wrong cause). Indices an interval
analysis proves in range cost nothing at run time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd._lowering import bounds

NUM = 4
ROWS, COLS = 8, 128
CORE = mpmd.tensorcore_mesh("core", num_cores=1)
BLOCK = jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32)
DMA_SEM = pltpu.SemaphoreType.DMA


def _on_ring(kernel, scratch_types):
  mesh = jax.make_mesh((NUM,), ("x",), devices=jax.devices()[:NUM])
  per_device = mpmd.mpmd_map(
    [(CORE, kernel)], BLOCK, scratch_types=scratch_types
  )
  f = jax.jit(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False
    )
  )
  x = jnp.arange(NUM * ROWS * COLS, dtype=jnp.float32).reshape(-1, COLS)
  return f, jax.device_put(x, NamedSharding(mesh, P("x")))


def _fails(f, x, *parts: str) -> None:
  with pytest.raises(mpmd.OutOfBoundsError) as info, mpmd.typed_errors():
    jax.block_until_ready(f(x))
  for part in parts:
    assert part in str(info.value), (part, str(info.value))


def _line_of(text: str) -> int:
  """The line of this file that holds ``text``."""
  with open(__file__) as source:
    return next(n for n, line in enumerate(source, 1) if text in line)


def test_a_remote_dma_past_the_mesh():
  def shift(x_hbm, o_hbm, buf, send, recv):
    me = lax.axis_index("x")
    copy = pltpu.make_async_remote_copy(
      x_hbm,
      buf,
      send,
      recv,
      device_id={"x": me + 1},  # no wrap: 3 -> 4
    )
    copy.start()
    copy.wait()
    pltpu.sync_copy(buf, o_hbm)

  f, x = _on_ring(
    shift, [pltpu.VMEM((ROWS, COLS), jnp.float32), DMA_SEM, DMA_SEM]
  )
  _fails(
    f,
    x,
    "kernel shift at ",
    "device (x=3)",
    f"a DMA at {__file__}:{_line_of('copy.start()')}",
    "names device_id 'x'=4, outside the mesh (its axis 'x' has size 4)",
  )


def test_a_remote_signal_past_the_mesh():
  def to_the_left(x_hbm, o_hbm, ready):
    me = lax.axis_index("x")
    pl.semaphore_signal(ready, 1, device_id={"x": me - 1})  # 0 -> -1
    pl.semaphore_wait(ready, 1)
    pltpu.sync_copy(x_hbm, o_hbm)

  f, x = _on_ring(to_the_left, [pltpu.SemaphoreType.REGULAR])
  _fails(
    f,
    x,
    "device (x=0)",
    f"a semaphore_signal at {__file__}:{_line_of('me - 1})  # 0 -> -1')}",
    "names device_id 'x'=-1, outside the mesh (its axis 'x' has size 4)",
  )


def test_an_index_past_an_array_of_semaphores():
  # Each device receives into slot (its left neighbour + 1): device 3
  # sends with receive semaphore 4 of 4.
  def slots(x_hbm, o_hbm, buf, sends, recvs):
    me = lax.axis_index("x")
    right = lax.rem(me + 1, NUM)
    slot = me + 1  # should wrap as ``right`` does
    copy = pltpu.make_async_remote_copy(
      x_hbm, buf, sends.at[slot], recvs.at[slot], device_id={"x": right}
    )
    copy.start()  # slots
    copy.wait()
    pltpu.sync_copy(buf, o_hbm)

  scratch = [pltpu.VMEM((ROWS, COLS), jnp.float32), DMA_SEM((NUM,))]
  f, x = _on_ring(slots, [*scratch, DMA_SEM((NUM,))])
  _fails(
    f,
    x,
    "device (x=3)",
    "a DMA's receive semaphore window .at[4] is out of bounds of 'recvs'",
    f"(at {__file__}:{_line_of('copy.start()  # slots')}",
  )


def _signals(core_of, num_cores=2):
  """Each program signals and takes semaphore ``core_of(core, i)`` of an
  array of ``num_cores`` (``i``: a value read when the kernel runs)."""

  def kernel(i_hbm, o_hbm, i_smem, sems):
    pltpu.sync_copy(i_hbm, i_smem)
    sem = sems.at[core_of(lax.axis_index("core"), i_smem[0])]
    pl.semaphore_signal(sem, 1)
    pl.semaphore_wait(sem, 1)

  return jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=num_cores), kernel)],
      jax.ShapeDtypeStruct((1,), jnp.int32),
      scratch_types=[
        pltpu.SMEM((1,), jnp.int32),
        pltpu.SemaphoreType.REGULAR((num_cores,)),
      ],
    )
  )


def test_fast_path_signal_past_an_array_of_semaphores():
  f = _signals(lambda core, i: core + i)  # i = 1: core 1 takes semaphore 2
  with pytest.raises(mpmd.OutOfBoundsError) as info, mpmd.typed_errors():
    jax.block_until_ready(f(jnp.ones((1,), jnp.int32)))
  message = str(info.value)
  assert "mesh 0 program 1 (core=1)" in message, message
  assert (
    "a semaphore_signal's semaphore window .at[2] is out of bounds of 'sems'"
    in message
  ), message
  jax.block_until_ready(f(jnp.zeros((1,), jnp.int32)))  # and in range, runs


@pytest.mark.parametrize("operation", ["signal", "wait", "read"])
def test_a_literal_semaphore_index_past_its_array_fails_when_traced(operation):
  # Hardware would fault; found before anything runs or lowers.
  def kernel(x_hbm, o_hbm, sems):
    if operation == "signal":
      pl.semaphore_signal(sems.at[2], 1)
    elif operation == "wait":
      pl.semaphore_wait(sems.at[2], 1)
    else:
      pl.semaphore_read(sems.at[2])
    pltpu.sync_copy(x_hbm, o_hbm)

  f = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR((2,))],
  )
  x = jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32)
  with pytest.raises(
    mpmd.OutOfBoundsError,  # and a ValueError: raised when traced
    match=rf"a semaphore_{operation}'s semaphore window \.at\[2\] is out "
    r"of bounds of 'sems' \(scratch 0, semaphore\[2\]\) \(at .*; "
    r"hardware would fault\)",
  ) as info:
    jax.jit(f).trace(x)
  assert isinstance(info.value, ValueError)


@pytest.fixture
def added(monkeypatch):
  """The messages of the run-time checks added while a launch is lowered."""
  messages = []
  check = bounds.Checks._check

  def recorded(self, ok, message, args):
    messages.append(message)
    check(self, ok, message, args)

  monkeypatch.setattr(bounds.Checks, "_check", recorded)
  return messages


def test_proven_semaphore_indices_are_not_checked(added):
  """A core's own semaphore (``sems.at[core]``) is proven in range: no
  run-time check is added for it; one read from memory is checked."""
  i = jnp.zeros((1,), jnp.int32)
  _signals(lambda core, i: core).lower(i)
  assert not any("semaphore window" in m for m in added), added
  _signals(lambda core, i: core + i).lower(i)
  assert any("semaphore_signal's semaphore window" in m for m in added)


def test_a_ring_neighbour_is_proven_in_the_mesh(added):
  """``lax.rem(me + 1, n)``: no run-time check of the device id."""

  def ring(x_hbm, o_hbm, buf, send, recv):
    right = lax.rem(lax.axis_index("x") + 1, NUM)
    copy = pltpu.make_async_remote_copy(
      x_hbm, buf, send, recv, device_id={"x": right}
    )
    copy.start()
    copy.wait()
    pltpu.sync_copy(buf, o_hbm)

  scratch = [pltpu.VMEM((ROWS, COLS), jnp.float32), DMA_SEM, DMA_SEM]
  f, x = _on_ring(ring, scratch)
  f.lower(x)
  assert not any("names device_id" in m for m in added), added
  out = np.asarray(f(x)).reshape(NUM, ROWS, COLS)
  blocks = np.asarray(x).reshape(NUM, ROWS, COLS)
  np.testing.assert_array_equal(out, np.roll(blocks, 1, axis=0))


def test_a_fixed_flat_device_id_past_the_mesh():
  """A plain-integer device_id (not a dict) fixed past the mesh: read as
  the coordinate along the shard_map's one axis, as a dict is, it fails
  when the kernel is traced."""

  def send_past(x_hbm, o_hbm, buf, send, recv):
    copy = pltpu.make_async_remote_copy(x_hbm, buf, send, recv, device_id=NUM)
    copy.start()
    copy.wait()
    pltpu.sync_copy(buf, o_hbm)

  f, x = _on_ring(
    send_past, [pltpu.VMEM((ROWS, COLS), jnp.float32), DMA_SEM, DMA_SEM]
  )
  with pytest.raises(mpmd.OutOfBoundsError) as info:
    f.trace(x)
  assert isinstance(info.value, ValueError)  # (a StaticOutOfBoundsError)
  assert "kernel send_past at " in str(info.value)
  assert "names device_id 4: expected an index in [0, 4)" in str(info.value)
