"""gmm / tgmm with traced group sizes outside the documented contract.

The contract is non-negative sizes summing to at most m. Concrete sizes are
checked (negative ones are rejected, see ``test_grouped_matmul_errors.py``;
a sum past m is clipped like ``jax.lax.ragged_dot``); traced ones cannot be,
so they must mean what ragged_dot means. Run on the CPU fallback.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grouped_matmul_util import (
  HIGHEST,
  TILING,
  G,
  K,
  M,
  N,
  loss_fn,
  operands,
  ragged_dot_ref,
  tolerances,
)
from jax import lax

from mpmd.kernels import grouped_matmul as gm


def tgmm_ragged_dot_ref(lhs, rhs, group_sizes):
  """tgmm as ``jax.lax.ragged_dot_general`` (the contraction is ragged)."""
  dims = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [0]), ([], [])),
    lhs_ragged_dimensions=[1],
    rhs_group_dimensions=[],
  )
  return lax.ragged_dot_general(
    lhs.astype(jnp.float32),
    rhs.astype(jnp.float32),
    group_sizes,
    dims,
    precision=HIGHEST,
    preferred_element_type=jnp.float32,
  )


def first_group_sizes(sizes, m):
  """Sizes whose disjoint groups give each row to the first of ragged_dot's
  (possibly overlapping) groups that holds it."""
  ends = np.clip(np.maximum.accumulate(np.cumsum(sizes)), 0, m)
  return np.diff(np.concatenate([[0], ends])).astype(np.int32)


def groups_per_row(sizes, m):
  """How many of ragged_dot's groups hold each row."""
  ends = np.cumsum(sizes)
  starts = np.concatenate([[0], ends[:-1]])
  rows = np.arange(m)[:, None]
  return ((rows >= starts) & (rows < ends)).sum(axis=1)


# Traced sizes outside the documented contract (non-negative, sum <= m):
# a sum past m, negative sizes (overlapping ragged_dot groups), a negative
# running sum, and everything at once.
OUT_OF_CONTRACT_SIZES = {
  "sum_past_m": [10, 20, 30, 40, 0, 9],
  "last_group_past_m": [0, 0, 0, 0, 60, 30],
  "negative_middle": [20, -8, 30, 10, 0, 5],
  "negative_first": [-5, 30, 10, 10, 10, 4],
  "overlap_past_m": [40, -30, 50, 20, -100, 70],
}


@functools.cache
def _jitted(kernel):
  """One compilation per kernel for all the patterns (sizes are data)."""
  return jax.jit(functools.partial(kernel, tiling=TILING))


class TestGroupSizesOutsideTheContract:
  """Traced sizes mean what ragged_dot means; concrete ones past m are
  clipped like it."""

  @pytest.mark.parametrize("pattern", list(OUT_OF_CONTRACT_SIZES))
  def test_traced_sizes_gmm(self, rng, pattern):
    sizes = np.asarray(OUT_OF_CONTRACT_SIZES[pattern], np.int32)
    lhs, rhs = operands(rng, M, K, N, G)
    out = np.asarray(_jitted(gm.gmm)(lhs, rhs, jnp.asarray(sizes)))
    # Equal to ragged_dot of the same sizes on every row that is in at most
    # one of its groups; everywhere to ragged_dot of the disjoint groups.
    ref = np.asarray(ragged_dot_ref(lhs, rhs, jnp.asarray(sizes)))
    single = groups_per_row(sizes, M) <= 1
    np.testing.assert_allclose(
      out[single], ref[single], **tolerances(jnp.float32)
    )
    first = jnp.asarray(first_group_sizes(sizes, M))
    np.testing.assert_allclose(
      out, ragged_dot_ref(lhs, rhs, first), **tolerances(jnp.float32)
    )

  @pytest.mark.parametrize("pattern", list(OUT_OF_CONTRACT_SIZES))
  def test_traced_sizes_tgmm(self, rng, pattern):
    sizes = np.asarray(OUT_OF_CONTRACT_SIZES[pattern], np.int32)
    x = jnp.asarray(rng.standard_normal((K, M)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((M, N)) / np.sqrt(M), jnp.float32)
    out = _jitted(gm.tgmm)(x, dy, jnp.asarray(sizes))
    first = jnp.asarray(first_group_sizes(sizes, M))
    np.testing.assert_allclose(
      out, tgmm_ragged_dot_ref(x, dy, first), **tolerances(jnp.float32)
    )
    if (sizes >= 0).all():  # no overlap: ragged_dot's own groups
      np.testing.assert_allclose(
        out,
        tgmm_ragged_dot_ref(x, dy, jnp.asarray(sizes)),
        **tolerances(jnp.float32),
      )

  def test_concrete_sizes_past_m_are_clipped_like_ragged_dot(self, rng):
    sizes = jnp.asarray(OUT_OF_CONTRACT_SIZES["last_group_past_m"], jnp.int32)
    lhs, rhs = operands(rng, M, K, N, G)
    np.testing.assert_allclose(
      gm.gmm(lhs, rhs, sizes, tiling=TILING),
      ragged_dot_ref(lhs, rhs, sizes),
      **tolerances(jnp.float32),
    )
    x, dy = lhs.T, jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    np.testing.assert_allclose(
      gm.tgmm(x, dy, sizes, tiling=TILING),
      tgmm_ragged_dot_ref(x, dy, sizes),
      **tolerances(jnp.float32),
    )

  def test_gradient_with_traced_negative_sizes(self, rng):
    """d lhs (gmm) and d rhs (tgmm) agree on which rows are whose."""
    sizes = np.asarray(OUT_OF_CONTRACT_SIZES["overlap_past_m"], np.int32)
    lhs, rhs = operands(rng, M, K, N, G)
    cot = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    ours = functools.partial(gm.gmm, tiling=TILING)
    got = jax.jit(jax.grad(loss_fn, argnums=(1, 2)), static_argnums=0)(
      ours, lhs, rhs, jnp.asarray(sizes), cot
    )
    want = jax.grad(loss_fn, argnums=(1, 2))(
      ragged_dot_ref, lhs, rhs, jnp.asarray(first_group_sizes(sizes, M)), cot
    )
    for g, r, name in zip(got, want, ["d lhs", "d rhs"], strict=True):
      np.testing.assert_allclose(g, r, err_msg=name, **tolerances(jnp.float32))
