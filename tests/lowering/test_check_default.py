"""The default pick is one rule (``schedule.default_choice``): the TPU
scheduling loop reads it off its options as it lists them (``sync._options``,
for speed) and the GPU loop calls the rule. Here every option list the TPU
loop makes, on schedules that reach many states (DMAs in flight, the
current program blocked, programs done), is checked against the rule."""

import jax
import jax.numpy as jnp
import pytest
from checked_ring import ring_launch
from jax.experimental.pallas import tpu as pltpu
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
