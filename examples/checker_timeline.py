"""Every schedule, not one: check a kernel, find a bug, replay it, draw it.

1. The ring ``all_gather_matmul`` on a 2x2 mesh of 4 CPU devices (a ring of
   two along ``y`` for each value of ``x``) runs under 16 schedules of the
   checking executor (``mpmd.explore``): clean, and each result equal to
   the normal run's.
2. Its timeline (``mpmd.timeline``) goes to ``all_gather_matmul.json`` in
   the temporary directory (or the path given):
   open it in https://ui.perfetto.dev or chrome://tracing (a process per
   device, a thread per program and one for DMAs, arrows from each signal
   to the wait it released; time in scheduler steps, not hardware time).
3. A kernel of two programs with a missing wait: ``explore`` finds the race,
   ``replay`` runs the failing schedule again, and raises the same error.

Run: ``python examples/checker_timeline.py [trace.json]`` (CPU, 4 devices).
"""

import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)

import functools  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mpmd  # noqa: E402
from mpmd.kernels import all_gather_matmul  # noqa: E402

N, K, M = 32, 256, 128


def collective_matmul():
  mesh = jax.make_mesh((2, 2), ("x", "y"))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((N, K)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((K, M)) / np.sqrt(K), jnp.float32)
  x = jax.device_put(x, NamedSharding(mesh, P("x", "y")))
  w = jax.device_put(w, NamedSharding(mesh, P(None, None)))
  f = jax.jit(
    jax.shard_map(
      lambda a, b: all_gather_matmul(
        a, b, axis_name="y", implementation="ring"
      ),
      mesh=mesh,
      in_specs=(P("x", "y"), P(None, None)),
      out_specs=P("x", None),
      check_vma=False,
    )
  )
  return f, (x, w)


def staged_copy(x, synchronised=True):
  """Program 0 stages ``x`` in shared HBM; program 1 copies it out."""

  def kernel(x_hbm, o_hbm, staged, ready):
    core = jax.lax.axis_index("core")

    @pl.when(core == 0)
    def _():
      pltpu.sync_copy(x_hbm, staged)
      if synchronised:
        pl.semaphore_signal(ready, 1, core_index=1)

    @pl.when(core == 1)
    def _():
      if synchronised:
        pl.semaphore_wait(ready, 1)
      pltpu.sync_copy(staged, o_hbm)

  return mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=2), kernel)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[pltpu.HBM(x.shape, x.dtype), pltpu.SemaphoreType.REGULAR],
  )(x)


def main(path: str) -> None:
  f, args = collective_matmul()
  report = mpmd.explore(f, *args, schedules=16)
  assert not report.failures, report
  want = jnp.dot(*(np.asarray(a) for a in args), precision="highest")
  out = mpmd.replay(f, *args, schedule="pct3:5")
  np.testing.assert_allclose(out, want, rtol=3e-5, atol=3e-5)
  print(f"all_gather_matmul, 2x2 mesh: {report}; matches jnp.dot: OK")
  mpmd.timeline(f, *args, path=path, schedule="random:1")
  print(f"timeline written to {path} (open it in ui.perfetto.dev)")

  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  assert not mpmd.explore(staged_copy, x, schedules=8).failures
  racy = functools.partial(staged_copy, synchronised=False)
  [failure] = mpmd.explore(racy, x, schedules=8).failures
  print(f"without the wait: {failure.kind}, schedule {failure.schedule!r}")
  try:
    mpmd.replay(racy, x, schedule=failure.schedule)
  except mpmd.RaceError as e:
    print("replayed:", str(e).splitlines()[0][:100], "...")
  else:
    raise SystemExit("FAIL: the race did not replay")


if __name__ == "__main__":
  default = os.path.join(tempfile.gettempdir(), "all_gather_matmul.json")
  main(sys.argv[1] if len(sys.argv) > 1 else default)
