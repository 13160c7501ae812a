"""Upstream GPU pipeline drop-ins: bad arguments and what is not
implemented fail with a message that names them."""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import pytest
from jax import lax
from upstream_pipeline_util import (
  add_one,
  ws,
  ws_mesh,
)

import mpmd
from mpmd.kernels import gpu


def _launch(kernel, mesh=None):
  """``kernel(x_gmem, o_gmem)`` launched on f32 zeros of (64, 128), on
  ``mesh`` (a warp-specialized mesh by default)."""
  x = jnp.zeros((64, 128), jnp.float32)
  return mpmd.mpmd_map(
    [(ws_mesh() if mesh is None else mesh, kernel)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
  )(x)


class TestUpstreamPipelineErrors:
  def test_grid_entries(self):
    with pytest.raises(ValueError, match=r"expected 'grid' of positive ints"):
      gpu.emit_pipeline(add_one, grid=(2, 0))
    with pytest.raises(TypeError, match=r"ints or int32 scalars, got the bool"):
      gpu.emit_pipeline(add_one, grid=(True,))
    with pytest.raises(TypeError, match=r"integer scalars, got 2.0"):
      gpu.emit_pipeline(add_one, grid=(2.0,))
    with pytest.raises(TypeError, match=r"integer scalars, got Array"):
      gpu.emit_pipeline(add_one, grid=(jnp.ones((2,), jnp.int32),))
    with pytest.raises(TypeError, match=r"a tuple of ints or int32 scalars"):
      gpu.emit_pipeline(add_one, grid="2")

  def test_element_padding(self):
    spec = pl.BlockSpec((pl.Element(8, (1, 1)), 128), lambda i: (i, 0))
    with pytest.raises(
      NotImplementedError,
      match=r"in_specs\[0\]: pl.Element block dimensions with padding are "
      r"not supported, got padding=\(1, 1\)",
    ):
      gpu.emit_pipeline(add_one, grid=(2,), in_specs=[spec])

  def test_bounded_slice(self):
    spec = pl.BlockSpec((pl.BoundedSlice(8), 128), lambda i: (i, 0))
    with pytest.raises(
      NotImplementedError,
      match=r"pl.BoundedSlice block dimensions are not supported",
    ):
      gpu.emit_pipeline(add_one, grid=(2,), in_specs=[spec])

  def test_element_window_larger_than_operand(self):
    x = jnp.zeros((16, 128), jnp.int32)
    spec = pl.BlockSpec((pl.Element(32), 128), lambda i: (i, 0))

    def kernel(x_gmem, o_gmem):
      gpu.emit_pipeline(add_one, grid=(1,), in_specs=[spec], out_specs=[spec])(
        x_gmem, o_gmem
      )

    with pytest.raises(
      ValueError, match=r"input\[0\] expected a shape at least its block_shape"
    ):
      mpmd.mpmd_map(
        [(plgpu.Mesh(), kernel)], jax.ShapeDtypeStruct(x.shape, x.dtype)
      )(x)

  def test_bad_block_dims(self):
    with pytest.raises(TypeError, match=r"expected block dimensions as ints"):
      gpu.emit_pipeline(
        add_one, grid=(2,), in_specs=[pl.BlockSpec((8.0,), lambda i: (i,))]
      )
    with pytest.raises(ValueError, match=r"positive block sizes, got 0"):
      gpu.emit_pipeline(
        add_one, grid=(2,), in_specs=[pl.BlockSpec((0,), lambda i: (i,))]
      )

  def test_collective_axes(self):
    spec = plgpu.BlockSpec(
      (64, 64), lambda i: (0, i), collective_axes=("cluster",)
    )
    with pytest.raises(
      NotImplementedError, match=r"collective_axes \(cluster multicast\)"
    ):
      ws(add_one, grid=(2,), in_specs=[spec])

  def test_rank_mismatch(self):
    x = jnp.zeros((16, 256), jnp.int32)
    spec = pl.BlockSpec((None, 16, 256), lambda i: (i, 0, 0))

    def kernel(x_gmem, o_gmem):
      gpu.emit_pipeline(add_one, grid=(2,), in_specs=[spec], out_specs=[spec])(
        x_gmem, o_gmem
      )

    with pytest.raises(ValueError, match=r"input\[0\] expected rank 3"):
      mpmd.mpmd_map(
        [(plgpu.Mesh(), kernel)], jax.ShapeDtypeStruct(x.shape, x.dtype)
      )(x)

  def test_ws_arguments(self):
    with pytest.raises(TypeError, match=r"expected 'wg_axis' a str"):
      ws(add_one, grid=(2,), wg_axis=None)
    with pytest.raises(
      ValueError, match=r"'memory_registers' a multiple of 8 in \[24, 256\]"
    ):
      ws(add_one, grid=(2,), memory_registers=41)
    with pytest.raises(
      ValueError,
      match=r"'memory_thread_idx' an int in \[0, num_compute_wgs=1\], got 2",
    ):
      ws(add_one, grid=(2,), memory_thread_idx=2)
    with pytest.raises(
      ValueError, match=r"expected 'memory_thread_idx' >= 0, got -1"
    ):
      ws(add_one, grid=(2,), memory_thread_idx=-1)
    with pytest.raises(
      TypeError, match=r"expected 'memory_thread_idx' to be an int, got True"
    ):
      ws(add_one, grid=(2,), memory_thread_idx=True)
    with pytest.raises(ValueError, match=r"'num_compute_wgs' >= 1, got 0"):
      ws(add_one, grid=(2,), num_compute_wgs=0)

  def test_ws_smem_outputs_with_two_compute_wgs(self):
    spec = pl.BlockSpec((64, 64), lambda i: (0, i))
    with pytest.raises(
      NotImplementedError, match=r"SMEM outputs need num_compute_wgs=1"
    ):
      ws(
        add_one,
        grid=(2,),
        in_specs=[spec],
        out_specs=[spec],
        num_compute_wgs=2,
      )

  def test_ws_pipeline_state_limits(self):
    start = plgpu.PipelinePipeline.START
    spec = pl.BlockSpec((64, 64), lambda i: (0, i))
    late = plgpu.BlockSpec((64, 64), lambda i: (0, i), delay_release=1)
    fixed = pl.BlockSpec((64, 64), lambda i: (0, 0))
    prefix = r"pipeline_state \(a pipeline of pipelines\)"
    for kw, message in (
      (dict(in_specs=[late]), r"with delay_release=1 is not supported"),
      (dict(in_specs=[spec, fixed]), r"with index-invariant inputs"),
      (dict(grid=(3,)), r"needs .* divisible by max_concurrent_steps=2, got 3"),
    ):
      kw = dict(dict(grid=(4,), in_specs=[spec]), **kw)
      with pytest.raises(NotImplementedError, match=rf"{prefix} {message}"):
        ws(add_one, pipeline_state=start, **kw)
    with pytest.raises(TypeError, match=r"expected 'pipeline_state' None"):
      ws(add_one, grid=(4,), in_specs=[spec], pipeline_state="START")

  def test_ws_pipeline_state_traced_grid(self):
    def kernel(x_gmem, o_gmem):
      ws(
        add_one,
        grid=(lax.axis_index("c") + 2,),
        in_specs=[pl.BlockSpec((64, 64), lambda i: (0, i))],
        pipeline_state=plgpu.PipelinePipeline.START,
      )

    with pytest.raises(NotImplementedError, match=r"with a traced grid"):
      _launch(kernel, ws_mesh(grid=(1,), grid_names=("c",)))

  def test_ws_pipeline_state_needs_allocations(self):
    spec = pl.BlockSpec((64, 64), lambda i: (0, i))

    def kernel(x_gmem, o_gmem):
      ws(
        add_one,
        grid=(2,),
        in_specs=[spec],
        pipeline_state=plgpu.PipelinePipeline.START,
      )(x_gmem)

    with pytest.raises(
      ValueError, match=r"expected 'allocations' .* with a pipeline_state"
    ):
      _launch(kernel)

  def test_ws_ref_structure(self):
    spec = pl.BlockSpec((64, 64), lambda i: (0, i))

    def kernel(x_gmem, o_gmem):
      ws(add_one, grid=(2,), in_specs=[(spec,)], out_specs=[spec])(
        x_gmem, o_gmem
      )

    with pytest.raises(
      ValueError, match=r"expected input refs with the pytree structure"
    ):
      _launch(kernel)
