"""The CPU lockstep path: collective kernels under shard_map as XLA ops.

Each kernel is checked against a plain-JAX reference, and where it matters
against the threaded TPU simulator; kernels the path cannot run in step go
to the simulator, and waits that would block forever end in a
DeadlockError that names the device and the semaphore.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rings
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd import _jax
from mpmd._lowering import exchange as exchange_lib

ROWS = (8, 128)
CORE = mpmd.tensorcore_mesh("core", num_cores=1)


def _launch(kernel, out_shape, scratch, interpret=None, debug=False):
  return mpmd.mpmd_map(
    [(CORE, kernel)],
    jax.ShapeDtypeStruct(out_shape, jnp.float32),
    scratch_types=scratch,
    interpret=interpret,
    debug=debug,
  )


def _sharded(mesh, spec, per_device):
  return jax.jit(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
    )
  )


def _rows(mesh, spec, shape=ROWS):
  count = int(np.prod([mesh.shape[a] for a in mesh.axis_names]))
  x = jnp.arange(count * np.prod(shape), dtype=jnp.float32)
  x = x.reshape(count * shape[0], *shape[1:])
  return jax.device_put(x, NamedSharding(mesh, spec))


def _shift_along(axis: str, size: int):
  """Each device sends its block to the next one along ``axis``."""

  def kernel(x_hbm, o_hbm, send, recv):
    rings.copy_to_right(x_hbm, o_hbm, send, recv, size, axis).wait()

  return kernel


def _swap_under_a_condition(x_hbm, o_hbm, send, recv):
  """Two devices swap blocks; the DMA starts under a (true) condition."""
  me = jax.lax.axis_index("x")
  copy = pltpu.make_async_remote_copy(
    x_hbm, o_hbm, send, recv, device_id={"x": 1 - me}
  )

  @pl.when(me >= 0)
  def _():
    copy.start()

  copy.wait()


def _ring_sum(n, interpret=None, debug=False):
  """All-reduce around a ring: a fori_loop of remote DMAs, each step's
  buffer slot freed by a capacity signal, after a barrier handshake."""

  def kernel(x_hbm, o_hbm, slots, acc, send, recv, cap):
    me = jax.lax.axis_index("x")
    right = jax.lax.rem(me + 1, n)
    left = jax.lax.rem(me + n - 1, n)
    barrier = pltpu.get_barrier_semaphore()
    for neighbour in (left, right):
      pl.semaphore_signal(barrier, 1, device_id={"x": neighbour})
    pl.semaphore_wait(barrier, 2)
    pltpu.sync_copy(x_hbm, acc)
    pltpu.sync_copy(x_hbm, slots.at[0])

    def step(t, carry):
      slot = jax.lax.rem(t, 2)
      copy = pltpu.make_async_remote_copy(
        slots.at[slot],
        slots.at[1 - slot],
        send,
        recv,
        device_id={"x": right},
      )

      @pl.when(t > 0)
      def _():
        pl.semaphore_wait(cap, 1)  # the right neighbour freed its slot

      copy.start()
      copy.wait()
      acc[...] += slots[1 - slot]
      pl.semaphore_signal(cap, 1, device_id={"x": left})
      return carry

    jax.lax.fori_loop(0, n - 1, step, 0)
    pl.semaphore_wait(cap, 1)  # the last capacity signal
    pltpu.sync_copy(acc, o_hbm)

  return lambda x: mpmd.mpmd_map(
    [(CORE, kernel)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[
      pltpu.VMEM((2, *x.shape), x.dtype),
      pltpu.VMEM(x.shape, x.dtype),
      pltpu.SemaphoreType.DMA(()),
      pltpu.SemaphoreType.DMA(()),
      pltpu.SemaphoreType.REGULAR(()),
    ],
    compiler_params=pltpu.CompilerParams(collective_id=0),
    interpret=interpret,
    debug=debug,
  )(x)


@pytest.fixture(params=["gathered", "ring_shifts"])
def exchange(request, monkeypatch):
  """Remote data travels in the batched all_gather (small, the default for
  these shapes) or by ring shifts (what large data takes)."""
  if request.param == "ring_shifts":
    monkeypatch.setattr(exchange_lib, "_GATHER_BYTES", 0)
  return request.param


@pytest.mark.parametrize("n", [2, 4])
def test_ring_all_reduce_runs_in_lockstep(n, capsys, exchange):
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  x = _rows(mesh, P("x"))
  fn = _sharded(mesh, P("x"), _ring_sum(n, debug=True))
  out = fn(x)
  assert (
    "takes the lockstep path: it uses the cross-device barrier semaphore, "
    "in step on every device" in capsys.readouterr().out
  )
  expected = jnp.tile(x.reshape(n, *ROWS).sum(0), (n, 1))
  np.testing.assert_array_equal(out, expected)
  hlo = fn.lower(x).compile().as_text()
  permutes = re.findall(r"= \S+ collective-permute\(", hlo)
  # The ring's device ids are the devices' own coordinates (the loop's
  # invariants): known when traced, so its one DMA is one ring shift, not
  # a switch over the n - 1 shifts the devices might agree on.
  assert len(permutes) == (0 if exchange == "gathered" else 1)


@pytest.mark.parametrize("n", [2, 4])
def test_interpret_true_runs_remote_dmas_in_step(n, capsys):
  """As upstream's HLO interpreter does: every device runs its program,
  remote DMAs exchange data between the devices of the shard_map."""
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  x = _rows(mesh, P("x"))
  out = _sharded(mesh, P("x"), _ring_sum(n, interpret=True, debug=True))(x)
  assert "takes the lockstep path" in capsys.readouterr().out
  expected = jnp.tile(x.reshape(n, *ROWS).sum(0), (n, 1))
  np.testing.assert_array_equal(out, expected)


def test_interpret_true_refuses_remote_dmas_it_cannot_run_in_step():
  n = 2
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])

  def per_device(x):
    sems = [pltpu.SemaphoreType.DMA(())] * 2
    return _launch(_swap_under_a_condition, ROWS, sems, interpret=True)(x)

  with pytest.raises(
    NotImplementedError,
    match=r"interpret=True .* cannot run this kernel: it issues a remote DMA"
    r".*not in step on every device: it issues a remote dma_start inside "
    r"cond. Pass interpret=pltpu.InterpretParams\(\)",
  ):
    _sharded(mesh, P("x"), per_device)(_rows(mesh, P("x")))


def test_lockstep_agrees_with_the_simulator():
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  x = _rows(mesh, P("x"))
  lockstep = _sharded(mesh, P("x"), _ring_sum(4))(x)
  with mpmd.deadlock_timeout(60.0):
    simulated = _sharded(
      mesh, P("x"), _ring_sum(4, interpret=pltpu.InterpretParams())
    )(x)
  np.testing.assert_array_equal(lockstep, simulated)


def _top_level_collectives(compiled) -> list[str]:
  """The collectives the entry computation runs (not those in branches)."""
  entry = compiled.as_text().split("\nENTRY ", 1)[1]
  return re.findall(r"= \S+ (all-gather|collective-permute)\(", entry)


@pytest.mark.parametrize("exchange", ["gathered", "ring_shifts"], indirect=True)
def test_remote_operations_in_a_row_travel_in_one_exchange(exchange):
  """Both neighbours' handshake signals, then both ring directions' DMAs:
  the wait for the handshake waits for the exchange, so the signals and
  the DMAs travel in one (every exchange is a rendezvous of every device);
  the failure report takes none (each device checks its own)."""
  n = 4
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])

  def kernel(x_hbm, o_hbm, send, recv):
    me = jax.lax.axis_index("x")
    neighbours = [jax.lax.rem(me + d + n, n) for d in (1, -1)]
    barrier = pltpu.get_barrier_semaphore()
    for neighbour in neighbours:
      pl.semaphore_signal(barrier, 1, device_id={"x": neighbour})
    pl.semaphore_wait(barrier, 2)
    copies = [
      pltpu.make_async_remote_copy(
        x_hbm.at[i], o_hbm.at[i], send.at[i], recv.at[i], device_id={"x": d}
      )
      for i, d in enumerate(neighbours)
    ]
    for copy in copies:
      copy.start()
    for copy in copies:
      copy.wait()

  def per_device(x):
    return mpmd.mpmd_map(
      [(CORE, kernel)],
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_types=[pltpu.SemaphoreType.DMA((2,))] * 2,
      compiler_params=pltpu.CompilerParams(collective_id=0),
    )(x)

  x = _rows(mesh, P("x"), (2, *ROWS))
  fn = _sharded(mesh, P("x"), per_device)
  out = np.asarray(fn(x)).reshape(n, 2, *ROWS)
  blocks = np.asarray(x).reshape(n, 2, *ROWS)
  np.testing.assert_array_equal(out[:, 0], np.roll(blocks[:, 0], 1, axis=0))
  np.testing.assert_array_equal(out[:, 1], np.roll(blocks[:, 1], -1, axis=0))
  collectives = _top_level_collectives(fn.lower(x).compile())
  if exchange == "gathered":
    # The handshake with the data; then every device's end-of-launch
    # verdict (``lockstep._run``).
    assert collectives == ["all-gather", "all-gather"]
  else:
    # The device ids are the devices' own coordinates, shifted: known when
    # traced, so the ring shifts move the data alone, and every device
    # knows who signals it (``device_ids``). Then every device's
    # end-of-launch verdict.
    assert collectives == ["collective-permute"] * 2 + ["all-gather"]


@pytest.mark.parametrize("form", ["dict", "flat"])
def test_every_device_sends_to_device_zero(form, exchange):
  """Several senders into one device, each at its own offset."""
  n = 4
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])

  def kernel(x_hbm, o_hbm, send, recv):
    me = jax.lax.axis_index("x")
    target = {"x": 0} if form == "dict" else 0
    copy = pltpu.make_async_remote_copy(
      x_hbm,
      o_hbm.at[pl.ds(me * ROWS[0], ROWS[0])],
      send,
      recv,
      device_id=target,
    )
    copy.start()
    copy.wait_send()

    @pl.when(me == 0)
    def _():
      for _ in range(n):
        copy.wait_recv()

  def per_device(x):
    sems = [pltpu.SemaphoreType.DMA(())] * 2
    return _launch(kernel, (n * ROWS[0], ROWS[1]), sems)(x)

  x = _rows(mesh, P("x"))
  out = jax.jit(
    jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=P("x"),
      out_specs=P("x"),
      check_vma=False,
    )
  )(x)
  # Device 0's block holds every shard; the others received nothing.
  np.testing.assert_array_equal(np.asarray(out)[: n * ROWS[0]], x)


def test_rows_of_a_2d_mesh_are_independent_rings():
  mesh = jax.make_mesh((2, 4), ("x", "y"))

  kernel = _shift_along("y", 4)

  def per_device(x):
    sems = [pltpu.SemaphoreType.DMA(())] * 2
    return _launch(kernel, ROWS, sems)(x)

  spec = P(("x", "y"))
  x = _rows(mesh, spec)
  out = _sharded(mesh, spec, per_device)(x)
  blocks = np.asarray(x).reshape(2, 4, *ROWS)
  expected = np.roll(blocks, 1, axis=1).reshape(x.shape)
  np.testing.assert_array_equal(out, expected)


def _shift(wait_first: bool, receptions: int = 1):
  """A ring shift that waits too early or for a reception never sent."""

  def kernel(x_hbm, o_hbm, send, recv):
    right = jax.lax.rem(jax.lax.axis_index("x") + 1, 4)
    copy = pltpu.make_async_remote_copy(
      x_hbm, o_hbm, send, recv, device_id={"x": right}
    )
    if wait_first:
      copy.wait_recv()
    copy.start()
    copy.wait_send()
    for _ in range(receptions - wait_first):
      copy.wait_recv()

  def per_device(x):
    sems = [pltpu.SemaphoreType.DMA(())] * 2
    return _launch(kernel, ROWS, sems)(x)

  return per_device


@pytest.mark.parametrize(
  "wait_first, receptions", [(False, 2), (True, 1)], ids=["never", "early"]
)
def test_a_wait_that_would_block_forever_names_device_and_semaphore(
  wait_first, receptions
):
  """A wait for a DMA nobody sends, and a wait before every device's start:
  the latter's data arrives later, yet the semaphore stays poisoned."""
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  f = _sharded(mesh, P("x"), _shift(wait_first, receptions))
  # The DeadlockError reaches us wrapped by the runtime (a callback error).
  with pytest.raises(Exception, match=r"lockstep path") as raised:
    jax.block_until_ready(f(_rows(mesh, P("x"))))
  # Every device waits short: one error names them all, in order.
  assert re.findall(
    r"device \(x=(\d)\) waits on '\w+' \(scratch 1, dma_sem", str(raised.value)
  ) == ["0", "1", "2", "3"]


