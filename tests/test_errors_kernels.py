"""Bad input to the kernels and ``tpu_target``: a typed error, before
lowering.

One table per entry (``gmm`` / ``tgmm``, the collective matmuls,
``tpu_target``), as in ``test_errors.py`` for ``mpmd_map``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from error_cases import Case, params, raises

import mpmd
from mpmd.kernels import collective_matmul as cm
from mpmd.kernels import gpu
from mpmd.kernels import grouped_matmul as gm

# -- gmm / tgmm ---------------------------------------------------------------

LHS = jnp.zeros((64, 32), jnp.float32)
RHS = jnp.zeros((4, 32, 16), jnp.float32)
SIZES = jnp.full((4,), 16, jnp.int32)
TILING = (16, 32, 16)
gmm = functools.partial(gm.gmm, tiling=TILING)
tgmm = functools.partial(gm.tgmm, tiling=TILING)

GROUPED_MATMUL_CASES = [
  Case(
    "gmm_negative_group_size",
    lambda: gmm(LHS, RHS, jnp.asarray([16, -4, 30, 16], jnp.int32)),
    ValueError,
    r"gmm: expected non-negative 'group_sizes', got group_sizes\[1\] = -4",
  ),
  Case(
    "tgmm_negative_group_size",
    lambda: tgmm(LHS.T, LHS, np.asarray([-1, 16, 16, 16], np.int32)),
    ValueError,
    r"tgmm: expected non-negative 'group_sizes', got group_sizes\[0\] = -1",
  ),
  Case(
    "group_sizes_of_floats",
    lambda: gmm(LHS, RHS, SIZES.astype(jnp.float32)),
    TypeError,
    r"gmm: expected 'group_sizes' of dtype int32, got float32",
  ),
  Case(
    "group_sizes_of_rank_2",
    lambda: tgmm(LHS.T, LHS, SIZES[None]),
    ValueError,
    r"tgmm: expected 'group_sizes' of rank 1 \(num_groups,\), got rank 2",
  ),
  Case(
    "group_sizes_as_a_list",
    lambda: gmm(LHS, RHS, [16, 16, 16, 16]),
    TypeError,
    r"gmm: expected 'group_sizes' to be an array \(num_groups,\), got list",
  ),
  Case(
    "lhs_of_rank_3",
    lambda: gmm(LHS[None], RHS, SIZES),
    ValueError,
    r"gmm: expected 'lhs' of rank 2 \(m, k\), got rank 3",
  ),
  Case(
    "lhs_of_ints",
    lambda: gmm(LHS.astype(jnp.int32), RHS, SIZES),
    TypeError,
    r"gmm: expected 'lhs' of dtype float32, bfloat16 or float16, got int32",
  ),
  Case(
    "lhs_with_a_zero_dimension",
    lambda: tgmm(LHS.T[:0], LHS, SIZES),
    ValueError,
    r"tgmm: expected 'lhs' \(k, m\) with no zero-sized dimension",
  ),
  Case(
    "mismatched_k",
    lambda: gmm(LHS, jnp.zeros((4, 16, 32), jnp.float32), SIZES),
    ValueError,
    r"gmm: expected 'rhs' \(num_groups, k, n\) with k=32 .* got shape "
    r"\(4, 16, 32\); for \(num_groups, n, k\) weights pass transpose_rhs=True",
  ),
  Case(
    "more_rhs_groups_than_sizes",
    lambda: gmm(LHS, RHS, SIZES[:2]),
    ValueError,
    r"gmm: expected 'rhs' to hold at most num_groups=2 groups",
  ),
  Case(
    "preferred_element_type_not_a_dtype",
    lambda: gmm(LHS, RHS, SIZES, preferred_element_type="banana"),
    TypeError,
    r"gmm: expected 'preferred_element_type' to be a dtype, got 'banana'",
  ),
  Case(
    "tiling_that_does_not_divide_m",
    lambda: gm.gmm(LHS, RHS, SIZES, tiling=(24, 32, 16)),
    ValueError,
    r"gmm: expected the row tile tm=24 .* divide m=64",
  ),
  Case(
    "tiling_of_two_sizes",
    lambda: gm.tgmm(LHS.T, LHS, SIZES, tiling=(16, 32)),
    TypeError,
    r"tgmm: expected 'tiling' to be a tuple",
  ),
  Case(
    "group_offset_past_the_groups",
    lambda: gmm(LHS, RHS[:2], SIZES, group_offset=3),
    ValueError,
    r"gmm: expected 'group_offset' in \[0, 2\] .* got 3",
  ),
  Case(
    "group_offset_of_floats",
    lambda: tgmm(LHS.T, LHS, SIZES, group_offset=jnp.float32(1)),
    TypeError,
    r"tgmm: expected 'group_offset' of dtype int32, got float32",
  ),
  Case(
    "existing_out_of_another_shape",
    lambda: gmm(LHS, RHS, SIZES, existing_out=LHS),
    ValueError,
    r"gmm: expected 'existing_out' of shape \(64, 16\), got \(64, 32\)",
  ),
  Case(
    "num_actual_groups_zero",
    lambda: tgmm(LHS.T, LHS, SIZES, num_actual_groups=0),
    ValueError,
    r"tgmm: expected 'num_actual_groups' >= 1, got 0",
  ),
  Case(
    "num_actual_groups_above_num_groups",
    lambda: tgmm(LHS.T, LHS, SIZES, num_actual_groups=5),
    ValueError,
    r"tgmm: expected 'num_actual_groups' in \[1, 4\] \(num_groups\), got 5",
  ),
  Case(
    "num_actual_groups_float",
    lambda: tgmm(LHS.T, LHS, SIZES, num_actual_groups=2.0),
    TypeError,
    r"tgmm: expected 'num_actual_groups' to be an int, got 2.0",
  ),
  Case(
    "transpose_rhs_as_a_str",
    lambda: gmm(LHS, RHS, SIZES, transpose_rhs="yes"),
    TypeError,
    r"gmm: expected 'transpose_rhs' to be a bool, got 'yes'",
  ),
]


@pytest.mark.parametrize("case", params(GROUPED_MATMUL_CASES))
def test_grouped_matmul_bad_input(case):
  raises(case)


def test_grouped_matmul_table_is_large_enough():
  assert len(GROUPED_MATMUL_CASES) >= 10


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
      A, B[:128], axis_name="x", block_sizes=cm.BlockSizes(block_m=100)
    ),
    ValueError,
    r"expected block_sizes.block_m to divide the dimension it tiles "
    r"\(64\), got 100",
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


@pytest.mark.parametrize("case", params(COLLECTIVE_MATMUL_CASES))
def test_collective_matmul_bad_input(case):
  raises(case)


def test_collective_matmul_table_is_large_enough():
  assert len(COLLECTIVE_MATMUL_CASES) >= 10


# -- tpu_target ---------------------------------------------------------------

TPU_TARGET_CASES = [
  Case(
    f"{type(name).__name__}_{name!r}",
    functools.partial(mpmd.tpu_target, name),
    TypeError,
    r"tpu_target: expected 'name' to be a str \(one of \['v4', 'v5e', "
    rf"'v5p', 'v6e', 'v7x'\]\), got {type(name).__name__}",
  )
  for name in (["v5e"], ("v5e",), {"v5e"}, None, 5, b"v5e", 5.0)
] + [
  Case(
    f"unknown_{name!r}",
    functools.partial(mpmd.tpu_target, name),
    ValueError,
    r"tpu_target: expected 'name' in \['v4', 'v5e', 'v5p', 'v6e', 'v7x'\], "
    rf"got '{name}'",
  )
  for name in ("v99", "", "V5E", "v5 lite", "TPU v5 lite", " v5e")
]


@pytest.mark.parametrize("case", params(TPU_TARGET_CASES))
def test_tpu_target_bad_input(case):
  """Raised by the call itself, before any ``with``."""
  raises(case)


def test_tpu_target_table_is_large_enough():
  assert len(TPU_TARGET_CASES) >= 10


# -- the GPU kernels ----------------------------------------------------------


def test_gpu_matmul_out_dtype_not_a_dtype():
  a = jnp.zeros((128, 128), jnp.bfloat16)
  with pytest.raises(
    TypeError, match=r"matmul: expected 'out_dtype' to be a dtype, got 'banana'"
  ):
    gpu.matmul(a, a, out_dtype="banana")
