"""An expert-parallel mixture-of-experts layer on 4 simulated CPU devices.

8 experts, 2 per device (expert ``e`` on device ``e // 2``); every device
holds 64 tokens of hidden size 64 and routes each to its top-2 experts.
``mpmd.kernels.moe`` sends each token's row to the devices of its experts
with ``mpmd.kernels.ragged_all_to_all`` (remote DMAs; XLA:CPU cannot run
``jax.lax.ragged_all_to_all``), runs ``gmm`` over the rows each device's
experts received, and sends the results back. The routing is skewed on
purpose: one expert gets most tokens and some get none, which a layer with
a fixed capacity per expert would have to drop (this one is dropless).

The check: the layer's output and its gradients against a dense per-token
reference (each token through its experts' full weights, no exchange), and
``ragged_all_to_all`` itself against an all_gather-based one. Then the
fused layer (``fused=True``): one ``mpmd_map`` launch of two meshes per
device, a dispatch program that streams token tiles to the experts'
devices by remote DMA next to a compute program that runs the experts'
MLP on each tile as it lands and streams the result back. It must give
the unfused layer's output bit for bit, run clean under a few schedules of
the checking executor, and lower for TPU as one Mosaic kernel (v5e, and
v7x, a generation with SparseCores). Finally the unfused layer is lowered
for TPU (Mosaic kernels with remote DMAs) from this host.

Run: ``python examples/moe_expert_parallel.py`` (CPU, well under a minute).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)

import functools  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mpmd  # noqa: E402
import mpmd.kernels  # noqa: E402

DEVICES, EXPERTS_LOCAL, TOP_K = 4, 2, 2
TOKENS, HIDDEN, FFN = 64, 64, 128  # tokens per device
EXPERTS = DEVICES * EXPERTS_LOCAL


def dense_reference(x, logits, w_in, w_out):
  """Each token through its top-k experts' full weights, in f32."""
  chosen, expert = lax.top_k(logits, TOP_K)
  weights = jax.nn.softmax(chosen, axis=-1)
  h = jnp.einsum("th,tkhf->tkf", x, w_in[expert], precision="highest")
  out = jnp.einsum(
    "tkf,tkfh->tkh", jax.nn.silu(h), w_out[expert], precision="highest"
  )
  return jnp.einsum("tkh,tk->th", out, weights, precision="highest")


def check_ragged_all_to_all(mesh, rng) -> None:
  """Each device sends a random slice of its rows to every device."""
  rows, spec = 12, P("x")
  sizes = rng.integers(0, 4, (DEVICES, DEVICES))  # [sender, receiver]
  in_off = np.cumsum(sizes, axis=1) - sizes  # packed in each operand
  out_off = (np.cumsum(sizes, axis=0) - sizes).T.copy()  # [receiver, sender]
  operand = rng.standard_normal((DEVICES, rows, 8)).astype(np.float32)
  output = np.zeros((DEVICES, rows, 8), np.float32)
  want = output.copy()
  for j in range(DEVICES):
    for t in range(DEVICES):
      n = sizes[j, t]
      o = out_off[t, j]
      want[t, o : o + n] = operand[j, in_off[j, t] : in_off[j, t] + n]
  fn = jax.shard_map(
    lambda *a: mpmd.kernels.ragged_all_to_all(
      *(x[0] for x in a), axis_name="x"
    )[None],
    mesh=mesh,
    in_specs=spec,
    out_specs=spec,
  )
  metadata = [a.astype(np.int32) for a in (in_off, sizes, out_off.T, sizes.T)]
  args = (operand, output, *metadata)
  place = NamedSharding(mesh, spec)
  got = jax.jit(fn)(*(jax.device_put(a, place) for a in args))
  np.testing.assert_array_equal(np.asarray(got), want)
  print(f"ragged_all_to_all: {int(sizes.sum())} rows moved, matches numpy")


def report_tpu_kernels(f, args, expected: int, what: str) -> None:
  """Lowers ``f(*args)`` for TPU; prints whether it holds ``expected``
  Mosaic kernels (FAIL if not)."""
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
  kernels = text.count("tpu_custom_call")
  print(
    f"{what}: lowered to {kernels} Mosaic kernel(s)"
    if kernels == expected
    else f"FAIL: {what}: {kernels} Mosaic kernels, expected {expected}"
  )


