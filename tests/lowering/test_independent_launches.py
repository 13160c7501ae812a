"""Simulator launches of one ``jax.jit`` that do not depend on each other.

XLA:CPU runs the host callbacks of one execution on one thread. Were a
launch's simulated operations callbacks of the caller's computation, the
second launch's first callback could take that thread, waiting for the
simulator, while the first launch still needed it: ``jax.jit(lambda x, y:
(g(x), g(y)))`` hung (issue 36). Each case runs in a subprocess with a
timeout, since it can hang.

On jax 0.10 the simulation stays in the caller's computation (see
``SIMULATE_DEVICES_AS_COMPUTATIONS`` in mpmd/_jax.py); there such launches
either complete or, when XLA interleaves them, end in a DeadlockError that
says so, after which the process runs launches again.
"""

import textwrap

import pytest
from python_runs import run_python

from mpmd import _jax

_TIMEOUT_S = 240  # a few seconds when they complete

_PRELUDE = """
import jax
jax.config.update("jax_num_cpu_devices", 2)
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import PartitionSpec as P
import mpmd

ROWS = (8, 128)
x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(ROWS)
y = -x


def copy(x_hbm, o_hbm):
  pltpu.sync_copy(x_hbm, o_hbm)


def tpu_launch(body, **kwargs):
  return mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), body)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    interpret=pltpu.InterpretParams(),
    **kwargs,
  )
"""

_CASES = {
  # The case: one launch function, twice, independent.
  "same_launch_twice": """
g = jax.jit(lambda x, y: (tpu_launch(copy)(x), tpu_launch(copy)(y)))
for _ in range(3):
  a, b = jax.block_until_ready(g(x, y))
  np.testing.assert_array_equal(a, x)
  np.testing.assert_array_equal(b, y)
""",
  # Two different kernels, each on two cores that wait on each other, on
  # both devices of a shard_map.
  "two_kernels_under_shard_map": """
def handshake(x_hbm, o_hbm, sem):
  c = jax.lax.axis_index("core")
  pl.semaphore_signal(sem, 1, core_index=1 - c)
  pl.semaphore_wait(sem, 1)

  @pl.when(c == 0)
  def _():
    pltpu.sync_copy(x_hbm, o_hbm)

def launch(body, scale):
  f = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=2), body)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR(())],
    interpret=pltpu.InterpretParams(),
  )
  return lambda v: f(v * scale)

mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
both = jax.jit(jax.shard_map(
  lambda x, y: (launch(handshake, 2.0)(x), launch(handshake, 3.0)(y)),
  mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))
rows = jax.NamedSharding(mesh, P("d"))
xs = jax.device_put(jnp.concatenate([x, y]), rows)
ys = jax.device_put(jnp.concatenate([y, x]), rows)
for _ in range(2):
  a, b = jax.block_until_ready(both(xs, ys))
  np.testing.assert_array_equal(a, 2.0 * xs)
  np.testing.assert_array_equal(b, 3.0 * ys)
""",
  # A GPU simulator launch beside a TPU one.
  "gpu_beside_tpu": """
def fill(o_ref):
  o_ref[...] = jnp.ones(ROWS, jnp.float32)

gpu = mpmd.mpmd_map(
  [(plgpu.Mesh(num_threads=2, thread_name="wg"), fill)],
  jax.ShapeDtypeStruct(ROWS, jnp.float32),
  interpret=mpmd.GPUInterpretParams(),
)
g = jax.jit(lambda x: (gpu(), tpu_launch(copy)(x), gpu()))
a, b, c = jax.block_until_ready(g(x))
np.testing.assert_array_equal(b, x)
np.testing.assert_array_equal(a, np.ones(ROWS, np.float32))
np.testing.assert_array_equal(c, a)
""",
  # A launch that fails beside one that works: the typed error, then a
  # healthy process (the same jit runs again with good inputs).
  "a_failure_beside_a_launch": """
def oob(start_hbm, x_hbm, o_hbm, start_smem):
  pltpu.sync_copy(start_hbm, start_smem)
  pltpu.sync_copy(x_hbm.at[pl.ds(start_smem[0], 8)], o_hbm)

bad = tpu_launch(oob, scratch_types=[pltpu.SMEM((1,), jnp.int32)])
g = jax.jit(
  lambda s, x, y: (bad(s, jnp.concatenate([x, y])), tpu_launch(copy)(y))
)
for _ in range(2):
  try:
    with mpmd.typed_errors():
      jax.block_until_ready(g(jnp.array([12], jnp.int32), x, y))
  except mpmd.OutOfBoundsError:
    pass
  else:
    raise AssertionError("no OutOfBoundsError")
a, b = jax.block_until_ready(g(jnp.array([8], jnp.int32), x, y))
np.testing.assert_array_equal(a, y)
np.testing.assert_array_equal(b, y)
jax.effects_barrier()
""",
}


# jax 0.10: the case, where XLA interleaves its launches, ends in the typed
# error; then a launch, and two that depend on each other in one jit, run.
_INTERLEAVED = """
try:
  with mpmd.typed_errors():
{case}
except mpmd.DeadlockError as e:
  assert "interleaved" in str(e), e
  print("interleaved")
one = jax.jit(tpu_launch(copy))
np.testing.assert_array_equal(one(x), x)
chained = jax.jit(lambda x: tpu_launch(copy)(tpu_launch(copy)(x)))
np.testing.assert_array_equal(chained(y), y)
"""


@pytest.mark.parametrize("case", sorted(_CASES))
def test_independent_launches_in_one_jit_complete(case):
  body = _CASES[case]
  if not _jax.SIMULATE_DEVICES_AS_COMPUTATIONS:
    body = _INTERLEAVED.format(case=textwrap.indent(body, "    "))
  program = textwrap.dedent(_PRELUDE) + body + "\nprint('done')\n"
  result = run_python(
    program, timeout=_TIMEOUT_S, hang=f"{case}: the launches hung"
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().endswith("done")
  if _jax.SIMULATE_DEVICES_AS_COMPUTATIONS:
    assert "interleaved" not in result.stdout
