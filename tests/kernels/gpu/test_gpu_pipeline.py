"""Software and warp-specialized pipelines in the Mosaic GPU simulator.

Each test builds a small kernel on ``mpmd.mpmd_map``, runs it on CPU with
``interpret=None`` (the Mosaic GPU simulator) and compares with plain JAX.
"""

import functools
import re

import gpu_test_util as util
import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

import mpmd
from mpmd.kernels import gpu

ROWS = 64
BLOCK = 64  # f32 blocks of (ROWS, BLOCK): 16 KiB per slot.


def _column_specs():
  """Block j of the columns (the last grid index) of a (ROWS, n) operand."""
  return pl.BlockSpec((ROWS, BLOCK), lambda *idx: (0, idx[-1]))


# The one (ROWS, BLOCK) block of every step of a one-dimensional grid.
_INVARIANT = pl.BlockSpec((ROWS, BLOCK), lambda j: (0, 0))


def _software_call(body, xs, out_shape, *, interpret=None, **pipeline_kw):
  mesh = plgpu.Mesh()  # One warpgroup, no thread axis.

  def kernel(*refs):
    gpu.pipeline(body, **pipeline_kw)(*refs)

  return mpmd.mpmd_map(
    [(mesh, kernel)],
    out_types=jax.ShapeDtypeStruct(out_shape, jnp.float32),
    interpret=interpret,
  )(*xs)


def _ws_call(body, xs, out_shape, *, multi_mesh=False, interpret=None, **kw):
  pipe = gpu.warp_specialized_pipeline(body, **kw)
  out_type = jax.ShapeDtypeStruct(out_shape, jnp.float32)
  call = gpu.warp_specialized_kernel(
    pipe,
    compute_fn=lambda *r: pipe.compute(*r[:-2], scratch=r[-2]),
    memory_fn=lambda *r: pipe.memory(*r[:-1], scratch=r[-1]),
    out_types=out_type,
    scratch_types=pipe.scratch_types(*xs, out_type),
    multi_mesh=multi_mesh,
    interpret=interpret,
  )
  return call(*xs)


def _add_one(indices, x, o):
  del indices
  o[...] = x[...] + 1.0


def _add_bias(indices, x, b, o):
  del indices
  o[...] = x[...] + b[...]


def _sum_blocks(restart_axis):
  """A body that adds each input block into its output block, zeroing it
  first at every step whose grid index ``restart_axis`` is 0."""

  def body(indices, x, o):
    @pl.when(indices[restart_axis] == 0)
    def _init():
      o[...] = jnp.zeros_like(o)

    o[...] += x[...]

  return body


def _columns(rng, steps):
  return jnp.asarray(rng.standard_normal((ROWS, BLOCK * steps)), jnp.float32)


