"""The CPU fallback's paths, each against plain JAX and the simulator.

A sync-free kernel (each of 4 programs scales its rows and adds a bias, tile
by tile) runs on the fast path (programs unrolled into one HLO program); a
ring kernel under ``shard_map`` (each of 4 devices sends its block to the
next with a remote DMA) runs on the lockstep path (the DMA an XLA
collective). Both also run, forced with ``interpret=pltpu.InterpretParams()``,
in the threaded TPU simulator. Ratios are measured side by side in one run,
rounds interleaved:

* fast path / plain jnp, lockstep path / ``lax.ppermute``: the cost of
  running a kernel instead of XLA ops;
* simulator / fast or lockstep path: what the automatic path choice saves.

  python benchmarks/cpu_fallback.py [--quick]
  mpmd bench cpu_fallback [--quick]
"""

import argparse
import functools
from collections.abc import Sequence

import jax

jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
from _timing import time_interleaved  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mpmd  # noqa: E402
from mpmd import demos  # noqa: E402

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
  mesh = mpmd.tensorcore_mesh("core", num_cores=NUM_CORES)
  return mpmd.mpmd_map(
    [(mesh, _kernel)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[pltpu.VMEM((TILE_ROWS, x.shape[1]), x.dtype)] * 2,
    interpret=interpret,
  )(x, b)


def _reference(x, b):
  rows, cols = x.shape
  return (x.reshape(-1, TILE_ROWS, cols) * 2.0 + b).reshape(rows, cols)


def _ring_reference(x, mesh):
  num = mesh.shape["x"]
  perm = [(i, (i + 1) % num) for i in range(num)]
  return jax.shard_map(
    lambda b: jax.lax.ppermute(b, "x", perm),
    mesh=mesh,
    in_specs=P("x"),
    out_specs=P("x"),
    check_vma=False,
  )(x)


def _compare(name, fns, reference, args, rounds):
  want = reference(*args)
  for path, fn in fns.items():
    if not jnp.array_equal(fn(*args), want):
      raise SystemExit(f"{name}: the {path} path disagrees with the reference")
  t = time_interleaved(
    {
      k: functools.partial(f, *args)
      for k, f in {**fns, "xla": reference}.items()
    },
    rounds=rounds,
  )
  path = next(iter(fns))
  print(
    f"    {path} {t[path] * 1e3:.2f} ms  simulator "
    f"{t['simulator'] * 1e3:.1f} ms  XLA {t['xla'] * 1e3:.2f} ms  |  "
    f"{path}/XLA {t[path] / t['xla']:.1f}x  "
    f"simulator/{path} {t['simulator'] / t[path]:.0f}x",
    flush=True,
  )


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="mpmd bench cpu_fallback")
  parser.add_argument("--quick", action="store_true", help="one small shape")
  args = parser.parse_args(argv)
  shapes = [(1024, 256)] if args.quick else [(1024, 256), (8192, 512)]
  print("CPU fallback paths; ratios from one run, rounds interleaved")
  rounds = 3 if args.quick else 5
  for rows, cols in shapes:
    x = jnp.arange(rows * cols, dtype=jnp.float32).reshape(rows, cols)
    b = jnp.ones((TILE_ROWS, cols), jnp.float32)
    print(f"  fast path: {rows}x{cols} f32, {NUM_CORES} programs", flush=True)
    _compare(
      "scale_rows",
      {
        "fast": jax.jit(scale_rows),
        "simulator": jax.jit(
          lambda x, b: scale_rows(x, b, interpret=pltpu.InterpretParams())
        ),
      },
      jax.jit(_reference),
      (x, b),
      rounds,
    )
  mesh = jax.make_mesh((4,), ("x",))
  for rows, cols in shapes:
    x = jnp.arange(rows * cols, dtype=jnp.float32).reshape(rows, cols)
    x = jax.device_put(x, NamedSharding(mesh, P("x")))
    print(f"  lockstep path: {rows}x{cols} f32 over 4 devices", flush=True)
    _compare(
      "ring_shift",
      {
        "lockstep": jax.jit(functools.partial(demos.ring_shift, mesh=mesh)),
        "simulator": jax.jit(
          functools.partial(
            demos.ring_shift, mesh=mesh, interpret=pltpu.InterpretParams()
          )
        ),
      },
      jax.jit(functools.partial(_ring_reference, mesh=mesh)),
      (x,),
      rounds,
    )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
