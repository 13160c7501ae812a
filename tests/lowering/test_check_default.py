"""The default pick is one rule (``schedule.default_choice``): the TPU
scheduling loop reads it off its options as it lists them (``sync._options``,
for speed) and the GPU loop calls the rule. Here every option list the TPU
loop makes, on schedules that reach many states (DMAs in flight, the
current program blocked, programs done), is checked against the rule."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checked_ring import ring_launch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_check import X, two_meshes

import mpmd
from mpmd._lowering.check import schedule, sync


@pytest.fixture
def compared(monkeypatch):
  """Wraps ``sync._options`` with the check; returns counts of the option
  lists checked and of the states among them."""
  seen = {"lists": 0, "with_dmas": 0, "current_blocked": 0}
  listed = sync._options

  def options(m, programs, current):
    options, default = listed(m, programs, current)
    if options:
      assert default == schedule.default_choice(options, current)
      seen["lists"] += 1
      seen["with_dmas"] += any(o[0] == "d" for o in options)
      seen["current_blocked"] += (
        current is not None and ("p", current) not in options
      )
    else:
      assert default is None
    return options, default

  monkeypatch.setattr(sync, "_options", options)
  return seen


@pytest.mark.parametrize("text", ["default", "random:3", "pct3:5"])
def test_tpu_loop_default_is_the_rule(compared, text):
  ring_launch(text)().block_until_ready()
  jax.block_until_ready(
    two_meshes(interpret=mpmd.CheckParams(schedule=text))(X)
  )
  # The states that tell the rule's branches apart were all reached.
  assert compared["lists"] > 100
  assert compared["with_dmas"] > 0
  assert compared["current_blocked"] > 0


# -- what the default schedule already finds ----------------------------------


def _two_loads_one_wait(x_hbm, y_hbm, o_hbm, a, b, sems):
  load_a = pltpu.make_async_copy(x_hbm, a, sems.at[0])
  load_b = pltpu.make_async_copy(y_hbm, b, sems.at[1])
  load_a.start()
  load_b.start()
  load_b.wait()
  a[...] = a[...] + b[...]  # A's DMA may still be in flight
  load_a.wait()
  pltpu.sync_copy(a, o_hbm)


def _copy_on_before_it_lands(x_hbm, o_hbm, buf, sem):
  pltpu.make_async_copy(x_hbm, buf, sem).start()
  # No wait: the second DMA may read 'buf' before the first has filled it
  # (both count on one semaphore, which orders nothing).
  onward = pltpu.make_async_copy(buf, o_hbm, sem)
  onward.start()
  onward.wait()


VMEM = pltpu.VMEM((8, 128), jnp.float32)


@pytest.mark.parametrize(
  "kernel, scratch, inputs, says",
  [
    (
      _two_loads_one_wait,
      [VMEM, VMEM, pltpu.SemaphoreType.DMA((2,))],
      2,
      ["data race on 'a'", "write by DMA #0 issued by"],
    ),
    (
      _copy_on_before_it_lands,
      [VMEM, pltpu.SemaphoreType.DMA],
      1,
      ["data race on 'buf'", "DMA #1 issued by", "write by DMA #0"],
    ),
  ],
  ids=["a_wait_on_another_dma", "two_dmas_on_one_semaphore"],
)
def test_a_wait_orders_only_the_dmas_it_waits_for(
  kernel, scratch, inputs, says
):
  """Hardware completes a program's DMAs in any order: a wait on one DMA's
  semaphore says nothing of another started before it, even one counting
  on the same semaphore. The default schedule (which lands DMAs in the
  order they started) reports the race."""
  f = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    jax.ShapeDtypeStruct((8, 128), jnp.float32),
    scratch_types=scratch,
  )
  x = jnp.ones((8, 128), jnp.float32)
  with pytest.raises(mpmd.RaceError) as e:
    mpmd.replay(jax.jit(f), *[x] * inputs, schedule="default")
  for text in says:
    assert text in str(e.value)


def _restages_without_an_ack(x_hbm, o_hbm, staged, ready):
  """Core 0 stages two halves through one buffer, signalling after each;
  nothing tells it that core 1 has read the first."""
  core = jax.lax.axis_index("core")

  @pl.when(core == 0)
  def _():
    pltpu.sync_copy(x_hbm.at[:8], staged)
    pl.semaphore_signal(ready, 1, core_index=1)
    pltpu.sync_copy(x_hbm.at[8:], staged)  # core 1 may still be reading
    pl.semaphore_signal(ready, 1, core_index=1)

  @pl.when(core == 1)
  def _():
    for half in (slice(0, 8), slice(8, 16)):
      pl.semaphore_wait(ready, 1)
      pltpu.sync_copy(staged, o_hbm.at[half])


def test_a_wait_is_ordered_after_the_oldest_signals_only():
  """Two signals counted before a wait for one: only the first orders the
  waiter (the second may come after it on hardware). The default schedule
  runs core 0 to its end first, so the read sees the second half."""
  f = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=2), _restages_without_an_ack)],
    jax.ShapeDtypeStruct((16, 128), jnp.float32),
    scratch_types=[
      pltpu.HBM((8, 128), jnp.float32),
      pltpu.SemaphoreType.REGULAR,
    ],
  )
  with pytest.raises(mpmd.RaceError, match=r"data race on 'staged'"):
    mpmd.replay(
      jax.jit(f), jnp.ones((16, 128), jnp.float32), schedule="default"
    )


def _flags_after_the_send(
  x_hbm, o_hbm, inbox, inbox_b, send_sem, recv_sem, flag, *, copies
):
  """Device 0 waits for its remote copies' *send* semaphore and flags
  device 1, which reads the first copy's destination before its receive
  semaphore. Two copies share one lane: the second's send must not stand
  for the first's landing either."""
  inboxes = (inbox, inbox_b)
  me = jax.lax.axis_index("x")
  sends = [
    pltpu.make_async_remote_copy(
      x_hbm, inbox, send_sem, recv_sem, device_id={"x": 1}
    )
    for inbox in inboxes[:copies]
  ]

  @pl.when(me == 0)
  def _():
    for copy in sends:
      copy.start()
    for copy in sends:
      copy.wait_send()  # the source has been read, not the data landed
    pl.semaphore_signal(flag, 1, device_id={"x": 1})
    pltpu.sync_copy(x_hbm, o_hbm)

  @pl.when(me == 1)
  def _():
    pl.semaphore_wait(flag, 1)
    pltpu.sync_copy(inboxes[0], o_hbm)
    for copy in sends:
      copy.wait_recv()