def test_a_deadlock_on_one_device_names_it_alone():
  """Device 2 waits for a second signal nobody sends: the devices that did
  not fail report nothing, and the process runs the next launch."""
  n = 4

  def kernel(x_hbm, o_hbm, sem):
    me = jax.lax.axis_index("x")
    right = jax.lax.rem(me + 1, n)
    pl.semaphore_signal(sem, 1, device_id={"x": right})
    pl.semaphore_wait(sem, 1 + (me == 2).astype(jnp.int32))
    pltpu.sync_copy(x_hbm, o_hbm)

  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  f = _sharded(
    mesh,
    P("x"),
    lambda x: _launch(kernel, ROWS, [pltpu.SemaphoreType.REGULAR(())])(x),
  )
  x = _rows(mesh, P("x"))
  with pytest.raises(Exception, match=r"lockstep path") as raised:
    jax.block_until_ready(f(x))
  assert re.findall(r"device \(x=(\d)\) waits", str(raised.value)) == ["2"]
  np.testing.assert_array_equal(
    _sharded(mesh, P("x"), _ring_sum(n))(x),
    jnp.tile(x.reshape(n, *ROWS).sum(0), (n, 1)),
  )


def _fails_on_a_pair(kernel, scratch, error, match):
  """``kernel`` on two devices in lockstep fails with ``error``."""
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  f = _sharded(mesh, P("x"), lambda x: _launch(kernel, ROWS, scratch)(x))
  with pytest.raises(error, match=match), mpmd.typed_errors():
    jax.block_until_ready(f(_rows(mesh, P("x"))))