def check_fused(mesh, args, y) -> None:
  """The one-launch layer: same output, clean schedules, one TPU kernel."""
  fused = jax.shard_map(
    functools.partial(mpmd.kernels.moe, top_k=TOP_K, axis_name="x", fused=True),
    mesh=mesh,
    in_specs=P("x"),
    out_specs=P("x"),
  )
  spec = NamedSharding(mesh, P("x"))
  placed = [jax.device_put(a, spec) for a in args]
  got = jax.jit(fused)(*placed)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(y))
  print("fused moe (one two-mesh launch): the unfused output, bit for bit")
  report = mpmd.testing.assert_schedule_independent(
    jax.jit(fused), *placed, schedules=3
  )
  print(f"fused moe on the checking executor: {report}")
  dtypes = (jnp.bfloat16, jnp.float32, jnp.bfloat16, jnp.bfloat16)
  shapes = [
    jax.ShapeDtypeStruct(a.shape, d, sharding=spec)
    for a, d in zip(args, dtypes, strict=True)
  ]
  for target in ("v5e", "v7x"):
    with mpmd.tpu_target(target):
      report_tpu_kernels(fused, shapes, 1, f"fused moe on TPU {target}")


def main() -> None:
  mesh = jax.make_mesh((DEVICES,), ("x",))
  rng = np.random.default_rng(0)
  check_ragged_all_to_all(mesh, rng)

  x = jnp.asarray(rng.standard_normal((DEVICES * TOKENS, HIDDEN)), jnp.float32)
  logits = rng.standard_normal((DEVICES * TOKENS, EXPERTS))
  logits[:, 3] += 2.0  # expert 3 is popular
  logits[:, [5, 6]] -= 6.0  # experts 5 and 6 get (almost) nothing
  logits = jnp.asarray(logits, jnp.float32)
  w_in = jnp.asarray(
    rng.standard_normal((EXPERTS, HIDDEN, FFN)) / np.sqrt(HIDDEN), jnp.float32
  )
  w_out = jnp.asarray(
    rng.standard_normal((EXPERTS, FFN, HIDDEN)) / np.sqrt(FFN), jnp.float32
  )
  _, chosen = lax.top_k(logits, TOP_K)
  load = np.bincount(np.asarray(chosen).ravel(), minlength=EXPERTS)
  print(f"rows per expert: {load.tolist()}")

  layer = jax.shard_map(
    functools.partial(mpmd.kernels.moe, top_k=TOP_K, axis_name="x"),
    mesh=mesh,
    in_specs=P("x"),
    out_specs=P("x"),
  )
  spec = NamedSharding(mesh, P("x"))
  args = (x, logits, w_in, w_out)
  placed = [jax.device_put(a, spec) for a in args]
  y = jax.jit(layer)(*placed)
  want = dense_reference(*args)
  np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)
  err = float(jnp.max(jnp.abs(y - want)))
  print(f"moe: {y.shape} {y.dtype}; max |error| vs dense reference {err:.1e}")

  cotangent = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)

  def loss(fn):
    return lambda *a: jnp.sum(fn(*a) * cotangent)

  grads = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2, 3)))(*placed)
  want_grads = jax.grad(loss(dense_reference), argnums=(0, 1, 2, 3))(*args)
  names = ("x", "router_logits", "w_in", "w_out")
  for name, g, w in zip(names, grads, want_grads, strict=True):
    scale = float(jnp.max(jnp.abs(w)))
    np.testing.assert_allclose(
      g / scale, w / scale, rtol=1e-4, atol=1e-5, err_msg=name
    )
  print(f"gradients in {', '.join(names)} match the dense reference")
  check_fused(mesh, args, y)

  shapes = [
    jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=spec)
    for a in (x, w_in, w_out)
  ]
  tpu_args = (
    shapes[0],
    jax.ShapeDtypeStruct(logits.shape, jnp.float32, sharding=spec),
    shapes[1],
    shapes[2],
  )
  with mpmd.tpu_target():
    # dispatch, 2 x gmm, combine
    report_tpu_kernels(layer, tpu_args, 4, "the layer on TPU")


if __name__ == "__main__":
  main()
