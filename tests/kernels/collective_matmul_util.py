"""Shared by the collective matmul tests: meshes, operands, references,
tolerances and shard_map wrappers (imported by module name: pytest puts this
directory on sys.path)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

HIGHEST = lax.Precision.HIGHEST


def tolerances(dtype) -> dict[str, float]:
  """assert_allclose tolerances for kernel outputs of ``dtype``.

  Operands are O(1) with rhs scaled by 1/sqrt(K), so outputs are O(1); the
  reference sees exactly the kernel's inputs upcast to f32, and a product of
  two bf16 values is exact in f32, so input rounding is common to both sides.
  What differs:
  * float32: the kernel sums shard products in ring order and tiles in
    pipeline order; the HIGHEST reference sums in one dot. Reordering a sum
    of K <= 2048 O(1/sqrt(K)) terms in f32 moves it by about
    sqrt(K) * eps(f32) ~ 5e-6; 3e-5 leaves margin.
  * bfloat16 (the output dtype): the f32 accumulator is rounded once to
    bf16 on store, half an ulp = 2**-9 relative (~2e-3); 8e-3 allows one ulp
    either way, on rtol and atol (outputs near zero).
  """
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return dict(rtol=3e-5, atol=3e-5)
  if dtype == jnp.bfloat16:
    return dict(rtol=8e-3, atol=8e-3)
  raise ValueError(f"tolerances: no tolerance for {dtype}")


def reference_matmul(lhs, rhs):
  return jnp.dot(
    lhs.astype(jnp.float32), rhs.astype(jnp.float32), precision=HIGHEST
  )


def make_mesh(sizes, names):
  return jax.make_mesh(sizes, names, devices=jax.devices()[: math.prod(sizes)])


def operands(rng, lhs_shape, rhs_shape, dtype):
  """O(1) lhs, rhs scaled by 1/sqrt(K): O(1) products (f32 numpy)."""
  lhs = rng.standard_normal(lhs_shape, np.float32)
  rhs = rng.standard_normal(rhs_shape, np.float32) / np.sqrt(rhs_shape[0])
  return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)


def sharded(fn, mesh, in_specs, out_specs, *args, check_vma=False):
  """jit(shard_map(fn)) applied to args placed with in_specs."""
  placed = [
    jax.device_put(a, NamedSharding(mesh, s))
    for a, s in zip(args, in_specs, strict=True)
  ]
  f = jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=in_specs,
    out_specs=out_specs,
    check_vma=check_vma,
  )
  return jax.jit(f)(*placed)


def assert_close(got, want, dtype):
  np.testing.assert_allclose(
    np.asarray(got, np.float32),
    np.asarray(want, np.float32),
    **tolerances(dtype),
  )


def trace_sharded(fn, mesh, in_specs, out_specs, *shapes):
  args = [
    jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec))
    for (s, d), spec in zip(shapes, in_specs, strict=True)
  ]
  f = jax.shard_map(
    fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
  )
  return jax.jit(f).trace(*args)
