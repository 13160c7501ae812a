"""Warp maps: ``mpmd_map`` / ``pl.core_map`` over a ``plgpu.WarpMesh`` inside
a GPU kernel body fork the 4 warps of the warpgroup, as upstream's do: run
on CPU (jax 0.12's simulator runs the warps as threads, jax 0.10.2's CPU
fallback one after another) and lowered for CUDA."""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import mpmd
from mpmd import _jax

WARPS = 4


def _cuda_text(f, *args) -> str:
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _one_warpgroup(body, out_type, **kw):
  """``body`` as a kernel of one warpgroup (a ``plgpu.Mesh()``)."""
  return mpmd.kernel(body, out_type, mesh=plgpu.Mesh(), **kw)


def _core_map(mesh):
  """``pl.core_map``, deprecated from jax 0.12 (its warning is not ours to
  fix: upstream's programs still call it)."""

  def wrapped(fn):
    with warnings.catch_warnings():
      warnings.filterwarnings(
        "ignore", "jax.experimental.pallas.core_map is deprecated"
      )
      return pl.core_map(mesh)(fn)

  return wrapped


def _our_map(mesh):
  def wrapped(fn):
    mpmd.mpmd_map([(mesh, fn)])()

  return wrapped


@pytest.mark.parametrize("entry", [_our_map, _core_map], ids=["ours", "core"])
def test_each_warp_of_each_warpgroup_runs_once(entry):
  def body(o_ref):
    wg = jax.lax.axis_index("wg")

    @entry(plgpu.WarpMesh(axis_name="warp"))
    def _():
      warp = jax.lax.axis_index("warp")
      o_ref[wg * WARPS + warp] = warp + 10 * wg

  f = mpmd.kernel(
    body,
    jax.ShapeDtypeStruct((2 * WARPS,), jnp.int32),
    mesh=plgpu.Mesh(num_threads=2, thread_name="wg"),
  )
  np.testing.assert_array_equal(f(), [0, 1, 2, 3, 10, 11, 12, 13])
  assert re.search(r"custom_call @mosaic_gpu", _cuda_text(f))


def test_warps_copy_smem_to_gmem():
  """Upstream's program: warps 1 and 3 each store one row (TMA), the
  warpgroup awaits both after the join."""

  def body(o_ref, ones, threes):
    ones[...] = jnp.ones(ones.shape, jnp.int32)
    threes[...] = jnp.full(threes.shape, 3, jnp.int32)
    plgpu.commit_smem()

    def per_warp():
      warp = jax.lax.axis_index("warp")

      @pl.when(warp == 1)
      def _():
        plgpu.copy_smem_to_gmem(ones, o_ref.at[0:1])

      @pl.when(warp == 3)
      def _():
        plgpu.copy_smem_to_gmem(threes, o_ref.at[1:2])

    _our_map(plgpu.WarpMesh(axis_name="warp"))(per_warp)
    plgpu.wait_smem_to_gmem(0)

  f = _one_warpgroup(
    body,
    jax.ShapeDtypeStruct((2, 128), jnp.int32),
    scratch_types=[plgpu.SMEM((1, 128), jnp.int32)] * 2,
  )
  np.testing.assert_array_equal(
    f(), np.stack([np.ones(128, np.int32), np.full(128, 3, np.int32)])
  )
  assert re.search(r"custom_call @mosaic_gpu", _cuda_text(f))


def test_warp_map_reads_inputs_under_jit():
  """Upstream's warp-specialize program: warp i copies element i; the
  fifth element (no fifth warp) stays zero."""

  def body(x_ref, o_ref):
    o_ref[...] = jnp.zeros(o_ref.shape, jnp.int32)

    def copy(i):
      o_ref[i] = x_ref[i]

    def per_warp():
      warp = jax.lax.axis_index("warp")
      for i in range(WARPS + 1):
        pl.when(warp == i)(functools.partial(copy, i))

    _our_map(plgpu.WarpMesh(axis_name="warp"))(per_warp)

  f = _one_warpgroup(body, jax.ShapeDtypeStruct((5,), jnp.int32))
  x = jnp.arange(1, 6, dtype=jnp.int32)
  np.testing.assert_array_equal(jax.jit(f)(x), [1, 2, 3, 4, 0])


def test_warps_sharing_smem_through_a_barrier():
  """Warp 0 writes SMEM and arrives; warp 1 waits and reads it. jax 0.12's
  simulator runs it; on jax 0.10.2 (no simulated warps) the CPU fallback
  refuses it, naming what is missing."""

  def body(o_ref, smem, barrier):
    def per_warp():
      warp = jax.lax.axis_index("warp")

      @pl.when(warp == 0)
      def _():
        smem[...] = jnp.int32(7)
        plgpu.barrier_arrive(barrier)

      @pl.when(warp == 1)
      def _():
        plgpu.barrier_wait(barrier)
        o_ref[...] = smem[...]

    _our_map(plgpu.WarpMesh(axis_name="warp"))(per_warp)

  f = _one_warpgroup(
    body,
    jax.ShapeDtypeStruct((), jnp.int32),
    scratch_types=[
      plgpu.SMEM((), jnp.int32),
      plgpu.Barrier(num_arrivals=1),
    ],
  )
  if _jax.GPU_SIMULATOR_RUNS_WARP_MAPS:
    assert int(f()) == 7
  else:
    with pytest.raises(
      NotImplementedError,
      match=r"cannot run a warp map .*WarpMesh\(axis_name='warp'\)\) whose "
      r"warps synchronise \(barrier_\w+ uses a barrier\).*jax >= 0.12",
    ):
      f()


