"""Shared by the ragged all-to-all and MoE tests: routings and the plain-JAX
reference (imported by module name: pytest puts this directory on
sys.path)."""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class Routing(NamedTuple):
  """Per-device ragged all-to-all arguments, stacked along a leading device
  axis (devices in mesh order): operand (P, N, *trailing), output (P, M,
  *trailing), four (P, k * D) int32 arrays; ``groups``: the global device
  indices that exchange together."""

  operand: jax.Array
  output: jax.Array
  input_offsets: jax.Array
  send_sizes: jax.Array
  output_offsets: jax.Array
  recv_sizes: jax.Array
  groups: list[list[int]]

  @property
  def metadata(self):
    return self[2:6]

  @property
  def args(self):
    return self[:6]

  def expected(self):
    """The plain-JAX reference's result for this routing."""
    groups = tuple(tuple(g) for g in self.groups)
    return _jitted_reference(groups)(*self[:5])


def random_routing(
  rng,
  *,
  devices,
  k,
  rows,
  trailing=(8,),
  dtype=jnp.float32,
  groups=None,
  empty_senders=(),
  max_size=None,
  pad=True,
):
  """A valid routing: each slice's size random (zeros included), slices
  packed in sender order in ``operand`` and in (sender, slot) order in each
  receiver's ``output``, with random padding between them when ``pad``
  (else packed: empty slots share their offset with the next one).
  ``empty_senders`` send nothing."""
  groups = groups or [list(range(devices))]
  d = len(groups[0])
  max_size = max_size or max(1, rows // (k * d))
  sizes = rng.integers(0, max_size + 1, (devices, d, k))
  # Some slots empty on purpose.
  sizes[rng.random(sizes.shape) < 0.25] = 0
  for j in empty_senders:
    sizes[j] = 0
  position = {}
  for g in groups:
    for p, dev in enumerate(g):
      position[dev] = (g, p)
  input_offsets = np.zeros((devices, d * k), np.int32)
  output_offsets = np.zeros((devices, d * k), np.int32)
  recv_sizes = np.zeros((devices, d * k), np.int32)
  send_sizes = sizes.reshape(devices, d * k).astype(np.int32)
  n_needed = 0
  for j in range(devices):
    at = 0
    for i in range(d * k):
      at += int(rng.integers(0, 2)) if pad else 0
      input_offsets[j, i] = at
      at += send_sizes[j, i]
    n_needed = max(n_needed, at)
  m_needed = 0
  for t in range(devices):
    g, pt = position[t]
    at = 0
    for pj, j in enumerate(g):
      for s in range(k):
        at += int(rng.integers(0, 2)) if pad else 0
        output_offsets[j, pt * k + s] = at
        recv_sizes[t, pj * k + s] = sizes[j, pt, s]
        at += sizes[j, pt, s]
    m_needed = max(m_needed, at)
  n = max(n_needed, rows)
  m = max(m_needed, 1) + 3  # rows nothing writes
  operand = jnp.asarray(rng.standard_normal((devices, n, *trailing)) * 4, dtype)
  output = jnp.asarray(rng.standard_normal((devices, m, *trailing)) * 4, dtype)
  return Routing(
    operand,
    output,
    jnp.asarray(input_offsets),
    jnp.asarray(send_sizes),
    jnp.asarray(output_offsets),
    jnp.asarray(recv_sizes),
    groups,
  )


@functools.cache
def _jitted_reference(groups):
  return jax.jit(functools.partial(reference, groups=groups))


def reference(
  operand, output, input_offsets, send_sizes, output_offsets, groups
):
  """What every device receives, in plain JAX over the stacked arrays (the
  all_gather of everything; a gather per slice): (P, M, *trailing)."""
  n, m = operand.shape[1], output.shape[1]
  d = len(groups[0])
  k = input_offsets.shape[1] // d
  rows = jnp.arange(m)
  results = [None] * operand.shape[0]
  for g in groups:
    for pt, t in enumerate(g):
      res = output[t]
      for j in g:
        for s in range(k):
          i = pt * k + s
          io, size, oo = (
            input_offsets[j, i],
            send_sizes[j, i],
            output_offsets[j, i],
          )
          inside = (rows >= oo) & (rows < oo + size)
          src = jnp.clip(io + rows - oo, 0, n - 1)
          inside = inside.reshape((m,) + (1,) * (res.ndim - 1))
          res = jnp.where(inside, operand[j][src], res)
      results[t] = res
  return jnp.stack(results)


def stacked_mesh(shape, names):
  return jax.make_mesh(shape, names, devices=jax.devices()[: math.prod(shape)])


def stacked(fn, mesh, axes=None):
  """``fn`` applied to each device's slice of arrays stacked along a leading
  device axis (devices in mesh order, along ``axes``: default all), as a
  ``shard_map``; the results are stacked the same way."""
  spec = P(tuple(mesh.axis_names) if axes is None else axes)

  def per_device(*xs):
    out = fn(*(x[0] for x in xs))
    return jax.tree.map(lambda y: y[None], out)

  return jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec)


def place(mesh, *xs, axes=None):
  """Arrays stacked along a leading device axis, placed on their devices."""
  spec = P(tuple(mesh.axis_names) if axes is None else axes)
  return [jax.device_put(x, NamedSharding(mesh, spec)) for x in xs]


def run_stacked(fn, mesh, *xs, axes=None):
  """jit(``stacked(fn)``) on the placed arrays."""
  return jax.jit(stacked(fn, mesh, axes))(*place(mesh, *xs, axes=axes))
