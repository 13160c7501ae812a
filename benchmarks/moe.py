"""The expert-parallel MoE layer on the CPU fallback vs plain-JAX layers.

For each shape, in one run, the forward pass of four dropless
expert-parallel layers (top-k routing, each expert's MLP on its device,
weighted sum), all inside ``shard_map``:

  ours      ``mpmd.kernels.moe``: ragged_all_to_all dispatch, gmm, reverse
            exchange
  fused     ``mpmd.kernels.moe(..., fused=True)``: one two-mesh launch that
            streams token tiles to the experts' devices, runs their MLP
            tile by tile as they land and streams the results back
  padded    XLA all_to_all of per-device buckets padded to the most rows a
            device can send another (tokens x top_k: dropless), rows sorted
            by expert on arrival, ``jax.lax.ragged_dot``, all_to_all back
  gathered  all_gather of every token and logit, each device's experts on
            the tokens routed to them (``ragged_dot``), psum_scatter back

and, for scale, a layer that is not dropless:

  capacity  GShard-style buckets of 1.25x the rows a uniform routing sends
            each expert, dense batched matmuls, rows past capacity dropped

printed as ours / each and fused / each (median of each round's ratio,
the rounds interleaved; in brackets the lowest and highest round), and
fused / ours (fused at the small shape only, unless --fused-large: on CPU
it runs on the checking executor, which tracks every element it touches,
several GB at the large shape), in wall time and in process CPU time, and
the floor on fused / ours that the fused forward's CPU time sets: it
cannot take less wall time than its CPU time over the machine's cores.
The dropless outputs are checked against each other first.
XLA:CPU's ``ragged_dot`` is slow (about 5x ``gmm``, see grouped_matmul's
bench), which weighs on the padded and gathered layers.

  mpmd bench moe            # the issue's small shape and a larger one
  mpmd bench moe --quick    # the small shape only (2 CPU cores)

Small: 4 devices, 8 experts, 2,048 tokens (512 per device), hidden 512, ffn
1,024, top-2, f32. Large: 8 devices, 16 experts, 4,096 tokens, same layer.
Each shape ends with an analytical TPU v5e estimate per chip: the
exchanges' bytes over ICI against the grouped matmuls' time, unfused
(one after the other) and at best overlapped, and what the fused kernel's
tiled schedule costs (``fused_estimate``).
  python benchmarks/moe.py --quick
"""

import argparse
import functools
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

_MAX_DEVICES = 8
jax.config.update("jax_num_cpu_devices", _MAX_DEVICES)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import paired_ratio, ratio_spread, time_rounds  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mpmd.kernels  # noqa: E402

# (devices, experts, tokens in all, hidden, ffn, top_k)
SMALL = (4, 8, 2048, 512, 1024, 2)
LARGE = (8, 16, 4096, 512, 1024, 2)
HIGHEST = lax.Precision.HIGHEST
# The capacity layer's buckets hold this many times the rows a uniform
# routing sends each expert (it drops the rest: not a dropless layer).
CAPACITY_FACTOR = 1.25


def _route(logits, top_k):
  chosen, expert = lax.top_k(logits.astype(jnp.float32), top_k)
  return jax.nn.softmax(chosen, axis=-1), expert.astype(jnp.int32)


def _mlp(rows, w_in, w_out, sizes):
  h = lax.ragged_dot(rows, w_in, sizes, precision=HIGHEST)
  return lax.ragged_dot(jax.nn.silu(h), w_out, sizes, precision=HIGHEST)


