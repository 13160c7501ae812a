"""Contracting dimension sharded along different mesh axes, on a 2x2 mesh.

Inputs ``x`` (N, K) are sharded ``P('x', 'y')``: rows over ``x``, the
contraction K over ``y``. Weights ``w`` (K, M) are sharded ``P('x', None)``:
K over ``x``. The output ``x @ w`` must come out ``P('x', None)``.

No device holds matching K-blocks of both operands (device (i, j) has
``x[rows i, K-block j]`` and ``w[K-block i]``), so something must move.
Here ``all_gather_matmul`` over ``y`` moves the activations: the K-blocks of
``x`` travel around each row of the mesh (an independent two-device ring per
value of ``x``, the remote DMAs addressed by ``{"y": index}`` so ``x`` is
kept) while every device multiplies the blocks that have arrived with the
matching rows of ``w``. ``w`` is gathered once over ``x`` (weights are the
operand that is reused across steps; in training they are gathered once per
step, activations every layer). The result rows ``i`` are then identical on
both devices of ring ``i``: exactly ``P('x', None)``.

Run: ``python examples/collective_matmul.py`` (CPU, 4 simulated devices).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mpmd.kernels import all_gather_matmul  # noqa: E402

# Small shapes keep the simulated run to a couple of seconds on 2 cores.
N, K, M = 64, 256, 128


def ring_over_y(x_block, w_block):
  """x_block: (N/2, K/2) at K-block y; w_block: (K/2, M) at K-block x."""
  w_full = lax.all_gather(w_block, "x", axis=0, tiled=True)  # (K, M)
  return all_gather_matmul(x_block, w_full, axis_name="y")  # (N/2, M)


def main() -> None:
  mesh = jax.make_mesh((2, 2), ("x", "y"))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((N, K), np.float32), jnp.bfloat16)
  w = jnp.asarray(
    rng.standard_normal((K, M), np.float32) / np.sqrt(K), jnp.bfloat16
  )
  x_sharded = jax.device_put(x, NamedSharding(mesh, P("x", "y")))
  w_sharded = jax.device_put(w, NamedSharding(mesh, P("x", None)))
  want = jnp.matmul(
    x.astype(jnp.float32), w.astype(jnp.float32), precision="highest"
  )
  f = jax.jit(
    jax.shard_map(
      ring_over_y,
      mesh=mesh,
      in_specs=(P("x", "y"), P("x", None)),
      out_specs=P("x", None),
      check_vma=False,
    )
  )
  out = f(x_sharded, w_sharded)
  assert out.sharding.spec == P("x", None), out.sharding
  # bf16 inputs, f32 accumulation: only the summation order differs.
  np.testing.assert_allclose(out, want, rtol=3e-5, atol=3e-5)
  err = float(jnp.max(jnp.abs(out - want)))
  print(
    f"x @ w: {out.shape} {out.dtype} sharded {out.sharding.spec}; "
    f"max |error| vs jnp.matmul {err:.2e}"
  )


if __name__ == "__main__":
  main()
