"""Matmul with a fused epilogue: ``activation(a @ b + c)`` in one kernel.

The addend ``c`` is a third pipeline input whose block does not depend on the
K step: the pipelines load it once per output tile (the memory warpgroup does,
when warp-specialized) while the ``a`` and ``b`` tiles stream through the SMEM
ring. The last K step adds it to the f32 accumulator, applies the activation
and writes the tile, so ``a @ b``, the addition and the activation never round
trip through global memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

# By name: the package's `matmul` is the function, which shadows the module.
from mpmd.kernels.gpu.matmul import MULTI_MESH_DEFAULT, build, check_config
from mpmd.types import Interpret

# Constants of the tanh approximation of GELU (jax.nn.gelu(approximate=True)),
# folded in Python: Mosaic GPU has no sqrt on scalars.
_GELU_SCALE = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715


def _gelu_tanh(x: jax.Array) -> jax.Array:
  inner = _GELU_SCALE * (x + _GELU_CUBIC * x * x * x)
  return 0.5 * x * (1.0 + jnp.tanh(inner))


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
  "relu": lambda x: jnp.maximum(x, 0.0),
  "gelu": _gelu_tanh,
}


def fused_matmul(
  a: jax.Array,
  b: jax.Array,
  c: jax.Array | None = None,
  *,
  activation: str | None = None,
  block_m: int = 128,
  block_n: int = 128,
  block_k: int = 64,
  max_concurrent_steps: int = 2,
  warp_specialized: bool = False,
  num_compute_wgs: int = 2,
  out_dtype: DTypeLike | None = None,
  interpret: Interpret = None,
  multi_mesh: bool = MULTI_MESH_DEFAULT,
) -> jax.Array:
  """``activation(a @ b + c)`` with the epilogue fused into the matmul.

  Args:
    a: ``(M, K)`` float16 or bfloat16.
    b: ``(K, N)``, the dtype of ``a``.
    c: optional ``(M, N)`` addend of ``out_dtype`` (e.g. a residual or a
      broadcast bias), loaded once per output tile.
    activation: None, ``"relu"`` or ``"gelu"`` (tanh approximation), applied
      in f32 to the sum.
    block_m, block_n, block_k, max_concurrent_steps, warp_specialized,
      num_compute_wgs, out_dtype, interpret, multi_mesh: as for
      :func:`mpmd.kernels.gpu.matmul`.

  Returns:
    ``(M, N)`` array of ``out_dtype`` (default: the input dtype).

  Example::

    a = jnp.ones((128, 128), jnp.bfloat16)
    b = jnp.ones((128, 128), jnp.bfloat16)
    c = jnp.zeros((128, 128), jnp.bfloat16)
    y = fused_matmul(a, b, c, activation="relu")  # (128, 128) bfloat16
  """
  if activation is not None and activation not in ACTIVATIONS:
    raise ValueError(
      f"fused_matmul: expected 'activation' None or one of "
      f"{sorted(ACTIVATIONS)}, got {activation!r}"
    )
  config = check_config(
    "fused_matmul",
    a,
    b,
    c=c,
    block_m=block_m,
    block_n=block_n,
    block_k=block_k,
    max_concurrent_steps=max_concurrent_steps,
    warp_specialized=warp_specialized,
    num_compute_wgs=num_compute_wgs,
    out_dtype=out_dtype,
  )
  act = ACTIVATIONS[activation] if activation is not None else (lambda x: x)

  def epilogue(acc: jax.Array, c_val: jax.Array | None) -> jax.Array:
    return act(acc if c_val is None else acc + c_val)

  call = build(
    config,
    epilogue=epilogue,
    has_c=c is not None,
    multi_mesh=multi_mesh,
    interpret=interpret,
    name="fused_matmul",
  )
  return call(a, b) if c is None else call(a, b, c)
