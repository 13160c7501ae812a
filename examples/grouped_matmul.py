"""A tiny mixture-of-experts layer on gmm, forward and backward.

Tokens are routed top-1 to experts, sorted by expert, pushed through each
expert's two-layer MLP with ``mpmd.kernels.gmm`` (one launch for all
experts), unsorted and scaled by the router's probability. The loss's
gradients (inputs, router, both expert weights) come from gmm's custom VJP
(gmm + tgmm kernels) and are checked against the same layer written with
``jax.lax.ragged_dot``.

Runs on CPU (the mpmd_map CPU fallback) by default:

  python examples/grouped_matmul.py
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpmd.kernels import gmm

TOKENS, D_MODEL, D_FF, EXPERTS = 256, 64, 128, 8


def moe_layer(params, x, *, matmul):
  """Top-1 MoE: route, sort by expert, expert MLPs, unsort."""
  logits = x @ params["router"]
  probs = jax.nn.softmax(logits, axis=-1)
  expert = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  order = jnp.argsort(expert)
  group_sizes = jnp.bincount(expert, length=EXPERTS).astype(jnp.int32)
  xs = x[order]
  h = jax.nn.gelu(matmul(xs, params["w_in"], group_sizes))
  ys = matmul(h, params["w_out"], group_sizes)
  y = jnp.zeros_like(ys).at[order].set(ys)
  gate = jnp.take_along_axis(probs, expert[:, None], axis=-1)
  return y * gate, group_sizes


def ours(lhs, rhs, group_sizes):
  return gmm(lhs, rhs, group_sizes)


def reference(lhs, rhs, group_sizes):
  return lax.ragged_dot(lhs, rhs, group_sizes, precision=lax.Precision.HIGHEST)


def loss(params, x, target, *, matmul):
  y, _ = moe_layer(params, x, matmul=matmul)
  return jnp.mean((y - target) ** 2)


def main():
  key = jax.random.key(0)
  k_x, k_t, k_r, k_i, k_o = jax.random.split(key, 5)
  x = jax.random.normal(k_x, (TOKENS, D_MODEL), jnp.float32)
  target = jax.random.normal(k_t, (TOKENS, D_MODEL), jnp.float32)
  params = {
    "router": jax.random.normal(k_r, (D_MODEL, EXPERTS)) / D_MODEL**0.5,
    "w_in": jax.random.normal(k_i, (EXPERTS, D_MODEL, D_FF)) / D_MODEL**0.5,
    "w_out": jax.random.normal(k_o, (EXPERTS, D_FF, D_MODEL)) / D_FF**0.5,
  }

  _, sizes = moe_layer(params, x, matmul=reference)
  print("tokens per expert:", np.asarray(sizes).tolist())

  results = {}
  for name, matmul in [("gmm", ours), ("ragged_dot", reference)]:
    step = jax.jit(
      jax.value_and_grad(functools.partial(loss, matmul=matmul)),
    )
    start = time.perf_counter()
    value, grads = jax.block_until_ready(step(params, x, target))
    print(
      f"{name:>10}: loss {float(value):.6f} "
      f"(first call, with compilation: {time.perf_counter() - start:.2f}s)"
    )
    results[name] = (value, grads)

  (v_ours, g_ours), (v_ref, g_ref) = results["gmm"], results["ragged_dot"]
  # f32 throughout; sums reordered by tiling: see the tests' tolerances.
  np.testing.assert_allclose(v_ours, v_ref, rtol=1e-5, atol=1e-6)
  for name in params:
    np.testing.assert_allclose(
      g_ours[name], g_ref[name], rtol=1e-4, atol=1e-6, err_msg=name
    )
    print(
      f"  d {name:<6} matches ragged_dot "
      f"(max |diff| {np.abs(g_ours[name] - g_ref[name]).max():.2e})"
    )
  print("forward and backward match jax.lax.ragged_dot")


if __name__ == "__main__":
  main()
