"""The checking executor inside the host callbacks of a multi-device program.

Under ``shard_map`` every device calls back into the launch. On jax 0.10
those callbacks hold the threads of the pool that runs the process's
computations, so the executor must run a kernel's arithmetic where a thread
is free (``lowering/check/host_client.py``). The kernel here does enough
arithmetic (a 256 x 256 matmul per program) to need that pool; it runs in a
child process so that a hang ends as a failure of this test, not of the run.
"""

import textwrap

from python_runs import run_python

SCRIPT = textwrap.dedent(
  """
  import jax, jax.numpy as jnp, numpy as np
  jax.config.update("jax_num_cpu_devices", 4)
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  from jax.sharding import NamedSharding, PartitionSpec as P
  import mpmd

  N = 256
  mesh = mpmd.tensorcore_mesh("core", num_cores=1)

  def square(x_hbm, o_hbm, buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] = jnp.dot(buf[...], buf[...], precision="highest")
    pltpu.sync_copy(buf, o_hbm)

  launch = mpmd.mpmd_map(
    [(mesh, square)],
    out_types=jax.ShapeDtypeStruct((N, N), jnp.float32),
    scratch_types=[pltpu.VMEM((N, N), jnp.float32)],
    interpret=mpmd.CheckParams(schedule="random:3"),
  )
  devices = jax.make_mesh((4,), ("x",))
  f = jax.jit(jax.shard_map(
    lambda x: launch(x[0])[None], mesh=devices,
    in_specs=P("x"), out_specs=P("x"), check_vma=False,
  ))
  x = np.random.default_rng(0).standard_normal((4, N, N)).astype(np.float32)
  got = f(jax.device_put(x, NamedSharding(devices, P("x"))))
  want = np.einsum("dij,djk->dik", x.astype(np.float64), x.astype(np.float64))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-3)
  print("OK")
  """
)


def _prints_ok(script: str, timeout: float, hang: str) -> None:
  run = run_python(script, timeout=timeout, hang=hang)
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.strip() == "OK"


def test_checked_launch_with_real_arithmetic_on_four_devices():
  _prints_ok(
    SCRIPT, 120, "the checked launch hung inside the devices' host callbacks"
  )


# Calls of one jitted launch from several threads at once, each with inputs
# of its own, one in three failing (a DMA window past its buffer): each
# call's devices must share that call's run (keyed by the tickets their
# all-gather hands them, lowering/check/launch.py), and nothing stays
# deposited or waiting once every call has returned.
CONCURRENT = textwrap.dedent(
  """
  import concurrent.futures, gc
  import jax, jax.numpy as jnp, numpy as np
  jax.config.update("jax_num_cpu_devices", 4)
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  from jax.sharding import NamedSharding, PartitionSpec as P
  import mpmd
  from mpmd._lowering.check import launch as launch_lib

  mesh = mpmd.tensorcore_mesh("core", num_cores=1)

  def window(start_hbm, x_hbm, o_hbm, start_smem, buf):
    pltpu.sync_copy(start_hbm, start_smem)
    pltpu.sync_copy(x_hbm.at[pl.ds(start_smem[0], 8)], buf)
    buf[...] = buf[...] * 2.0
    pltpu.sync_copy(buf, o_hbm)

  launch = mpmd.mpmd_map(
    [(mesh, window)],
    out_types=jax.ShapeDtypeStruct((8, 128), jnp.float32),
    scratch_types=[
      pltpu.SMEM((1,), jnp.int32), pltpu.VMEM((8, 128), jnp.float32)
    ],
    interpret=mpmd.CheckParams(schedule="random:1"),
  )
  devices = jax.make_mesh((4,), ("x",))
  f = jax.jit(jax.shard_map(
    lambda s, x: launch(s, x[0])[None], mesh=devices,
    in_specs=(P(), P("x")), out_specs=P("x"), check_vma=False,
  ))
  sharded = NamedSharding(devices, P("x"))

  def call(k):
    start = np.array([8 * (k % 2) if k % 3 else 12], np.int32)
    x = np.arange(4 * 16 * 128, dtype=np.float32).reshape(4, 16, 128) + k
    try:
      with mpmd.typed_errors():
        got = np.asarray(f(start, jax.device_put(x, sharded)))
    except mpmd.OutOfBoundsError:
      return "out of bounds" if k % 3 == 0 else f"call {k}: unexpected"
    want = 2 * x[:, start[0] : start[0] + 8]
    return "ok" if np.array_equal(got, want) else f"call {k}: wrong numbers"

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    outcomes = list(pool.map(call, range(24)))
  expected = ["out of bounds" if k % 3 == 0 else "ok" for k in range(24)]
  assert outcomes == expected, outcomes
  [held] = [o for o in gc.get_objects() if isinstance(o, launch_lib.Launch)]
  assert not held.deposits and not held.results, (held.deposits, held.results)
  print("OK")
  """
)


def test_concurrent_calls_share_their_own_run_and_leave_nothing_behind():
  _prints_ok(
    CONCURRENT, 180, "concurrent checked launches hung in the callbacks"
  )
