"""What the checking executor does not copy, and what it must still keep.

Loads of a window share one read-only copy of it until its buffer is
next written (a kernel's weights, read by every tile, are copied once),
so a loaded value never changes, nor anything cut from it. A launch under
``shard_map`` runs on its own copies of the devices' inputs (its
buffers take them without copying again), never on the arrays XLA lends
its callbacks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd._lowering.check import memory

SHAPE = (16, 128)
CORE = mpmd.tensorcore_mesh("core", num_cores=1)


def _launch(kernel, scratch=2):
  return mpmd.mpmd_map(
    [(CORE, kernel)],
    jax.ShapeDtypeStruct(SHAPE, jnp.float32),
    scratch_types=[pltpu.VMEM(SHAPE, jnp.float32)] * scratch,
    interpret=mpmd.CheckParams(),
  )


def _x():
  return jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE)


def _stored_over(x_hbm, o_hbm, s, t):
  pltpu.sync_copy(x_hbm, s)
  before = s[...]
  s[...] = before + 1.0  # a store while the loaded value lives
  t[...] = before * 2.0  # ... which still holds what it loaded
  pltpu.sync_copy(t, o_hbm)


def _landed_over(x_hbm, o_hbm, s, t):
  pltpu.sync_copy(x_hbm, s)
  rows = s[4:8]
  t[...] = jnp.zeros(SHAPE, jnp.float32)
  pltpu.sync_copy(t, s)  # a DMA lands over the loaded rows
  t[4:8] = rows
  pltpu.sync_copy(t, o_hbm)


def _swapped(x_hbm, o_hbm, s, t):
  pltpu.sync_copy(x_hbm, s)
  old = s.swap(jnp.ones(SHAPE, jnp.float32))  # the old values, then a store
  t[...] = old - s[...]
  pltpu.sync_copy(t, o_hbm)


def test_a_loaded_value_keeps_its_values_through_a_store():
  got = jax.jit(_launch(_stored_over))(_x())
  np.testing.assert_array_equal(got, 2.0 * _x())


def test_a_loaded_value_keeps_its_values_through_a_dma_landing():
  got = np.asarray(jax.jit(_launch(_landed_over))(_x()))
  np.testing.assert_array_equal(got[4:8], _x()[4:8])
  np.testing.assert_array_equal(got[:4], 0.0)


def test_a_swap_returns_the_values_before_its_store():
  got = jax.jit(_launch(_swapped))(_x())
  np.testing.assert_array_equal(got, _x() - 1.0)


def _scanned_rows(x_hbm, o_hbm, s, t):
  pltpu.sync_copy(x_hbm, s)

  def row(carry, r):
    t[0:1, :] = r[None]  # touches a Ref: the scan is interpreted
    return r, None

  last, _ = lax.scan(row, jnp.zeros(SHAPE[1:], jnp.float32), s[...])
  s[...] = jnp.full(SHAPE, -1.0, jnp.float32)  # after the load's last use
  t[...] = jnp.broadcast_to(last[None], SHAPE)  # ... but not its row's
  pltpu.sync_copy(t, o_hbm)


def test_a_value_cut_from_a_loaded_one_keeps_its_values_through_a_store():
  got = jax.jit(_launch(_scanned_rows))(_x())
  np.testing.assert_array_equal(got, jnp.broadcast_to(_x()[-1], SHAPE))


def _buffer():
  b = memory.Buffer(
    "b", ("b",), SHAPE, np.float32, memory.Aranges(), data=np.ones(SHAPE)
  )
  return b, b.whole


def test_reads_share_one_read_only_copy_until_the_buffer_is_written():
  b, view = _buffer()
  first = view.read()
  assert view.read() is first  # copied once, not per read
  assert not first.flags.writeable and not np.shares_memory(first, b.data)
  with pytest.raises(ValueError, match="read-only"):
    first[0, 0] = 5.0
  view.write(np.full(SHAPE, 3.0, np.float32))
  np.testing.assert_array_equal(first, 1.0)  # its values, not the store's
  np.testing.assert_array_equal(view.read(), 3.0)


def _writes_its_input(x_hbm, o_hbm, s):
  pltpu.sync_copy(x_hbm, s)
  s[...] = s[...] + 1.0
  pltpu.sync_copy(s, x_hbm)  # into the input, as a kernel may
  pltpu.sync_copy(x_hbm, o_hbm)


@pytest.mark.parametrize("under_shard_map", [False, True])
def test_a_kernel_writing_its_input_leaves_the_callers_array(under_shard_map):
  launch = _launch(_writes_its_input, scratch=1)
  x = _x()
  if under_shard_map:
    devices = jax.make_mesh((2,), ("x",))
    f = jax.jit(
      jax.shard_map(
        lambda x: launch(x[0])[None],
        mesh=devices,
        in_specs=P("x"),
        out_specs=P("x"),
        check_vma=False,
      )
    )
    x = jax.device_put(jnp.stack([x, 2 * x]), NamedSharding(devices, P("x")))
  else:
    f = jax.jit(launch)
  kept = np.array(x)
  for _ in range(2):  # the same inputs, the same result each call
    np.testing.assert_array_equal(f(x), kept + 1.0)
  np.testing.assert_array_equal(x, kept)
