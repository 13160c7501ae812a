"""A ring ``all_gather_matmul`` on 4 CPU devices under the checking
executor, for the checker's own tests (its records, its garbage)."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd.kernels import all_gather_matmul

D = 4


def ring_launch(schedule: str, rows: int = 8 * D) -> Callable[[], jax.Array]:
  """``launch()`` runs the jitted ring under ``CheckParams(schedule=...)``:
  lhs (rows, 128 D) sharded by columns, rhs (128 D, 128) replicated."""
  mesh = jax.make_mesh((D,), ("x",), devices=jax.devices()[:D])
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((rows, 128 * D)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((128 * D, 128)), jnp.float32)
  lhs = jax.device_put(lhs, NamedSharding(mesh, P(None, "x")))
  rhs = jax.device_put(rhs, NamedSharding(mesh, P()))
  f = jax.jit(
    jax.shard_map(
      lambda a, b: all_gather_matmul(
        a,
        b,
        axis_name="x",
        implementation="ring",
        interpret=mpmd.CheckParams(schedule=schedule),
      ),
      mesh=mesh,
      in_specs=(P(None, "x"), P()),
      out_specs=P("x"),
      check_vma=False,
    )
  )
  return lambda: f(lhs, rhs)
