"""Collective matmul on the CPU fallback vs XLA's collectives, as ratios.

For each ring length D and shape, in one run:
  ours / XLA for  all_gather_matmul      vs shard_map(all_gather + dot)
  ours / XLA for  matmul_reduce_scatter  vs shard_map(dot + psum_scatter)
for each kernel implementation (``direct``, the CPU fallback's default: one
exchange between the devices; ``ring``, what runs on TPU: one per ring step),
and for the reduce-scatter, the floor of the direct implementation's
exchange:
plain XLA moving each block to its device by one ``ppermute`` per peer, as
the CPU fallback moves blocks too large to gather everywhere (the large
shape; at the small one the blocks travel in one all_gather)
(median wall time of ``--repeats`` rounds after a warm-up, ours and XLA's
interleaved so that machine noise hits both, and in brackets the lowest and
highest ratio of one round's pair; bf16 inputs, f32 results),
followed by an analytical TPU estimate of the bidirectional schedule: flops
and bytes per step and which transfer hides behind which matmul.

The CPU fallback runs these kernels on its lockstep path (every remote DMA
an XLA collective); ``interpret=pltpu.InterpretParams()`` would run the
threaded TPU simulator instead, which is slower by orders of magnitude.

  mpmd bench collective_matmul            # D=4,8; n=m=1024, K=2048 + small
  mpmd bench collective_matmul --quick    # small shapes only (2 CPU cores)

The large shape is the issue's (lhs (1024, 2048/D), rhs (2048/D, 1024) for
the reduce-scatter, scattered along rows); the small one (n=128, K=512,
m=256) is what test suites run, where a ring step's fixed costs (every
exchange is a rendezvous of every simulated device) weigh most.
  python benchmarks/collective_matmul.py --quick
"""

import argparse
import functools
import os
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

_MAX_RING = 8
jax.config.update("jax_num_cpu_devices", _MAX_RING)

import jax.numpy as jnp  # noqa: E402
from _timing import ratio_spread, time_rounds  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mpmd._lowering import exchange  # noqa: E402
from mpmd.kernels import all_gather_matmul, matmul_reduce_scatter  # noqa: E402
from mpmd.kernels.collective_matmul.api import IMPLEMENTATIONS  # noqa: E402

# (n, K, m): the large shape and a small one.
LARGE = (1024, 2048, 1024)
SMALL = (128, 512, 256)

# TPU v5e (one TensorCore per chip), public figures: peak bf16 matmul
# throughput, HBM bandwidth, and one ICI link's bandwidth per direction.
TPU_NAME = "TPU v5e"
TPU_BF16_FLOPS = 197e12
TPU_HBM_BYTES_PER_S = 819e9
TPU_ICI_BYTES_PER_S = 50e9
BF16_BYTES = 2


def _mapped(fn, mesh, in_specs, out_specs):
  return jax.jit(
    jax.shard_map(
      fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )
  )


def _xla_all_gather_matmul(lhs, rhs):
  gathered = lax.all_gather(lhs, "x", axis=1, tiled=True)
  return jnp.dot(gathered, rhs, preferred_element_type=jnp.float32)


def _xla_matmul_reduce_scatter(lhs, rhs):
  product = jnp.dot(lhs, rhs, preferred_element_type=jnp.float32)
  return lax.psum_scatter(product, "x", scatter_dimension=0, tiled=True)


def _xla_matmul_reduce_scatter_by_shifts(lhs, rhs, *, ring: int):
  """dot, then block ``b`` to device ``b`` by one ring shift per peer, summed
  on arrival: the exchange of the direct schedule at the large shape, in
  plain XLA (its D - 1 ``ppermute``s are D - 1 rendezvous, XLA's
  ``psum_scatter`` one)."""
  product = jnp.dot(lhs, rhs, preferred_element_type=jnp.float32)
  blocks = product.reshape(ring, -1, product.shape[1])
  me = lax.axis_index("x")
  total = lax.dynamic_index_in_dim(blocks, me, keepdims=False)
  for shift in range(1, ring):
    block = lax.dynamic_index_in_dim(
      blocks, (me + shift) % ring, keepdims=False
    )
    perm = [(i, (i + shift) % ring) for i in range(ring)]
    total = total + lax.ppermute(block, "x", perm)
  return total


