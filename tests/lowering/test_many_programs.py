"""Simulator launches of more programs than XLA:CPU runs at once.

XLA:CPU runs at most 32 computations at once on a device, and the
simulators run each program as one that blocks while it waits: a launch of
2 SparseCores x 16 vector subcores + 2 scalar subcores (34 programs) used
to deadlock, its waits short of their count as though signals were lost
(issue 36, item 1). Programs past ``host_programs.compiled_limit()`` now
run on the host.
"""

import threading

import addressing_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd import _patches
from mpmd._lowering import host_programs

NUM_CORES, NUM_SUBCORES = 2, 16
SIMULATOR = pltpu.InterpretParams()  # the threaded simulator
NUM_PROGRAMS = NUM_CORES * NUM_SUBCORES + NUM_CORES  # 34: past XLA's 32


@pytest.fixture
def on_host(monkeypatch):
  """Counts the programs that run on the host."""
  runs = []
  run = host_programs.run_on_host

  def counted(*args):
    runs.append(1)
    return run(*args)

  monkeypatch.setattr(host_programs, "run_on_host", counted)
  return runs


@pytest.fixture(autouse=True)
def sparsecores():
  with mpmd.tpu_target("v7x"):
    yield


def _meshes(num_subcores=NUM_SUBCORES):
  return addressing_util.sc_meshes(
    NUM_CORES, subcores=num_subcores, core_axis="core"
  )


def _barrier(mine, scalar_sem, vector_sem):
  """Every program signals every program once, then waits for them all."""
  num_cores = jax.lax.axis_size("core")
  num_subcores = jax.lax.axis_size("subcore")
  for i in range(num_cores):
    pl.semaphore_signal(scalar_sem, device_id={"core": i})
    for j in range(num_subcores):
      pl.semaphore_signal(vector_sem, device_id={"core": i, "subcore": j})
  pl.semaphore_wait(mine, num_cores + num_cores * num_subcores)


def all_to_all_barrier(num_subcores=NUM_SUBCORES, interpret=SIMULATOR):
  """The reproducer: an all-to-all semaphore barrier over the scalar and
  vector subcores of 2 SparseCores; each vector subcore then writes its
  row."""
  vector, scalar = _meshes(num_subcores)

  def vector_fn(o_hbm, vector_sem, scalar_sem, row):
    _barrier(vector_sem, scalar_sem, vector_sem)
    c, s = jax.lax.axis_index("core"), jax.lax.axis_index("subcore")
    row[...] = jnp.full((16,), c * num_subcores + s, jnp.int32)
    pltpu.sync_copy(row, o_hbm.at[c * num_subcores + s])

  def scalar_fn(o_hbm, vector_sem, scalar_sem, row):
    del o_hbm, row
    _barrier(scalar_sem, scalar_sem, vector_sem)

  return jax.jit(
    mpmd.mpmd_map(
      [(vector, vector_fn), (scalar, scalar_fn)],
      jax.ShapeDtypeStruct((NUM_CORES * num_subcores, 16), jnp.int32),
      scratch_types=[
        pltpu.SemaphoreType.REGULAR(()) @ vector,
        pltpu.SemaphoreType.REGULAR(()) @ scalar,
        (pltpu.VMEM @ vector)((16,), jnp.int32),
      ],
      # The threaded simulator, which these tests are about (by default
      # the checking executor runs it, one program at a time).
      interpret=interpret,
    )
  )


def test_all_to_all_barrier_of_34_programs_on_the_checking_executor():
  """The default for programs that wait on each other: one at a time, so
  the count of concurrent computations does not matter."""
  f = all_to_all_barrier(interpret=None)
  np.testing.assert_array_equal(f(), _expected())


def _expected(num_subcores=NUM_SUBCORES):
  rows = np.arange(NUM_CORES * num_subcores, dtype=np.int32)
  return np.repeat(rows[:, None], 16, axis=1)


def test_all_to_all_barrier_of_34_programs_completes(on_host):
  f = all_to_all_barrier()
  with mpmd.deadlock_timeout(30.0):
    for _ in range(3):
      np.testing.assert_array_equal(f(), _expected())
  assert len(on_host) >= 3 * (NUM_PROGRAMS - host_programs.compiled_limit())


