"""What the MoE tests share: a dense per-token reference, the problems
(global arrays stacked over the devices) and the tolerances."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ragged_all_to_all_util import stacked_mesh

import mpmd
import mpmd.kernels

HIGHEST = lax.Precision.HIGHEST


def tolerances(dtype) -> dict[str, float]:
  """assert_allclose tolerances for outputs / gradients of ``dtype``.

  float32: the layer and the reference sum the same products in different
  orders (the grouped matmul by tiles, the reference by einsum), a few ulps
  of O(1) values. bfloat16: the layer rounds the activations to bfloat16
  between the two matmuls and its output to bfloat16 (gmm's tolerances: a
  couple of bf16 ulps, 2**-8 relative each).
  """
  if jnp.dtype(dtype) == jnp.float32:
    return dict(rtol=2e-5, atol=2e-5)
  return dict(rtol=3e-2, atol=3e-2)


def dense_reference(
  x, router_logits, w_in, w_out, *, top_k, activation, dropped=None
):
  """Every token through each of its top-k experts, dense, in f32; the
  (token, choice) pairs ``dropped`` (a bool mask) add nothing."""
  f32 = jnp.float32
  chosen, expert = lax.top_k(router_logits.astype(f32), top_k)
  weights = jax.nn.softmax(chosen, axis=-1)
  if dropped is not None:
    weights = jnp.where(dropped, jnp.zeros_like(weights), weights)
  x = x.astype(f32)
  h = jnp.einsum("th,tkhf->tkf", x, w_in.astype(f32)[expert], precision=HIGHEST)
  out = jnp.einsum(
    "tkf,tkfh->tkh", activation(h), w_out.astype(f32)[expert], precision=HIGHEST
  )
  return jnp.einsum("tkh,tk->th", out, weights, precision=HIGHEST)


class Problem:
  """A layer's global arrays: tokens and logits stacked over the devices,
  experts concatenated (device j holds experts j * El .. (j + 1) * El)."""

  def __init__(
    self,
    rng,
    *,
    devices,
    tokens,
    hidden,
    ffn,
    experts_local,
    dtype=jnp.float32,
    logits_dtype=jnp.float32,
    routing="random",
  ):
    experts = devices * experts_local
    self.devices = devices
    x = rng.standard_normal((devices * tokens, hidden))
    logits = rng.standard_normal((devices * tokens, experts))
    if routing == "one_expert":
      logits[:, 1] += 100.0  # every token's first choice: expert 1
    elif routing == "first_expert":
      logits[:, 0] += 100.0  # ... expert 0: a device's first expert
    elif routing == "ties":
      logits = np.round(logits)  # many equal logits
    elif routing == "own_device":
      # Every token's first choice: the first expert of its own device
      # (with top_k=1 no device sends another anything).
      for j in range(devices):
        logits[j * tokens : (j + 1) * tokens, j * experts_local] += 100.0
    elif routing == "skewed":
      # Most tokens prefer the last device's experts.
      logits[:, -experts_local:] += 1.5
    w_in = rng.standard_normal((experts, hidden, ffn)) / np.sqrt(hidden)
    w_out = rng.standard_normal((experts, ffn, hidden)) / np.sqrt(ffn)
    self.x = jnp.asarray(x, dtype)
    self.logits = jnp.asarray(logits, logits_dtype)
    self.w_in = jnp.asarray(w_in, dtype)
    self.w_out = jnp.asarray(w_out, dtype)
    self.mesh = stacked_mesh((devices,), ("x",))

  @property
  def args(self):
    return (self.x, self.logits, self.w_in, self.w_out)

  def placed(self):
    spec = NamedSharding(self.mesh, P("x"))
    return [jax.device_put(a, spec) for a in self.args]

  def layer(self, **kwargs):
    return jax.shard_map(
      functools.partial(mpmd.kernels.moe, axis_name="x", **kwargs),
      mesh=self.mesh,
      in_specs=P("x"),
      out_specs=P("x"),
    )


def assert_close(got, want, dtype):
  np.testing.assert_allclose(
    np.asarray(got, np.float32),
    np.asarray(want, np.float32),
    **tolerances(dtype),
  )


def expected_drops(router_logits, top_k, devices, capacity_factor):
  """The (token, choice) pairs a capacity drops: each expert takes its
  first ``ceil(factor * tokens * top_k * D / experts)`` rows in the order
  (device, token, choice)."""
  _, expert = lax.top_k(jnp.asarray(router_logits, jnp.float32), top_k)
  expert = np.asarray(expert)
  total, experts = router_logits.shape
  rows = total // devices * top_k
  per_expert = int(np.ceil(capacity_factor * rows * devices / experts))
  taken = np.zeros(experts, int)
  dropped = np.zeros(expert.shape, bool)
  for t in range(total):  # tokens stacked in device order
    for c in range(top_k):
      e = expert[t, c]
      dropped[t, c] = taken[e] >= per_expert
      taken[e] += 1
  return dropped