def padded_layer(x, logits, w_in, w_out, *, top_k, devices):
  """Dropless buckets of tokens x top_k rows per (sender, receiver)."""
  tokens, hidden = x.shape
  experts_local = w_in.shape[0]
  rows = tokens * top_k
  weights, expert = _route(logits, top_k)
  expert = expert.reshape(rows)
  order = jnp.argsort(expert, stable=True)
  sorted_expert = expert[order]
  device = sorted_expert // experts_local
  # Position of each sorted row in its destination's bucket.
  first = jnp.searchsorted(sorted_expert, device * experts_local)
  slot = jnp.arange(rows, dtype=jnp.int32) - first.astype(jnp.int32)
  buckets = jnp.zeros((devices, rows, hidden), x.dtype)
  buckets = buckets.at[device, slot].set(x[order // top_k])
  local = jnp.full((devices, rows), experts_local, jnp.int32)
  local = local.at[device, slot].set(sorted_expert % experts_local)
  buckets = lax.all_to_all(buckets, "x", 0, 0, tiled=True)
  local = lax.all_to_all(local, "x", 0, 0, tiled=True).reshape(-1)
  # Arrived rows grouped by local expert (padding, expert El, last).
  arrival = jnp.argsort(local, stable=True)
  sizes = jnp.zeros((experts_local + 1,), jnp.int32).at[local].add(1)
  out = _mlp(
    buckets.reshape(-1, hidden)[arrival], w_in, w_out, sizes[:experts_local]
  )
  back = jnp.zeros_like(out).at[arrival].set(out).reshape(buckets.shape)
  back = lax.all_to_all(back, "x", 0, 0, tiled=True)
  returned = back[device, slot]
  unsorted = jnp.zeros_like(returned).at[order].set(returned)
  per_choice = unsorted.reshape(tokens, top_k, hidden)
  return jnp.einsum("tkh,tk->th", per_choice, weights, precision=HIGHEST)


def capacity_layer(x, logits, w_in, w_out, *, top_k, devices, factor):
  """GShard-style: per (device, expert) buckets of a fixed capacity, dense
  batched matmuls; rows past a bucket's capacity are dropped."""
  tokens, hidden = x.shape
  experts_local = w_in.shape[0]
  experts = experts_local * devices
  rows = tokens * top_k
  capacity = max(1, int(np.ceil(factor * rows / experts)))
  weights, expert = _route(logits, top_k)
  expert = expert.reshape(rows)
  one_hot = jax.nn.one_hot(expert, experts, dtype=jnp.int32)
  slot = (jnp.cumsum(one_hot, axis=0) - one_hot)[jnp.arange(rows), expert]
  kept = slot < capacity
  slot = jnp.where(kept, slot, capacity)  # out of range: dropped
  buckets = jnp.zeros((experts, capacity, hidden), x.dtype)
  buckets = buckets.at[expert, slot].set(
    x[jnp.arange(rows) // top_k], mode="drop"
  )
  buckets = buckets.reshape(devices, experts_local, capacity, hidden)
  buckets = lax.all_to_all(buckets, "x", 0, 0, tiled=True)
  h = jnp.einsum("delh,ehf->delf", buckets, w_in, precision=HIGHEST)
  out = jnp.einsum("delf,efh->delh", jax.nn.silu(h), w_out, precision=HIGHEST)
  out = lax.all_to_all(out, "x", 0, 0, tiled=True)
  out = out.reshape(experts, capacity, hidden)
  returned = out.at[expert, slot].get(mode="fill", fill_value=0)
  per_choice = returned.reshape(tokens, top_k, hidden)
  return jnp.einsum("tkh,tk->th", per_choice, weights, precision=HIGHEST)


def gathered_layer(x, logits, w_in, w_out, *, top_k, devices):
  """Every device sees every token; its experts work on theirs."""
  tokens, hidden = x.shape
  experts_local = w_in.shape[0]
  all_x = lax.all_gather(x, "x", tiled=True)
  weights, expert = _route(lax.all_gather(logits, "x", tiled=True), top_k)
  me = lax.axis_index("x")
  expert = expert.reshape(-1)
  mine = expert // experts_local == me
  local = jnp.where(mine, expert % experts_local, experts_local)
  order = jnp.argsort(local, stable=True)
  sizes = jnp.zeros((experts_local + 1,), jnp.int32).at[local].add(1)
  out = _mlp(all_x[order // top_k], w_in, w_out, sizes[:experts_local])
  unsorted = jnp.zeros_like(out).at[order].set(out)
  per_choice = unsorted.reshape(devices * tokens, top_k, hidden)
  y = jnp.einsum("tkh,tk->th", per_choice, weights, precision=HIGHEST)
  return lax.psum_scatter(y, "x", tiled=True)


def _case(shape, rounds, fused: bool):
  devices, experts, tokens, hidden, ffn, top_k = shape
  mesh = jax.make_mesh((devices,), ("x",), devices=jax.devices()[:devices])
  rng = np.random.default_rng(0)
  x = rng.standard_normal((tokens, hidden), np.float32)
  logits = rng.standard_normal((tokens, experts), np.float32)
  w_in = rng.standard_normal((experts, hidden, ffn), np.float32)
  w_out = rng.standard_normal((experts, ffn, hidden), np.float32)
  spec = NamedSharding(mesh, P("x"))
  args = [
    jax.device_put(jnp.asarray(a), spec)
    for a in (x, logits, w_in / np.sqrt(hidden), w_out / np.sqrt(ffn))
  ]
  layers = {
    "ours": functools.partial(mpmd.kernels.moe, axis_name="x"),
    "fused": functools.partial(mpmd.kernels.moe, axis_name="x", fused=True),
    "padded": functools.partial(padded_layer, devices=devices),
    "gathered": functools.partial(gathered_layer, devices=devices),
    "capacity": functools.partial(
      capacity_layer, devices=devices, factor=CAPACITY_FACTOR
    ),
  }
  mine = ("ours", "fused") if fused else ("ours",)
  if not fused:
    del layers["fused"]
  fns = {
    name: jax.jit(
      jax.shard_map(
        functools.partial(layer, top_k=top_k),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
        check_vma=False,
      )
    )
    for name, layer in layers.items()
  }
  outs = {name: np.asarray(fn(*args)) for name, fn in fns.items()}
  for name in ("fused", "padded", "gathered")[0 if fused else 1 :]:
    np.testing.assert_allclose(outs["ours"], outs[name], rtol=1e-4, atol=1e-4)
  calls = {n: functools.partial(f, *args) for n, f in fns.items()}
  times = time_rounds(calls, rounds)
  pairs = [
    (ours, name) for ours in mine for name in ("padded", "gathered", "capacity")
  ] + ([("fused", "ours")] if fused else [])
  ratios = {
    (ours, name): (
      paired_ratio(times[ours], times[name]),
      ratio_spread(times[ours], times[name]),
      statistics.median(times[name]),
    )
    for ours, name in pairs
  }
  if fused:
    # The same pair in process CPU time: what the two layers cost the
    # machine, whatever the cores do in parallel.
    cpu = time_rounds({n: calls[n] for n in mine}, rounds, time.process_time)
    ratios[("fused", "ours (CPU time)")] = (
      paired_ratio(cpu["fused"], cpu["ours"]),
      ratio_spread(cpu["fused"], cpu["ours"]),
      statistics.median(cpu["ours"]),
    )
  medians = {ours: statistics.median(times[ours]) for ours in mine}
  if fused:
    # The least wall time the fused forward's CPU time allows on this
    # machine's cores, against the unfused forward's wall time.
    medians["floor"] = statistics.median(cpu["fused"]) / (os.cpu_count() or 1)
  return ratios, medians


# TPU v5e (one TensorCore per chip), public figures, as in the collective
# matmul bench: peak bf16 matmul throughput, HBM bandwidth, one ICI link's
# bandwidth per direction (a chip has 4; an all-to-all uses several).
TPU_NAME = "TPU v5e"
TPU_BF16_FLOPS = 197e12
TPU_HBM_BYTES_PER_S = 819e9
TPU_ICI_BYTES_PER_S = 50e9
BF16_BYTES = 2


def tpu_estimate(shape) -> str:
  """What one chip spends on the unfused layer in bf16 (the conditional
  schedule moves only the slices' rows): the two exchanges over ICI, the
  two grouped matmuls on the MXU, and what a fused launch could hide."""
  devices, experts, tokens, hidden, ffn, top_k = shape
  # Rows a chip sends (and, on average, receives) per exchange.
  rows = tokens // devices * top_k
  remote = rows * (devices - 1) / devices  # of which leave the chip
  wire = 2 * remote * hidden * BF16_BYTES  # dispatch + combine
  flops = 2 * 2 * rows * hidden * ffn  # two matmuls per row
  hbm = (2 * rows * hidden + 2 * rows * ffn) * BF16_BYTES + (
    2 * experts // devices * hidden * ffn * BF16_BYTES
  )
  t_wire = wire / TPU_ICI_BYTES_PER_S
  t_mxu = max(flops / TPU_BF16_FLOPS, hbm / TPU_HBM_BYTES_PER_S)
  return (
    f"  {TPU_NAME} estimate per chip (bf16, uniform routing): exchanges "
    f"{wire / 1e6:.2f} MB over one ICI link {t_wire * 1e6:.0f} us, grouped "
    f"matmuls {flops / 1e9:.2f} GFLOP / {hbm / 1e6:.1f} MB HBM "
    f"{t_mxu * 1e6:.0f} us; unfused {(t_wire + t_mxu) * 1e6:.0f} us, a fused "
    f"launch that overlaps them at best {max(t_wire, t_mxu) * 1e6:.0f} us"
  )


# The fused kernel's tile on TPU (``fused._TILE_ROWS["tpu"]``).
TPU_TILE_ROWS = 128


def fused_estimate(shape) -> str:
  """What the fused schedule overlaps on one chip, and its overheads.

  The dispatch program's sends of tile i + 1 overlap the compute program's
  MLP of tile i, and the return of tile i the MLP of tile i + 1: the
  exchanges hide behind the matmuls except for one tile each way (the
  first tile in, the last result out). The compute program multiplies a
  tile by every local expert whose rows it holds: per source slot at most
  El - 1 tiles straddle two experts and are computed once more.
  """
  devices, experts, tokens, hidden, ffn, top_k = shape
  experts_local = experts // devices
  rows = tokens // devices * top_k
  remote = rows * (devices - 1) / devices
  t_wire = 2 * remote * hidden * BF16_BYTES / TPU_ICI_BYTES_PER_S
  flops_per_row = 2 * 2 * hidden * ffn
  extra = devices * (experts_local - 1) * TPU_TILE_ROWS * flops_per_row
  t_mxu = (rows * flops_per_row + extra) / TPU_BF16_FLOPS
  tile = TPU_TILE_ROWS * hidden * BF16_BYTES / TPU_ICI_BYTES_PER_S
  tile_mxu = TPU_TILE_ROWS * flops_per_row / TPU_BF16_FLOPS
  fused = max(t_wire, t_mxu) + 2 * tile + tile_mxu
  weights = 2 * experts_local * hidden * ffn * BF16_BYTES
  return (
    f"  fused (tiles of {TPU_TILE_ROWS} rows): about {fused * 1e6:.0f} us "
    f"per chip = max(exchanges, matmuls incl. {extra / 1e9:.2f} GFLOP on "
    f"tiles straddling two experts) + one tile in, one out, one tile's "
    f"MLP; the compute program holds {weights / 2**20:.1f} MiB of weights "
    "in VMEM"
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="mpmd bench moe", description=__doc__)
  parser.add_argument("--quick", action="store_true", help="small shape only")
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument(
    "--fused-large",
    action="store_true",
    help="also time fused=True at the large shape (several GB of memory)",
  )
  args = parser.parse_args(argv)
  shapes = [SMALL] if args.quick else [SMALL, LARGE]
  print(
    f"moe forward, CPU fallback vs plain-JAX layers ({os.cpu_count()} "
    f"cores), {args.rounds} rounds"
  )
  for shape in shapes:
    devices, experts, tokens, hidden, ffn, top_k = shape
    fused = shape == SMALL or args.fused_large
    ratios, ours = _case(shape, args.rounds, fused)
    print(
      f"D={devices} E={experts} tokens={tokens} hidden={hidden} ffn={ffn} "
      f"top-{top_k}: ours {ours['ours'] * 1e3:.1f} ms"
      + (f", fused {ours['fused'] * 1e3:.1f} ms" if fused else "")
    )
    if not fused:
      print(
        "  fused: not timed at this shape (on CPU it runs on the checking "
        "executor, which tracks every element: several GB; --fused-large)"
      )
    for (mine, name), (ratio, (low, high), theirs) in ratios.items():
      print(
        f"  {mine:<5} / {name:<8} {ratio:5.2f} [{low:.2f}-{high:.2f}] "
        f"({theirs * 1e3:.1f} ms)"
      )
    if fused:
      print(
        f"  fused / ours floor {ours['floor'] / ours['ours']:5.2f} (fused "
        f"CPU time / {os.cpu_count()} cores: {ours['floor'] * 1e3:.1f} ms, "
        "the least wall time it allows)"
      )
    print(tpu_estimate(shape))
    print(fused_estimate(shape))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
