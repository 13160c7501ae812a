"""Upstream's GPU pipeline programs on ``mpmd.kernels.gpu``'s drop-ins.

Programs written against ``plgpu.emit_pipeline`` and
``plgpu.emit_pipeline_warp_specialized`` (traced grids, ``grid=()``, list
grids, ``pl.Element`` / ``pl.Squeezed()`` / ``None`` block dims, pytree specs,
manual barriers, pipelines of pipelines, ...), launched through
``mpmd.mpmd_map`` with ``gpu.emit_pipeline`` /
``gpu.emit_pipeline_warp_specialized`` in their place. One base of cases,
run twice: in the Mosaic GPU simulator on CPU against plain-jnp references,
and cross-lowered for CUDA (one ``mosaic_gpu`` custom call per launch).
"""

import functools

import gpu_test_util as util
import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mpmd
from mpmd.kernels import gpu

WG = "wg"
MEMORY_REGISTERS = 40


def _ws(body, **kw):
  """``emit_pipeline_warp_specialized`` with upstream tests' usual knobs."""
  kw.setdefault("memory_registers", MEMORY_REGISTERS)
  kw.setdefault("wg_axis", WG)
  kw.setdefault("num_compute_wgs", 1)
  return gpu.emit_pipeline_warp_specialized(body, **kw)


def _add_one(_, x, o):
  o[...] = x[...] + 1


def _ws_mesh(num_compute_wgs=1, **kw):
  return plgpu.Mesh(num_threads=num_compute_wgs + 1, thread_name=WG, **kw)