def _right():
  return {"x": jax.lax.rem(jax.lax.axis_index("x") + 1, 2)}


def test_a_leftover_names_the_element_and_its_count():
  def kernel(x_hbm, o_hbm, sems):
    pl.semaphore_signal(sems.at[1], 2, device_id=_right())  # unawaited
    pltpu.sync_copy(x_hbm, o_hbm)

  _fails_on_a_pair(
    kernel,
    [pltpu.SemaphoreType.REGULAR((3,))],
    mpmd.LeftoverError,
    r"lockstep path(.|\n)*\n  device \(x=0\): 'sems' \(scratch 0, "
    r"semaphore\[3\]\) \.at\[1\] \(count 2\)\n  device \(x=1\)",
  )


def test_a_deadlock_names_the_element_waited_on():
  def kernel(x_hbm, o_hbm, empty, sems):
    del empty  # an empty array of semaphores: nothing to report on it
    pl.semaphore_signal(sems.at[1], 1, device_id=_right())
    pl.semaphore_wait(sems.at[2], 1)  # nobody signals .at[2]
    pltpu.sync_copy(x_hbm, o_hbm)

  _fails_on_a_pair(
    kernel,
    [pltpu.SemaphoreType.REGULAR((0,)), pltpu.SemaphoreType.REGULAR((3,))],
    mpmd.DeadlockError,
    r"lockstep path(.|\n)*\n  device \(x=0\) waits on 'sems' "
    r"\(scratch 1, semaphore\[3\]\) \.at\[2\]\n",
  )


