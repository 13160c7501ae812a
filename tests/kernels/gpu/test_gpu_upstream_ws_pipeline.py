"""Upstream's ``plgpu.emit_pipeline_warp_specialized`` programs on
``gpu.emit_pipeline_warp_specialized``.

Pytree specs, manual produced / consumed barriers, delay_release, carries,
several compute warpgroups, pipelines of pipelines, launched through
``mpmd.mpmd_map``. One base of cases, run in the Mosaic GPU simulator on CPU
against plain-jnp references (some also under the race detector) and
cross-lowered for CUDA (one ``mosaic_gpu`` custom call per launch).
"""

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from upstream_pipeline_util import (
  WG,
  PipelineCases,
  add_one,
  backend_classes,
  blocks_sum,
  ws,
  ws_mesh,
)


class WsPipelineCases(PipelineCases):
  """emit_pipeline_warp_specialized: the shared programs."""

  def two_inputs(self, body, x, y, **pipeline_kw):
    """``body`` by the warp-specialized pipeline (``ws(body,
    **pipeline_kw)``) on inputs ``x`` and ``y``, into an output like
    ``x``, in one launch on a one-compute-warpgroup mesh."""

    def kernel(x_gmem, y_gmem, o_gmem):
      ws(body, **pipeline_kw)(x_gmem, y_gmem, o_gmem)

    out_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return self.launch(kernel, out_type, x, y, mesh=ws_mesh())

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
      pipe = ws(
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
      mesh=ws_mesh(),
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
      ws(
        body,
        grid=grid,
        in_specs=(spec, (spec,), None),
        out_specs=[spec],
        manual_consumed_barriers=manual_consumed_barriers,
      )(x_gmem, (y_gmem,), None, o_gmem)

    out = self.launch(
      kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), x, y, mesh=ws_mesh()
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

      ws(
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
      mesh=ws_mesh(2),
      scratch_types=[plgpu.SMEM((2, blk, blk), jnp.float32)],
    )
    total = steps * blocks_sum(x, (blk, blk))
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

    out = self.two_inputs(
      body,
      x,
      y,
      grid=(m // blk_m, n // blk_n),
      max_concurrent_steps=max_concurrent_steps,
      manual_consumed_barriers=manual_consumed_barriers,
      in_specs=[spec, spec],
      out_specs=[out_spec],
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

    out = self.two_inputs(
      body,
      x,
      y,
      grid=(m // blk, n // blk),
      in_specs=[
        pl.BlockSpec((blk, blk), lambda i, j: (i, j)),
        pl.BlockSpec((blk, blk), lambda i, j: (0, 0)),
      ],
      out_specs=[pl.BlockSpec((blk, blk), lambda i, j: (i, j))],
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
        ws(
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
      mesh=ws_mesh(2),
      scratch_types=[
        plgpu.SMEM((blk, blk), jnp.float32),
        plgpu.Barrier(num_arrivals=3),
      ],
    )
    self.check(out, repeats * blocks_sum(x, (blk, blk)), rtol=1e-5)

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
        ws,
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
      mesh=ws_mesh(),
      scratch_types=[plgpu.SMEM((blk, blk), jnp.int32)],
    )
    self.check(out, 5 * blocks_sum(x, (blk, blk)))

  def test_ws_manual_produced_barriers(self):
    self.manual_loaded_barriers(manual_produced_barriers=True)

  def test_ws_manual_ready_barriers(self):
    # jax 0.11's and upstream main's name for manual_produced_barriers.
    self.manual_loaded_barriers(manual_ready_barriers=True)

  def manual_loaded_barriers(self, **flag):
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

    out = self.two_inputs(
      body,
      x,
      y,
      grid=(m // blk, n // blk),
      **flag,
      in_specs=[spec, spec],
      out_specs=[spec],
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
      ws(
        add_one,
        grid=(rows - 3 * c,),
        memory_thread_idx=0,
        in_specs=spec,
        out_specs=spec,
      )(x_gmem, o_gmem)

    out = self.launch(
      kernel,
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      x,
      mesh=ws_mesh(grid=(ctas,), grid_names=("c",)),
    )
    written = np.arange(rows)[None, :] < rows - 3 * np.arange(ctas)[:, None]
    # Rows past a CTA's traced grid are never written.
    self.check(out, x + 1, where=written.reshape(-1)[:, None])


TestWsPipelineSimulated, TestWsPipelineCudaLowering = backend_classes(
  WsPipelineCases,
  race_checked=[
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