def _blocks_sum(x, block):
  """Sum of the (block)-shaped tiles of a 2D ``x``."""
  m, n = x.shape
  bm, bn = block
  return x.reshape(m // bm, bm, n // bn, bn).sum((0, 2))


class UpstreamPipelineCases:
  """Shared programs; subclasses run them or cross-lower them."""

  interpret = None

  def launch(self, kernel, out_types, *args, mesh=None, scratch_types=()):
    """Runs ``kernel`` in one ``mpmd_map`` launch (None when lowering)."""
    raise NotImplementedError

  def check(self, out, expected, *, where=None, **tol):
    """Compares ``out`` with ``expected`` (where ``where`` holds)."""
    raise NotImplementedError

  def _call(self, kernel, out_types, mesh, scratch_types):
    return mpmd.mpmd_map(
      [(mesh or plgpu.Mesh(), kernel)],
      out_types,
      scratch_types=scratch_types,
      interpret=self.interpret,
    )

  # -- emit_pipeline ---------------------------------------------------------

  @pytest.mark.parametrize(
    "squeezed", [None, pl.Squeezed()], ids=["None", "Squeezed"]
  )
  def test_emit_squeezed_dim(self, squeezed):
    x = jnp.arange(16 * 256, dtype=jnp.int32).reshape(16, 256)

    def body(_, x_smem, o_smem):
      assert x_smem.shape == o_smem.shape == (256,)
      o_smem[...] = x_smem[...] + 1

    def kernel(x_gmem, o_gmem):
      spec = pl.BlockSpec((squeezed, 256), lambda i: (i, 0))
      gpu.emit_pipeline(
        body,
        grid=(16,),
        in_specs=[spec],
        out_specs=[spec],
        max_concurrent_steps=2,
      )(x_gmem, o_gmem)

    out = self.launch(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    self.check(out, x + 1)

  def test_emit_element_dim(self):
    # Windows of 8 rows at element offsets 1 and 11: rows 0, 9, 10 and 19
    # are never written.
    x = jnp.arange(20 * 256, dtype=jnp.int32).reshape(20, 256)
    written = (np.arange(20) - 1) % 10 < 8

    def body(_, x_smem, o_smem):
      assert x_smem.shape == (8, 256)
      o_smem[...] = x_smem[...] + 1

    def kernel(x_gmem, o_gmem):
      spec = pl.BlockSpec((pl.Element(8), 256), lambda i: (10 * i + 1, 0))
      gpu.emit_pipeline(
        body,
        grid=(2,),
        in_specs=[spec],
        out_specs=[spec],
        max_concurrent_steps=2,
      )(x_gmem, o_gmem)

    out = self.launch(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    self.check(out, x + 1, where=written[:, None])

  def test_emit_blocked_dims_list_grid_default_steps(self):
    # pl.Blocked dims, a list grid and upstream's default of one step in
    # flight.
    x = jnp.arange(128 * 128, dtype=jnp.float32).reshape(128, 128)
    spec = pl.BlockSpec((pl.Blocked(64), pl.Blocked(32)), lambda i, j: (i, j))

    def kernel(x_gmem, o_gmem):
      gpu.emit_pipeline(
        _add_one, grid=[2, 4], in_specs=[spec], out_specs=[spec]
      )(x_gmem, o_gmem)

    out = self.launch(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    self.check(out, x + 1)

  @pytest.mark.parametrize("max_concurrent_steps", [2, 3])
  def test_emit_traced_grid(self, max_concurrent_steps):
    # CTA c walks c column blocks of its row block: 0 steps (CTA 0), fewer
    # steps than slots, and more.
    ctas, block = 4, 32
    x = jnp.arange(ctas * block * 3 * block, dtype=jnp.float32)
    x = x.reshape(ctas * block, 3 * block)

    def kernel(x_gmem, o_gmem):
      c = lax.axis_index("c")
      spec = pl.BlockSpec((block, block), lambda j: (c, j))
      gpu.emit_pipeline(
        _add_one,
        grid=(c,),
        in_specs=[spec],
        out_specs=[spec],
        max_concurrent_steps=max_concurrent_steps,
      )(x_gmem, o_gmem)

    out = self.launch(
      kernel,
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      x,
      mesh=plgpu.Mesh(grid=(ctas,), grid_names=("c",)),
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

    def kernel(x_gmem, o_gmem):
      grid = (jnp.asarray(steps1), jnp.asarray(steps2))
      gpu.emit_pipeline(
        _add_one,
        grid=grid,
        in_specs=[spec],
        out_specs=[spec],
        max_concurrent_steps=2,
      )(x_gmem, o_gmem)

    out = self.launch(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
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
        _add_one,
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
        _add_one,
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

  # -- emit_pipeline_warp_specialized ---------------------------------------

  @pytest.mark.parametrize("manual_consumed_barriers", [False, True])
  @pytest.mark.parametrize("max_concurrent_steps", [2, 3])
  def test_ws_pipelined_copy(
    self, manual_consumed_barriers, max_concurrent_steps
  ):
    # A streamed and an index-invariant output, the pipeline run twice.
    m, n, blk_m, blk_n = 128, 64, 32, 32
    x = jax.random.uniform(jax.random.key(1), (m, n), jnp.float16)
    spec = pl.BlockSpec((blk_m, blk_n), lambda i, j: (i, j))
    last_spec = pl.BlockSpec((blk_m, blk_n), lambda i, j: (0, 0))

    def body(_, x_smem, o_smem, last_smem, *consumed):
      o_smem[...] = x_smem[...]
      last_smem[...] = x_smem[...]
      if manual_consumed_barriers:
        plgpu.commit_smem()
        [barrier] = consumed
        plgpu.barrier_arrive(barrier)

    def kernel(x_gmem, o_gmem, last_gmem):
      pipe = _ws(
        body,
        grid=(m // blk_m, n // blk_n),
        max_concurrent_steps=max_concurrent_steps,
        manual_consumed_barriers=manual_consumed_barriers,
        in_specs=[spec],
        out_specs=[spec, last_spec],
      )
      for _ in range(2):
        pipe(x_gmem, o_gmem, last_gmem)

    out = self.launch(
      kernel,
      (
        jax.ShapeDtypeStruct((m, n), jnp.float16),
        jax.ShapeDtypeStruct((blk_m, blk_n), jnp.float16),
      ),
      x,
      mesh=_ws_mesh(),
    )
    self.check(out, (x, x[-blk_m:, -blk_n:]))

  @pytest.mark.parametrize("traced_grid", [False, True])
  @pytest.mark.parametrize("manual_consumed_barriers", [False, True])
  def test_ws_pytree_specs(self, traced_grid, manual_consumed_barriers):
    # in_specs shaped (x, (y,), None): the body gets blocks (and barriers)
    # in that structure.
    m, n, blk = 128, 64, 32
    keys = jax.random.split(jax.random.key(2))
    x, y = (jax.random.uniform(k, (m, n), jnp.float32) for k in keys)
    spec = pl.BlockSpec((blk, blk), lambda i, j: (i, j))

    def body(_, x_smem, y_tree, nothing, o_smem, *consumed):
      [y_smem] = y_tree
      assert nothing is None
      o_smem[...] = x_smem[...] + y_smem[...]
      if manual_consumed_barriers:
        plgpu.commit_smem()
        x_barrier, (y_barrier,), none = consumed
        assert none is None
        plgpu.barrier_arrive(x_barrier)
        plgpu.barrier_arrive(y_barrier)

    def kernel(x_gmem, y_gmem, o_gmem):
      grid = (m // blk, n // blk)
      if traced_grid:
        grid = tuple(jnp.asarray(g) for g in grid)
      _ws(
        body,
        grid=grid,
        in_specs=(spec, (spec,), None),
        out_specs=[spec],
        manual_consumed_barriers=manual_consumed_barriers,
      )(x_gmem, (y_gmem,), None, o_gmem)

    out = self.launch(
      kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), x, y, mesh=_ws_mesh()
    )
    self.check(out, x + y)

  def test_ws_carry_two_compute_wgs(self):
    # compute_context on two compute warpgroups: each adds every block into
    # its SMEM accumulator and counts the steps in a carry; the epilogue
    # scales by the count and stores. (A scalar carry: an array carry's
    # register layout needs plgpu.layout_cast, which jax 0.10.2's simulator
    # lacks.)
    m, n, blk = 128, 64, 32
    steps = (m // blk) * (n // blk)
    x = jax.random.uniform(jax.random.key(3), (m, n), jnp.float32)

    def kernel(x_gmem, out_gmem, acc_smem):
      wg = lax.axis_index(WG)
      acc = acc_smem.at[wg]

      def body(_, x_smem, count):
        acc[...] += x_smem[...]
        return count + 1

      def context(run):
        acc[...] = jnp.zeros_like(acc)
        count = run(jnp.int32(0))
        acc[...] = acc[...] * count.astype(jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(acc, out_gmem.at[wg])
        plgpu.wait_smem_to_gmem(0)

      _ws(
        body,
        grid=(m // blk, n // blk),
        num_compute_wgs=2,
        compute_context=context,
        in_specs=[pl.BlockSpec((blk, blk), lambda i, j: (i, j))],
      )(x_gmem)

    out = self.launch(
      kernel,
      jax.ShapeDtypeStruct((2, blk, blk), jnp.float32),
      x,
      mesh=_ws_mesh(2),
      scratch_types=[plgpu.SMEM((2, blk, blk), jnp.float32)],
    )
    total = steps * _blocks_sum(x, (blk, blk))
    self.check(out, jnp.stack([total, total]), rtol=1e-5)

  @pytest.mark.parametrize("manual_consumed_barriers", [False, True])
  @pytest.mark.parametrize("max_concurrent_steps", [2, 4])
  def test_ws_delay_release(
    self, manual_consumed_barriers, max_concurrent_steps
  ):
    # With delay_release=1 the consumed barriers passed at step s release
    # step s - 1's slot: the body skips the first step.
    m, n, blk_m, blk_n = 64, 128, 32, 32
    keys = jax.random.split(jax.random.key(4))
    x, y = (jax.random.uniform(k, (m, n), jnp.float32) for k in keys)
    spec = plgpu.BlockSpec((blk_m, blk_n), lambda i, j: (i, j), delay_release=1)
    out_spec = pl.BlockSpec((blk_m, blk_n), lambda i, j: (i, j))

    def body(idx, x_smem, y_smem, o_smem, *consumed):
      o_smem[...] = x_smem[...] + y_smem[...]
      if manual_consumed_barriers:

        @pl.when(jnp.logical_or(idx[0] != 0, idx[1] != 0))
        def _release_previous():
          plgpu.commit_smem()
          for barrier in consumed:
            plgpu.barrier_arrive(barrier)

    def kernel(*refs):
      _ws(
        body,
        grid=(m // blk_m, n // blk_n),
        max_concurrent_steps=max_concurrent_steps,
        manual_consumed_barriers=manual_consumed_barriers,
        in_specs=[spec, spec],
        out_specs=[out_spec],
      )(*refs)

    out = self.launch(
      kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), x, y, mesh=_ws_mesh()
    )
    self.check(out, x + y)

  def test_ws_stationary_input(self):
    # Upstream raises NotImplementedError for an index-invariant input; we
    # load it once.
    m, n, blk = 128, 64, 32
    x = jax.random.uniform(jax.random.key(5), (m, n), jnp.float16)
    y = jax.random.uniform(jax.random.key(6), (blk, blk), jnp.float16)

    def body(_, x_smem, y_smem, o_smem):
      o_smem[...] = x_smem[...] + y_smem[...]

    def kernel(x_gmem, y_gmem, o_gmem):
      _ws(
        body,
        grid=(m // blk, n // blk),
        in_specs=[
          pl.BlockSpec((blk, blk), lambda i, j: (i, j)),
          pl.BlockSpec((blk, blk), lambda i, j: (0, 0)),
        ],
        out_specs=[pl.BlockSpec((blk, blk), lambda i, j: (i, j))],
      )(x_gmem, y_gmem, o_gmem)

    out = self.launch(
      kernel, jax.ShapeDtypeStruct((m, n), jnp.float16), x, y, mesh=_ws_mesh()
    )
    self.check(out, x + jnp.tile(y, (m // blk, n // blk)))

  def test_ws_no_output_repeated(self):
    # Two compute warpgroups add their halves of every block into shared
    # SMEM, five times over; no output specs.
    m, n, blk = 64, 64, 32
    repeats = 5
    x = jax.random.uniform(jax.random.key(7), (m, n), jnp.float32)

    def kernel(x_ref, o_ref, o_scratch, barrier):
      wg = lax.axis_index(WG)

      @pl.when(wg == 0)
      def _zero():
        o_scratch[...] = jnp.zeros_like(o_scratch)

      plgpu.barrier_arrive(barrier)
      plgpu.barrier_wait(barrier)

      def add(_, x_smem):
        rows = pl.ds(wg * (blk // 2), blk // 2)
        o_scratch[rows] += x_smem[rows]

      @pl.loop(0, repeats)
      def _repeat(_):
        _ws(
          add,
          grid=(m // blk, n // blk),
          num_compute_wgs=2,
          in_specs=[pl.BlockSpec((blk, blk), lambda i, j: (i, j))],
        )(x_ref)

      plgpu.barrier_arrive(barrier)
      plgpu.barrier_wait(barrier)

      @pl.when(wg == 0)
      def _store():
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_scratch, o_ref)
        plgpu.wait_smem_to_gmem(0)

    out = self.launch(
      kernel,
      jax.ShapeDtypeStruct((blk, blk), jnp.float32),
      x,
      mesh=_ws_mesh(2),
      scratch_types=[
        plgpu.SMEM((blk, blk), jnp.float32),
        plgpu.Barrier(num_arrivals=3),
      ],
    )
    self.check(out, repeats * _blocks_sum(x, (blk, blk)), rtol=1e-5)

  @pytest.mark.parametrize("traced_state", [False, True])
  @pytest.mark.parametrize("manual_consumed_barriers", [False, True])
  def test_ws_pipeline_of_pipelines(
    self, traced_state, manual_consumed_barriers
  ):
    # START, STEADY, STEADY, STOP over one allocation, then a plain run:
    # the ring is never drained in between, and left clean at the end.
    m, n, blk = 64, 128, 32
    x = jax.random.randint(jax.random.key(8), (m, n), -10, 15, jnp.int32)
    spec = pl.BlockSpec((blk, blk), lambda i, j: (i, j))

    def kernel(x_ref, o_gmem, acc):
      wg = lax.axis_index(WG)

      @pl.when(wg == 0)
      def _zero():
        acc[...] = jnp.zeros_like(acc)

      def body(_, x_smem, *consumed):
        acc[...] += x_smem[...]
        if manual_consumed_barriers:
          plgpu.commit_smem()
          [barrier] = consumed
          plgpu.barrier_arrive(barrier)

      pipeline = functools.partial(
        _ws,
        body,
        grid=(m // blk, n // blk),
        manual_consumed_barriers=manual_consumed_barriers,
        in_specs=[spec],
      )
      states = plgpu.PipelinePipeline
      allocations = pipeline().get_allocations(x_ref)

      def scope(allocs):
        if traced_state:

          @pl.loop(0, 4)
          def _sequence(i):
            state = jnp.where(i > 0, int(states.STEADY), int(states.START))
            state = jnp.where(i == 3, int(states.STOP), state)
            pipeline(pipeline_state=state)(x_ref, allocations=allocs)

        else:
          for state in (states.START, states.STEADY, states.STEADY):
            pipeline(pipeline_state=state)(x_ref, allocations=allocs)
          pipeline(pipeline_state=states.STOP)(x_ref, allocations=allocs)
        pipeline()(x_ref, allocations=allocs)

      pl.run_scoped(scope, allocations, collective_axes=WG)

      @pl.when(wg == 0)
      def _store():
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(acc, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    out = self.launch(
      kernel,
      jax.ShapeDtypeStruct((blk, blk), jnp.int32),
      x,
      mesh=_ws_mesh(),
      scratch_types=[plgpu.SMEM((blk, blk), jnp.int32)],
    )
    self.check(out, 5 * _blocks_sum(x, (blk, blk)))

  def test_ws_manual_produced_barriers(self):
    # The body waits for each input's load itself (x first, then y).
    m, n, blk = 64, 64, 32
    keys = jax.random.split(jax.random.key(9))
    x, y = (jax.random.uniform(k, (m, n), jnp.float32) for k in keys)
    spec = pl.BlockSpec((blk, blk), lambda i, j: (i, j))

    def body(_, x_smem, y_smem, o_smem, x_loaded, y_loaded):
      plgpu.barrier_wait(x_loaded)
      o_smem[...] = x_smem[...]
      plgpu.barrier_wait(y_loaded)
      o_smem[...] += y_smem[...]

    def kernel(*refs):
      _ws(
        body,
        grid=(m // blk, n // blk),
        manual_produced_barriers=True,
        in_specs=[spec, spec],
        out_specs=[spec],
      )(*refs)

    out = self.launch(
      kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), x, y, mesh=_ws_mesh()
    )
    self.check(out, x + y)

  def test_ws_memory_thread_first_squeezed_traced_grid(self):
    # The memory warpgroup at index 0 (upstream: last only), squeezed
    # block dims and a traced number of rows per CTA.
    ctas, rows, n = 2, 8, 128
    x = jnp.arange(ctas * rows * n, dtype=jnp.int32).reshape(ctas * rows, n)

    def kernel(x_gmem, o_gmem):
      c = lax.axis_index("c")
      spec = pl.BlockSpec((None, n), lambda r: (c * rows + r, 0))
      _ws(
        _add_one,
        grid=(rows - 3 * c,),
        memory_thread_idx=0,
        in_specs=spec,
        out_specs=spec,
      )(x_gmem, o_gmem)

    out = self.launch(
      kernel,
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      x,
      mesh=_ws_mesh(grid=(ctas,), grid_names=("c",)),
    )
    written = np.arange(rows)[None, :] < rows - 3 * np.arange(ctas)[:, None]
    # Rows past a CTA's traced grid are never written.
    self.check(out, x + 1, where=written.reshape(-1)[:, None])


class TestUpstreamPipelinesSimulated(UpstreamPipelineCases):
  """Mosaic GPU simulator on CPU (``interpret=None``) vs plain jnp."""

  def launch(self, kernel, out_types, *args, mesh=None, scratch_types=()):
    return self._call(kernel, out_types, mesh, scratch_types)(*args)

  def check(self, out, expected, *, where=None, **tol):
    for o, e in zip(
      jax.tree.leaves(out), jax.tree.leaves(expected), strict=True
    ):
      assert o.shape == e.shape and o.dtype == e.dtype
      if where is not None:
        where = np.broadcast_to(where, o.shape)
        o, e = np.asarray(o)[where], np.asarray(e)[where]
      if tol:
        np.testing.assert_allclose(o, e, **tol)
      else:
        np.testing.assert_array_equal(o, e)

  @pytest.mark.parametrize(
    "case, kwargs",
    [
      ("test_emit_traced_grid", dict(max_concurrent_steps=3)),
      ("test_emit_carry_and_levels_of_delay_release", {}),
      (
        "test_ws_delay_release",
        dict(manual_consumed_barriers=True, max_concurrent_steps=2),
      ),
      (
        "test_ws_pipeline_of_pipelines",
        dict(traced_state=True, manual_consumed_barriers=False),
      ),
      ("test_ws_manual_produced_barriers", {}),
      ("test_ws_memory_thread_first_squeezed_traced_grid", {}),
    ],
  )
  def test_no_race(self, case, kwargs):
    getattr(_RaceChecked(), case)(**kwargs)


class _RaceChecked(TestUpstreamPipelinesSimulated):
  """Runs a case with the simulator's race detector; fails on a race."""

  interpret = util.race_detecting_params()

  def launch(self, *args, **kwargs):
    out = super().launch(*args, **kwargs)
    assert not util.races_found()
    return out


class TestUpstreamPipelinesCudaLowering(UpstreamPipelineCases):
  """Cross-lowered for CUDA on this host: one Mosaic GPU call per launch."""

  interpret = False

  def launch(self, kernel, out_types, *args, mesh=None, scratch_types=()):
    call = self._call(kernel, out_types, mesh, scratch_types)
    text = util.cuda_lowering_text(call, *args)
    assert len(util.MOSAIC_GPU_CALL.findall(text)) == 1
    return None

  def check(self, out, expected, *, where=None, **tol):
    del expected, where, tol
    assert out is None  # Lowered, not run.


class TestUpstreamPipelineErrors:
  def test_grid_entries(self):
    with pytest.raises(ValueError, match=r"expected 'grid' of positive ints"):
      gpu.emit_pipeline(_add_one, grid=(2, 0))
    with pytest.raises(TypeError, match=r"ints or int32 scalars, got the bool"):
      gpu.emit_pipeline(_add_one, grid=(True,))
    with pytest.raises(TypeError, match=r"integer scalars, got 2.0"):
      gpu.emit_pipeline(_add_one, grid=(2.0,))
    with pytest.raises(TypeError, match=r"integer scalars, got Array"):
      gpu.emit_pipeline(_add_one, grid=(jnp.ones((2,), jnp.int32),))
    with pytest.raises(TypeError, match=r"a tuple of ints or int32 scalars"):
      gpu.emit_pipeline(_add_one, grid="2")

  def test_element_padding(self):
    spec = pl.BlockSpec((pl.Element(8, (1, 1)), 128), lambda i: (i, 0))
    with pytest.raises(
      NotImplementedError,
      match=r"in_specs\[0\]: pl.Element block dimensions with padding are "
      r"not supported, got padding=\(1, 1\)",
    ):
      gpu.emit_pipeline(_add_one, grid=(2,), in_specs=[spec])

  def test_bounded_slice(self):
    spec = pl.BlockSpec((pl.BoundedSlice(8), 128), lambda i: (i, 0))
    with pytest.raises(
      NotImplementedError,
      match=r"pl.BoundedSlice block dimensions are not supported",
    ):
      gpu.emit_pipeline(_add_one, grid=(2,), in_specs=[spec])

  def test_element_window_larger_than_operand(self):
    x = jnp.zeros((16, 128), jnp.int32)
    spec = pl.BlockSpec((pl.Element(32), 128), lambda i: (i, 0))

    def kernel(x_gmem, o_gmem):
      gpu.emit_pipeline(_add_one, grid=(1,), in_specs=[spec], out_specs=[spec])(
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
        _add_one, grid=(2,), in_specs=[pl.BlockSpec((8.0,), lambda i: (i,))]
      )
    with pytest.raises(ValueError, match=r"positive block sizes, got 0"):
      gpu.emit_pipeline(
        _add_one, grid=(2,), in_specs=[pl.BlockSpec((0,), lambda i: (i,))]
      )

  def test_collective_axes(self):
    spec = plgpu.BlockSpec(
      (64, 64), lambda i: (0, i), collective_axes=("cluster",)
    )
    with pytest.raises(
      NotImplementedError, match=r"collective_axes \(cluster multicast\)"
    ):
      _ws(_add_one, grid=(2,), in_specs=[spec])

  def test_rank_mismatch(self):
    x = jnp.zeros((16, 256), jnp.int32)
    spec = pl.BlockSpec((None, 16, 256), lambda i: (i, 0, 0))

    def kernel(x_gmem, o_gmem):
      gpu.emit_pipeline(_add_one, grid=(2,), in_specs=[spec], out_specs=[spec])(
        x_gmem, o_gmem
      )

    with pytest.raises(ValueError, match=r"input\[0\] expected rank 3"):
      mpmd.mpmd_map(
        [(plgpu.Mesh(), kernel)], jax.ShapeDtypeStruct(x.shape, x.dtype)
      )(x)

  def test_ws_arguments(self):
    with pytest.raises(TypeError, match=r"expected 'wg_axis' a str"):
      _ws(_add_one, grid=(2,), wg_axis=None)
    with pytest.raises(
      ValueError, match=r"'memory_registers' a multiple of 8 in \[24, 256\]"
    ):
      _ws(_add_one, grid=(2,), memory_registers=41)
    with pytest.raises(
      ValueError,
      match=r"'memory_thread_idx' an int in \[0, num_compute_wgs=1\], got 2",
    ):
      _ws(_add_one, grid=(2,), memory_thread_idx=2)
    with pytest.raises(
      ValueError, match=r"expected 'memory_thread_idx' >= 0, got -1"
    ):
      _ws(_add_one, grid=(2,), memory_thread_idx=-1)
    with pytest.raises(
      TypeError, match=r"expected 'memory_thread_idx' to be an int, got True"
    ):
      _ws(_add_one, grid=(2,), memory_thread_idx=True)
    with pytest.raises(ValueError, match=r"'num_compute_wgs' >= 1, got 0"):
      _ws(_add_one, grid=(2,), num_compute_wgs=0)

  def test_ws_smem_outputs_with_two_compute_wgs(self):
    spec = pl.BlockSpec((64, 64), lambda i: (0, i))
    with pytest.raises(
      NotImplementedError, match=r"SMEM outputs need num_compute_wgs=1"
    ):
      _ws(
        _add_one,
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
        _ws(_add_one, pipeline_state=start, **kw)
    with pytest.raises(TypeError, match=r"expected 'pipeline_state' None"):
      _ws(_add_one, grid=(4,), in_specs=[spec], pipeline_state="START")

  def test_ws_pipeline_state_traced_grid(self):
    def kernel(x_gmem, o_gmem):
      _ws(
        _add_one,
        grid=(lax.axis_index("c") + 2,),
        in_specs=[pl.BlockSpec((64, 64), lambda i: (0, i))],
        pipeline_state=plgpu.PipelinePipeline.START,
      )

    x = jnp.zeros((64, 128), jnp.float32)
    with pytest.raises(NotImplementedError, match=r"with a traced grid"):
      mpmd.mpmd_map(
        [(_ws_mesh(grid=(1,), grid_names=("c",)), kernel)],
        jax.ShapeDtypeStruct(x.shape, x.dtype),
      )(x)

  def test_ws_pipeline_state_needs_allocations(self):
    spec = pl.BlockSpec((64, 64), lambda i: (0, i))

    def kernel(x_gmem, o_gmem):
      _ws(
        _add_one,
        grid=(2,),
        in_specs=[spec],
        pipeline_state=plgpu.PipelinePipeline.START,
      )(x_gmem)

    x = jnp.zeros((64, 128), jnp.float32)
    with pytest.raises(
      ValueError, match=r"expected 'allocations' .* with a pipeline_state"
    ):
      mpmd.mpmd_map(
        [(_ws_mesh(), kernel)], jax.ShapeDtypeStruct(x.shape, x.dtype)
      )(x)

  def test_ws_ref_structure(self):
    spec = pl.BlockSpec((64, 64), lambda i: (0, i))

    def kernel(x_gmem, o_gmem):
      _ws(_add_one, grid=(2,), in_specs=[(spec,)], out_specs=[spec])(
        x_gmem, o_gmem
      )

    x = jnp.zeros((64, 128), jnp.float32)
    with pytest.raises(
      ValueError, match=r"expected input refs with the pytree structure"
    ):
      mpmd.mpmd_map(
        [(_ws_mesh(), kernel)], jax.ShapeDtypeStruct(x.shape, x.dtype)
      )(x)