def _shifts_floor(ring: int, shape):
  """The by-shifts reference where the direct schedule moves its blocks by
  ring shifts (too large to gather everywhere), else None."""
  n, _, m = shape
  block_bytes = n // ring * m * 4  # f32
  if (ring - 1) * block_bytes <= exchange._GATHER_BYTES:
    return None
  return functools.partial(_xla_matmul_reduce_scatter_by_shifts, ring=ring)


def _cases(ring: int, shape, repeats: int, implementations):
  n, k, m = shape
  mesh = jax.make_mesh((ring,), ("x",), devices=jax.devices()[:ring])
  key_lhs, key_rhs = jax.random.split(jax.random.key(ring * 7919 + n))
  lhs = jax.random.normal(key_lhs, (n, k), jnp.bfloat16)
  rhs = jax.random.normal(key_rhs, (k, m), jnp.bfloat16)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  # name: ours, XLA's, in and out specs, and XLA's floor of our exchange
  rows = {
    "all_gather_matmul": (
      functools.partial(all_gather_matmul, axis_name="x"),
      _xla_all_gather_matmul,
      (P(None, "x"), P()),
      P(),
      None,
    ),
    "matmul_reduce_scatter": (
      functools.partial(matmul_reduce_scatter, axis_name="x"),
      _xla_matmul_reduce_scatter,
      (P(None, "x"), P("x")),
      P("x"),
      _shifts_floor(ring, shape),
    ),
  }
  for name, (ours, xla, in_specs, out_spec, floor) in rows.items():
    args = (put(lhs, in_specs[0]), put(rhs, in_specs[1]))
    print(f"  D={ring} {name} n={n} K={k} m={m}:", flush=True)
    fns = {
      impl: _mapped(
        functools.partial(ours, implementation=impl), mesh, in_specs, out_spec
      )
      for impl in implementations
    }
    fns["xla"] = _mapped(xla, mesh, in_specs, out_spec)
    if floor is not None:
      fns["shifts"] = _mapped(floor, mesh, in_specs, out_spec)
    times = time_rounds(
      {key: functools.partial(fn, *args) for key, fn in fns.items()}, repeats
    )
    t_xla = statistics.median(times["xla"])
    for impl in implementations:
      t_ours = statistics.median(times[impl])
      spread = ratio_spread(times[impl], times["xla"])
      print(
        f"    {impl:<6} {t_ours * 1e3:8.2f} ms  XLA {t_xla * 1e3:8.2f} ms"
        f"  ratio {t_ours / t_xla:5.2f} [{spread[0]:.2f}-{spread[1]:.2f}]",
        flush=True,
      )
      yield name, impl, ring, shape, t_ours / t_xla, spread
    if floor is not None:
      t_floor = statistics.median(times["shifts"])
      spread = ratio_spread(times["shifts"], times["xla"])
      print(
        f"    XLA by ring shifts (the direct exchange's floor) "
        f"{t_floor * 1e3:8.2f} ms  ratio {t_floor / t_xla:5.2f} "
        f"[{spread[0]:.2f}-{spread[1]:.2f}]",
        flush=True,
      )
      yield name, "shifts", ring, shape, t_floor / t_xla, spread