def test_a_dma_left_unawaited_is_reported_in_bytes():
  def kernel(x_hbm, o_hbm, send, recv):
    copy = pltpu.make_async_remote_copy(
      x_hbm, o_hbm, send, recv, device_id=_right()
    )
    copy.start()
    copy.wait_send()  # the receive side is never awaited

  _fails_on_a_pair(
    kernel,
    [pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
    mpmd.LeftoverError,
    r"device \(x=0\): 'recv' \(scratch 1, dma_sem\[\]\) "
    rf"\({ROWS[0] * ROWS[1] * 4} bytes of DMAs not awaited\)",
  )


def test_a_failed_launch_leaves_no_device_in_a_collective(exchange):
  """Every device waits for its DMA twice, its device id known when
  traced (the data lands with no exchange of targets): every device is
  named, and the next launch runs. A device whose report raises stops
  there, so the counts it reads wait for the collective that carries the
  data (``xla_cpu.arrival``, checked in test_xla_cpu; without it, jax
  0.10.2 ran the report first in test_semaphores_across_launches' deadlock
  test, and the other device waited in the collective until XLA aborted
  the process)."""
  n = 4

  def kernel(x_hbm, o_hbm, send, recv):
    copy = rings.copy_to_right(x_hbm, o_hbm, send, recv, n)
    copy.wait_send()
    copy.wait_recv()
    copy.wait_recv()

  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  f = _sharded(
    mesh,
    P("x"),
    lambda x: _launch(kernel, ROWS, [pltpu.SemaphoreType.DMA(())] * 2)(x),
  )
  x = _rows(mesh, P("x"))
  with pytest.raises(mpmd.DeadlockError) as raised, mpmd.typed_errors():
    jax.block_until_ready(f(x))
  assert sorted(re.findall(r"device \(x=(\d)\) waits", str(raised.value))) == [
    str(d) for d in range(n)
  ]
  np.testing.assert_array_equal(
    _sharded(mesh, P("x"), _ring_sum(n))(x),
    jnp.tile(x.reshape(n, *ROWS).sum(0), (n, 1)),
  )


def _signal_and_wait(n, steps):
  """Each device runs ``steps``: ``None`` signals its right neighbour's
  semaphore, a number waits on its own for that much; then it reads its
  semaphore (the count output) and takes what is left (a kernel ends with
  its semaphores at zero)."""

  def kernel(x_hbm, o_hbm, count_hbm, sem, count_smem):
    right = jax.lax.rem(jax.lax.axis_index("x") + 1, n)
    for step in steps:
      if step is None:
        pl.semaphore_signal(sem, 1, device_id={"x": right})
      else:
        pl.semaphore_wait(sem, step)
    count_smem[0] = pl.semaphore_read(sem)
    # (Not below zero: a wait that came up short leaves it negative.)
    pl.semaphore_wait(sem, jnp.maximum(count_smem[0], 0))
    pltpu.sync_copy(count_smem, count_hbm)
    pltpu.sync_copy(x_hbm, o_hbm)

  def per_device(x):
    return mpmd.mpmd_map(
      [(CORE, kernel)],
      (
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct((1,), jnp.int32),
      ),
      scratch_types=[
        pltpu.SemaphoreType.REGULAR(()),
        pltpu.SMEM((1,), jnp.int32),
      ],
      debug=True,
    )(x)

  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  return jax.jit(
    jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=P("x"),
      out_specs=(P("x"), P("x")),
      check_vma=False,
    )
  ), _rows(mesh, P("x"))


