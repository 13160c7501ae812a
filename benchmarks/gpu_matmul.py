"""GPU matmul on mpmd_map vs ``jnp.dot``, both pipelines, in one run.

On a CUDA machine: TFLOP/s of ``mpmd.kernels.gpu.matmul`` (software and
warp-specialized) and of ``jnp.dot`` (cuBLAS), and their ratio.
On CPU: seconds per call in the Mosaic GPU simulator vs ``jnp.dot`` on the
same shapes, as a ratio (the simulator's cost, not a GPU prediction).

Rounds are interleaved (each runs every side once, in a shuffled order) so
that load from other processes hits all sides alike; each time is the median
over rounds.

  python benchmarks/gpu_matmul.py            # default shapes
  python benchmarks/gpu_matmul.py --quick    # smallest shapes
  mpmd bench gpu_matmul [--quick]
"""

import argparse
import functools
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from _timing import time_interleaved

from mpmd.kernels import gpu

GPU_SHAPES = ((4096, 4096, 4096), (8192, 8192, 4096))
CPU_SHAPES = ((256, 256, 256),)
QUICK_SHAPES = ((128, 256, 128),)


def run(shapes: Sequence[tuple[int, int, int]], rounds: int) -> None:
  on_gpu = jax.default_backend() == "gpu"
  print(
    f"backend={jax.default_backend()} "
    f"({'native Mosaic GPU' if on_gpu else 'Mosaic GPU simulator'})"
  )
  rng = np.random.default_rng(0)
  steps = 4 if on_gpu else 2
  for m, n, k in shapes:
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    fns = {
      "software": jax.jit(
        functools.partial(gpu.matmul, max_concurrent_steps=steps)
      ),
      "warp_specialized": jax.jit(
        functools.partial(
          gpu.matmul, max_concurrent_steps=steps, warp_specialized=True
        )
      ),
      "jnp.dot": jax.jit(
        lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
      ),
    }
    expected = fns["jnp.dot"](a, b)
    for name in ("software", "warp_specialized"):
      np.testing.assert_allclose(
        np.asarray(fns[name](a, b), np.float32),
        np.asarray(expected),
        rtol=2.0**-7,
        atol=1e-1,
      )
    times = time_interleaved(
      {n_: functools.partial(f, a, b) for n_, f in fns.items()}, rounds
    )
    flops = 2 * m * n * k
    print(f"  bf16 {m}x{k} @ {k}x{n}:")
    for name in ("software", "warp_specialized"):
      ratio = times[name] / times["jnp.dot"]
      if on_gpu:
        print(
          f"    {name:17s} {flops / times[name] / 1e12:7.1f} TFLOP/s vs "
          f"jnp.dot {flops / times['jnp.dot'] / 1e12:7.1f} TFLOP/s "
          f"(time ratio {ratio:.2f}x)"
        )
      else:
        print(
          f"    {name:17s} {times[name]:.3f} s vs jnp.dot "
          f"{times['jnp.dot'] * 1e3:.3f} ms: {ratio:,.0f}x slower "
          "(simulator)"
        )


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="smallest shapes")
  parser.add_argument("--rounds", type=int, default=None)
  args = parser.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  shapes = QUICK_SHAPES if args.quick else GPU_SHAPES if on_gpu else CPU_SHAPES
  rounds = args.rounds or (20 if on_gpu else 3)
  run(shapes, rounds)
  return 0


if __name__ == "__main__":
  sys.exit(main())