def test_the_34_programs_deadlock_when_all_run_compiled():
  """The cause: with every program compiled (upstream's way), XLA:CPU
  starts 32 and the launch deadlocks; this proves the test above can
  fail."""
  f = all_to_all_barrier()
  with host_programs.limit_compiled(NUM_PROGRAMS):
    with mpmd.deadlock_timeout(2.0):
      with pytest.raises(mpmd.DeadlockError, match=r"waits on the semaphore"):
        with mpmd.typed_errors():
          jax.block_until_ready(f())
  # The process stays healthy: the next launch runs.
  np.testing.assert_array_equal(f(), _expected())


def test_the_routing_took_effect():
  all_to_all_barrier(num_subcores=2)()
  assert _patches.installed()["simulator_programs"]


@pytest.mark.parametrize("limit", [0, 5])
def test_programs_run_on_the_host_compute_what_compiled_ones_do(limit, on_host):
  """Loops, branches, DMAs and semaphores inside programs that run on the
  host (``limit`` compiled at once, the rest on the host)."""
  vector, scalar = _meshes(num_subcores=4)
  x = jnp.arange(NUM_CORES * 4 * 16, dtype=jnp.int32).reshape(-1, 16)

  def vector_fn(x_hbm, o_hbm, done, buf):
    c, s = jax.lax.axis_index("core"), jax.lax.axis_index("subcore")
    row = c * 4 + s
    pltpu.sync_copy(x_hbm.at[row], buf)

    @pl.loop(0, 3)
    def _(i):
      buf[...] = buf[...] + i

    @pl.when(s % 2 == 0)
    def _():
      buf[...] = -buf[...]

    pltpu.sync_copy(buf, o_hbm.at[row])
    pl.semaphore_signal(done, 1, device_id={"core": c})

  def scalar_fn(x_hbm, o_hbm, done, buf):
    del x_hbm, o_hbm, buf
    pl.semaphore_wait(done, 4)

  f = jax.jit(
    mpmd.mpmd_map(
      [(vector, vector_fn), (scalar, scalar_fn)],
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_types=[
        pltpu.SemaphoreType.REGULAR(()) @ scalar,
        (pltpu.VMEM @ vector)((16,), jnp.int32),
      ],
      interpret=pltpu.InterpretParams(),  # the threaded simulator
    )
  )
  expected = np.asarray(x) + 3
  expected[0::2] = -expected[0::2]
  with host_programs.limit_compiled(limit):
    np.testing.assert_array_equal(f(x), expected)
  assert len(on_host) >= NUM_CORES * 4 + NUM_CORES - limit


def test_gpu_programs_run_on_the_host_too(on_host):
  memory = plgpu.Mesh(num_threads=1, thread_name="memory")
  compute = plgpu.Mesh(num_threads=2, thread_name="compute")

  def load(x_ref, o_ref, smem, loaded):
    plgpu.copy_gmem_to_smem(x_ref, smem, loaded)

  def use(x_ref, o_ref, smem, loaded):
    plgpu.barrier_wait(loaded)
    rows = pl.ds(jax.lax.axis_index("compute") * 64, 64)
    o_ref[rows, :] = smem[rows, :] * 2.0

  f = mpmd.mpmd_map(
    [(memory, load), (compute, use)],
    jax.ShapeDtypeStruct((128, 128), jnp.float32),
    scratch_types=[
      plgpu.SMEM((128, 128), jnp.float32),
      plgpu.Barrier(num_arrivals=1),
    ],
  )
  x = jnp.arange(128 * 128, dtype=jnp.float32).reshape(128, 128)
  with host_programs.limit_compiled(0):
    np.testing.assert_array_equal(f(x), 2.0 * x)
  assert len(on_host) >= 3  # the three warpgroups


def test_limit_compiled_checks_its_argument():
  with pytest.raises(ValueError, match=r"expected 'limit' >= 0, got -1"):
    with host_programs.limit_compiled(-1):
      pass


@pytest.mark.parametrize(
  "launches", [10, pytest.param(200, marks=pytest.mark.slow)]
)
def test_stress_all_to_all_barrier(launches):
  f = all_to_all_barrier()
  expected = _expected()
  with mpmd.deadlock_timeout(30.0):
    for _ in range(launches):
      np.testing.assert_array_equal(f(), expected)


def test_the_limit_holds_in_every_thread_and_is_restored():
  """The simulated programs run in the simulators' threads: the limit set
  in this one is the one they read (XLA:CPU's room is process-wide), and
  it is back to the default afterwards."""
  default = host_programs.compiled_limit()
  seen = []
  with host_programs.limit_compiled(3):
    thread = threading.Thread(
      target=lambda: seen.append(host_programs.compiled_limit())
    )
    thread.start()
    thread.join()
  assert seen == [3]
  assert host_programs.compiled_limit() == default == 16