def tpu_estimate(ring: int, shape) -> str:
  """The bidirectional all-gather schedule on TPU, step by step."""
  n, k, m = shape
  k_local = k // ring
  half = n // 2
  # Per step and direction: one (n/2, k_local) shard moves one hop while the
  # previous one is multiplied with its (k_local, m) block of rhs.
  step_flops = 2 * 2 * half * k_local * m  # both directions
  wire_bytes = half * k_local * BF16_BYTES  # per link direction
  hbm_bytes = (
    2 * half * k_local * BF16_BYTES  # the two shards read
    + k_local * m * BF16_BYTES * 2  # rhs block, read per direction
    + 2 * n * m * 4  # f32 accumulator read + written
  )
  t_mxu = step_flops / TPU_BF16_FLOPS
  t_hbm = hbm_bytes / TPU_HBM_BYTES_PER_S
  t_ici = wire_bytes / TPU_ICI_BYTES_PER_S
  t_compute = max(t_mxu, t_hbm)
  hidden = "hidden" if t_ici <= t_compute else "exposed"
  total = t_compute * ring + t_ici  # first transfer overlaps step 0 too
  lines = [
    f"  D={ring} n={n} K={k} m={m} on {TPU_NAME}: {ring - 1} transfers per "
    f"direction, {ring} matmul steps",
    f"    per step: {step_flops / 1e9:.2f} GFLOP ({t_mxu * 1e6:.1f} us MXU), "
    f"{hbm_bytes / 2**20:.2f} MiB HBM ({t_hbm * 1e6:.1f} us), "
    f"{wire_bytes / 2**10:.0f} KiB per ICI link direction "
    f"({t_ici * 1e6:.1f} us)",
    f"    transfer t+1 (shard p-t-1 -> p+1, and p+t+1 -> p-1) runs under "
    f"the matmul of shard p-t: {hidden} "
    f"({t_ici * 1e6:.1f} us wire vs {t_compute * 1e6:.1f} us compute)",
    f"    estimate {total * 1e6:.0f} us overlapped vs "
    f"{(t_compute * ring + (ring - 1) * t_ici) * 1e6:.0f} us if each "
    "transfer waited for its matmul",
  ]
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="mpmd bench collective_matmul", description=__doc__
  )
  parser.add_argument(
    "--quick", action="store_true", help="small shapes only (2 CPU cores)"
  )
  parser.add_argument(
    "--rings", default="4,8", help="comma-separated ring lengths (<= 8)"
  )
  parser.add_argument("--repeats", type=int, default=9)
  parser.add_argument(
    "--implementations",
    default="direct,ring",
    help="comma-separated kernel implementations to time (direct is the "
    "CPU default, ring what runs on TPU)",
  )
  args = parser.parse_args(argv)
  impls = args.implementations.split(",")
  if not set(impls) <= set(IMPLEMENTATIONS.names):
    parser.error(
      f"--implementations: expected some of {IMPLEMENTATIONS.names}, got "
      f"{impls}"
    )
  rings = [int(r) for r in args.rings.split(",")]
  if any(r < 2 or r > _MAX_RING for r in rings):
    parser.error(f"--rings: expected lengths in [2, {_MAX_RING}], got {rings}")
  shapes = [SMALL] if args.quick else [LARGE, SMALL]
  print(
    f"collective matmul, CPU fallback vs XLA ({jax.device_count()} simulated "
    f"CPU devices, {os.cpu_count()} cores), median of {args.repeats}"
  )
  results = []
  for shape in shapes:
    for ring in rings:
      results.extend(_cases(ring, shape, args.repeats, impls))
  print(
    "\nratios ours / XLA (lower is better; shifts: plain XLA by one ring "
    "shift per peer, the floor of the direct implementation's exchange):"
  )
  for name, impl, ring, (n, k, m), ratio, (low, high) in results:
    print(
      f"  {name:<22} {impl:<6} D={ring} n={n} K={k} m={m}: {ratio:5.2f} "
      f"[{low:.2f}-{high:.2f}]"
    )
  print("\nanalytical TPU estimate, all_gather_matmul (bidirectional):")
  for ring in rings:
    print(tpu_estimate(ring, LARGE))
  return 0


if __name__ == "__main__":
  sys.exit(main())
