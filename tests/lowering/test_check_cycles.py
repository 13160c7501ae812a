"""A checked launch leaves no reference cycle behind: its machine, buffers
and views are freed by refcounting when it ends, so Python's cyclic
collector never walks them (its collections, a large share of a launch's
time, ran later inside whatever ran next)."""

import concurrent.futures
import gc

import example_scripts
import jax
import jax.numpy as jnp
import numpy as np
from checked_ring import ring_launch
from jax.experimental.pallas import tpu as pltpu

import mpmd

_example = example_scripts.load("producer_consumer")


def _cyclic_garbage_of_checker(call) -> list[str]:
  """Types of the checker's objects left in reference cycles by
  ``call()`` (run once before, so that compilation is not counted)."""
  jax.block_until_ready(call())
  gc.collect()
  gc.disable()
  gc.set_debug(gc.DEBUG_SAVEALL)
  try:
    jax.block_until_ready(call())
    gc.collect()
    return sorted(
      {
        type(o).__qualname__
        for o in gc.garbage
        if type(o).__module__.startswith("mpmd._lowering.check")
      }
    )
  finally:
    gc.set_debug(0)
    gc.garbage.clear()
    gc.enable()


def test_producer_consumer_launch_leaves_no_cycle():
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)

  @jax.jit
  def f(x):
    return mpmd.mpmd_map(
      [
        (_example.consumers, _example.consume),
        (_example.producer, _example.produce),
      ],
      jax.ShapeDtypeStruct((_example.NUM_CONSUMERS, *x.shape), x.dtype),
      scratch_types=[
        pltpu.HBM(x.shape, x.dtype),
        pltpu.SemaphoreType.REGULAR @ _example.consumers,
        pltpu.VMEM(x.shape, x.dtype) @ _example.consumers,
      ],
      interpret=mpmd.CheckParams(schedule="random:3"),
    )(x)

  assert _cyclic_garbage_of_checker(lambda: f(x)) == []


def test_ring_launch_leaves_no_cycle():
  # Remote DMAs, run_scoped buffers, windows of whole buffers: every kind
  # of object a launch keeps views of.
  launch = ring_launch("random:1", rows=64)
  assert _cyclic_garbage_of_checker(launch) == []


def _checked_copy():
  def copy(x_hbm, o_hbm):
    pltpu.sync_copy(x_hbm, o_hbm)

  return jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), copy)],
      jax.ShapeDtypeStruct((8, 128), jnp.float32),
      interpret=mpmd.CheckParams(),
    )
  )


def test_a_launch_leaves_the_collector_as_it_found_it():
  f, x = _checked_copy(), jnp.ones((8, 128), jnp.float32)
  assert gc.isenabled()
  jax.block_until_ready(f(x))
  assert gc.isenabled()
  gc.disable()
  try:
    jax.block_until_ready(f(x))
    assert not gc.isenabled()  # the user's choice stays
  finally:
    gc.enable()


def test_launches_from_several_threads_turn_the_collector_back_on():
  f, x = _checked_copy(), jnp.ones((8, 128), jnp.float32)
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    outs = list(pool.map(lambda _: np.asarray(f(x)), range(16)))
  assert all((o == 1.0).all() for o in outs)
  assert gc.isenabled()
