"""Programs that crashed under ``jax_enable_checks`` (issue 36, item 3).

JAX's own test base runs everything with its internal checks on; each test
here is a small program that failed there (or, for gmm's mixed-dtype
gradient, failed on XLA:CPU at all), run with the checks on and checked
against plain JAX.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd.kernels import gmm

ROWS = (8, 128)


@pytest.fixture(autouse=True)
def enable_checks():
  with jax.enable_checks(True):
    yield


def tc():
  return mpmd.tensorcore_mesh("core", num_cores=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_closing_over_an_hbm_ref(dtype):
  """A Ref in HBM that the kernel closes over (not an operand), its windows
  moved in a loop and a branch: in bf16 on jax 0.10.2 the CPU fallback
  holds it as 16-bit words (``lowering/words.py``)."""
  x = jnp.asarray(np.arange(2 * 8 * 128).reshape(2, *ROWS) % 251, dtype)

  @jax.jit
  def f(x, first):
    x_ref = jax.new_ref(x, memory_space=pltpu.HBM)

    def kernel(o_hbm, buf):
      @pl.loop(0, 2)
      def _(j):
        @pl.when(j == first)
        def _():
          pltpu.sync_copy(x_ref.at[j], buf)
          buf[...] = buf[...] + jnp.ones((), dtype)
          pltpu.sync_copy(buf, o_hbm)
          pltpu.sync_copy(buf, x_ref.at[1 - j])

    out = mpmd.mpmd_map(
      [(tc(), kernel)],
      jax.ShapeDtypeStruct(ROWS, dtype),
      scratch_types=[pltpu.VMEM(ROWS, dtype)],
    )()
    return out, jax.freeze(x_ref)

  out, final = f(x, 1)
  np.testing.assert_array_equal(out, x[1] + 1)
  np.testing.assert_array_equal(final[0], x[1] + 1)
  np.testing.assert_array_equal(final[1], x[1])


def _assert_adds_one_per_shard(shard, *, num_devices):
  """``shard`` (f32 (8, 128) -> the same, plus one) under a jitted
  shard_map over ``num_devices`` devices with check_vma on."""
  mesh = jax.make_mesh((num_devices,), ("d",))
  f = jax.jit(
    jax.shard_map(
      shard, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=True
    )
  )
  x = jnp.arange(num_devices * 8 * 128, dtype=jnp.float32).reshape(-1, 128)
  x = jax.device_put(x, jax.NamedSharding(mesh, P("d")))
  np.testing.assert_array_equal(f(x), np.asarray(x) + 1.0)


@pytest.mark.parametrize(
  "interpret",
  [pltpu.InterpretParams(), None],
  ids=["simulator", "default"],
)
def test_simulator_under_shard_map_with_check_vma(interpret):
  """The TPU simulator's device index, traced without vma, was type-checked
  with it: "inconsistently typed as i32[]{V:d}"."""

  def kernel(x_hbm, o_hbm, buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] = buf[...] + 1.0
    pltpu.sync_copy(buf, o_hbm)

  def shard(x):
    return mpmd.mpmd_map(
      [(tc(), kernel)],
      jax.typeof(x),  # how the output varies, as check_vma needs
      scratch_types=[pltpu.VMEM(ROWS, jnp.float32)],
      interpret=interpret,
    )(x)

  _assert_adds_one_per_shard(shard, num_devices=4)


def test_gpu_simulator_under_shard_map_with_check_vma():
  """The Mosaic GPU simulator shares the TPU simulator's supervision."""
  warpgroups = plgpu.Mesh(num_threads=2, thread_name="wg")

  def kernel(x_ref, o_ref):
    half = ROWS[0] // 2
    rows = pl.ds(jax.lax.axis_index("wg") * half, half)
    o_ref[rows, :] = x_ref[rows, :] + 1.0

  def shard(x):
    return mpmd.mpmd_map(
      [(warpgroups, kernel)],
      jax.typeof(x),  # how the output varies, as check_vma needs
      interpret=mpmd.GPUInterpretParams(),
    )(x)

  _assert_adds_one_per_shard(shard, num_devices=2)


def test_aliased_refs_in_a_branch_and_a_loop():
  """An input aliased to an output is one buffer on the CPU fallback; a
  branch or loop that took both Refs got that buffer twice ("cond passes
  the same Ref as more than one operand"), and would discharge each copy
  on its own."""

  def kernel(x_hbm, o_hbm, buf):
    @pl.loop(0, 3)
    def _(i):
      @pl.when(i < 2)
      def _():
        pltpu.sync_copy(x_hbm, buf)
        buf[...] = buf[...] * 2.0
        pltpu.sync_copy(buf, o_hbm)

  f = jax.jit(
    mpmd.mpmd_map(
      [(tc(), kernel)],
      jax.ShapeDtypeStruct(ROWS, jnp.float32),
      input_output_aliases={0: 0},
      scratch_types=[pltpu.VMEM(ROWS, jnp.float32)],
    )
  )
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(ROWS)
  # One buffer: the second pass reads what the first wrote.
  np.testing.assert_array_equal(f(x), x * 4.0)


