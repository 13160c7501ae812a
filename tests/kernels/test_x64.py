"""Every shipped kernel under ``jax_enable_x64``: it runs on the CPU fallback
against its reference, and the TPU and GPU ones lower for their hardware
(collective matmul and tiled gmm, the conditional ragged all-to-all, the
GPU matmuls; the MoE layer runs, forward and gradients).

With x64 on, a Python int meets an int32 index as an int64 in ``lax``
operations (``lax.rem``, ``lax.select``), ``jnp.sum`` / ``jnp.cumsum`` of
int32 counts give int64, and a Python-int ``fori_loop`` bound gives an int64
loop index, which Mosaic rejects in a DMA's slice. The kernels keep their
indices int32; these tests run each of them with x64 on, inputs in the
dtypes the other tests use (f32, int32 metadata; int64 offsets for the
ragged all-to-all, which takes any integer dtype).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collective_matmul_util import make_mesh, operands, reference_matmul
from grouped_matmul_util import ragged_dot_ref
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from moe_util import Problem, dense_reference
from ragged_all_to_all_util import (
  place,
  random_routing,
  run_stacked,
  stacked,
  stacked_mesh,
)

import mpmd
import mpmd.kernels
from mpmd.kernels import gpu

F32 = jnp.float32


@pytest.fixture(autouse=True)
def _x64():
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", previous)


def _tpu_lowering(fn, *args) -> str:
  with mpmd.tpu_target():
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
  return lowered.as_text()


# -- collective matmul ---------------------------------------------------------


def _collective(kernel, implementation):
  """(fn, args, reference) on a 2-device ring, lhs sharded along K."""
  mesh = make_mesh((2,), ("x",))
  if kernel == "all_gather_matmul":
    shapes, rhs_spec, out_spec = ((16, 256), (256, 128)), P(), P()
  else:
    shapes, rhs_spec, out_spec = ((32, 256), (256, 128)), P("x"), P("x")
  lhs, rhs = operands(np.random.default_rng(0), *shapes, F32)
  fn = jax.shard_map(
    functools.partial(
      getattr(mpmd.kernels, kernel),
      axis_name="x",
      implementation=implementation,
    ),
    mesh=mesh,
    in_specs=(P(None, "x"), rhs_spec),
    out_specs=out_spec,
    check_vma=False,
  )
  args = [
    jax.device_put(a, NamedSharding(mesh, s))
    for a, s in [(lhs, P(None, "x")), (rhs, rhs_spec)]
  ]
  return fn, args, reference_matmul(lhs, rhs)


@pytest.mark.parametrize("implementation", ["ring", "direct"])
@pytest.mark.parametrize(
  "kernel", ["all_gather_matmul", "matmul_reduce_scatter"]
)
def test_collective_matmul(kernel, implementation):
  fn, args, want = _collective(kernel, implementation)
  got = jax.jit(fn)(*args)
  assert got.dtype == F32
  np.testing.assert_allclose(got, want, rtol=3e-5, atol=3e-5)
  assert "tpu_custom_call" in _tpu_lowering(fn, *args)


# -- grouped matmul ------------------------------------------------------------


def _gmm_args():
  rng = np.random.default_rng(1)
  lhs = jnp.asarray(rng.standard_normal((64, 32)), F32)
  rhs = jnp.asarray(rng.standard_normal((4, 32, 16)), F32)
  sizes = jnp.asarray([20, 0, 30, 14], jnp.int32)
  return (lhs, rhs, sizes), ragged_dot_ref(lhs, rhs, sizes)


def test_gmm_windows():
  args, want = _gmm_args()
  got = jax.jit(functools.partial(mpmd.kernels.gmm, implementation="windows"))(
    *args
  )
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gmm_tiled():
  args, want = _gmm_args()
  tiled = functools.partial(mpmd.kernels.gmm, implementation="tiled")
  np.testing.assert_allclose(jax.jit(tiled)(*args), want, rtol=1e-5, atol=1e-5)
  assert "tpu_custom_call" in _tpu_lowering(tiled, *args)


# -- ragged all-to-all and the MoE layer ---------------------------------------


@pytest.mark.parametrize("offsets_dtype", [jnp.int32, jnp.int64])
@pytest.mark.parametrize("implementation", ["conditional", "window"])
def test_ragged_all_to_all(implementation, offsets_dtype):
  r = random_routing(np.random.default_rng(2), devices=2, k=2, rows=8)
  args = [*r.args[:2], *(m.astype(offsets_dtype) for m in r.metadata)]
  fn = functools.partial(
    mpmd.kernels.ragged_all_to_all,
    axis_name="x",
    implementation=implementation,
  )
  mesh = stacked_mesh((2,), ("x",))
  got = run_stacked(fn, mesh, *args)
  with jax.numpy_dtype_promotion("standard"):  # the reference's arange
    want = r.expected()
  np.testing.assert_array_equal(got, want)
  if implementation == "conditional":  # what a TPU runs
    lowered = _tpu_lowering(stacked(fn, mesh), *place(mesh, *args))
    assert "tpu_custom_call" in lowered


@pytest.mark.parametrize("fused", [False, True])
def test_moe(fused):
  p = Problem(
    np.random.default_rng(3),
    devices=2,
    tokens=5,
    hidden=8,
    ffn=16,
    experts_local=2,
  )
  layer = p.layer(top_k=2, fused=fused)
  got = jax.jit(layer)(*p.placed())
  assert got.dtype == F32
  want = dense_reference(*p.args, top_k=2, activation=jax.nn.silu)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)

  def loss(*args):
    return jnp.sum(layer(*args) ** 2)

  def dense_loss(*args):
    return jnp.sum(dense_reference(*args, top_k=2, activation=jax.nn.silu) ** 2)

  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*p.placed())
  want = jax.grad(dense_loss, argnums=(0, 1, 2, 3))(*p.args)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


# -- GPU pipelines -------------------------------------------------------------


@pytest.mark.parametrize("warp_specialized", [False, True])
def test_gpu_matmul(warp_specialized):
  rng = np.random.default_rng(4)
  a = jnp.asarray(rng.standard_normal((128, 128)), jnp.float16)
  b = jnp.asarray(rng.standard_normal((128, 256)), jnp.float16)
  fn = functools.partial(gpu.matmul, warp_specialized=warp_specialized)
  got = jax.jit(fn)(a, b)
  want = jnp.dot(a.astype(F32), b.astype(F32))
  # f16 output of an f32 accumulation: half an f16 ulp of O(10) values.
  np.testing.assert_allclose(got.astype(F32), want, rtol=2e-3, atol=2e-2)
  lowered = jax.jit(fn).trace(a, b).lower(lowering_platforms=("cuda",))
  assert "custom_call @mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("offset", [2**32 + 1, -(2**32) + 1])
def test_an_int64_offset_outside_int32_is_out_of_bounds(offset):
  # Either would wrap to 1, a valid offset, if cast as is: it is read as
  # -1 (no buffer has 2**31 rows), out of bounds.
  r = random_routing(np.random.default_rng(5), devices=2, k=1, rows=8)
  metadata = [m.astype(jnp.int64) for m in r.metadata]
  metadata[0] = metadata[0].at[0, 1].set(offset)
  fn = functools.partial(mpmd.kernels.ragged_all_to_all, axis_name="x")
  with (
    pytest.raises(
      mpmd.OutOfBoundsError,
      match=r"input_offsets\[1\] = -1 .*outside int32 reads as -1",
    ),
    mpmd.typed_errors(),
  ):
    jax.block_until_ready(
      run_stacked(fn, stacked_mesh((2,), ("x",)), *r.args[:2], *metadata)
    )