def test_waits_on_pending_signals_count_those_issued_before_them(capsys):
  """A wait on a pending signal's semaphore waits for the exchange, and
  takes what was signalled before it."""
  n = 4
  f, x = _signal_and_wait(n, [None, 1, None, 1, None, None, 1])
  out, count = f(x)
  assert "lockstep path" in capsys.readouterr().out
  np.testing.assert_array_equal(out, x)
  np.testing.assert_array_equal(count, [1] * n)


def test_a_wait_that_a_later_signal_would_satisfy_still_deadlocks():
  """One signal arrives before the wait for two, the other after it: on
  hardware the wait blocks forever, though both signals could land in one
  exchange."""
  f, x = _signal_and_wait(4, [None, 2, None])
  with pytest.raises(
    Exception,
    match=r"lockstep path(.|\n)*device \(x=\d\) waits on '\w+' \(scratch 0",
  ):
    jax.block_until_ready(f(x))


def test_a_remote_dma_under_a_condition_goes_to_the_simulator(capsys):
  """Devices may disagree on a condition: no exchange can wait there."""
  n = 2
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])

  def per_device(x):
    sems = [pltpu.SemaphoreType.DMA(())] * 2
    return _launch(_swap_under_a_condition, ROWS, sems, debug=True)(x)

  x = _rows(mesh, P("x"))
  with mpmd.deadlock_timeout(60.0):
    out = _sharded(mesh, P("x"), per_device)(x)
  printed = capsys.readouterr().out
  assert "check path" in printed  # the checking executor runs it
  assert "remote dma_start inside cond" in printed
  np.testing.assert_array_equal(out, np.roll(np.asarray(x), ROWS[0], axis=0))


