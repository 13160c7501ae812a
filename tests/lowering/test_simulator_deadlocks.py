"""The threaded TPU simulator's deadlock report (issue 36, item 8).

* The count a semaphore holds is read when the deadlock is reported, not
  when the wait began ("holds 0" after 3 signals, before).
* A wait is timed out only while nothing else of its launch moves, so the
  default timeout can be short (10 s, was 60 s) and a program that waits
  longer than the timeout for a slow producer still completes.
"""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd._lowering import watchdog

ROWS = (8, 128)
SIMULATOR = pltpu.InterpretParams()


def _two_cores():
  return mpmd.tensorcore_mesh("core", num_cores=2)


def test_the_report_gives_the_count_reached_since_the_wait_began():
  """Core 0 starts waiting for 4, then core 1 signals it 3 times."""

  def kernel(o_hbm, ready, go):
    c = jax.lax.axis_index("core")

    @pl.when(c == 0)
    def _():
      pl.semaphore_signal(go, 1, core_index=1)
      pl.semaphore_wait(ready, 4)

    @pl.when(c == 1)
    def _():
      pl.semaphore_wait(go, 1)  # core 0 is waiting (or about to)
      for _ in range(3):
        pl.semaphore_signal(ready, 1, core_index=0)

  f = mpmd.mpmd_map(
    [(_two_cores(), kernel)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR(())] * 2,
    interpret=SIMULATOR,
  )
  with (
    mpmd.deadlock_timeout(1.0),
    pytest.raises(mpmd.DeadlockError) as raised,
    mpmd.typed_errors(),
  ):
    jax.block_until_ready(f())
  message = str(raised.value)
  assert (
    "program 0 (core=0) waits on the semaphore 'ready' (scratch 0, "
    "semaphore[]) for 4 (it holds 3 now) at "
  ) in message
  assert "holds 0" not in message


SLOW_STEPS = 20_000  # simulated read-modify-writes: about 1-2 s on CPU


def test_a_wait_longer_than_the_timeout_for_a_working_producer_completes():
  """Core 0 waits from the start while core 1 works through many simulated
  operations: no deadlock, although the wait outlasts the timeout."""

  def kernel(o_hbm, buf, ready):
    c = jax.lax.axis_index("core")

    @pl.when(c == 0)
    def _():
      pl.semaphore_wait(ready, 1)

    @pl.when(c == 1)
    def _():
      buf[...] = jnp.zeros_like(buf)

      def step(i, carry):
        buf[...] += 1.0
        return carry

      jax.lax.fori_loop(0, SLOW_STEPS, step, 0)
      pltpu.sync_copy(buf, o_hbm)
      pl.semaphore_signal(ready, 1, core_index=0)

  f = jax.jit(
    mpmd.mpmd_map(
      [(_two_cores(), kernel)],
      jax.ShapeDtypeStruct(ROWS, jnp.float32),
      scratch_types=[
        pltpu.VMEM(ROWS, jnp.float32),
        pltpu.SemaphoreType.REGULAR(()),
      ],
      interpret=SIMULATOR,
    )
  )
  jax.block_until_ready(f())  # compiled outside the timed launch
  timeout = 0.3
  start = time.monotonic()
  with mpmd.deadlock_timeout(timeout):
    out = jax.block_until_ready(f())
  waited = time.monotonic() - start
  np.testing.assert_array_equal(out, np.full(ROWS, SLOW_STEPS, np.float32))
  # The wait did outlast the timeout (else this test proves nothing).
  assert waited > 2 * timeout


def test_the_default_timeout_is_ten_seconds():
  assert watchdog.DEFAULT_DEADLOCK_TIMEOUT_S == 10.0
  assert mpmd.get_deadlock_timeout() == 10.0


def test_the_report_names_an_element_of_a_semaphore_array_and_the_wait_line():
  """Core 1 waits on element 1 of an array of semaphores, and on a DMA
  semaphore nothing signals: the report names each as the kernel does, with
  the line of the wait."""

  def kernel(o_hbm, sems, copied):
    c = jax.lax.axis_index("core")

    @pl.when(c == 0)
    def _():
      pltpu.make_async_copy(o_hbm, o_hbm, copied).wait()  # nothing started

    @pl.when(c == 1)
    def _():
      pl.semaphore_wait(sems.at[1], 2)

  f = mpmd.mpmd_map(
    [(_two_cores(), kernel)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[
      pltpu.SemaphoreType.REGULAR((3,)),
      pltpu.SemaphoreType.DMA(()),
    ],
    interpret=SIMULATOR,
  )
  with mpmd.deadlock_timeout(1.0), pytest.raises(mpmd.DeadlockError) as raised:
    f()
  message = str(raised.value)
  here = r"test_simulator_deadlocks.py:\d+"
  assert re.search(
    r"program 1 \(core=1\) waits on the semaphore \[1\] of 'sems' "
    rf"\(scratch 0, semaphore\[3\]\) for 2 \(it holds 0 now\) at .*{here}",
    message,
  ), message
  assert re.search(
    r"program 0 \(core=0\) waits on the DMA semaphore 'copied' "
    rf"\(scratch 1, dma_sem\[\]\) for \d+ \(it holds 0 now\) at .*{here}",
    message,
  ), message
