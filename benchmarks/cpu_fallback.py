"""The CPU fallback's two paths on one kernel, against plain JAX.

A sync-free kernel (each of 4 programs scales its rows and adds a bias, tile
by tile) runs on the fast path (programs unrolled into one HLO program) and,
forced with ``interpret=pltpu.InterpretParams()``, in the threaded TPU
simulator. Ratios are measured side by side in one run, rounds interleaved:

* fast path / plain jnp: the cost of running a kernel instead of XLA ops;
* simulator / fast path: what the automatic path choice saves.

  python benchmarks/cpu_fallback.py [--quick]
  mpmd bench cpu_fallback [--quick]
"""

import argparse
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from _timing import time_interleaved
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import mpmd

NUM_CORES = 4
TILE_ROWS = 64


def _kernel(x_hbm, b_hbm, o_hbm, x_vmem, b_vmem):
  core = jax.lax.axis_index("core")
  rows_per_core = x_hbm.shape[0] // NUM_CORES
  pltpu.sync_copy(b_hbm, b_vmem)

  @pl.loop(0, rows_per_core // TILE_ROWS)
  def _(t):
    rows = pl.ds(core * rows_per_core + t * TILE_ROWS, TILE_ROWS)
    pltpu.sync_copy(x_hbm.at[rows], x_vmem)
    x_vmem[...] = x_vmem[...] * 2.0 + b_vmem[...]
    pltpu.sync_copy(x_vmem, o_hbm.at[rows])


def scale_rows(x: jax.Array, b: jax.Array, interpret=None) -> jax.Array:
  """``2 * x + b`` (f32 ``x: (rows, cols)``, ``b: (64, cols)``) over 4 cores."""
  mesh = pltpu.create_tensorcore_mesh("core", num_cores=NUM_CORES)
  return mpmd.mpmd_map(
    [(mesh, _kernel)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[pltpu.VMEM((TILE_ROWS, x.shape[1]), x.dtype)] * 2,
    interpret=interpret,
  )(x, b)


def _reference(x, b):
  rows, cols = x.shape
  return (x.reshape(-1, TILE_ROWS, cols) * 2.0 + b).reshape(rows, cols)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="mpmd bench cpu_fallback")
  parser.add_argument("--quick", action="store_true", help="one small shape")
  args = parser.parse_args(argv)
  shapes = [(1024, 256)] if args.quick else [(1024, 256), (8192, 512)]
  print("CPU fallback paths; ratios from one run, rounds interleaved")
  for rows, cols in shapes:
    x = jnp.arange(rows * cols, dtype=jnp.float32).reshape(rows, cols)
    b = jnp.ones((TILE_ROWS, cols), jnp.float32)
    fast = jax.jit(scale_rows)
    simulated = jax.jit(
      lambda x, b: scale_rows(x, b, interpret=pltpu.InterpretParams())
    )
    plain = jax.jit(_reference)
    want = plain(x, b)
    for name, fn in (("fast", fast), ("simulator", simulated)):
      if not jnp.array_equal(fn(x, b), want):
        raise SystemExit(f"{name} path disagrees with the reference")
    print(f"  {rows}x{cols} f32, {NUM_CORES} programs ...", flush=True)
    t = time_interleaved(
      {
        "fast": functools.partial(fast, x, b),
        "simulator": functools.partial(simulated, x, b),
        "jnp": functools.partial(plain, x, b),
      },
      rounds=3 if args.quick else 5,
    )
    print(
      f"    fast {t['fast'] * 1e3:.2f} ms  simulator "
      f"{t['simulator'] * 1e3:.1f} ms  jnp {t['jnp'] * 1e3:.2f} ms  |  "
      f"fast/jnp {t['fast'] / t['jnp']:.1f}x  "
      f"simulator/fast {t['simulator'] / t['fast']:.0f}x"
    )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
