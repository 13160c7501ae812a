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


def test_checked_launch_with_real_arithmetic_on_four_devices():
  run = run_python(
    SCRIPT,
    timeout=120,
    hang="the checked launch hung inside the devices' host callbacks",
  )
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.strip() == "OK"
