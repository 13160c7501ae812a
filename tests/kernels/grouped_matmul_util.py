"""Shared by the grouped matmul tests: references, operands, group-size
patterns and tolerances (imported by module name: pytest puts this directory
on sys.path)."""

import jax.numpy as jnp
import numpy as np
from jax import lax

HIGHEST = lax.Precision.HIGHEST


def tolerances(dtype) -> dict[str, float]:
  """assert_allclose tolerances for outputs of ``dtype``.

  Operands are drawn so that outputs are O(1) (rhs scaled by 1/sqrt(k)), and
  the reference sees exactly the kernel's (possibly bfloat16) inputs, upcast
  to f32, so input rounding is common to both sides. What differs:
  * float32: the kernel sums partial products per tile, the HIGHEST
    reference in one dot; reordering a sum of k <= 512 O(1/sqrt(k)) terms in
    f32 moves it by about sqrt(k) * eps(f32) ~ 3e-6; 2e-5 leaves margin.
  * bfloat16: the f32 accumulator is rounded once to bfloat16 on store:
    half an ulp is 2**-9 relative (~2e-3); 8e-3 allows one ulp either way on
    both rtol and atol (outputs near zero).
  * float16: as bfloat16 with a 10-bit mantissa: 2**-11 relative; 2e-3.
  """
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return dict(rtol=2e-5, atol=2e-5)
  if dtype == jnp.bfloat16:
    return dict(rtol=8e-3, atol=8e-3)
  if dtype == jnp.float16:
    return dict(rtol=2e-3, atol=2e-3)
  raise ValueError(f"tolerances: no tolerance for {dtype}")


def ragged_dot_ref(lhs, rhs, group_sizes):
  """f32, HIGHEST-precision reference: rows past sum(group_sizes) are 0."""
  return lax.ragged_dot(
    lhs.astype(jnp.float32),
    rhs.astype(jnp.float32),
    group_sizes,
    precision=HIGHEST,
    preferred_element_type=jnp.float32,
  )


def tgmm_ref(lhs, rhs, group_sizes, group_offset=0, num_groups=None):
  """Per-group lhs[:, rows] @ rhs[rows] in f64 numpy (exact for f32 data)."""
  lhs = np.asarray(lhs, np.float64)
  rhs = np.asarray(rhs, np.float64)
  sizes = np.asarray(group_sizes)
  ends = np.cumsum(sizes)
  starts = ends - sizes
  num_groups = len(sizes) if num_groups is None else num_groups
  return np.stack(
    [
      lhs[:, starts[g] : ends[g]] @ rhs[starts[g] : ends[g]]
      for g in range(group_offset, group_offset + num_groups)
    ]
  )


def operands(rng, m, k, n, num_groups, dtype=jnp.float32, transpose=False):
  lhs = rng.standard_normal((m, k))
  rhs = rng.standard_normal((num_groups, k, n)) / np.sqrt(k)
  if transpose:
    rhs = rhs.swapaxes(1, 2)
  return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)


def group_size_patterns(rng, m, num_groups, tm, num_random=3):
  """Named int32 group sizes covering the visit list's special cases."""
  g = num_groups

  def sizes(xs):
    xs = np.asarray(xs, np.int64)
    assert xs.shape == (g,) and xs.min() >= 0 and xs.sum() <= m, xs
    return np.asarray(xs, np.int32)

  def split(total, parts):
    cuts = np.sort(rng.integers(0, total + 1, parts - 1))
    return np.diff(np.concatenate([[0], cuts, [total]]))

  one = np.zeros(g, np.int64)
  one[rng.integers(g)] = m
  first_empty = np.concatenate([[0], split(m, g - 1)])
  last_empty = np.concatenate([split(m, g - 1), [0]])
  # Boundaries one row either side of tile edges: every group straddles.
  straddle = np.full(g, 0, np.int64)
  edges = np.minimum(np.arange(1, g) * tm + np.tile([1, -1], g)[: g - 1], m)
  straddle[:-1] = np.diff(np.concatenate([[0], np.maximum.accumulate(edges)]))
  straddle[-1] = m - straddle[:-1].sum()
  alternating = np.zeros(g, np.int64)
  alternating[1::2] = split(m, len(alternating[1::2]))
  patterns = {
    "all_zero": np.zeros(g),
    "one_group_all_rows": one,
    "first_empty": first_empty,
    "last_empty": last_empty,
    "straddle_tiles": straddle,
    "empty_every_other": alternating,
    "sum_less_than_m": split(m - tm - 3, g),
    "only_last_rows": np.concatenate([np.zeros(g - 1), [3]]),
  }
  for i in range(num_random):
    patterns[f"random_{i}"] = split(int(rng.integers(1, m + 1)), g)
  return {name: sizes(p) for name, p in patterns.items()}


def loss_fn(f, lhs, rhs, sizes, cotangent):
  return jnp.sum(f(lhs, rhs, sizes) * cotangent)


# Shared shapes: K and N ragged against the tile, several K tiles.
M, K, N, G = 64, 96, 80, 6
TILING = (16, 64, 64)
