"""all_gather_matmul / matmul_reduce_scatter argument errors: each is raised
while tracing, before anything is lowered, with the error kind and a message
that names the argument.

Two tables of bad calls, rows (id, call, exception type, message regex):
``ERRORS`` and ``COLLECTIVE_MATMUL_CASES`` (rows that name the message whole).
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from collective_matmul_util import make_mesh, trace_sharded
from error_cases import Case, params, raises
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


# The reduce-scatter with its usual specs: contraction sharded, rows scattered.
rs_traced = functools.partial(
  traced, matmul_reduce_scatter, in_specs=RS_SPECS, out_specs=P("x")
)


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
      implementation="ring",
    ),
    ValueError,
    # The ring's local matmuls contract one shard (k_local = 256 / 2).
    r"block_sizes.block_k to divide the dimension .*\(128\), got 96",
  ),
  (
    "all-gather-matmul-direct-block-size-must-divide",
    traced(
      all_gather_matmul,
      ((8, 256), F32),
      ((256, 128), F32),
      block_sizes=cm.BlockSizes(block_k=96),
      implementation="direct",
    ),
    ValueError,
    # The direct implementation's one matmul contracts the gathered K.
    r"block_sizes.block_k to divide the dimension .*\(256\), got 96",
  ),
  (
    "matmul-reduce-scatter-scatter-dimension-divisible",
    rs_traced(
      ((9, 256), F32),
      ((256, 128), F32),
    ),
    ValueError,
    r"dimension 0 of lhs @ rhs \(9\) to be divisible by the",
  ),
  (
    "matmul-reduce-scatter-contraction-mismatch",
    rs_traced(
      ((8, 256), F32),
      ((512, 128), F32),
    ),
    ValueError,
    r"lhs.shape\[1\] = 128 rows",
  ),
  (
    "matmul-reduce-scatter-scatter-dimension-value",
    rs_traced(
      ((8, 256), F32),
      ((256, 128), F32),
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


# -- all_gather_matmul / matmul_reduce_scatter --------------------------------

A = jnp.zeros((16, 128), jnp.float32)
B = jnp.zeros((256, 128), jnp.float32)


def in_shard_map(fn, lhs, rhs, **kw):
  """Traces ``fn`` inside a shard_map over a 2-device axis ``x``."""
  mesh = jax.make_mesh((2,), ("x",))
  spec = jax.sharding.PartitionSpec
  f = jax.shard_map(
    lambda a, b: fn(a, b, **kw),
    mesh=mesh,
    in_specs=(spec(), spec()),
    out_specs=spec(),
    check_vma=False,
  )
  return jax.jit(f).trace(lhs, rhs)


ag = functools.partial(in_shard_map, cm.all_gather_matmul)
rs = functools.partial(in_shard_map, cm.matmul_reduce_scatter)


def _deprecated(kernel, *args, **kwargs):
  """``kernel(*args, **kwargs)``, which must warn that ``schedule`` is
  deprecated (before anything else it raises)."""
  with pytest.warns(DeprecationWarning, match=r"'schedule' is deprecated"):
    return kernel(*args, **kwargs)


COLLECTIVE_MATMUL_CASES = [
  Case(
    "outside_shard_map",
    lambda: cm.all_gather_matmul(A, B, axis_name="x"),
    ValueError,
    r"all_gather_matmul: must be called inside jax.shard_map",
  ),
  Case(
    "axis_not_in_the_mesh",
    lambda: ag(A, B, axis_name="y"),
    ValueError,
    r"'axis_name' 'y' is not an axis of the enclosing shard_map mesh, "
    r"whose axes are \('x',\)",
  ),
  Case(
    "axis_name_an_int",
    lambda: ag(A, B, axis_name=0),
    TypeError,
    r"expected 'axis_name' to be a mesh axis name \(str\) .* got 0",
  ),
  Case(
    "lhs_a_list",
    lambda: ag([[1.0]], B, axis_name="x"),
    TypeError,
    r"all_gather_matmul: expected 'lhs' to be an array, got list",
  ),
  Case(
    "lhs_of_rank_3",
    lambda: rs(A[None], B[:128], axis_name="x"),
    ValueError,
    r"matmul_reduce_scatter: expected 'lhs' of rank 2, got rank 3 with shape "
    r"\(1, 16, 128\)",
  ),
  Case(
    "lhs_with_a_zero_dimension",
    lambda: ag(A[:0], B, axis_name="x"),
    ValueError,
    r"expected 'lhs' with no zero-sized dimension, got shape \(0, 128\)",
  ),
  Case(
    "int_operands",
    lambda: ag(A.astype(jnp.int32), B.astype(jnp.int32), axis_name="x"),
    TypeError,
    r"expected 'lhs' of dtype float32 or bfloat16, got int32",
  ),
  Case(
    "mixed_dtypes",
    lambda: ag(A, B.astype(jnp.bfloat16), axis_name="x"),
    TypeError,
    r"expected 'lhs' and 'rhs' of the same dtype, got float32 and bfloat16",
  ),
  Case(
    "preferred_element_type_not_a_dtype",
    lambda: rs(A, B[:128], axis_name="x", preferred_element_type="banana"),
    TypeError,
    r"expected 'preferred_element_type' to be a dtype, got 'banana'",
  ),
  Case(
    "rhs_rows_not_the_gathered_k",
    lambda: ag(A, B[:100], axis_name="x"),
    ValueError,
    r"expected 'rhs' with k_local \* ring = 128 \* 2 = 256 rows .* got "
    r"rhs.shape\[0\] = 100",
  ),
  Case(
    "rhs_rows_not_the_contraction",
    lambda: rs(A, B, axis_name="x"),
    ValueError,
    r"expected 'rhs' with lhs.shape\[1\] = 128 rows \(the contraction\)",
  ),
  Case(
    "bidirectional_a_str",
    lambda: ag(A, B, axis_name="x", bidirectional="yes"),
    TypeError,
    r"expected 'bidirectional' to be a bool, got 'yes'",
  ),
  Case(
    "no_buffering",
    lambda: rs(A, B[:128], axis_name="x", buffering=0),
    ValueError,
    r"expected 'buffering' >= 1, got 0",
  ),
  Case(
    "block_sizes_a_tuple",
    lambda: ag(A, B, axis_name="x", block_sizes=(8, 128, 128)),
    TypeError,
    r"expected 'block_sizes' to be a BlockSizes or None, got tuple",
  ),
  Case(
    "block_that_does_not_divide",
    lambda: rs(
      A,
      B[:128],
      axis_name="x",
      block_sizes=cm.BlockSizes(block_m=100),
      implementation="ring",
    ),
    ValueError,
    # Each ring direction carries half of the 128 columns.
    r"expected block_sizes.block_m to divide the dimension it tiles "
    r"\(64\), got 100",
  ),
  Case(
    "unknown_implementation",
    lambda: rs(A, B[:128], axis_name="x", implementation="tree"),
    ValueError,
    r"matmul_reduce_scatter: expected 'implementation' in \('ring', "
    r"'direct'\) or None, got 'tree'",
  ),
  Case(
    "implementation_not_a_str",
    lambda: ag(A, B, axis_name="x", implementation=1),
    TypeError,
    r"all_gather_matmul: expected 'implementation' to be a str in \('ring', "
    r"'direct'\) or None, got int: 1",
  ),
  Case(
    "implementation_and_its_deprecated_alias",
    lambda: _deprecated(
      ag, A, B, axis_name="x", implementation="ring", schedule="direct"
    ),
    TypeError,
    r"all_gather_matmul: got both 'implementation' \('ring'\) and its "
    r"deprecated alias 'schedule' \('direct'\); pass 'implementation' only",
  ),
  Case(
    "deprecated_alias_unknown_name",
    lambda: _deprecated(rs, A, B[:128], axis_name="x", schedule="tree"),
    ValueError,
    r"matmul_reduce_scatter: expected 'implementation' in \('ring', "
    r"'direct'\) or None, got 'tree'",
  ),
  Case(
    "ring_not_a_permutation",
    lambda: ag(A, B, axis_name="x", ring=(0, 0)),
    ValueError,
    r"expected 'ring' to be a permutation of range\(2\)",
  ),
  Case(
    "ring_of_floats",
    lambda: ag(A, B, axis_name="x", ring=(0, 1.7)),
    TypeError,
    r"expected 'ring' to be a sequence of ints, got \(0, 1.7\)",
  ),
  Case(
    "ring_a_str",
    lambda: rs(A, B[:128], axis_name="x", ring="01"),
    TypeError,
    r"expected 'ring' to be a sequence of ints, got '01'",
  ),
  Case(
    "scatter_dimension_2",
    lambda: rs(A, B[:128], axis_name="x", scatter_dimension=2),
    ValueError,
    r"expected 'scatter_dimension' 0 or 1, got 2",
  ),
  Case(
    "scattered_dimension_not_divisible",
    lambda: rs(A[:15], B[:128], axis_name="x"),
    ValueError,
    r"expected dimension 0 of lhs @ rhs \(15\) to be divisible by the ring "
    r"length 2",
  ),
]


@pytest.mark.parametrize(
  "case", params([*(Case(*row) for row in ERRORS), *COLLECTIVE_MATMUL_CASES])
)
def test_error(case):
  raises(case)


def test_collective_matmul_table_is_large_enough():
  assert len(COLLECTIVE_MATMUL_CASES) >= 10
