"""Shared helpers of the GPU kernel tests: tolerances, references, races."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from mpmd import _jax

# The Mosaic GPU custom call in a CUDA lowering
# (``stablehlo.custom_call @mosaic_gpu_v2``): one per kernel launch, however
# many meshes the launch has.
MOSAIC_GPU_CALL = re.compile(r"custom_call @mosaic_gpu")


def tolerances(dtype) -> dict[str, float]:
  """``assert_allclose`` tolerances for a matmul result stored as ``dtype``.

  f16/bf16 inputs are exact in f32 and so are their products (two 8- or
  11-bit significands fit in f32's 24), so the kernel and the f32 HIGHEST
  reference differ only by (1) f32 summation order, at most about
  ``K * 2**-24`` relative to ``sum |a*b|`` (K <= 512 here: < 3e-5), and
  (2) one final rounding to ``dtype``: half an ulp, 2**-11 (f16) or 2**-8
  (bf16) relative. rtol is twice (2) (at least 1e-5 for (1)); atol covers
  results near zero, where (1) is relative to the much larger ``sum |a*b|``
  (about 0.8 * K for standard-normal inputs, so atol ~ 2 * K * 2**-24 *
  0.8 * K, rounded up to 1e-3, or rtol times that magnitude for halfs).
  """
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return dict(rtol=1e-5, atol=1e-3)
  if dtype == jnp.float16:
    return dict(rtol=2.0**-10, atol=2e-2)
  if dtype == jnp.bfloat16:
    return dict(rtol=2.0**-7, atol=1e-1)
  raise ValueError(f"tolerances: no tolerance for {dtype}")


def matmul_reference(a, b, c=None):
  """``a @ b (+ c)`` in f32 with HIGHEST precision."""
  out = jnp.dot(
    a.astype(jnp.float32),
    b.astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
  )
  return out if c is None else out + c.astype(jnp.float32)


def assert_close(actual, expected, dtype=None):
  dtype = actual.dtype if dtype is None else dtype
  np.testing.assert_allclose(
    np.asarray(actual, np.float32),
    np.asarray(expected, np.float32),
    **tolerances(dtype),
  )


def cuda_lowering_text(fn, *args) -> str:
  """Lowers ``fn(*args)`` for CUDA on this CPU host; returns the module."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def race_detecting_params():
  """GPU simulator parameters with the happens-before race detector on."""
  return _jax.gpu().interpret.InterpretGPUParams(detect_races=True)


def races_found() -> bool:
  """Whether the last kernel run with :func:`race_detecting_params` raced.

  The simulator keeps its race state in a module global until the next
  kernel starts.
  """
  return _jax.gpu().simulator.get_races().races_found
