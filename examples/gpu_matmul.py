"""Hopper-style matmul on mpmd_map: software and warp-specialized pipelines.

On CPU the kernels run in the Mosaic GPU simulator (``interpret=None``) and
are also lowered for CUDA to show the Mosaic GPU custom call; on a GPU machine
they run natively.

  python examples/gpu_matmul.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mpmd.kernels import gpu


def main() -> None:
  key_a, key_b, key_c = jax.random.split(jax.random.key(0), 3)
  m, n, k = 128, 256, 128
  a = jax.random.normal(key_a, (m, k), jnp.bfloat16)
  b = jax.random.normal(key_b, (k, n), jnp.bfloat16)
  c = jax.random.normal(key_c, (m, n), jnp.float32)
  ref = jnp.dot(
    a.astype(jnp.float32),
    b.astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
  )
  runs = jax.default_backend()
  print(f"backend: {runs} ({'native' if runs == 'gpu' else 'simulator'})")
  cases = {
    "matmul (software pipeline)": (
      functools.partial(gpu.matmul, out_dtype=jnp.float32),
      (a, b),
      ref,
    ),
    "matmul (warp-specialized)": (
      functools.partial(
        gpu.matmul, warp_specialized=True, out_dtype=jnp.float32
      ),
      (a, b),
      ref,
    ),
    "fused_matmul relu(a @ b + c)": (
      functools.partial(
        gpu.fused_matmul, activation="relu", out_dtype=jnp.float32
      ),
      (a, b, c),
      jax.nn.relu(ref + c),
    ),
  }
  failures = []
  for name, (fn, args, expected) in cases.items():
    out = jax.jit(fn)(*args)
    err = float(jnp.max(jnp.abs(out - expected)))
    ok = np.allclose(out, expected, rtol=1e-5, atol=1e-3)
    lowered = (
      jax.jit(functools.partial(fn, interpret=False))
      .trace(*args)
      .lower(lowering_platforms=("cuda",))
      .as_text()
    )
    cuda = "mosaic_gpu" in lowered
    print(
      f"{name:30s} max |err| {err:.2e} {'OK' if ok else 'MISMATCH'}; "
      f"CUDA lowering: {'Mosaic GPU custom call' if cuda else 'MISSING'}"
    )
    if not (ok and cuda):
      failures.append(name)
  if failures:
    raise SystemExit(f"FAIL: {', '.join(failures)}")


if __name__ == "__main__":
  main()
