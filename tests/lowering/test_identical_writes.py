"""Unordered writes of the same bytes: a race the checker reports when
asked to check (``CheckParams()``), and not on the CPU fallback's default
path, which runs such launches on the checker unasked and must mean what
upstream's simulator means (two cores copying one array to one place)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import mpmd

ROWS, COLS = 8, 128
X = jnp.arange(ROWS * COLS, dtype=jnp.float32).reshape(ROWS, COLS)


def _handshake(sem):
  # The cores wait on each other: no lockstep path, the checker runs it.
  c = jax.lax.axis_index("core")
  pl.semaphore_signal(sem, 1, core_index=1 - c)
  pl.semaphore_wait(sem, 1)
  return c


def both_copy(x_hbm, o_hbm, sem):
  _handshake(sem)
  pltpu.sync_copy(x_hbm, o_hbm)


def each_its_own(x_hbm, o_hbm, sem, buf):
  c = _handshake(sem)
  pltpu.sync_copy(x_hbm, buf)
  buf[...] = buf[...] + c.astype(jnp.float32)
  pltpu.sync_copy(buf, o_hbm)


def _launch(kernel, interpret, scratch=()):
  return jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=2), kernel)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[pltpu.SemaphoreType.REGULAR, *scratch],
      interpret=interpret,
    )
  )


def test_the_default_path_runs_cores_that_copy_the_same_bytes():
  np.testing.assert_array_equal(_launch(both_copy, None)(X), X)


def test_asked_to_check_it_is_a_race():
  with pytest.raises(mpmd.RaceError, match="data race on"):
    with mpmd.typed_errors():
      jax.block_until_ready(_launch(both_copy, mpmd.CheckParams())(X))


def test_the_race_can_be_switched_off():
  params = mpmd.CheckParams(schedule="random:1", identical_writes_race=False)
  np.testing.assert_array_equal(_launch(both_copy, params)(X), X)


@pytest.mark.parametrize("interpret", [None, mpmd.CheckParams()])
def test_writes_of_different_bytes_race_on_every_path(interpret):
  f = _launch(each_its_own, interpret, [pltpu.VMEM((ROWS, COLS), jnp.float32)])
  with pytest.raises(mpmd.RaceError, match="data race on") as caught:
    with mpmd.typed_errors():
      jax.block_until_ready(f(X))
  # The rerun it suggests checks as this path did.
  option = "identical_writes_race=False"
  assert (option in str(caught.value)) == (interpret is None)


# -- programs that never wait on each other (the fast path's launches) --------


def _copies(kernel, debug=False):
  return jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=2), kernel)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[pltpu.VMEM((ROWS, COLS), jnp.float32)],
      debug=debug,
    )
  )


def copy_plus_core(x_hbm, o_hbm, buf):
  pltpu.sync_copy(x_hbm, buf)
  buf[...] = buf[...] + jax.lax.axis_index("core").astype(jnp.float32)
  pltpu.sync_copy(buf, o_hbm)  # both cores, all rows: different bytes


def copy_as_is(x_hbm, o_hbm, buf):
  pltpu.sync_copy(x_hbm, buf)
  pltpu.sync_copy(buf, o_hbm)  # both cores, all rows: the same bytes


def test_programs_that_never_wait_race_on_writes_of_different_bytes(capsys):
  # The fast path proves nothing about bytes: it hands the launch to the
  # checking executor (it ran the programs one after the other, and the
  # last one's rows came out, whatever the hardware would keep).
  with pytest.raises(mpmd.RaceError, match="data race on 'o_hbm'"):
    with mpmd.typed_errors():
      jax.block_until_ready(_copies(copy_plus_core, debug=True)(X))
  # Both write at the kernel's last line, named in the message.
  line = copy_plus_core.__code__.co_firstlineno + 3
  write = f"{__file__}:{line}:2 (copy_plus_core)"
  assert (
    f"the checking executor runs it instead: mesh 0 program 0 (core=0) at "
    f"{write} and mesh 0 program 1 (core=1) at {write} write 1024 elements "
    "of 'o_hbm'"
  ) in capsys.readouterr().out


def test_programs_that_never_wait_may_write_the_same_bytes():
  np.testing.assert_array_equal(_copies(copy_as_is)(X), X)


def test_where_callbacks_cannot_go_the_fast_path_keeps_the_launch():
  """Exports, shard_maps manual over some axes only and interpret=True keep
  the fast path's meaning (the last program's bytes): the checking
  executor's host callbacks cannot go there, or were not asked for."""
  exported = jax.export.export(_copies(copy_as_is), platforms=("cpu",))(X)
  np.testing.assert_array_equal(exported.call(X), X)
  last = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=2), copy_plus_core)],
    jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
    scratch_types=[pltpu.VMEM((ROWS, COLS), jnp.float32)],
    interpret=True,
  )
  np.testing.assert_array_equal(jax.jit(last)(X), X + 1.0)
  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4])
  partial = jax.jit(
    jax.shard_map(
      _copies(copy_as_is),
      mesh=mesh,
      in_specs=jax.P("x"),
      out_specs=jax.P("x"),
      axis_names={"x"},
      check_vma=False,
    )
  )
  xs = jax.device_put(
    jnp.concatenate([X, X]), jax.sharding.NamedSharding(mesh, jax.P("x"))
  )
  np.testing.assert_array_equal(partial(xs), xs)