def test_warp_awaits_another_warps_copy():
  """Upstream's program: warp 0 starts a TMA copy into SMEM, warp 1 awaits
  its barrier and stores the rows (lowers for CUDA on both jax versions;
  on CPU as above)."""

  def body(x_ref, o_ref, smem, loaded):
    def per_warp():
      warp = jax.lax.axis_index("warp")

      @pl.when(warp == 0)
      def _():
        plgpu.copy_gmem_to_smem(x_ref.at[32:64], smem, loaded)

      @pl.when(warp == 1)
      def _():
        plgpu.barrier_wait(loaded)
        plgpu.copy_smem_to_gmem(smem, o_ref)

    _our_map(plgpu.WarpMesh(axis_name="warp"))(per_warp)
    plgpu.wait_smem_to_gmem(0)

  f = _one_warpgroup(
    body,
    jax.ShapeDtypeStruct((32, 32), jnp.float32),
    scratch_types=[plgpu.SMEM((32, 32), jnp.float32), plgpu.Barrier()],
  )
  x = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32)
  if _jax.GPU_SIMULATOR_RUNS_WARP_MAPS:
    np.testing.assert_array_equal(f(x), x[32:64])
  else:
    with pytest.raises(NotImplementedError, match=r"uses a barrier"):
      f(x)
  assert re.search(r"custom_call @mosaic_gpu", _cuda_text(f, x))


def test_core_map_under_upstreams_forced_interpret_mode():
  """Under upstream's ``force_gpu_interpret_mode`` (its Blackwell examples'
  way to run on CPU), ``pl.core_map`` binds the warp map with interpreter
  params, whose ordered effect reaches the launch: the launch still runs."""

  def body(o_ref):
    @_core_map(plgpu.WarpMesh(axis_name="warp"))
    def _():
      warp = jax.lax.axis_index("warp")
      o_ref[warp] = warp + 1

  f = _one_warpgroup(body, jax.ShapeDtypeStruct((WARPS,), jnp.int32))
  interpret = _jax.gpu().interpret
  with interpret.force_gpu_interpret_mode(interpret.InterpretGPUParams()):
    out = jax.jit(f)()
  np.testing.assert_array_equal(out, np.arange(1, WARPS + 1))


def test_warp_map_inside_a_warp_map_names_upstreams_error():
  def body(o_ref):
    def outer():
      def inner():
        o_ref[...] = jnp.int32(42)

      mpmd.mpmd_map([(plgpu.WarpMesh(axis_name="warp1"), inner)])()

    mpmd.mpmd_map([(plgpu.WarpMesh(axis_name="warp0"), outer)])()

  f = _one_warpgroup(body, jax.ShapeDtypeStruct((), jnp.int32))
  with pytest.raises(
    ValueError,
    match="Cannot mpmd_map over WarpMesh while already mpmd_mapped",
  ):
    f()


def test_core_map_inside_a_warp_map_names_upstreams_error():
  def body(o_ref):
    def outer():
      @_core_map(plgpu.WarpMesh(axis_name="warp1"))
      def _():
        o_ref[...] = jnp.int32(42)

    mpmd.mpmd_map([(plgpu.WarpMesh(axis_name="warp0"), outer)])()

  f = _one_warpgroup(body, jax.ShapeDtypeStruct((), jnp.int32))
  # jax 0.12's simulator raises it in its own words (which name mpmd_map,
  # the primitive pl.core_map binds there), ours on 0.10.2 name core_map.
  with pytest.raises(
    Exception,
    match="Cannot (core_map|mpmd_map) over WarpMesh while already "
    "(core|mpmd)_mapped",
  ):
    f()


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (
      dict(out_types=jax.ShapeDtypeStruct((), jnp.int32)),
      ValueError,
      r"takes no 'out_types'.*got ShapeDtypeStruct",
    ),
    (
      dict(scratch_types=[plgpu.SMEM((), jnp.int32)]),
      ValueError,
      r"takes no 'scratch_types'",
    ),
  ],
)
def test_warp_map_arguments_are_checked(kwargs, error, match):
  with pytest.raises(error, match=match):
    mpmd.mpmd_map([(plgpu.WarpMesh(axis_name="warp"), lambda: None)], **kwargs)


def test_warp_map_takes_no_inputs_and_no_other_mesh():
  f = mpmd.mpmd_map([(plgpu.WarpMesh(axis_name="warp"), lambda x: None)])
  with pytest.raises(ValueError, match=r"takes no inputs.*got 1 argument"):
    f(jnp.ones(()))
  with pytest.raises(
    NotImplementedError,
    match=r"shares its launch with no other mesh.*\['WarpMesh', 'Mesh'\]",
  ):
    mpmd.mpmd_map(
      [
        (plgpu.WarpMesh(axis_name="warp"), lambda: None),
        (plgpu.Mesh(), lambda: None),
      ]
    )
