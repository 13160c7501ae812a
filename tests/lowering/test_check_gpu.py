"""The checking executor on GPU meshes: barriers, TMA copies, WGMMA.

Our GPU pipelines (software, warp-specialized, the matmuls on both) run
clean under ``mpmd.explore``; synchronisation bugs injected into them
(``sync_bugs``) or written by hand are each found, with a schedule that
replays them. (The pipelines' own numeric cases run on the executor in
tests/kernels/gpu/test_gpu_checked.py.)
"""

import functools
import json

import example_scripts
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sync_bugs
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import mpmd
from mpmd.kernels import gpu

# The example's ring and its compute warpgroups' half of each block.
_example = example_scripts.load("warp_specialized_copy")
transform = _example.transform
ROWS, SLOTS, WGS = _example.BLOCK_ROWS, _example.SLOTS, _example.COMPUTE_WGS
COLS = 128
memory_mesh = plgpu.Mesh(num_threads=1, thread_name="memory")
compute_mesh = plgpu.Mesh(num_threads=WGS, thread_name="compute")


def _steps(x_ref):
  return x_ref.shape[0] // ROWS


def stream_in(x_ref, o_ref, ring, loaded, consumed, *, wait_consumed=True):
  """The memory warpgroup: fills the ring's slots with TMA copies, each
  once its previous block was consumed."""
  del o_ref

  @pl.loop(0, _steps(x_ref))
  def _(step):
    slot = step % SLOTS
    if wait_consumed:

      @pl.when(step >= SLOTS)
      def _():
        plgpu.barrier_wait(consumed.at[slot])

    rows = pl.ds(step * ROWS, ROWS)
    plgpu.copy_gmem_to_smem(x_ref.at[rows], ring.at[slot], loaded.at[slot])


def ws_copy(producer=stream_in, consumer=transform, consumed_arrivals=WGS):
  def f(x):
    return mpmd.mpmd_map(
      [(memory_mesh, producer), (compute_mesh, consumer)],
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_types=[
        plgpu.SMEM((SLOTS, ROWS, x.shape[1]), x.dtype),
        plgpu.Barrier(num_arrivals=1, num_barriers=SLOTS),
        plgpu.Barrier(num_arrivals=consumed_arrivals, num_barriers=SLOTS),
      ],
    )(x)

  return jax.jit(f)


X = jnp.arange(4 * ROWS * COLS, dtype=jnp.float32).reshape(-1, COLS)
BLOCK = 64


def _blocks(*, ws: bool, steps: int = 4):
  """``x + 1`` streamed block by block by one of our GPU pipelines."""
  spec = pl.BlockSpec((ROWS, BLOCK), lambda i: (0, i))
  kw = dict(
    grid=(steps,), in_specs=[spec], out_specs=[spec], max_concurrent_steps=2
  )

  def body(indices, x, o):
    del indices
    o[...] = x[...] + 1.0

  out = jax.ShapeDtypeStruct((ROWS, BLOCK * steps), jnp.float32)
  if ws:
    pipe = gpu.warp_specialized_pipeline(body, **kw)
    call = gpu.warp_specialized_kernel(
      pipe,
      compute_fn=lambda *r: pipe.compute(*r[:-2], scratch=r[-2]),
      memory_fn=lambda *r: pipe.memory(*r[:-1], scratch=r[-1]),
      out_types=out,
      scratch_types=pipe.scratch_types(
        jax.ShapeDtypeStruct(out.shape, out.dtype), out
      ),
    )
    return jax.jit(call)

  def kernel(x_ref, o_ref):
    gpu.pipeline(body, **kw)(x_ref, o_ref)

  return jax.jit(mpmd.mpmd_map([(plgpu.Mesh(), kernel)], out))


def _upstream_ws(num_compute_wgs=1):
  """``x + 1`` by the emit_pipeline_warp_specialized drop-in: a compute
  warpgroup and the memory one on one mesh's thread axis (SMEM outputs
  take one compute warpgroup)."""
  spec = pl.BlockSpec((ROWS, BLOCK), lambda i: (0, i))

  def body(_, x, o):
    o[...] = x[...] + 1.0

  def kernel(x_ref, o_ref):
    gpu.emit_pipeline_warp_specialized(
      body,
      grid=(4,),
      memory_registers=40,
      in_specs=[spec],
      out_specs=[spec],
      wg_axis="wg",
      num_compute_wgs=num_compute_wgs,
    )(x_ref, o_ref)

  mesh = plgpu.Mesh(num_threads=num_compute_wgs + 1, thread_name="wg")
  out = jax.ShapeDtypeStruct((ROWS, 4 * BLOCK), jnp.float32)
  return jax.jit(mpmd.mpmd_map([(mesh, kernel)], out))


