"""The checking executor against upstream's TPU simulator, per launch.

Time per checked schedule (``interpret=mpmd.CheckParams(schedule=...)``:
every program of the launch under our deterministic scheduler, with its
race, uninitialised-read and leftover checks) over time per launch of the
same kernel on Pallas' threaded TPU simulator
(``interpret=pltpu.InterpretParams()``, races not checked), measured side
by side in one run, rounds interleaved. Goal: <= 0.5.

* the producer / consumer example (3 programs on two meshes);
* the ring ``all_gather_matmul`` at D=4 and D=8 devices.

  python benchmarks/checker.py [--quick] [--rounds N]
  mpmd bench checker [--quick]
"""

import argparse
import functools
import sys
from collections.abc import Sequence
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import paired_ratio, time_rounds  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mpmd  # noqa: E402
from mpmd.kernels import all_gather_matmul  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import producer_consumer as pc  # noqa: E402

SIMULATOR = pltpu.InterpretParams()


def _producer_consumer(x, interpret):
  return mpmd.mpmd_map(
    [(pc.consumers, pc.consume), (pc.producer, pc.produce)],
    jax.ShapeDtypeStruct((pc.NUM_CONSUMERS, *x.shape), x.dtype),
    scratch_types=[
      pltpu.HBM(x.shape, x.dtype),
      pltpu.SemaphoreType.REGULAR @ pc.consumers,
      pltpu.VMEM(x.shape, x.dtype) @ pc.consumers,
    ],
    interpret=interpret,
  )(x)


def _ring(devices: int, m: int, k: int, n: int, interpret):
  mesh = jax.make_mesh((devices,), ("x",), devices=jax.devices()[:devices])
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
  lhs = jax.device_put(lhs, NamedSharding(mesh, P(None, "x")))
  rhs = jax.device_put(rhs, NamedSharding(mesh, P()))
  f = jax.jit(
    jax.shard_map(
      lambda a, b: all_gather_matmul(
        a, b, axis_name="x", implementation="ring", interpret=interpret
      ),
      mesh=mesh,
      in_specs=(P(None, "x"), P()),
      out_specs=P("x"),
      check_vma=False,
    )
  )
  return functools.partial(f, lhs, rhs)


class _Schedules:
  """A checked call that takes the next schedule each time it runs: one
  jitted function per schedule string, compiled before the timing."""

  def __init__(self, build, count: int):
    self.calls = [
      build(mpmd.CheckParams(schedule=f"random:{s}")) for s in range(count)
    ]
    self.next = 0
    for call in self.calls:
      jax.block_until_ready(call())

  def __call__(self):
    call = self.calls[self.next % len(self.calls)]
    self.next += 1
    return call()


def _compare(name: str, build, rounds: int) -> float:
  checked = _Schedules(build, count=4)
  simulator = build(SIMULATOR)
  want = np.asarray(simulator())
  got = np.asarray(checked())
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  times = time_rounds({"checker": checked, "simulator": simulator}, rounds)
  ratio = paired_ratio(times["checker"], times["simulator"])
  median = {k: float(np.median(v)) for k, v in times.items()}
  print(
    f"  {name}: checker {median['checker'] * 1e3:.1f} ms per schedule, "
    f"simulator {median['simulator'] * 1e3:.1f} ms per launch  |  "
    f"checker / simulator {ratio:.2f} (goal <= 0.5)",
    flush=True,
  )
  return ratio


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="mpmd bench checker")
  parser.add_argument("--quick", action="store_true", help="fewer rounds")
  parser.add_argument("--rounds", type=int, default=None)
  args = parser.parse_args(argv)
  rounds = args.rounds or (3 if args.quick else 7)
  print(
    "checking executor / TPU simulator, per launch; paired rounds, "
    f"{rounds} rounds"
  )
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  _compare(
    "producer/consumer (3 programs)",
    lambda interpret: functools.partial(
      jax.jit(functools.partial(_producer_consumer, interpret=interpret)), x
    ),
    rounds,
  )
  for devices in (4, 8):
    _compare(
      f"ring all_gather_matmul, D={devices}, (256, {128 * devices}) x "
      f"({128 * devices}, 256)",
      lambda interpret, d=devices: _ring(d, 256, 128 * d, 256, interpret),
      rounds,
    )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