def test_semaphores_placed_on_the_mesh_count_in_int32():
  """``SemaphoreType.DMA @ mesh`` wraps the semaphore memory space: it is
  widened to int32 like a plain one (it was left int16, and the first
  signal mixed int16 and int32)."""
  n = 2
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])

  def per_device(x):
    sems = [pltpu.SemaphoreType.DMA @ CORE] * 2
    return _launch(_shift_along("x", n), ROWS, sems)(x)

  x = _rows(mesh, P("x"))
  out = _sharded(mesh, P("x"), per_device)(x)
  np.testing.assert_array_equal(out, np.roll(np.asarray(x), ROWS[0], axis=0))


def test_pending_dmas_beyond_int16_counts():
  """Two DMAs of 64 KiB each pending on one semaphore (Pallas' int16 counts
  would wrap): semaphores count bytes in int32."""
  n, half = 2, 128
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])

  def kernel(x_hbm, o_hbm, send, recv):
    right = jax.lax.rem(jax.lax.axis_index("x") + 1, n)
    copies = [
      pltpu.make_async_remote_copy(
        x_hbm.at[pl.ds(i * half, half)],
        o_hbm.at[pl.ds(i * half, half)],
        send,
        recv,
        device_id={"x": right},
      )
      for i in range(2)
    ]
    for copy in copies:
      copy.start()
    for copy in copies:
      copy.wait()

  def per_device(x):
    sems = [pltpu.SemaphoreType.DMA(())] * 2
    return _launch(kernel, (2 * half, 128), sems)(x)

  x = _rows(mesh, P("x"), (2 * half, 128))
  out = _sharded(mesh, P("x"), per_device)(x)
  np.testing.assert_array_equal(out, np.roll(np.asarray(x), 2 * half, axis=0))


def test_scoped_local_semaphores_run_in_lockstep(capsys):
  """emit_pipeline-style scoped DMA semaphores next to a remote DMA."""
  n = 4
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])

  def kernel(x_hbm, o_hbm, send, recv, buf):
    rings.copy_to_right(x_hbm, o_hbm, send, recv, n).wait()

    def scoped(sem):
      load = pltpu.make_async_copy(o_hbm, buf, sem)
      load.start()
      load.wait()
      buf[...] = buf[...] * 2.0
      store = pltpu.make_async_copy(buf, o_hbm, sem)
      store.start()
      store.wait()

    pl.run_scoped(scoped, pltpu.SemaphoreType.DMA(()))

  def per_device(x):
    scratch = [pltpu.SemaphoreType.DMA(())] * 2 + [pltpu.VMEM(ROWS, x.dtype)]
    return _launch(kernel, ROWS, scratch, debug=True)(x)

  x = _rows(mesh, P("x"))
  out = _sharded(mesh, P("x"), per_device)(x)
  assert "lockstep path" in capsys.readouterr().out
  np.testing.assert_array_equal(
    out, 2.0 * np.roll(np.asarray(x), ROWS[0], axis=0)
  )


def test_remote_dma_with_scoped_semaphores_goes_to_the_simulator(capsys):
  """Scoped semaphores vanish before the end-of-launch check."""
  n = 2
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])

  def kernel(x_hbm, o_hbm):
    def scoped(send, recv):
      rings.copy_to_right(x_hbm, o_hbm, send, recv, n).wait()

    pl.run_scoped(scoped, *[pltpu.SemaphoreType.DMA(())] * 2)

  def per_device(x):
    return _launch(kernel, ROWS, [], debug=True)(x)

  x = _rows(mesh, P("x"))
  with mpmd.deadlock_timeout(60.0):
    out = _sharded(mesh, P("x"), per_device)(x)
  assert "inside pl.run_scoped with semaphores" in capsys.readouterr().out
  np.testing.assert_array_equal(out, np.roll(np.asarray(x), ROWS[0], axis=0))


