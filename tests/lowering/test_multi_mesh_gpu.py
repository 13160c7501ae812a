"""GPU meshes in one launch: warpgroup ranges of one Mosaic GPU kernel, run
in the Mosaic GPU simulator on CPU and cross-lowered for CUDA."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import mpmd
from mpmd._lowering import gpu_simulator
from mpmd.demos import gpu_two_meshes


def _noop(*refs):
  del refs


def test_gpu_two_meshes_run_in_the_simulator_and_lower_for_cuda(rng):
  x = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)
  np.testing.assert_allclose(gpu_two_meshes(x), 2.0 * x)
  text = (
    jax.jit(gpu_two_meshes)
    .trace(x)
    .lower(lowering_platforms=("cuda",))
    .as_text()
  )
  assert re.search(r"custom_call @mosaic_gpu", text)
  [eqn] = jax.make_jaxpr(gpu_two_meshes)(x).eqns
  assert [m.thread_name for m in eqn.params["meshes"]] == ["memory", "compute"]


def test_gpu_barrier_deadlock_names_the_warpgroup():
  memory = plgpu.Mesh(num_threads=1, thread_name="memory")
  compute = plgpu.Mesh(num_threads=2, thread_name="compute")

  def idle(x_ref, o_ref, loaded):
    pass  # never arrives

  def waits(x_ref, o_ref, loaded):
    plgpu.barrier_wait(loaded)
    o_ref[...] = x_ref[...]

  f = mpmd.mpmd_map(
    [(memory, idle), (compute, waits)],
    jax.ShapeDtypeStruct((128, 128), jnp.float32),
    scratch_types=[plgpu.Barrier(num_arrivals=1)],
  )
  with mpmd.deadlock_timeout(1.0):
    # Ended cooperatively (the barrier wakes its waiters), typed, and
    # twice: the first failure left nothing behind.
    for _ in range(2):
      with pytest.raises(
        mpmd.DeadlockError,
        match=r"mpmd_map deadlock(.|\n)*mesh 1 "
        r"program \d \(compute=\d\) waits on a barrier",
      ):
        jax.block_until_ready(f(jnp.ones((128, 128), jnp.float32)))


def _arrivals_past_the_count(interpret):
  """Two warpgroups arrive on a barrier of ``num_arrivals=1``: it completes
  two phases, and each warpgroup's wait for the first is behind it."""
  mesh = plgpu.Mesh(num_threads=2, thread_name="wg")

  def kernel(x_ref, o_ref, bar):
    plgpu.barrier_arrive(bar)
    plgpu.barrier_wait(bar)
    o_ref[...] = x_ref[...]

  f = mpmd.mpmd_map(
    [(mesh, kernel)],
    jax.ShapeDtypeStruct((8, 128), jnp.float32),
    scratch_types=[plgpu.Barrier(num_arrivals=1)],
    interpret=interpret,
  )
  return lambda: jax.block_until_ready(f(jnp.ones((8, 128), jnp.float32)))


def test_gpu_barrier_arrivals_past_its_count_are_a_named_deadlock():
  """Pallas' simulator words it in its own terms (they differ between JAX
  versions); the report names the kernel, the waiter and the line, and
  says why; the checking executor names the barrier too."""
  run = _arrivals_past_the_count(None)
  line = r"\S*test_multi_mesh_gpu.py:\d+"
  # Thread timing decides who sees it first: a waiter behind the barrier,
  # or (0.12) the arrival that completes phase 1 before anyone waited.
  waiter = (
    rf"device 0 mesh 0 program \d \(wg=\d\) waits on a barrier at "
    rf"{line}:\d+ \(\S*kernel\) for a phase that the barrier has already "
    r"completed \(it is at phase 2\)"
  )
  arrival = (
    r"a barrier completed phase 1 before any warpgroup waited for phase 0"
  )
  for _ in range(2):  # the failure leaves nothing behind
    with pytest.raises(
      mpmd.DeadlockError,
      match=rf"kernel kernel at {line}: (?:{waiter}|{arrival}): more "
      r"warpgroups arrive on it than its num_arrivals counts",
    ):
      run()
  with pytest.raises(
    mpmd.DeadlockError,
    match=r"barrier_wait on 'bar' .* 2 phases completed, .*: it is 2 phases "
    r"behind, so more warpgroups arrive on the barrier than its "
    r"num_arrivals counts",
  ):
    _arrivals_past_the_count(mpmd.CheckParams())()


def test_gpu_swizzled_smem_scratch_shared_by_two_meshes(rng):
  memory = plgpu.Mesh(num_threads=1, thread_name="memory")
  compute = plgpu.Mesh(num_threads=1, thread_name="compute")
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def load(x_ref, o_ref, smem, loaded):
    plgpu.copy_gmem_to_smem(x_ref, smem, loaded)

  def use(x_ref, o_ref, smem, loaded):
    plgpu.barrier_wait(loaded)
    # Back to GMEM through the TMA: Mosaic GPU 0.12 finds no GMEM transfer
    # plan for a value in the swizzled layout (its own kernels fail alike).
    smem[...] = smem[...] + 1.0
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  def f(x):
    return mpmd.mpmd_map(
      [(memory, load), (compute, use)],
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_types=[
        plgpu.SMEM(x.shape, x.dtype, transforms=swizzled),
        plgpu.Barrier(num_arrivals=1),
      ],
    )(x)

  x = jnp.asarray(rng.standard_normal((128, 64)), jnp.float16)
  np.testing.assert_array_equal(f(x), x + 1.0)
  text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def _gpu_scoped_body(x_ref, o_ref):
  def scoped(smem, bar):
    wg = jax.lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
      plgpu.copy_gmem_to_smem(x_ref, smem, bar)

    plgpu.barrier_wait(bar)
    rows = pl.ds(wg * 64, 64)
    o_ref[rows, :] = smem[rows, :] * 3.0

  pl.run_scoped(
    scoped,
    plgpu.SMEM((128, 128), jnp.float32),
    plgpu.Barrier(num_arrivals=1),
    collective_axes="wg",
  )


def test_gpu_collective_scope_over_a_mesh_thread_axis(rng):
  mesh = plgpu.Mesh(num_threads=2, thread_name="wg")
  out = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  x = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)
  f = mpmd.mpmd_map([(mesh, _gpu_scoped_body)], out)
  np.testing.assert_allclose(f(x), 3.0 * x)
  other = plgpu.Mesh(num_threads=1, thread_name="other")
  g = mpmd.mpmd_map([(mesh, _gpu_scoped_body), (other, _noop)], out)
  with pytest.raises(
    NotImplementedError,
    match=r"run_scoped\(collective_axes"
    r"=\('wg',\)\) allocates over the warpgroups of mesh 0",
  ):
    g(x)


def test_an_arrival_that_completes_an_unobserved_phase_is_a_deadlock():
  # The arriving thread's report (0.12's simulator, when both warpgroups
  # arrive before either waits), worded as the waiter's would be.
  report = ValueError(
    "Barrier completed phase 1, but no threads observed phase 0."
  )
  error = gpu_simulator._unobserved(report, "k at f.py:3")
  assert isinstance(error, mpmd.DeadlockError)
  assert str(error).startswith(
    "mpmd_map: kernel k at f.py:3: a barrier completed phase 1 before any "
    "warpgroup waited for phase 0: more warpgroups arrive on it than its "
    "num_arrivals counts"
  )
  assert gpu_simulator._unobserved(ValueError("other"), "k") is None
