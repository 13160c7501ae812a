"""all_gather_matmul / matmul_reduce_scatter argument errors: each is raised
while tracing, before anything is lowered, with the error kind and a message
that names the argument.

One table row per bad call: (id, call, exception type, message regex).
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from collective_matmul_util import make_mesh, trace_sharded
from jax.sharding import PartitionSpec as P

from mpmd.kernels import all_gather_matmul, matmul_reduce_scatter
from mpmd.kernels import collective_matmul as cm

F32 = jnp.float32
REPLICATED = P()
AG_SPECS = (P(None, "x"), REPLICATED)  # lhs columns sharded, rhs replicated
RS_SPECS = (P(None, "x"), P("x"))  # contraction sharded on both
KERNELS = (
  ("all-gather-matmul", all_gather_matmul, AG_SPECS),
  ("matmul-reduce-scatter", matmul_reduce_scatter, RS_SPECS),
)


def traced(
  fn, lhs, rhs, *, devices=2, in_specs=AG_SPECS, out_specs=REPLICATED, **kwargs
):
  """A call tracing ``fn(**kwargs)`` under shard_map on a 1-D mesh "x" of
  ``devices`` devices, on operands of (shape, dtype) ``lhs`` and ``rhs``."""
  kwargs = {"axis_name": "x", **kwargs}

  def call():
    trace_sharded(
      functools.partial(fn, **kwargs),
      make_mesh((devices,), ("x",)),
      in_specs,
      out_specs,
      lhs,
      rhs,
    )

  return call


def outside_shard_map(fn):
  """A call tracing ``fn`` under jit alone."""

  def call():
    jax.jit(functools.partial(fn, axis_name="x")).trace(
      jax.ShapeDtypeStruct((8, 128), F32),
      jax.ShapeDtypeStruct((128, 128), F32),
    )

  return call


ERRORS = [
  (
    "axis-name-not-in-mesh",
    traced(
      all_gather_matmul, ((8, 256), F32), ((256, 128), F32), axis_name="z"
    ),
    ValueError,
    r"'axis_name' 'z' is not an axis of the enclosing",
  ),
  *(
    (
      f"{name}-bidirectional-not-a-bool",
      traced(
        fn,
        ((8, 256), F32),
        ((256, 128), F32),
        in_specs=specs,
        bidirectional="no",
      ),
      TypeError,
      r"'bidirectional' to be a bool, got",
    )
    for name, fn, specs in KERNELS
  ),
  (
    "all-gather-matmul-rhs-rows-mismatch",
    traced(all_gather_matmul, ((8, 256), F32), ((384, 128), F32)),
    ValueError,
    r"k_local \* ring = 128 \* 2 = 256 rows .* = 384",
  ),
  *(
    (
      f"{name}-unsupported-dtype",
      # rhs replicated for both kernels, as in the all-gather layout.
      traced(fn, ((8, 256), jnp.int32), ((256, 128), jnp.int32)),
      TypeError,
      r"'lhs' of dtype float32 or bfloat16, got int32",
    )
    for name, fn, _ in KERNELS
  ),
  (
    "all-gather-matmul-unsupported-output-dtype",
    traced(
      all_gather_matmul,
      ((8, 256), F32),
      ((512, 128), F32),
      preferred_element_type=jnp.float16,
    ),
    TypeError,
    r"'preferred_element_type' float32 or bfloat16, got",
  ),
  *(
    (
      f"{name}-outside-shard-map",
      outside_shard_map(fn),
      ValueError,
      r"must be called inside jax.shard_map",
    )
    for name, fn, _ in KERNELS
  ),
  (
    "all-gather-matmul-bad-ring",
    traced(
      all_gather_matmul,
      ((8, 512), F32),
      ((512, 128), F32),
      devices=4,
      ring=(0, 1, 1, 2),
    ),
    ValueError,
    r"'ring' to be a permutation of range\(4\).*\(0, 1, 1, 2\)",
  ),
  *(
    (
      f"matmul-reduce-scatter-buffering-{buffering}",
      traced(
        matmul_reduce_scatter,
        ((8, 256), F32),
        ((256, 128), F32),
        in_specs=RS_SPECS,
        out_specs=P("x"),
        buffering=buffering,
      ),
      ValueError,
      rf"'buffering' >= 1, got {buffering}\b",
    )
    for buffering in (0, -1)
  ),
  (
    "all-gather-matmul-block-size-must-divide",
    traced(
      all_gather_matmul,
      ((8, 256), F32),
      ((256, 128), F32),
      block_sizes=cm.BlockSizes(block_k=96),
    ),
    ValueError,
    r"block_sizes.block_k to divide the dimension .*\(128\), got 96",
  ),
  (
    "matmul-reduce-scatter-scatter-dimension-divisible",
    traced(
      matmul_reduce_scatter,
      ((9, 256), F32),
      ((256, 128), F32),
      in_specs=RS_SPECS,
      out_specs=P("x"),
    ),
    ValueError,
    r"dimension 0 of lhs @ rhs \(9\) to be divisible by the",
  ),
  (
    "matmul-reduce-scatter-contraction-mismatch",
    traced(
      matmul_reduce_scatter,
      ((8, 256), F32),
      ((512, 128), F32),
      in_specs=RS_SPECS,
      out_specs=P("x"),
    ),
    ValueError,
    r"lhs.shape\[1\] = 128 rows",
  ),
  (
    "matmul-reduce-scatter-scatter-dimension-value",
    traced(
      matmul_reduce_scatter,
      ((8, 256), F32),
      ((256, 128), F32),
      in_specs=RS_SPECS,
      out_specs=P("x"),
      scatter_dimension=2,
    ),
    ValueError,
    r"'scatter_dimension' 0 or 1, got 2",
  ),
  (
    "all-gather-matmul-mismatched-dtypes",
    traced(all_gather_matmul, ((8, 256), F32), ((256, 128), jnp.bfloat16)),
    TypeError,
    r"same dtype, got float32 and bfloat16",
  ),
]


@pytest.mark.parametrize(
  "call, error, message",
  [pytest.param(*row, id=name) for name, *row in ERRORS],
)
def test_error(call, error, message):
  with pytest.raises(error, match=message):
    call()
