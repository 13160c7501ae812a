"""Upstream's ``plgpu.emit_pipeline`` programs on ``gpu.emit_pipeline``.

Traced grids, ``grid=()``, list grids, ``pl.Element`` / ``pl.Squeezed()`` /
``None`` block dims, carries, pipelines of pipelines, launched through
``mpmd.mpmd_map`` with ``gpu.emit_pipeline`` in upstream's place. One base of
cases, run in the Mosaic GPU simulator on CPU against plain-jnp references
(some also under the race detector) and cross-lowered for CUDA (one
``mosaic_gpu`` custom call per launch).
"""

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from upstream_pipeline_util import (
  PipelineCases,
  add_one,
  backend_classes,
)

from mpmd.kernels import gpu


class EmitPipelineCases(PipelineCases):
  """emit_pipeline: the shared programs."""

  def pipelined(self, body, x, grid, spec, *, mesh=None, **kw):
    """``body`` by emit_pipeline over ``grid``, with ``spec`` for ``x`` and
    the output alike, in one launch. ``grid`` or ``spec`` may be a function
    of no arguments, called in the kernel (for values traced there)."""

    def kernel(x_gmem, o_gmem):
      block = spec() if callable(spec) else spec
      gpu.emit_pipeline(
        body,
        grid=grid() if callable(grid) else grid,
        in_specs=[block],
        out_specs=[block],
        **kw,
      )(x_gmem, o_gmem)

    out_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return self.launch(kernel, out_type, x, mesh=mesh)

  @pytest.mark.parametrize(
    "squeezed", [None, pl.Squeezed()], ids=["None", "Squeezed"]
  )
  def test_emit_squeezed_dim(self, squeezed):
    x = jnp.arange(16 * 256, dtype=jnp.int32).reshape(16, 256)

    def body(_, x_smem, o_smem):
      assert x_smem.shape == o_smem.shape == (256,)
      o_smem[...] = x_smem[...] + 1

    spec = pl.BlockSpec((squeezed, 256), lambda i: (i, 0))
    out = self.pipelined(body, x, (16,), spec, max_concurrent_steps=2)
    self.check(out, x + 1)

  def test_emit_element_dim(self):
    # Windows of 8 rows at element offsets 1 and 11: rows 0, 9, 10 and 19
    # are never written.
    x = jnp.arange(20 * 256, dtype=jnp.int32).reshape(20, 256)
    written = (np.arange(20) - 1) % 10 < 8

    def body(_, x_smem, o_smem):
      assert x_smem.shape == (8, 256)
      o_smem[...] = x_smem[...] + 1

    spec = pl.BlockSpec((pl.Element(8), 256), lambda i: (10 * i + 1, 0))
    out = self.pipelined(body, x, (2,), spec, max_concurrent_steps=2)
    self.check(out, x + 1, where=written[:, None])

  def test_emit_blocked_dims_list_grid_default_steps(self):
    # pl.Blocked dims, a list grid and upstream's default of one step in
    # flight.
    x = jnp.arange(128 * 128, dtype=jnp.float32).reshape(128, 128)
    spec = pl.BlockSpec((pl.Blocked(64), pl.Blocked(32)), lambda i, j: (i, j))

    out = self.pipelined(add_one, x, [2, 4], spec)
    self.check(out, x + 1)

  @pytest.mark.parametrize("max_concurrent_steps", [2, 3])
  def test_emit_traced_grid(self, max_concurrent_steps):
    # CTA c walks c column blocks of its row block: 0 steps (CTA 0), fewer
    # steps than slots, and more.
    ctas, block = 4, 32
    x = jnp.arange(ctas * block * 3 * block, dtype=jnp.float32)
    x = x.reshape(ctas * block, 3 * block)

    def cta():
      return lax.axis_index("c")

    out = self.pipelined(
      add_one,
      x,
      lambda: (cta(),),
      lambda: pl.BlockSpec((block, block), lambda j: (cta(), j)),
      mesh=plgpu.Mesh(grid=(ctas,), grid_names=("c",)),
      max_concurrent_steps=max_concurrent_steps,
    )
    rows = np.arange(ctas * block)[:, None] // block
    cols = np.arange(3 * block)[None, :] // block
    self.check(out, x + 1, where=cols < rows)

  @pytest.mark.parametrize("short", [False, True])
  def test_emit_grid_of_arrays(self, short):
    # Upstream's "non-static" grids: jnp scalars, not Python ints.
    steps1, steps2 = (1, 1) if short else (3, 2)
    x = jnp.arange(16 * steps1 * 8 * steps2, dtype=jnp.float32)
    x = x.reshape(16 * steps1, 8 * steps2)
    spec = pl.BlockSpec((16, 8), lambda i, j: (i, j))

    out = self.pipelined(
      add_one,
      x,
      lambda: (jnp.asarray(steps1), jnp.asarray(steps2)),
      spec,
      max_concurrent_steps=2,
    )
    self.check(out, x + 1)

  def test_emit_traced_grid_invariant_output(self):
    # An accumulating index-invariant output under a traced grid: stored
    # only by CTAs that ran a step.
    ctas, block = 3, 32
    x = jnp.arange(block * 2 * block, dtype=jnp.float32).reshape(block, -1)

    def body(indices, x_smem, o_smem):
      @pl.when(indices[0] == 0)
      def _init():
        o_smem[...] = jnp.zeros_like(o_smem)

      o_smem[...] += x_smem[...]

    def kernel(x_gmem, o_gmem):
      c = lax.axis_index("c")
      gpu.emit_pipeline(
        body,
        grid=(jnp.minimum(c, 2),),
        in_specs=[pl.BlockSpec((block, block), lambda j: (0, j))],
        out_specs=[pl.BlockSpec((None, block, block), lambda j: (c, 0, 0))],
        max_concurrent_steps=2,
      )(x_gmem, o_gmem)

    out = self.launch(
      kernel,
      jax.ShapeDtypeStruct((ctas, block, block), jnp.float32),
      x,
      mesh=plgpu.Mesh(grid=(ctas,), grid_names=("c",)),
    )
    first = x[:, :block]
    expected = jnp.stack([first, first, first + x[:, block:]])
    # CTA 0 ran no step, so it stored nothing.
    self.check(out, expected, where=np.arange(ctas)[:, None, None] > 0)

  def test_emit_nested_empty_grid(self):
    # grid=() is one step; GMEM specs hand the refs to a nested pipeline.
    x = jnp.arange(32 * 4 * 16, dtype=jnp.float32).reshape(32, 4 * 16)

    def inner(_, x_gmem, o_gmem):
      spec = pl.BlockSpec((32, 16), lambda i: (0, i))
      gpu.emit_pipeline(
        add_one,
        grid=(4,),
        in_specs=[spec],
        out_specs=[spec],
        max_concurrent_steps=2,
      )(x_gmem, o_gmem)

    def kernel(x_gmem, o_gmem):
      gmem = pl.BlockSpec(memory_space=plgpu.GMEM)
      gpu.emit_pipeline(inner, grid=(), in_specs=[gmem], out_specs=[gmem])(
        x_gmem, o_gmem
      )

    out = self.launch(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    self.check(out, x + 1)

  def test_emit_whole_operand_blocks_empty_grid(self):
    # block_shape=None / index_map=None: the whole operand, one step.
    x = jnp.arange(32 * 64, dtype=jnp.float32).reshape(32, 64)

    def kernel(x_gmem, o_gmem):
      gpu.emit_pipeline(
        add_one,
        grid=(),
        in_specs=[pl.BlockSpec()],
        out_specs=[pl.BlockSpec((32, 64))],
      )(x_gmem, o_gmem)

    out = self.launch(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    self.check(out, x + 1)

  def test_emit_carry_and_levels_of_delay_release(self):
    # Inputs on three delay_release levels and an int carry.
    m, n, block = 128, 64, 32
    keys = jax.random.split(jax.random.key(0), 3)
    xs = [jax.random.uniform(k, (m, n), jnp.float32) for k in keys]
    in_specs = [
      plgpu.BlockSpec((block, block), lambda i, j: (i, j), delay_release=d)
      for d in range(3)
    ]
    out_spec = pl.BlockSpec((block, block), lambda i, j: (i, j))

    def body(_, x, y, z, o, carry):
      o[...] = x[...] + y[...] + z[...] + carry.astype(jnp.float32)
      return carry + 1

    def kernel(x, y, z, o):
      gpu.emit_pipeline(
        body,
        grid=(m // block, n // block),
        in_specs=in_specs,
        out_specs=[out_spec],
        max_concurrent_steps=4,
        init_carry=jnp.int32(0),
      )(x, y, z, o)

    out = self.launch(kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), *xs)
    steps = jnp.arange(8, dtype=jnp.float32).reshape(4, 2)
    offsets = jnp.kron(steps, jnp.ones((block, block), jnp.float32))
    self.check(out, xs[0] + xs[1] + xs[2] + offsets, rtol=1e-6)


TestEmitPipelineSimulated, TestEmitPipelineCudaLowering = backend_classes(
  EmitPipelineCases,
  race_checked=[
    ("test_emit_traced_grid", dict(max_concurrent_steps=3)),
    ("test_emit_carry_and_levels_of_delay_release", {}),
  ],
)