def _over_columns(call, body, xs, out_shape=None, **kw):
  """``call`` streaming the column blocks of ``xs[0]`` (one grid step a
  block) into an output of ``out_shape`` (default: ``xs[0]``'s); each of
  ``grid``, ``in_specs`` and ``out_specs`` can be given instead."""
  kw.setdefault("grid", (xs[0].shape[-1] // BLOCK,))
  kw.setdefault("in_specs", [_column_specs()])
  kw.setdefault("out_specs", [_column_specs()])
  return call(body, xs, xs[0].shape if out_shape is None else out_shape, **kw)


class PipelineTestBase:
  """Shared cases; subclasses say which pipeline runs them."""

  call = None  # (body, xs, out_shape, **pipeline kwargs) -> output

  @pytest.mark.parametrize("max_concurrent_steps", [1, 2, 3, 4])
  @pytest.mark.parametrize("steps", [1, 3])
  def test_streams_every_block(self, rng, steps, max_concurrent_steps):
    # steps=1 and 3 with up to 4 stages: fewer steps than stages included.
    x = _columns(rng, steps)
    out = _over_columns(
      type(self).call, _add_one, [x], max_concurrent_steps=max_concurrent_steps
    )
    np.testing.assert_array_equal(out, x + 1.0)

  def test_two_dim_grid(self, rng):
    x = jnp.asarray(rng.standard_normal((2 * ROWS, 3 * BLOCK)), jnp.float32)
    spec = pl.BlockSpec((ROWS, BLOCK), lambda i, j: (i, j))
    out = _over_columns(
      type(self).call,
      _add_one,
      [x],
      grid=(2, 3),
      in_specs=[spec],
      out_specs=[spec],
      max_concurrent_steps=2,
    )
    np.testing.assert_array_equal(out, x + 1.0)

  def test_index_invariant_input(self, rng):
    x = _columns(rng, 3)
    bias = jnp.asarray(rng.standard_normal((ROWS, BLOCK)), jnp.float32)

    out = _over_columns(
      type(self).call,
      _add_bias,
      [x, bias],
      in_specs=[_column_specs(), _INVARIANT],
      max_concurrent_steps=2,
    )
    np.testing.assert_array_equal(out, x + jnp.tile(bias, (1, 3)))

  def test_index_invariant_output_accumulates(self, rng):
    x = _columns(rng, 4)

    out = _over_columns(
      type(self).call,
      _sum_blocks(restart_axis=0),
      [x],
      (ROWS, BLOCK),
      out_specs=[_INVARIANT],
      max_concurrent_steps=3,
    )
    expected = x.reshape(ROWS, 4, BLOCK).sum(axis=1)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)

  def test_output_stored_when_block_changes(self, rng):
    # Output block (i, 0) is revisited on consecutive steps (i, 0..2): the
    # body accumulates into one buffer, stored once per i.
    x = jnp.asarray(rng.standard_normal((2 * ROWS, 3 * BLOCK)), jnp.float32)

    out = _over_columns(
      type(self).call,
      _sum_blocks(restart_axis=1),
      [x],
      (2 * ROWS, BLOCK),
      grid=(2, 3),
      in_specs=[pl.BlockSpec((ROWS, BLOCK), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((ROWS, BLOCK), lambda i, j: (i, 0))],
      max_concurrent_steps=2,
    )
    expected = x.reshape(2 * ROWS, 3, BLOCK).sum(axis=1)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)

  @pytest.mark.parametrize("max_concurrent_steps", [2, 3])
  def test_delay_release(self, rng, max_concurrent_steps):
    x = _columns(rng, 4)
    spec = plgpu.BlockSpec((ROWS, BLOCK), lambda j: (0, j), delay_release=1)
    out = _over_columns(
      type(self).call,
      _add_one,
      [x],
      in_specs=[spec],
      max_concurrent_steps=max_concurrent_steps,
    )
    np.testing.assert_array_equal(out, x + 1.0)

  def test_swizzled_blocks(self, rng):
    x = jnp.asarray(rng.standard_normal((ROWS, 2 * BLOCK)), jnp.float16)
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    spec = plgpu.BlockSpec(
      (ROWS, BLOCK), lambda j: (0, j), transforms=transforms
    )

    def body(indices, x, o):
      del indices
      o[...] = x[...].astype(jnp.float32) * 2.0

    out = _over_columns(
      type(self).call, body, [x], in_specs=[spec], max_concurrent_steps=2
    )
    np.testing.assert_array_equal(out, x.astype(jnp.float32) * 2.0)

  def test_no_race(self, rng):
    x = _columns(rng, 3)
    out = _over_columns(
      type(self).call,
      _add_one,
      [x],
      max_concurrent_steps=2,
      interpret=util.race_detecting_params(),
    )
    assert not util.races_found()
    np.testing.assert_array_equal(out, x + 1.0)


class TestSoftwarePipeline(PipelineTestBase):
  call = staticmethod(_software_call)

  def test_init_carry(self, rng):
    x = _columns(rng, 3)

    def body(indices, x, o, carry):
      del indices
      o[...] = x[...] + carry
      return carry + 1.0

    out = _over_columns(
      _software_call,
      body,
      [x],
      init_carry=10.0,  # a Python float: traced inside the kernel
    )
    offsets = jnp.repeat(jnp.arange(10.0, 13.0, dtype=jnp.float32), BLOCK)
    np.testing.assert_array_equal(out, x + offsets[None, :])

  def test_invariant_input_loaded_outside_the_loop(self, rng):
    # Structural: the invariant block's copy is issued once, before the loop.
    x = _columns(rng, 3)
    bias = jnp.zeros((ROWS, BLOCK), jnp.float32)

    fn = functools.partial(
      _over_columns,
      _software_call,
      _add_bias,
      in_specs=[_column_specs(), _INVARIANT],
      max_concurrent_steps=2,
    )
    text = str(jax.make_jaxpr(lambda *xs: fn(list(xs)))(x, bias))
    # fori_loop with static bounds traces to a scan.
    loop_start = re.search(r"\b(scan|while)\[", text).start()
    before, inside = text[:loop_start], text[loop_start:]
    # Prologue: one invariant copy + two streamed; the loop only refills.
    assert before.count("copy_gmem_to_smem") == 3
    assert inside.count("copy_gmem_to_smem") == 1


class TestWarpSpecializedSingleMesh(PipelineTestBase):
  call = staticmethod(_ws_call)

  @pytest.mark.parametrize("num_compute_wgs", [1, 2])
  def test_compute_context_carry(self, rng, num_compute_wgs):
    # Each compute warpgroup sums its rows of every column block in a carry,
    # then stores them from the compute context.
    steps, rows = 3, ROWS // num_compute_wgs
    x = _columns(rng, steps)
    pipe_kw = dict(
      grid=(steps,),
      in_specs=[_column_specs()],
      max_concurrent_steps=2,
      num_compute_wgs=num_compute_wgs,
    )
    pipe = gpu.warp_specialized_pipeline(lambda *a: a[-1], **pipe_kw)
    out_type = jax.ShapeDtypeStruct((ROWS, BLOCK), jnp.float32)
    scratch = dict(
      pipeline=pipe.scratch_types(x),
      out=plgpu.SMEM((num_compute_wgs, rows, BLOCK), jnp.float32),
    )

    def compute_fn(x_ref, o_ref, scratch, wg):
      mine = pl.ds(wg * rows, rows)

      def body(indices, x, carry):
        del indices
        return carry + x.at[mine][...]

      def context(run):
        total = run(jnp.zeros((rows, BLOCK), jnp.float32))
        scratch["out"].at[wg][...] = total
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(scratch["out"].at[wg], o_ref.at[mine])
        plgpu.wait_smem_to_gmem(0)

      pipe.compute(
        x_ref, scratch=scratch["pipeline"], body=body, compute_context=context
      )

    call = gpu.warp_specialized_kernel(
      pipe,
      compute_fn=compute_fn,
      memory_fn=lambda x_ref, o_ref, s: pipe.memory(
        x_ref, scratch=s["pipeline"]
      ),
      out_types=out_type,
      scratch_types=scratch,
      multi_mesh=False,
    )
    expected = x.reshape(ROWS, steps, BLOCK).sum(axis=1)
    np.testing.assert_allclose(call(x), expected, rtol=1e-6, atol=1e-6)


class TestWarpSpecializedMultiMesh(PipelineTestBase):
  """Two meshes in one mpmd_map: compute warpgroups, then the memory one."""

  call = staticmethod(functools.partial(_ws_call, multi_mesh=True))

  def test_jaxpr_has_both_meshes(self, rng):
    x = _columns(rng, 2)
    fn = functools.partial(_over_columns, _ws_call, _add_one, multi_mesh=True)
    jaxpr = jax.make_jaxpr(lambda x: fn([x]))(x)
    [eqn] = [e for e in jaxpr.eqns if e.primitive is mpmd.mpmd_map_p]
    names = [m.thread_name for m in eqn.params["meshes"]]
    assert names == ["compute", "memory"]

  def test_cuda_lowering(self, rng):
    x = _columns(rng, 2)
    fn = functools.partial(
      _over_columns, _ws_call, _add_one, multi_mesh=True, interpret=False
    )
    lowered = util.cuda_lowering_text(lambda x: fn([x]), x)
    assert len(util.MOSAIC_GPU_CALL.findall(lowered)) == 1


@pytest.mark.parametrize("multi_mesh", [False, True])
class TestWarpSpecializedManualBarriers:
  """Manual barriers on both forms of the two-function pipeline."""

  @pytest.mark.parametrize("delay_release", [0, 1])
  def test_manual_consumed_barriers(self, rng, multi_mesh, delay_release):
    # At step s the body gets the consumed barrier of step s - delay_release's
    # slot and releases it (the first delay_release steps have none).
    x = _columns(rng, 4)
    spec = plgpu.BlockSpec(
      (ROWS, BLOCK), lambda j: (0, j), delay_release=delay_release
    )

    def body(indices, x, o, consumed):
      _add_one(indices, x, o)

      @pl.when(indices[0] >= delay_release)
      def _release():
        plgpu.commit_smem()
        plgpu.barrier_arrive(consumed)

    out = _over_columns(
      _ws_call,
      body,
      [x],
      in_specs=[spec],
      max_concurrent_steps=2,
      manual_consumed_barriers=True,
      multi_mesh=multi_mesh,
    )
    np.testing.assert_array_equal(out, x + 1.0)

  def test_manual_produced_barriers(self, rng, multi_mesh):
    # The body waits for each load itself; the index-invariant input has a
    # barrier too (the memory warpgroup arrives on it every step).
    x = _columns(rng, 3)
    bias = jnp.asarray(rng.standard_normal((ROWS, BLOCK)), jnp.float32)

    def body(indices, x, b, o, x_loaded, b_loaded):
      del indices
      plgpu.barrier_wait(b_loaded)
      o[...] = b[...]
      plgpu.barrier_wait(x_loaded)
      o[...] += x[...]

    out = _over_columns(
      _ws_call,
      body,
      [x, bias],
      in_specs=[_column_specs(), _INVARIANT],
      max_concurrent_steps=2,
      manual_produced_barriers=True,
      multi_mesh=multi_mesh,
    )
    np.testing.assert_array_equal(out, x + jnp.tile(bias, (1, 3)))


class TestPipelineErrors:
  @pytest.mark.parametrize(
    "make", [gpu.pipeline, gpu.warp_specialized_pipeline]
  )
  def test_bad_grid(self, make):
    with pytest.raises(ValueError, match=r"expected 'grid' of positive ints"):
      make(_add_one, grid=(0,))

  @pytest.mark.parametrize(
    "make", [gpu.pipeline, gpu.warp_specialized_pipeline]
  )
  def test_bad_max_concurrent_steps(self, make):
    with pytest.raises(
      ValueError, match=r"expected 'max_concurrent_steps' >= 1, got 0"
    ):
      make(_add_one, grid=(2,), max_concurrent_steps=0)
    for bad in (True, 2.0, "2"):
      with pytest.raises(
        TypeError,
        match=r"expected 'max_concurrent_steps' to be an int, got "
        + re.escape(repr(bad)),
      ):
        make(_add_one, grid=(2,), max_concurrent_steps=bad)

  @pytest.mark.parametrize(
    "make", [gpu.pipeline, gpu.warp_specialized_pipeline]
  )
  def test_negative_delay_release(self, make):
    spec = plgpu.BlockSpec((ROWS, BLOCK), lambda j: (0, j), delay_release=-1)
    with pytest.raises(ValueError, match=r"'delay_release' >= 0, got -1"):
      make(_add_one, grid=(2,), in_specs=[spec], out_specs=[spec])

  @pytest.mark.parametrize(
    "make", [gpu.pipeline, gpu.warp_specialized_pipeline]
  )
  def test_delay_release_too_large(self, make):
    spec = plgpu.BlockSpec((ROWS, BLOCK), lambda j: (0, j), delay_release=2)
    with pytest.raises(ValueError, match=r"delay_release < max_concurrent"):
      make(_add_one, grid=(4,), in_specs=[spec], max_concurrent_steps=2)

  def test_not_a_block_spec(self):
    with pytest.raises(TypeError, match=r"in_specs\[0\]: expected a pl.Block"):
      gpu.pipeline(_add_one, grid=(2,), in_specs=[(ROWS, BLOCK)])

  def test_block_does_not_divide_operand(self):
    x = jnp.zeros((ROWS, BLOCK + 8), jnp.float32)
    with pytest.raises(ValueError, match=r"input\[0\] expected a shape divis"):
      _over_columns(
        _software_call,
        _add_one,
        [x],
        grid=(1,),
        out_specs=[pl.BlockSpec((ROWS, BLOCK + 8), lambda j: (0, 0))],
      )

  def test_ws_smem_outputs_need_one_compute_wg(self):
    with pytest.raises(NotImplementedError, match=r"need num_compute_wgs=1"):
      gpu.warp_specialized_pipeline(
        _add_one,
        grid=(2,),
        in_specs=[_column_specs()],
        out_specs=[_column_specs()],
        num_compute_wgs=2,
      )

  def test_ws_bad_num_compute_wgs(self):
    with pytest.raises(
      ValueError,
      match=r"warp_specialized_pipeline: expected 'num_compute_wgs' >= 1, "
      r"got 0",
    ):
      gpu.warp_specialized_pipeline(_add_one, grid=(2,), num_compute_wgs=0)
    with pytest.raises(
      TypeError, match=r"expected 'num_compute_wgs' to be an int, got 1.0"
    ):
      gpu.warp_specialized_pipeline(_add_one, grid=(2,), num_compute_wgs=1.0)

  def test_compute_context_must_run_once(self, rng):
    x = _columns(rng, 1)
    with pytest.raises(ValueError, match=r"exactly once, got no call"):
      _over_columns(
        _software_call, _add_one, [x], compute_context=lambda run: None
      )