def _on_two_devices(kernel):
  """``kernel`` jitted on two devices, and its input (its scratch: two
  VMEM blocks, two DMA semaphores and a REGULAR one)."""
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  launch = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    jax.ShapeDtypeStruct((8, 128), jnp.float32),
    scratch_types=[VMEM, VMEM, pltpu.SemaphoreType.DMA]
    + [pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.REGULAR],
  )
  f = jax.jit(
    jax.shard_map(
      launch, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False
    )
  )
  x = jax.device_put(
    jnp.ones((16, 128), jnp.float32), NamedSharding(mesh, P("x"))
  )
  return f, x


def _replay_on_two_devices(kernel):
  """Replays ``kernel`` (``_on_two_devices``) under the default schedule."""
  mpmd.replay(*_on_two_devices(kernel), schedule="default")


@pytest.mark.parametrize("copies", [1, 2])
def test_a_send_wait_does_not_order_the_landing(copies):
  kernel = functools.partial(_flags_after_the_send, copies=copies)
  with pytest.raises(mpmd.RaceError) as e:
    _replay_on_two_devices(kernel)
  assert "data race on 'inbox'" in str(e.value)
  assert "write by DMA #0 issued by device 0" in str(e.value)


def _frees_then_reads(x_hbm, o_hbm, inbox, staged, send, recv, free):
  """Device 0 tells device 1 that 'inbox' is free, then still reads it;
  device 1 copies into it once told."""
  me = jax.lax.axis_index("x")
  copy = pltpu.make_async_remote_copy(
    x_hbm, inbox, send, recv, device_id={"x": 0}
  )

  @pl.when(me == 0)
  def _():
    inbox[...] = jnp.zeros((8, 128), jnp.float32)
    pl.semaphore_signal(free, 1, device_id={"x": 1})
    staged[...] = inbox[...]  # device 1's copy may land meanwhile
    copy.wait_recv()
    pltpu.sync_copy(staged, o_hbm)

  @pl.when(me == 1)
  def _():
    pl.semaphore_wait(free, 1)
    copy.start()
    copy.wait_send()
    pltpu.sync_copy(x_hbm, o_hbm)


def test_a_wait_is_not_ordered_after_what_the_signaller_does_next():
  """A signal keeps the signaller's clock as it was: the waiter is not
  ordered after the load device 0 makes after signalling."""
  with pytest.raises(mpmd.RaceError, match=r"data race on 'inbox'"):
    _replay_on_two_devices(_frees_then_reads)


