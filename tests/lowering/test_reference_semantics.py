"""The checking executor is the CPU fallback's reference semantics.

The fast path (programs one after another) and the lockstep path (devices
in step, remote operations as XLA collectives) are optimisations of it:
on the same cases they give the same outputs, bit for bit, and fail with
the same error types. Each case runs on its default path (asserted) and
through ``mpmd.replay`` under the checker's default schedule and a random
one.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rings
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from launches import kernel_path

import mpmd
from mpmd import demos
from mpmd._lowering import paths
from mpmd.kernels import all_gather_matmul, gmm, matmul_reduce_scatter

ROWS, COLS = 8, 128
D = 4


def _mesh():
  return jax.make_mesh((D,), ("x",), devices=jax.devices()[:D])


def _sharded(fn, in_specs, out_specs):
  return jax.jit(
    jax.shard_map(
      fn,
      mesh=_mesh(),
      in_specs=in_specs,
      out_specs=out_specs,
      check_vma=False,
    )
  )


def _put(x, spec):
  return jax.device_put(x, NamedSharding(_mesh(), spec))


def _quickstart():
  x = jnp.arange(ROWS * COLS, dtype=jnp.float32).reshape(ROWS, COLS)
  return jax.jit(demos.axpy), (x, x + 1), paths.FAST


def _ring_shift():
  x = jnp.arange(D * ROWS * COLS, dtype=jnp.float32).reshape(-1, COLS)
  f = jax.jit(functools.partial(demos.ring_shift, mesh=_mesh()))
  return f, (_put(x, P("x")),), paths.LOCKSTEP


def _collective(kind):
  rng = np.random.default_rng(1)
  m, k, n = 8 * D, 128 * D, 128
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
  if kind == "all_gather_matmul":
    specs, out = (P(None, "x"), P()), P("x")
    fn = functools.partial(
      all_gather_matmul, axis_name="x", implementation="ring"
    )
  else:
    specs, out = (P(None, "x"), P("x")), P("x")
    fn = functools.partial(
      matmul_reduce_scatter, axis_name="x", implementation="ring"
    )
  args = tuple(_put(a, s) for a, s in zip((lhs, rhs), specs, strict=True))
  return _sharded(fn, specs, out), args, paths.LOCKSTEP


def _gmm():
  rng = np.random.default_rng(2)
  lhs = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((3, 128, 128)), jnp.float32)
  sizes = jnp.array([20, 0, 44], jnp.int32)
  f = jax.jit(functools.partial(gmm, tiling=(32, 128, 128)))
  return f, (lhs, rhs, sizes), paths.FAST


CASES = {
  "quickstart": _quickstart,
  "ring_shift": _ring_shift,
  "all_gather_matmul": functools.partial(_collective, "all_gather_matmul"),
  "matmul_reduce_scatter": functools.partial(
    _collective, "matmul_reduce_scatter"
  ),
  "gmm": _gmm,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_outputs_equal_the_checkers(name):
  f, args, path = CASES[name]()
  assert kernel_path(f, *args).kind == path
  want = jax.tree.leaves(f(*args))
  for schedule in ("default", "random:3"):
    got = jax.tree.leaves(mpmd.replay(f, *args, schedule=schedule))
    for a, b in zip(got, want, strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- the same failures --------------------------------------------------------


def _launch(body, scratch, num_cores=1):
  return jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=num_cores), body)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=scratch,
    )
  )


def _waits_for_nothing(x_hbm, o_hbm, sem):
  pltpu.sync_copy(x_hbm, o_hbm)
  pl.semaphore_wait(sem, 1)


def _signals_for_nobody(x_hbm, o_hbm, sem):
  pltpu.sync_copy(x_hbm, o_hbm)
  pl.semaphore_signal(sem, 1)


def _window_past_the_end(x_hbm, o_hbm, start_smem):
  start_smem[0] = jax.lax.axis_index("core") + ROWS  # known at run time
  pltpu.sync_copy(x_hbm.at[pl.ds(start_smem[0], ROWS)], o_hbm)


def _remote_wait_for_nothing(x_hbm, o_hbm, send, recv, sem):
  rings.copy_to_right(x_hbm, o_hbm, send, recv, D).wait()
  pl.semaphore_wait(sem, 1)  # nobody signals it


def _remote_signal_for_nobody(x_hbm, o_hbm, send, recv, sem):
  rings.copy_to_right(x_hbm, o_hbm, send, recv, D).wait()
  right = jax.lax.rem(jax.lax.axis_index("x") + 1, D)
  pl.semaphore_signal(sem, 1, device_id={"x": right})  # nobody waits


def _per_device(body):
  def per_device(x):
    return mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), body)],
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_types=[
        pltpu.SemaphoreType.DMA(()),
        pltpu.SemaphoreType.DMA(()),
        pltpu.SemaphoreType.REGULAR(()),
      ],
    )(x)

  return _sharded(per_device, P("x"), P("x"))


FAILURES = {
  "deadlock_fast": (
    lambda: _launch(_waits_for_nothing, [pltpu.SemaphoreType.REGULAR(())]),
    mpmd.DeadlockError,
    paths.FAST,
  ),
  "leftover_fast": (
    lambda: _launch(_signals_for_nobody, [pltpu.SemaphoreType.REGULAR(())]),
    mpmd.LeftoverError,
    paths.FAST,
  ),
  "out_of_bounds_fast": (
    lambda: _launch(
      _window_past_the_end, [pltpu.SMEM((1,), jnp.int32)], num_cores=2
    ),
    mpmd.OutOfBoundsError,
    paths.FAST,
  ),
  "deadlock_lockstep": (
    lambda: _per_device(_remote_wait_for_nothing),
    mpmd.DeadlockError,
    paths.LOCKSTEP,
  ),
  "leftover_lockstep": (
    lambda: _per_device(_remote_signal_for_nobody),
    mpmd.LeftoverError,
    paths.LOCKSTEP,
  ),
}


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_failures_are_the_checkers(name):
  build, error, path = FAILURES[name]
  f = build()
  x = jnp.arange(D * ROWS * COLS, dtype=jnp.float32).reshape(-1, COLS)
  if path == paths.LOCKSTEP:
    x = _put(x, P("x"))
  else:
    x = x[:ROWS]
  assert kernel_path(f, x).kind == path
  with pytest.raises(error):
    with mpmd.typed_errors():
      jax.block_until_ready(f(x))
  with pytest.raises(error):
    mpmd.replay(f, x, schedule="default")
