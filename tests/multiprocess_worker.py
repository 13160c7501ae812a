"""One process of tests/test_multiprocess.py's two-process job.

Usage: ``python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR``.

Joins the job through ``jax.distributed`` (coordinator on 127.0.0.1:PORT,
gloo collectives, ``DEVICES_PER_PROCESS`` CPU devices here), then over the
ring of all the job's devices runs both collective matmul kernels and their
plain-XLA references (all_gather + dot; dot + psum_scatter) on the same
deterministic operands in every process. It saves the shards this process
holds to ``OUT_DIR/process<ID>.npz`` and what the checks saw to
``OUT_DIR/process<ID>.json``; the test compares them. An exception ends the
process with a traceback and a non-zero exit status.
"""

import json
import sys
from pathlib import Path

import jax

DEVICES_PER_PROCESS = 2
# Small shapes: one 128-wide tile per ring step keeps the job quick.
N, K_LOCAL, M = 16, 128, 128
SEED = 0


def _init(process_id: int, num_processes: int, port: int) -> None:
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
  # CPU collectives across processes need a collectives implementation.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # The suite's strictness (tests/conftest.py).
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  jax.config.update("jax_numpy_rank_promotion", "raise")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=120,
  )


def main(process_id: int, num_processes: int, port: int, out_dir: Path):
  _init(process_id, num_processes, port)

  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpmd
  from mpmd.kernels import all_gather_matmul, matmul_reduce_scatter

  ring = jax.device_count()
  mesh = jax.make_mesh((ring,), ("x",))
  k = K_LOCAL * ring
  # The same operands in every process: each one places the blocks its own
  # devices hold.
  rng = np.random.default_rng(SEED)
  ag_lhs = rng.standard_normal((N, k), np.float32)
  rs_lhs = rng.standard_normal((N * ring, k), np.float32)
  rhs = rng.standard_normal((k, M), np.float32) / np.float32(np.sqrt(k))

  def place(value, spec):
    return jax.make_array_from_callback(
      value.shape, NamedSharding(mesh, spec), lambda index: value[index]
    )

  def run(fn, in_specs, out_spec, *args):
    placed = [place(a, s) for a, s in zip(args, in_specs, strict=True)]
    f = jax.shard_map(
      fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False
    )
    return jax.jit(f)(*placed)

  def dot(a, b):
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST)

  shards = {}

  def keep(name, out):
    for shard in out.addressable_shards:
      rows = shard.index[0]
      shards[f"{name}/{rows.start}:{rows.stop}"] = np.asarray(shard.data)

  # all_gather_matmul: every device's full product, stacked over the ring.
  ag_specs = (P(None, "x"), P())
  keep(
    "all_gather_matmul",
    run(
      lambda a, b: all_gather_matmul(a, b, axis_name="x"),
      ag_specs,
      P("x"),
      ag_lhs,
      rhs,
    ),
  )
  keep(
    "all_gather_matmul_reference",
    run(
      lambda a, b: dot(lax.all_gather(a, "x", axis=1, tiled=True), b),
      ag_specs,
      P("x"),
      ag_lhs,
      rhs,
    ),
  )
  # matmul_reduce_scatter: rows of the product scattered over the ring.
  rs_specs = (P(None, "x"), P("x"))
  keep(
    "matmul_reduce_scatter",
    run(
      lambda a, b: matmul_reduce_scatter(a, b, axis_name="x"),
      rs_specs,
      P("x"),
      rs_lhs,
      rhs,
    ),
  )
  keep(
    "matmul_reduce_scatter_reference",
    run(
      lambda a, b: lax.psum_scatter(
        dot(a, b), "x", scatter_dimension=0, tiled=True
      ),
      rs_specs,
      P("x"),
      rs_lhs,
      rhs,
    ),
  )

  # A kernel the lockstep path cannot run (its remote DMA starts under a
  # condition), in the TPU simulator, whose memory is this process's.
  core = mpmd.tensorcore_mesh("core", num_cores=1)

  def conditional_send(x_hbm, o_hbm, send, recv):
    me = lax.axis_index("x")
    copy = pltpu.make_async_remote_copy(
      x_hbm, o_hbm, send, recv, device_id={"x": lax.rem(me + 1, ring)}
    )

    @pl.when(me >= 0)
    def _():
      copy.start()

    copy.wait()

  def send_right(x, interpret=pltpu.InterpretParams()):  # noqa: B008
    return mpmd.mpmd_map(
      [(core, conditional_send)],
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_types=[pltpu.SemaphoreType.DMA(())] * 2,
      interpret=interpret,
    )(x)

  def error_of(launch):
    try:
      launch()
    except NotImplementedError as e:
      return {"type": type(e).__name__, "message": str(e)}
    return None

  block = np.arange(ring * 8 * 128, dtype=np.float32).reshape(ring * 8, 128)
  errors = {
    "mesh": error_of(lambda: run(send_right, (P("x"),), P("x"), block)),
    # Over an abstract mesh the lowering does not know the devices.
    "abstract_mesh": error_of(
      lambda: jax.jit(
        jax.shard_map(
          send_right,
          mesh=mesh.abstract_mesh,
          in_specs=P("x"),
          out_specs=P("x"),
          check_vma=False,
        )
      )(place(block, P("x")))
    ),
  }

  # By default the checking executor runs it: every process gathers the
  # ring's inputs and runs the whole launch.
  keep(
    "checked_send",
    run(lambda x: send_right(x, interpret=None), (P("x"),), P("x"), block),
  )
  shards["checked_send_input"] = block

  # The simulator still runs launches on this process's own devices.
  def signal_then_copy(x_hbm, o_hbm, sem):
    pl.semaphore_signal(sem, 1)
    pl.semaphore_wait(sem, 1)
    pltpu.sync_copy(x_hbm, o_hbm)

  local = mpmd.mpmd_map(
    [(core, signal_then_copy)],
    jax.ShapeDtypeStruct((8, 128), jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR(())],
    interpret=pltpu.InterpretParams(),
  )(jnp.asarray(block[:8]))
  shards["local_simulator"] = np.asarray(local)
  shards["local_simulator_input"] = block[:8]

  np.savez(out_dir / f"process{process_id}.npz", **shards)
  report = {
    "process_count": jax.process_count(),
    "device_count": jax.device_count(),
    "local_device_count": jax.local_device_count(),
    "simulator_errors": errors,
  }
  (out_dir / f"process{process_id}.json").write_text(json.dumps(report))
  jax.distributed.shutdown()


if __name__ == "__main__":
  process_id, num_processes, port, out_dir = sys.argv[1:]
  main(int(process_id), int(num_processes), int(port), Path(out_dir))