def _two_sends_on_one_semaphore(x_hbm, o_hbm, inbox0, inbox1, send, recv, _):
  """Device 0 sends two blocks to device 1 on one receive semaphore, the
  second after the first's ``wait_send``; device 1 reads the first block
  once its wait passes. Nothing orders the two DMAs' landings."""
  me = jax.lax.axis_index("x")
  first, second = (
    pltpu.make_async_remote_copy(x_hbm, inbox, send, recv, device_id={"x": 1})
    for inbox in (inbox0, inbox1)
  )

  @pl.when(me == 0)
  def _():
    first.start()
    first.wait_send()
    second.start()
    second.wait_send()
    pltpu.sync_copy(x_hbm, o_hbm)

  @pl.when(me == 1)
  def _():
    first.wait_recv()  # the second DMA's bytes may be what it counts
    pltpu.sync_copy(inbox0, o_hbm)
    second.wait_recv()


def test_a_remote_dma_may_land_after_its_send_wait():
  """A remote DMA reads its source, then lands, as two scheduled steps:
  ``wait_send`` may pass in between, and a later DMA on the same receive
  semaphore overtake it. The default schedule lands each at once (and is
  right); ``explore`` finds the overtaking, and its schedule replays."""
  f, x = _on_two_devices(_two_sends_on_one_semaphore)
  mpmd.replay(f, x, schedule="default")
  report = mpmd.explore(f, x, schedules=24, max_failures=1)
  assert [failure.kind for failure in report.failures] == ["race"]
  failure = report.failures[0]
  message = str(failure.error)
  assert "data race on 'inbox0'" in message
  assert "DMA #0 issued by device 0" in message  # (the first DMA's write)
  assert "an earlier read by DMA #2 issued by device 1" in message
  with pytest.raises(mpmd.RaceError, match="data race on 'inbox0'"):
    mpmd.replay(f, x, schedule=failure.schedule)


def _sends_from_a_scope(x_hbm, o_hbm, inbox, recv, *, wait_send):
  """Each of two devices sends a block to the other from a ``run_scoped``
  source with a scoped send semaphore, and leaves the scope."""
  other = 1 - jax.lax.axis_index("x")

  def scope(src, send):
    pltpu.sync_copy(x_hbm, src)
    copy = pltpu.make_async_remote_copy(
      src, inbox, send, recv, device_id={"x": other}
    )
    copy.start()
    if wait_send:
      copy.wait_send()  # the source is read: the scope may end

  pl.run_scoped(scope, VMEM, pltpu.SemaphoreType.DMA)
  pltpu.make_async_remote_copy(
    inbox, inbox, recv, recv, device_id={"x": other}
  ).wait_recv()
  pltpu.sync_copy(inbox, o_hbm)


@pytest.mark.parametrize("wait_send", [True, False])
def test_a_scope_may_end_once_its_dma_has_read_its_source(wait_send):
  """A remote DMA that has read its source (``wait_send`` passed) no
  longer uses the source or the send semaphore: a scope holding them may
  end before it lands. Without the ``wait_send`` it may not."""
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  launch = mpmd.mpmd_map(
    [
      (
        mpmd.tensorcore_mesh("core", num_cores=1),
        functools.partial(_sends_from_a_scope, wait_send=wait_send),
      )
    ],
    jax.ShapeDtypeStruct((8, 128), jnp.float32),
    scratch_types=[VMEM, pltpu.SemaphoreType.DMA],
  )
  f = jax.jit(
    jax.shard_map(
      launch, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False
    )
  )
  x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
  x = jax.device_put(x, NamedSharding(mesh, P("x")))
  report = mpmd.explore(f, x, schedules=24)
  if wait_send:
    assert not report.failures, report
    np.testing.assert_array_equal(
      mpmd.replay(f, x, schedule="default"), np.roll(np.asarray(x), 8, axis=0)
    )
  else:
    # (Its send semaphore still counts as the scope ends.)
    assert [failure.kind for failure in report.failures] == ["leftover"]
    assert "run_scoped ends" in str(report.failures[0].error)


def test_a_remote_dma_is_two_spans_on_the_timeline(tmp_path):
  """Start to source read, then read to landing: back to back."""
  path = tmp_path / "trace.json"
  mpmd.timeline(*_on_two_devices(_two_sends_on_one_semaphore), path=str(path))
  events = json.loads(path.read_text())["traceEvents"]
  spans = {e["name"]: e for e in events if e.get("cat") == "dma"}
  read, landing = spans["DMA #0 reads its source"], spans["DMA #0 lands"]
  assert read["ts"] + read["dur"] == landing["ts"]