def _gmm_ref(lhs, rhs_local, sizes, offset, existing):
  """f32 plain JAX: local groups' rows from ragged_dot, the rest kept."""
  num_groups, (num_local, k, n) = len(sizes), rhs_local.shape
  rhs = jnp.zeros((num_groups, k, n), jnp.float32)
  rhs = rhs.at[offset : offset + num_local].set(rhs_local.astype(jnp.float32))
  out = lax.ragged_dot(
    lhs.astype(jnp.float32),
    rhs,
    sizes,
    precision=lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )
  ends = np.cumsum(sizes)
  lo, hi = ends[offset] - sizes[offset], ends[offset + num_local - 1]
  rows = np.arange(lhs.shape[0])[:, None]
  return jnp.where((rows >= lo) & (rows < hi), out, existing)


@pytest.mark.parametrize("tiling", [(16, 32, 16), None], ids=["tiled", "cpu"])
def test_gmm_grad_with_group_offset_and_existing_out(rng, tiling):
  """Differentiated outside jit: the tiled kernel aliases existing_out to
  its output inside branches."""
  m, k, n, offset = 64, 32, 16, 1
  sizes = np.array([10, 20, 14, 20], np.int32)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((2, k, n)) / np.sqrt(k), jnp.float32)
  existing = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  weights = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

  def loss(lhs, rhs, existing):
    out = gmm(
      lhs,
      rhs,
      jnp.asarray(sizes),
      tiling=tiling,
      group_offset=jnp.int32(offset),
      existing_out=existing,
    )
    return jnp.sum(out * weights)

  def loss_ref(lhs, rhs, existing):
    return jnp.sum(_gmm_ref(lhs, rhs, sizes, offset, existing) * weights)

  got = jax.grad(loss, argnums=(0, 1, 2))(lhs, rhs, existing)
  want = jax.grad(loss_ref, argnums=(0, 1, 2))(lhs, rhs, existing)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_gmm_grad_bf16_lhs_f32_rhs_bf16_out(rng):
  """The VJP's tgmm of ``lhs.T`` in a jit: XLA:CPU folds the transpose into
  a bf16 x bf16 -> f32 dot it cannot run (UNIMPLEMENTED)."""
  m, k, n = 64, 32, 16
  sizes = jnp.array([10, 20, 14, 20], jnp.int32)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((4, k, n)) / np.sqrt(k), jnp.float32)

  def loss(lhs, rhs):
    out = gmm(lhs, rhs, sizes, preferred_element_type=jnp.bfloat16)
    return jnp.sum(out.astype(jnp.float32))

  def loss_ref(lhs, rhs):
    out = _gmm_ref(lhs, rhs, np.asarray(sizes), 0, jnp.zeros((m, n)))
    return jnp.sum(out)

  dlhs, drhs = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
  want_lhs, want_rhs = jax.grad(loss_ref, argnums=(0, 1))(
    lhs.astype(jnp.float32), rhs
  )
  assert (dlhs.dtype, drhs.dtype) == (jnp.bfloat16, jnp.float32)
  # d lhs is rounded to bf16 once; d rhs sums bf16 inputs in f32.
  np.testing.assert_allclose(dlhs.astype(jnp.float32), want_lhs, rtol=8e-3)
  np.testing.assert_allclose(drhs, want_rhs, rtol=2e-5, atol=2e-5)


def _select_sem_launch(interpret=None):
  def kernel(x_hbm, o_hbm, buf, sems):
    sem = pl.select_ref(jnp.int32(1), sems.at[0], sems.at[1])
    copy = pltpu.make_async_copy(x_hbm, buf, sem)
    copy.start()
    copy.wait()
    pltpu.sync_copy(buf, o_hbm)

  return mpmd.mpmd_map(
    [(tc(), kernel)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[
      pltpu.VMEM(ROWS, jnp.float32),
      pltpu.SemaphoreType.DMA((2,)),
    ],
    interpret=interpret,
  )


def test_dma_semaphore_chosen_by_select_ref():
  """Our kernel checks crashed on the selected semaphore ("'tuple' object
  has no attribute 'aval'"): it lowers for TPU, and the CPU fallback says
  what it cannot run."""
  x = jnp.ones(ROWS, jnp.float32)
  traced = jax.jit(_select_sem_launch()).trace(x)
  text = traced.lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text
  with pytest.raises(
    NotImplementedError,
    match=r"the CPU fallback cannot run pl.select_ref .*'dma_start'",
  ):
    traced.lower(lowering_platforms=("cpu",))