XB = jnp.asarray(
  np.random.default_rng(0).standard_normal((ROWS, 4 * BLOCK)), jnp.float32
)
A = jax.random.normal(jax.random.key(0), (128, 512), jnp.bfloat16)
B = jax.random.normal(jax.random.key(1), (512, 128), jnp.bfloat16)


def _matmul(warp_specialized=False):
  return jax.jit(
    functools.partial(
      gpu.matmul, out_dtype=jnp.float32, warp_specialized=warp_specialized
    )
  )


def _mm_reference():
  return jnp.dot(
    A.astype(jnp.float32),
    B.astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
  )


KERNELS = {
  "ws_copy": (ws_copy, (X,), lambda: 2.0 * X + 1.0),
  "pipeline": (functools.partial(_blocks, ws=False), (XB,), lambda: XB + 1),
  "ws_pipeline": (functools.partial(_blocks, ws=True), (XB,), lambda: XB + 1),
  "upstream_ws_pipeline": (_upstream_ws, (XB,), lambda: XB + 1),
  "matmul": (_matmul, (A, B), _mm_reference),
  "matmul_ws": (
    functools.partial(_matmul, warp_specialized=True),
    (A, B),
    _mm_reference,
  ),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_gpu_pipelines_are_clean_under_explore(kernel):
  build, args, reference = KERNELS[kernel]
  f = build()
  report = mpmd.explore(f, *args, schedules=4)
  assert report.schedules_run == 4
  assert report.failures == [], str(report)
  out = mpmd.replay(f, *args, schedule="pct:3:2")
  np.testing.assert_allclose(out, reference(), rtol=1e-5, atol=1e-3)


def test_check_params_on_a_gpu_launch_runs_the_checker(capsys):
  def f(x):
    return mpmd.mpmd_map(
      [(memory_mesh, stream_in), (compute_mesh, transform)],
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_types=[
        plgpu.SMEM((SLOTS, ROWS, COLS), x.dtype),
        plgpu.Barrier(num_arrivals=1, num_barriers=SLOTS),
        plgpu.Barrier(num_arrivals=WGS, num_barriers=SLOTS),
      ],
      interpret=mpmd.CheckParams(schedule="random:3"),
      debug=True,
    )(x)

  np.testing.assert_array_equal(jax.jit(f)(X), 2.0 * X + 1.0)
  assert "CPU fallback takes the check path" in capsys.readouterr().out


# (kernel, primitive, k): the k-th equation of primitive dropped.
INJECTED = [
  # The compute warpgroups read a slot without waiting for its copy.
  ("ws_copy", "barrier_wait", 1),
  # The memory warpgroup refills a slot without waiting for its release
  # (here it also loses the barrier's parity: a hang on hardware).
  ("ws_copy", "barrier_wait", 0),
  # A compute warpgroup never releases its slot.
  ("ws_copy", "barrier_arrive", 0),
  # The software pipeline's output stores are never awaited.
  ("pipeline", "wait_smem_to_gmem", 1),
  # Its output block reaches the TMA store without a proxy fence.
  ("pipeline", "commit_smem", 0),
  # The warp-specialized pipeline's consumer never releases a slot.
  ("ws_pipeline", "barrier_arrive", 0),
  ("upstream_ws_pipeline", "barrier_arrive", 0),
  # Its output stores are never awaited.
  ("upstream_ws_pipeline", "wait_smem_to_gmem", 1),
  # WGMMAs still reading a slot when the next TMA copy refills it.
  ("matmul", "wgmma_wait", 0),
  ("matmul_ws", "wgmma_wait", 0),
]


@pytest.mark.parametrize("kernel, primitive, k", INJECTED)
def test_injected_gpu_bug_is_found_and_replays(kernel, primitive, k):
  build, args, _ = KERNELS[kernel]
  sync_bugs.assert_found_and_replays(
    build, args, primitive, k, sync_bugs.DROP, schedules=8
  )


def test_refill_before_release_is_a_race():
  # Slot 0 is refilled at step 2 while the compute warpgroups may still
  # read its first block.
  f = ws_copy(
    producer=functools.partial(stream_in, wait_consumed=False),
    consumer=transform,
  )
  # Some schedules hang instead (a slot's loaded barrier completes twice
  # before its first waiter looks: the parity it waits for never returns).
  report = mpmd.explore(f, X, schedules=16, max_failures=4)
  races = [x for x in report.failures if x.kind == "race"]
  assert races, str(report)
  assert "'ring'" in str(races[0].error)
  with pytest.raises(mpmd.RaceError):
    mpmd.replay(f, X, schedule=races[0].schedule)


def test_missing_fence_before_release_is_named():
  def consumer(x_ref, o_ref, ring, loaded, consumed):
    wg = jax.lax.axis_index("compute")
    half = x_ref.shape[1] // WGS

    @pl.loop(0, _steps(x_ref))
    def _(step):
      slot = step % SLOTS
      plgpu.barrier_wait(loaded.at[slot])
      rows = pl.ds(step * ROWS, ROWS)
      cols = pl.ds(wg * half, half)
      o_ref[rows, cols] = ring[slot, :, cols] * 2.0 + 1.0
      plgpu.barrier_arrive(consumed.at[slot])  # no commit_smem() before

  with pytest.raises(mpmd.RaceError, match="commit_smem"):
    mpmd.replay(ws_copy(consumer=consumer), X, schedule="default")


def test_too_many_arrivals_expected_is_a_deadlock_naming_the_barrier():
  f = ws_copy(consumed_arrivals=WGS + 1)
  with pytest.raises(mpmd.DeadlockError) as e:
    mpmd.replay(f, X, schedule="default")
  message = str(e.value)
  assert "barrier_wait on" in message
  assert f"of {WGS + 1} arrivals" in message


def test_unsupported_gpu_operation_is_named():
  def kernel(x_ref, o_ref, barrier):
    del x_ref
    done = plgpu.barrier_test(barrier)
    o_ref[...] = jnp.full(o_ref.shape, done.astype(jnp.float32))

  f = jax.jit(
    mpmd.mpmd_map(
      [(plgpu.Mesh(), kernel)],
      jax.ShapeDtypeStruct((8, 128), jnp.float32),
      scratch_types=[plgpu.Barrier(num_arrivals=1)],
      interpret=mpmd.CheckParams(),
    )
  )
  with pytest.raises(
    NotImplementedError,
    match=r"mpmd checker: the Mosaic GPU operation 'barrier_test' is not "
    r"supported by the checking executor; run the launch with "
    r"interpret=None \(the Mosaic GPU simulator\)",
  ):
    f(jnp.zeros((8, 128), jnp.float32))


def test_cuda_lowering_stays_mosaic_gpu_when_checking_is_forced():
  # The checker is a CPU path: a CUDA lowering inside mpmd.explore's
  # config state is the Mosaic GPU kernel, with no host callback.
  from mpmd._lowering.check import params as check_params

  f = ws_copy()

  def lowered():
    return f.trace(X).lower(lowering_platforms=("cuda",)).as_text()

  plain = lowered()
  with check_params.config_state()("random:0"):
    forced = lowered()
  assert "mosaic_gpu" in forced
  assert "callback" not in forced
  assert forced == plain


def test_layout_cast_is_the_identity_on_values():
  def kernel(x_ref, o_ref, smem):
    smem[...] = plgpu.layout_cast(
      x_ref[...] + 1.0, plgpu.Layout.WG_STRIDED((64, 64), vec_size=2)
    )
    o_ref[...] = smem[...]

  x = jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64)
  f = mpmd.mpmd_map(
    [(plgpu.Mesh(), kernel)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[plgpu.SMEM(x.shape, x.dtype)],
    interpret=mpmd.CheckParams(),
  )
  np.testing.assert_array_equal(jax.jit(f)(x), x + 1.0)


def test_timeline_of_a_gpu_launch(tmp_path):
  path = tmp_path / "trace.json"
  out = mpmd.timeline(ws_copy(), X, path=str(path), schedule="random:2")
  np.testing.assert_array_equal(out, 2.0 * X + 1.0)
  events = json.loads(path.read_text())["traceEvents"]
  names = {e.get("name", "") for e in events}
  assert any(n.startswith("TMA #") for n in names), sorted(names)[:20]
  assert {"dma", "wait", "exit"} <= {e["cat"] for e in events if "cat" in e}


def test_assert_schedule_independent_on_gpu_pipelines():
  mpmd.testing.assert_schedule_independent(_blocks(ws=True), XB, schedules=3)


def test_a_barrier_wait_covers_only_the_loads_it_waits_for():
  """TMA loads complete on their barriers in any order: the wait on slot
  1's barrier says nothing of slot 0's load. The default schedule (which
  lands loads in the order they were issued) reports the race."""

  def kernel(x_ref, o_ref, ring, loaded):
    for slot in range(2):
      rows = pl.ds(slot * ROWS, ROWS)
      plgpu.copy_gmem_to_smem(x_ref.at[rows], ring.at[slot], loaded.at[slot])
    plgpu.barrier_wait(loaded.at[1])
    o_ref[...] = ring[0] + ring[1]  # slot 0 may not have landed
    plgpu.barrier_wait(loaded.at[0])

  f = mpmd.mpmd_map(
    [(plgpu.Mesh(num_threads=1, thread_name="wg"), kernel)],
    jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
    scratch_types=[
      plgpu.SMEM((2, ROWS, COLS), jnp.float32),
      plgpu.Barrier(num_arrivals=1, num_barriers=2),
    ],
  )
  with pytest.raises(mpmd.RaceError) as e:
    mpmd.replay(jax.jit(f), X[: 2 * ROWS], schedule="default")
  message = str(e.value)
  assert "data race on 'ring'" in message
  assert "copy_gmem_to_smem #0 issued by" in message
