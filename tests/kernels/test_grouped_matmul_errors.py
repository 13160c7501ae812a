"""gmm / tgmm argument errors: each fails before tracing the kernel, with the
error kind and a message that names the argument.

Two tables of bad calls, rows (id, call, exception type, message regex):
``ERRORS`` and ``GROUPED_MATMUL_CASES`` (rows that name the message whole).
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from error_cases import Case, params, raises

import mpmd
from mpmd.kernels import grouped_matmul as gm

LHS = jnp.zeros((64, 32), jnp.float32)
RHS = jnp.zeros((4, 32, 16), jnp.float32)
SIZES = jnp.full((4,), 16, jnp.int32)
# 2 of the 4 groups: a concrete group_offset must leave room for them.
LOCAL_RHS = RHS[:2]
# Transposed rhs (num_groups, n, k): k does not match lhs.
RHS_T = jnp.zeros((4, 16, 32), jnp.float32)
NEGATIVE_SIZES = np.asarray([8, 8, -3, 8, 8, 8], np.int32)
# Shapes for the negative-sizes rows, whose sizes have 6 groups.
LHS_6 = jnp.zeros((64, 96), jnp.float32)
RHS_6 = jnp.zeros((6, 96, 80), jnp.float32)
TILING_6 = (16, 64, 64)


def under_tpu_target(call):
  """``call`` with kernels built for TPU (the TPU tiling rules apply)."""

  def wrapped():
    with mpmd.tpu_target("v5e"):
      call()

  return wrapped


ERRORS = [
  (
    "gmm-lhs-rank",
    lambda: gm.gmm(LHS[None], RHS, SIZES),
    ValueError,
    r"gmm: expected 'lhs' of rank 2",
  ),
  (
    "gmm-rhs-rank",
    lambda: gm.gmm(LHS, RHS[0], SIZES),
    ValueError,
    r"gmm: expected 'rhs' of rank 3",
  ),
  (
    "gmm-group-sizes-dtype",
    lambda: gm.gmm(LHS, RHS, SIZES.astype(jnp.float32)),
    TypeError,
    r"gmm: expected 'group_sizes' of dtype int32, got float32",
  ),
  (
    "tgmm-group-sizes-dtype",
    lambda: gm.tgmm(LHS.T, LHS, SIZES.astype(jnp.int16)),
    TypeError,
    r"tgmm: expected 'group_sizes' of dtype int32",
  ),
  (
    "gmm-group-sizes-rank",
    lambda: gm.gmm(LHS, RHS, SIZES[None]),
    ValueError,
    r"'group_sizes' of rank 1",
  ),
  *(
    (
      f"{kernel}-negative-group-sizes-{kind}",
      call,
      ValueError,
      message,
    )
    for kind, as_array in (("numpy", np.asarray), ("jax", jnp.asarray))
    for kernel, call, message in (
      (
        "gmm",
        lambda a=as_array: gm.gmm(
          LHS_6, RHS_6, a(NEGATIVE_SIZES), tiling=TILING_6
        ),
        r"gmm: expected non-negative 'group_sizes', got "
        r"group_sizes\[2\] = -3",
      ),
      (
        "tgmm",
        lambda a=as_array: gm.tgmm(
          LHS_6.T, LHS_6, a(NEGATIVE_SIZES), tiling=TILING_6
        ),
        r"tgmm: expected non-negative 'group_sizes'",
      ),
    )
  ),
  (
    "gmm-mismatched-k",
    lambda: gm.gmm(LHS, RHS_T, SIZES),
    ValueError,
    r"gmm: expected 'rhs' .* with k=32.*got shape",
  ),
  (
    "tgmm-mismatched-m",
    lambda: gm.tgmm(LHS.T, LHS[:32], SIZES),
    ValueError,
    r"tgmm: expected 'rhs' \(m, n\)",
  ),
  (
    "gmm-transposed-rhs-hint",
    lambda: gm.gmm(LHS, RHS_T, SIZES),
    ValueError,
    r"transpose_rhs=True",
  ),
  (
    "gmm-row-tile-does-not-divide-m",
    lambda: gm.gmm(LHS, RHS, SIZES, tiling=(24, 32, 16)),
    ValueError,
    r"gmm: expected the row tile tm=24 .* divide m=64 .*; try tm=16$",
  ),
  (
    # The hint is one a TPU takes too (a multiple of 8 rows), not tm=4.
    "gmm-row-tile-hint-fits-a-tpu",
    lambda: gm.gmm(LHS, RHS, SIZES, tiling=(7, 32, 16)),
    ValueError,
    r"tm=7 .* divide m=64 .*; try tm=8$",
  ),
  (
    "gmm-tiling-not-positive",
    lambda: gm.gmm(LHS, RHS, SIZES, tiling=(0, 32, 16)),
    ValueError,
    r"positive 'tiling'",
  ),
  (
    "gmm-tiling-not-a-triple",
    lambda: gm.gmm(LHS, RHS, SIZES, tiling=(16, 32)),
    TypeError,
    r"'tiling' to be a tuple",
  ),
  (
    "tgmm-tiling-function-returned-none",
    lambda: gm.tgmm(LHS.T, LHS, SIZES, tiling=lambda m, k, n: None),
    ValueError,
    r"'tiling' function returned None",
  ),
  (
    "gmm-lhs-dtype",
    lambda: gm.gmm(LHS.astype(jnp.int32), RHS, SIZES),
    TypeError,
    r"gmm: expected 'lhs' of dtype",
  ),
  (
    "gmm-preferred-element-type",
    lambda: gm.gmm(LHS, RHS, SIZES, preferred_element_type=jnp.int8),
    TypeError,
    r"expected 'preferred_element_type' float32",
  ),
  (
    "gmm-too-many-rhs-groups",
    lambda: gm.gmm(LHS, RHS, SIZES[:2]),
    ValueError,
    r"at most num_groups=2",
  ),
  (
    "gmm-existing-out-shape",
    lambda: gm.gmm(LHS, RHS, SIZES, existing_out=LHS),
    ValueError,
    r"'existing_out' of shape \(64, 16\)",
  ),
  (
    "gmm-existing-out-dtype",
    lambda: gm.gmm(
      LHS, RHS, SIZES, existing_out=jnp.zeros((64, 16), jnp.bfloat16)
    ),
    TypeError,
    r"'existing_out' of dtype float32",
  ),
  (
    "gmm-group-offset-dtype",
    lambda: gm.gmm(LHS, RHS, SIZES, group_offset=jnp.float32(1)),
    TypeError,
    r"'group_offset' of dtype int32",
  ),
  (
    "gmm-group-offset-shape",
    lambda: gm.gmm(LHS, RHS, SIZES, group_offset=SIZES),
    ValueError,
    r"'group_offset' of shape \(\)",
  ),
  # A concrete offset past the groups would be clamped by dynamic_slice.
  *(
    (
      f"gmm-group-offset-{name}",
      lambda bad=bad: gm.gmm(LHS, LOCAL_RHS, SIZES, group_offset=bad),
      ValueError,
      r"'group_offset' in \[0, 2\] "
      r"\(num_groups=4 minus the 2 local groups\)",
    )
    for name, bad in (
      ("past-the-groups", 3),
      ("negative", -1),
      ("past-the-groups-as-array", jnp.int32(3)),
    )
  ),
  (
    "tgmm-group-offset-past-the-groups",
    lambda: gm.tgmm(LHS.T, LHS, SIZES, group_offset=3, num_actual_groups=2),
    ValueError,
    r"'group_offset' in \[0, 2\]",
  ),
  (
    "gmm-tpu-row-tile-not-whole-sublanes",
    under_tpu_target(lambda: gm.gmm(LHS, RHS, SIZES, tiling=(4, 16, 16))),
    ValueError,
    r"row tile tm=4 of 'tiling' to be "
    r"a multiple of 8 \(TPU sublanes\) or all m=64",
  ),
  (
    "tgmm-num-actual-groups",
    lambda: gm.tgmm(LHS.T, LHS, SIZES, num_actual_groups=5),
    ValueError,
    r"'num_actual_groups' in \[1, 4\].*got 5",
  ),
]


# -- gmm / tgmm ---------------------------------------------------------------

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
    r"gmm: expected the row tile tm=24 .* divide m=64 .*; try tm=16$",
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


@pytest.mark.parametrize(
  "case", params([*(Case(*row) for row in ERRORS), *GROUPED_MATMUL_CASES])
)
def test_error(case):
  raises(case)


def test_grouped_matmul_table_is_large_enough():
  assert len(GROUPED_MATMUL_CASES) >= 10


def test_cpu_row_tile_need_not_be_whole_sublanes():
  # The TPU-only rule of the row above: on the CPU fallback tm=4 is fine.
  gm.gmm(LHS, RHS, SIZES, tiling=(4, 16, 16))
