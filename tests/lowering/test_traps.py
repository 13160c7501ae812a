"""Each upstream trap that our lowering works around (docs/design.md, *Traps
of upstream Pallas*; found on jax 0.10.2).

Every test runs a kernel that hits the trap and checks that it now works.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd import _jax, demos

ROWS = (8, 128)


def test_trap1_a_program_above_zero_signals_itself(capsys):
  """Upstream delivers a local signal without core_index to core 0."""
  mesh = mpmd.tensorcore_mesh("core", num_cores=2)

  def kernel(x_hbm, o_hbm, sem, buf):
    c = jax.lax.axis_index("core")
    pl.semaphore_signal(sem, 2)  # its own semaphore: no core_index
    pl.semaphore_wait(sem, 2)
    pltpu.sync_copy(x_hbm.at[c], buf)
    buf[...] += 1.0
    pltpu.sync_copy(buf, o_hbm.at[c])

  f = mpmd.mpmd_map(
    [(mesh, kernel)],
    jax.ShapeDtypeStruct((2, *ROWS), jnp.float32),
    scratch_types=[
      pltpu.SemaphoreType.REGULAR(()),
      pltpu.VMEM(ROWS, jnp.float32),
    ],
    interpret=pltpu.InterpretParams(),
    debug=True,
  )
  x = jnp.arange(2 * 8 * 128, dtype=jnp.float32).reshape(2, *ROWS)
  with mpmd.deadlock_timeout(10.0):
    np.testing.assert_allclose(f(x), x + 1.0)
  assert "tpu-simulator path" in capsys.readouterr().out


def test_trap2_hbm_scratch_in_the_simulator():
  """Upstream rejects HBM scratch: it becomes a hidden output."""
  mesh = mpmd.tensorcore_mesh("core", num_cores=1)

  def kernel(x_hbm, o_hbm, staging):
    pltpu.sync_copy(x_hbm, staging)
    pltpu.sync_copy(staging, o_hbm)

  f = mpmd.mpmd_map(
    [(mesh, kernel)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.HBM(ROWS, jnp.float32)],
    interpret=pltpu.InterpretParams(),
  )
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(ROWS)
  out = f(x)
  assert out.shape == ROWS  # the hidden output does not leak
  np.testing.assert_array_equal(out, x)


def ring_shift(x, mesh, check_vma=False, interpret=None):
  """Each device sends its shard to the right neighbour (a remote DMA)."""
  return jax.jit(
    functools.partial(
      demos.ring_shift, mesh=mesh, check_vma=check_vma, interpret=interpret
    )
  )(x)


@pytest.mark.slow
def test_trap3_eight_devices_with_large_buffers():
  """Upstream's callbacks hung with 4+ devices once buffers exceed a few KB.

  (interpret=None would take the lockstep path, which has no callbacks.)
  """
  mesh = jax.make_mesh((8,), ("x",))
  rows = 8 * 512  # 256 KiB per device
  x = jnp.arange(rows * 128, dtype=jnp.float32).reshape(rows, 128)
  x = jax.device_put(x, jax.NamedSharding(mesh, P("x")))
  with mpmd.deadlock_timeout(60.0):
    np.testing.assert_array_equal(
      ring_shift(x, mesh, interpret=pltpu.InterpretParams()),
      np.roll(np.asarray(x), rows // 8, axis=0),
    )


def test_trap4_emit_pipeline_inside_shard_map_on_cpu():
  """TPU facts while tracing, without leaking a TPU mesh into shard_map."""
  mesh = jax.make_mesh((2,), ("x",))
  core = mpmd.tensorcore_mesh("core", num_cores=1)

  def kernel(x_hbm, o_hbm):
    pltpu.emit_pipeline(
      lambda i, o: o.__setitem__(..., i[...] * 2.0),
      grid=(2,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
    )(x_hbm, o_hbm)

  def per_device(x):
    return mpmd.mpmd_map(
      [(core, kernel)], jax.ShapeDtypeStruct(x.shape, x.dtype)
    )(x)

  f = jax.jit(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False
    )
  )
  x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
  x = jax.device_put(x, jax.NamedSharding(mesh, P("x")))
  np.testing.assert_array_equal(f(x), 2.0 * x)
  text = f.trace(x).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text


@pytest.mark.parametrize("name", ["v5e", "v6e", "v5p"])
def test_trap4_every_module_pallas_asks_answers_the_target(name):
  """jax 0.11 moved tpu_info and left a re-exporting module where Pallas
  looks the queries up: the target must answer through both."""
  from mpmd import _jax

  target = mpmd.TPU_TARGETS[name]
  with mpmd.tpu_target(name):
    for module in _jax.tpu().info_modules:
      assert module.get_device_kind() == target.device_kind
      assert module.get_num_device_cores() == target.num_cores
      assert module.get_tpu_info().num_cores == target.num_cores
    assert mpmd.tensorcore_mesh("core").shape == {"core": target.num_cores}


def test_trap4_the_simulator_asks_for_tilings_at_run_time():
  """buffer_bounds="padded" pads buffers to the TPU's tiling in a callback,
  at run time: the target answers there too, and only there."""
  mesh = mpmd.tensorcore_mesh("core", num_cores=2)

  def kernel(x_hbm, o_hbm, buf):
    c = jax.lax.axis_index("core")
    pltpu.sync_copy(x_hbm.at[c], buf)
    buf[...] += 1.0
    pltpu.sync_copy(buf, o_hbm.at[c])

  f = mpmd.mpmd_map(
    [(mesh, kernel)],
    jax.ShapeDtypeStruct((2, 5, 100), jnp.float32),
    scratch_types=[pltpu.VMEM((5, 100), jnp.float32)],
    interpret=pltpu.InterpretParams(buffer_bounds="padded"),
  )
  x = jnp.arange(2 * 5 * 100, dtype=jnp.float32).reshape(2, 5, 100)
  np.testing.assert_array_equal(f(x), x + 1.0)
  assert not _jax.tpu().info.is_tpu_device()  # outside: JAX's own answer


def test_trap5_axis_index_inside_loops_and_conds_on_the_fast_path(capsys):
  """The HLO interpreter knows no mesh axis_index, nor program_id in loops."""
  mesh = mpmd.tensorcore_mesh("core", num_cores=2)

  def kernel(x_hbm, o_hbm, buf):
    def step(i, carry):
      c = jax.lax.axis_index("core")

      @pl.when(c == 1)
      def _():
        pltpu.sync_copy(x_hbm.at[c, i], buf)
        buf[...] = buf[...] * 10.0 + c.astype(jnp.float32)
        pltpu.sync_copy(buf, o_hbm.at[c, i])

      @pl.when(c == 0)
      def _():
        pltpu.sync_copy(x_hbm.at[c, i], o_hbm.at[c, i])

      return carry

    jax.lax.fori_loop(0, 3, step, 0)

  f = mpmd.mpmd_map(
    [(mesh, kernel)],
    jax.ShapeDtypeStruct((2, 3, *ROWS), jnp.float32),
    scratch_types=[pltpu.VMEM(ROWS, jnp.float32)],
    debug=True,
  )
  x = jnp.arange(2 * 3 * 8 * 128, dtype=jnp.float32).reshape(2, 3, *ROWS)
  want = x.at[1].set(x[1] * 10.0 + 1.0)
  np.testing.assert_allclose(f(x), want)
  assert "takes the fast path" in capsys.readouterr().out


@pytest.mark.parametrize(
  "interpret", [None, pltpu.InterpretParams()], ids=["lockstep", "simulator"]
)
def test_shard_map_with_check_vma_and_typed_outputs(rng, interpret):
  """Out types say how they vary (``jax.typeof(block)``); device-index
  arithmetic in the kernel runs on the CPU paths although kernels are
  traced without vma."""
  mesh = jax.make_mesh((4,), ("x",))
  x = jnp.asarray(rng.standard_normal((4 * 8, 128)), jnp.float32)
  x = jax.device_put(x, jax.NamedSharding(mesh, P("x")))
  out = ring_shift(x, mesh, check_vma=True, interpret=interpret)
  np.testing.assert_array_equal(out, np.roll(np.asarray(x), 8, axis=0))


def test_simulator_launches_compile_once():
  """jax 0.10.2's TPU simulator recompiled every program of a multi-core
  launch on every call; a repeated launch must compile nothing."""
  mesh = mpmd.tensorcore_mesh("core", num_cores=2)

  def kernel(x_hbm, o_hbm, sem, buf):
    c = jax.lax.axis_index("core")
    pl.semaphore_signal(sem, 1, core_index=1 - c)
    pl.semaphore_wait(sem, 1)
    pltpu.sync_copy(x_hbm.at[c], buf)
    buf[...] += 1.0
    pltpu.sync_copy(buf, o_hbm.at[c])

  f = jax.jit(
    mpmd.mpmd_map(
      [(mesh, kernel)],
      jax.ShapeDtypeStruct((2, *ROWS), jnp.float32),
      scratch_types=[
        pltpu.SemaphoreType.REGULAR(()),
        pltpu.VMEM(ROWS, jnp.float32),
      ],
    )
  )
  x = jnp.ones((2, *ROWS), jnp.float32)
  np.testing.assert_array_equal(f(x), x + 1.0)  # compiles what it needs
  compiles = []

  def count(event, duration, **kwargs):
    del duration, kwargs
    if "backend_compile" in event:
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    for _ in range(3):
      np.testing.assert_array_equal(f(x), x + 1.0)
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  assert compiles == []