def test_device_ids_naming_both_axes_of_a_2d_mesh():
  """A transpose of a 2x2 device grid: each device sends to (y, x)."""
  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4])

  def kernel(x_hbm, o_hbm, send, recv):
    x, y = jax.lax.axis_index("x"), jax.lax.axis_index("y")
    copy = pltpu.make_async_remote_copy(
      x_hbm,
      o_hbm,
      send,
      recv,
      device_id={"x": y, "y": x},
    )
    copy.start()
    copy.wait()

  def per_device(x):
    return _launch(kernel, ROWS, [pltpu.SemaphoreType.DMA(())] * 2)(x)

  spec = P(("x", "y"))
  x = _rows(mesh, spec)
  out = _sharded(mesh, spec, per_device)(x)
  blocks = np.asarray(x).reshape(2, 2, *ROWS)
  np.testing.assert_array_equal(
    out, blocks.transpose(1, 0, 2, 3).reshape(x.shape)
  )


def test_a_launch_under_a_condition_on_another_axis():
  """Rings along y, launched only on the x=0 row: devices exchange along
  the axes their device ids name, so the x=1 row is not waited for."""
  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4])

  kernel = _shift_along("y", 2)

  def launch(x):
    return _launch(kernel, ROWS, [pltpu.SemaphoreType.DMA(())] * 2)(x)

  def per_device(x):
    return jax.lax.cond(jax.lax.axis_index("x") == 0, launch, lambda x: x, x)

  spec = P(("x", "y"))
  x = _rows(mesh, spec)
  out = np.asarray(_sharded(mesh, spec, per_device)(x)).reshape(2, 2, *ROWS)
  blocks = np.asarray(x).reshape(2, 2, *ROWS)
  np.testing.assert_array_equal(out[0], blocks[0, ::-1])
  np.testing.assert_array_equal(out[1], blocks[1])


def test_one_value_naming_different_axes_is_two_patterns():
  """{x: d} is a ring shift and {y: d} is not, though d is one value; and
  no tracer outlives the rewrite (jax.checking_leaks)."""
  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4])

  def kernel(x_hbm, o1, o2, s1, r1, s2, r2):
    x, y = jax.lax.axis_index("x"), jax.lax.axis_index("y")
    d = 1 - x
    swap = pltpu.make_async_remote_copy(x_hbm, o1, s1, r1, device_id={"x": d})
    swap.start()
    swap.wait()
    # (x, *) -> (x, 1 - x): two senders per receiver, each into its y block.
    gather = pltpu.make_async_remote_copy(
      x_hbm,
      o2.at[pl.ds(y * ROWS[0], ROWS[0])],
      s2,
      r2,
      device_id={"y": d},
    )
    gather.start()
    gather.wait_send()

    @pl.when(y == 1 - x)
    def _():
      gather.wait_recv()
      gather.wait_recv()

  def per_device(a):
    return mpmd.mpmd_map(
      [(CORE, kernel)],
      (
        jax.ShapeDtypeStruct(ROWS, jnp.float32),
        jax.ShapeDtypeStruct((2 * ROWS[0], ROWS[1]), jnp.float32),
      ),
      scratch_types=[pltpu.SemaphoreType.DMA(())] * 4,
    )(a)

  spec = P(("x", "y"))
  a = _rows(mesh, spec)
  f = jax.jit(
    jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=spec,
      out_specs=(spec, spec),
      check_vma=False,
    )
  )
  with jax.checking_leaks():
    o1, o2 = f(a)
  blocks = np.asarray(a).reshape(2, 2, *ROWS)
  np.testing.assert_array_equal(
    np.asarray(o1).reshape(2, 2, *ROWS), blocks[::-1]
  )
  o2 = np.asarray(o2).reshape(2, 2, 2, *ROWS)  # device x, device y, slot
  np.testing.assert_array_equal(o2[0, 1], blocks[0])
  np.testing.assert_array_equal(o2[1, 0], blocks[1])


def test_a_partially_manual_shard_map_is_not_lockstep():
  """Trace time (declared effects) and lowering agree: only a shard_map
  manual over every mesh axis offers the lockstep path."""
  from mpmd._lowering import paths

  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4])
  seen = {}

  def body(x, name):
    seen[name] = paths.traced_manual_axes()
    return x

  x = jax.ShapeDtypeStruct((32, 128), jnp.float32)  # traced, not run
  for name, axis_names in (("all", {"x", "y"}), ("x only", {"x"})):
    jax.jit(
      jax.shard_map(
        functools.partial(body, name=name),
        mesh=mesh,
        in_specs=P(),
        out_specs=P(),
        axis_names=axis_names,
        check_vma=False,
      )
    ).trace(x)
  assert seen == {"all": ("x", "y"), "x only": ()}
  assert paths.fully_manual_axes(("x", "y"), {"x"}) == ()


@pytest.mark.parametrize("as_integers", [False, True])
def test_both_forms_of_16bit_float_updates(monkeypatch, as_integers):
  """Remote bf16 blocks landing in windows of a larger buffer, updated as
  bf16 or (where jaxlib 0.10.2's XLA would convert the whole buffer to f32
  for each update, ``FLOAT16_DYNAMIC_OPS_CONVERT``) as uint16: same result."""
  monkeypatch.setattr(_jax, "FLOAT16_DYNAMIC_OPS_CONVERT", as_integers)
  n, cols = 4, ROWS[1]

  def kernel(x_hbm, o_hbm, send, recv):
    me = jax.lax.axis_index("x")
    copy = pltpu.make_async_remote_copy(
      x_hbm,
      o_hbm.at[:, pl.ds(me * cols, cols)],
      send,
      recv,
      device_id={"x": jax.lax.rem(me + 1, n)},
    )
    copy.start()
    copy.wait()

  def per_device(x):
    return mpmd.mpmd_map(
      [(CORE, kernel)],
      jax.ShapeDtypeStruct((ROWS[0], n * cols), x.dtype),
      scratch_types=[pltpu.SemaphoreType.DMA(())] * 2,
    )(x)

  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  x = _rows(mesh, P("x")).astype(jnp.bfloat16)
  fn = _sharded(mesh, P("x"), per_device)
  out = np.asarray(fn(x), np.float32).reshape(n, ROWS[0], n, cols)
  blocks = np.asarray(x, np.float32).reshape(n, *ROWS)
  for me in range(n):
    sender = (me - 1) % n
    np.testing.assert_array_equal(out[me, :, sender], blocks[sender])
  updates = re.findall(
    r"dynamic_update_slice.*-> tensor<\d+x\d+x(\w+)>", fn.lower(x).as_text()
  )
  if as_integers:
    assert "ui16" in updates and "bf16" not in updates, updates
  else:
    assert "bf16" in updates, updates


@pytest.mark.parametrize("as_integers", [False, True])
def test_both_forms_of_16bit_float_slices(monkeypatch, as_integers):
  """A bf16 window read at a run-time offset, sliced as bf16 or (where
  jaxlib 0.10.2's XLA would convert the whole buffer to f32 for it,
  ``FLOAT16_DYNAMIC_OPS_CONVERT``) as uint16: same result."""
  monkeypatch.setattr(_jax, "FLOAT16_DYNAMIC_OPS_CONVERT", as_integers)

  def kernel(start_hbm, x_hbm, o_hbm, start_smem, window):
    pltpu.sync_copy(start_hbm, start_smem)
    pltpu.sync_copy(x_hbm.at[pl.ds(start_smem[0], ROWS[0])], window)
    pltpu.sync_copy(window, o_hbm)

  fn = jax.jit(
    mpmd.mpmd_map(
      [(CORE, kernel)],
      jax.ShapeDtypeStruct(ROWS, jnp.bfloat16),
      scratch_types=[
        pltpu.SMEM((1,), jnp.int32),
        pltpu.VMEM(ROWS, jnp.bfloat16),
      ],
    )
  )
  x = jnp.arange(4 * ROWS[0] * ROWS[1]).reshape(-1, ROWS[1]) % 256
  x = x.astype(jnp.bfloat16)  # exact: integers below 256
  start = jnp.array([5], jnp.int32)
  np.testing.assert_array_equal(fn(start, x), x[5 : 5 + ROWS[0]])
  slices = re.findall(
    r"dynamic_slice.*-> tensor<\d+x\d+x(\w+)>", fn.lower(start, x).as_text()
  )
  if as_integers:
    assert "ui16" in slices and "bf16" not in slices, slices
  else:
    assert "bf16" in slices, slices


def test_the_failure_report_declares_no_effect():
  """A launch that declares an effect leaves JAX's fast dispatch (0.1-0.2
  ms a call at small shapes), on every supported version (a failed first
  call's error ends with it all the same: see the failure tests)."""
  n = 4
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  effects = jax.make_jaxpr(_sharded(mesh, P("x"), _ring_sum(n)))(
    _rows(mesh, P("x"))
  ).effects
  assert not effects, effects
