"""gmm / tgmm on mpmd_map vs jax.lax.ragged_dot.

One test base per kernel behaviour, run on the CPU fallback (the fast path:
the kernel has no cross-program synchronisation); a second class cross-lowers
the same kernels for TPU. Group sizes are generated property-style: every
pattern the kernel's visit list has a special case for (empty groups, one
group owning every row, empty first / last groups, boundaries one row either
side of a tile edge, fewer rows than m) plus seeded random compositions.
Shapes are shared between tests so that one compilation serves many
patterns: group sizes are data, not part of the kernel.
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd.kernels import grouped_matmul as gm
from mpmd.lowering import paths

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


def kernel_path(f, *args) -> paths.Path:
  """Which CPU-fallback path the mpmd_map launch inside ``f`` takes."""
  jaxpr = jax.make_jaxpr(f)(*args)
  found = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is mpmd.mpmd_map_p:
        found.append(eqn)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jaxpr.jaxpr)
  assert found, "no mpmd_map launch in the jaxpr"
  return found[0].params["cpu_path"]


# Shared shapes: K and N ragged against the tile, several K tiles.
M, K, N, G = 64, 96, 80, 6
TILING = (16, 64, 64)


class TestGmmCpuFallback:
  """gmm executed by the CPU fallback (interpret=None on a CPU host)."""

  def test_takes_fast_path(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.full((G,), M // G, jnp.int32)
    path = kernel_path(
      functools.partial(gm.gmm, tiling=TILING), lhs, rhs, sizes
    )
    assert path.kind == paths.FAST, path

  def test_group_size_patterns(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    f = jax.jit(functools.partial(gm.gmm, tiling=TILING))
    for name, sizes in group_size_patterns(rng, M, G, TILING[0]).items():
      out = f(lhs, rhs, jnp.asarray(sizes))
      np.testing.assert_allclose(
        out,
        ragged_dot_ref(lhs, rhs, jnp.asarray(sizes)),
        err_msg=f"pattern {name}: {sizes}",
        **tolerances(jnp.float32),
      )
      # Rows past sum(group_sizes) are exactly zero, not just small.
      assert not np.asarray(out)[sizes.sum() :].any(), name

  @pytest.mark.parametrize(
    "tiling",
    [
      pytest.param((16, 32, 16), id="aligned-tuple"),
      pytest.param((32, 40, 48), id="ragged-K-and-N"),
      pytest.param((64, 512, 512), id="tile-larger-than-dims"),
      pytest.param(lambda m, k, n: (m // 4, k, n // 2), id="callable"),
      pytest.param(None, id="default"),
    ],
  )
  def test_tiling_forms(self, rng, tiling):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["random_0"])
    out = gm.gmm(lhs, rhs, sizes, tiling=tiling)
    np.testing.assert_allclose(
      out, ragged_dot_ref(lhs, rhs, sizes), **tolerances(jnp.float32)
    )

  def test_transpose_rhs(self, rng):
    lhs, rhs_t = operands(rng, M, K, N, G, transpose=True)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["straddle_tiles"])
    out = gm.gmm(lhs, rhs_t, sizes, tiling=TILING, transpose_rhs=True)
    ref = ragged_dot_ref(lhs, rhs_t.swapaxes(1, 2), sizes)
    np.testing.assert_allclose(out, ref, **tolerances(jnp.float32))

  @pytest.mark.parametrize(
    "lhs_dtype, rhs_dtype, out_dtype",
    [
      (jnp.bfloat16, jnp.bfloat16, jnp.float32),
      (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
      (jnp.float32, jnp.bfloat16, jnp.float32),
      (jnp.float16, jnp.float16, jnp.float16),
    ],
  )
  def test_dtypes(self, rng, lhs_dtype, rhs_dtype, out_dtype):
    lhs, _ = operands(rng, M, K, N, G, lhs_dtype)
    _, rhs = operands(rng, M, K, N, G, rhs_dtype)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["random_1"])
    out = gm.gmm(
      lhs, rhs, sizes, preferred_element_type=out_dtype, tiling=TILING
    )
    assert out.dtype == out_dtype
    np.testing.assert_allclose(
      out.astype(jnp.float32),
      ragged_dot_ref(lhs, rhs, sizes),
      **tolerances(out_dtype),
    )

  def test_group_offset_computes_only_local_groups(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["random_2"])
    full = np.asarray(ragged_dot_ref(lhs, rhs, sizes))
    ends = np.cumsum(np.asarray(sizes))
    starts = ends - np.asarray(sizes)
    f = jax.jit(functools.partial(gm.gmm, tiling=TILING))
    local = 2
    for offset in range(0, G, local):
      out = f(lhs, rhs[offset : offset + local], sizes, group_offset=offset)
      rows = np.zeros(M, bool)
      rows[starts[offset] : ends[offset + local - 1]] = True
      want = np.where(rows[:, None], full, 0.0)
      np.testing.assert_allclose(
        out, want, err_msg=f"offset {offset}", **tolerances(jnp.float32)
      )

  def test_existing_out_keeps_rows_of_other_groups(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["random_0"])
    full = np.asarray(ragged_dot_ref(lhs, rhs, sizes))
    existing = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    offset, local = 2, 3
    out = gm.gmm(
      lhs,
      rhs[offset : offset + local],
      sizes,
      tiling=TILING,
      group_offset=jnp.asarray(offset, jnp.int32),
      existing_out=existing,
    )
    ends = np.cumsum(np.asarray(sizes))
    lo, hi = ends[offset] - sizes[offset], ends[offset + local - 1]
    want = np.asarray(existing).copy()
    want[lo:hi] = full[lo:hi]
    np.testing.assert_allclose(out, want, **tolerances(jnp.float32))

  def test_second_call_does_not_recompile(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.full((G,), 4, jnp.int32)
    cfg_tiling = (32, 64, 64)  # a tiling no other test uses
    gm.gmm(lhs, rhs, sizes, tiling=cfg_tiling).block_until_ready()
    sizes = (sizes + 1).block_until_ready()
    with jax.log_compiles(True):
      import logging

      records = []
      handler = logging.Handler()
      handler.emit = records.append
      logger = logging.getLogger("jax")
      logger.addHandler(handler)
      try:
        gm.gmm(lhs, rhs, sizes, tiling=cfg_tiling).block_until_ready()
      finally:
        logger.removeHandler(handler)
    compiles = [r for r in records if "Compiling" in r.getMessage()]
    assert not compiles, [r.getMessage() for r in compiles]


def _loss_fn(f, lhs, rhs, sizes, cotangent):
  return jnp.sum(f(lhs, rhs, sizes) * cotangent)


class TestGmmGradients:
  @pytest.mark.parametrize("transpose_rhs", [False, True])
  def test_grad_matches_ragged_dot(self, rng, transpose_rhs):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["first_empty"])
    cot = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    w = rhs.swapaxes(1, 2) if transpose_rhs else rhs
    ours = functools.partial(gm.gmm, tiling=TILING, transpose_rhs=transpose_rhs)

    def ref(lhs, w, sizes):
      rhs = w.swapaxes(1, 2) if transpose_rhs else w
      return ragged_dot_ref(lhs, rhs, sizes)

    got = jax.grad(_loss_fn, argnums=(1, 2))(ours, lhs, w, sizes, cot)
    want = jax.grad(_loss_fn, argnums=(1, 2))(ref, lhs, w, sizes, cot)
    for g, r, name in zip(got, want, ["d lhs", "d rhs"], strict=True):
      assert g.shape == r.shape, name
      np.testing.assert_allclose(g, r, err_msg=name, **tolerances(jnp.float32))

  def test_grad_of_existing_out_and_sharded_rhs(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["random_1"])
    existing = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    offset, local = 1, 3

    def ours(lhs, rhs_local, existing):
      out = gm.gmm(
        lhs,
        rhs_local,
        sizes,
        tiling=TILING,
        group_offset=offset,
        existing_out=existing,
      )
      return jnp.sum(out * cot)

    def ref(lhs, rhs_local, existing):
      full = jnp.zeros((G, K, N), jnp.float32)
      full = full.at[offset : offset + local].set(rhs_local)
      ends = jnp.cumsum(sizes)
      rows = lax.broadcasted_iota(jnp.int32, (M, 1), 0)
      local_rows = (rows >= ends[offset] - sizes[offset]) & (
        rows < ends[offset + local - 1]
      )
      out = jnp.where(local_rows, ragged_dot_ref(lhs, full, sizes), existing)
      return jnp.sum(out * cot)

    args = (lhs, rhs[offset : offset + local], existing)
    got = jax.grad(ours, argnums=(0, 1, 2))(*args)
    want = jax.grad(ref, argnums=(0, 1, 2))(*args)
    for g, r, name in zip(got, want, ["lhs", "rhs", "existing"], strict=True):
      np.testing.assert_allclose(g, r, err_msg=name, **tolerances(jnp.float32))


class TestTgmmCpuFallback:
  def test_takes_fast_path(self, rng):
    lhs, rhs = operands(rng, M, K, N, 1)
    sizes = jnp.full((G,), M // G, jnp.int32)
    path = kernel_path(
      functools.partial(gm.tgmm, tiling=TILING), lhs.T, rhs[0][:M], sizes
    )
    assert path.kind == paths.FAST, path

  def test_group_size_patterns(self, rng):
    # tgmm(lhs (k, m), rhs (m, n)): K and N are output dims, both ragged.
    x = jnp.asarray(rng.standard_normal((K, M)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((M, N)) / np.sqrt(M), jnp.float32)
    f = jax.jit(functools.partial(gm.tgmm, tiling=TILING))
    for name, sizes in group_size_patterns(rng, M, G, TILING[0]).items():
      out = f(x, dy, jnp.asarray(sizes))
      assert out.shape == (G, K, N)
      np.testing.assert_allclose(
        out,
        tgmm_ref(x, dy, sizes),
        err_msg=f"pattern {name}: {sizes}",
        **tolerances(jnp.float32),
      )
      # Empty groups are exactly zero.
      assert not np.asarray(out)[sizes == 0].any(), name

  @pytest.mark.parametrize(
    "tiling",
    [
      pytest.param((16, 32, 16), id="aligned"),
      pytest.param(lambda m, k, n: (m, k // 2, n), id="callable"),
      pytest.param(None, id="default"),
    ],
  )
  def test_tiling_forms(self, rng, tiling):
    x = jnp.asarray(rng.standard_normal((K, M)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((M, N)) / np.sqrt(M), jnp.float32)
    sizes = group_size_patterns(rng, M, G, 16)["random_0"]
    out = gm.tgmm(x, dy, jnp.asarray(sizes), tiling=tiling)
    np.testing.assert_allclose(
      out, tgmm_ref(x, dy, sizes), **tolerances(jnp.float32)
    )

  def test_offset_num_actual_groups_existing_out(self, rng):
    x = jnp.asarray(rng.standard_normal((K, M)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((M, N)) / np.sqrt(M), jnp.bfloat16)
    sizes = group_size_patterns(rng, M, G, 16)["straddle_tiles"]
    offset, local = 3, 2
    existing = jnp.asarray(rng.standard_normal((local, K, N)), jnp.float32)
    out = gm.tgmm(
      x,
      dy,
      jnp.asarray(sizes),
      tiling=TILING,
      group_offset=offset,
      num_actual_groups=local,
      existing_out=existing,
    )
    want = tgmm_ref(x.astype(jnp.float32), dy.astype(jnp.float32), sizes)
    want = want[offset : offset + local] + np.asarray(existing)
    np.testing.assert_allclose(out, want, **tolerances(jnp.float32))


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
  """Concrete sizes are checked; traced ones mean what ragged_dot means."""

  def setup_method(self):
    self.lhs = jnp.zeros((M, K), jnp.float32)
    self.rhs = jnp.zeros((G, K, N), jnp.float32)

  @pytest.mark.parametrize("as_array", [np.asarray, jnp.asarray])
  def test_concrete_negative_sizes_are_rejected(self, as_array):
    sizes = as_array(np.asarray([8, 8, -3, 8, 8, 8], np.int32))
    with pytest.raises(
      ValueError,
      match=r"gmm: expected non-negative 'group_sizes', got "
      r"group_sizes\[2\] = -3",
    ):
      gm.gmm(self.lhs, self.rhs, sizes, tiling=TILING)
    with pytest.raises(
      ValueError, match=r"tgmm: expected non-negative 'group_sizes'"
    ):
      gm.tgmm(self.lhs.T, self.lhs, sizes, tiling=TILING)

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
    got = jax.jit(jax.grad(_loss_fn, argnums=(1, 2)), static_argnums=0)(
      ours, lhs, rhs, jnp.asarray(sizes), cot
    )
    want = jax.grad(_loss_fn, argnums=(1, 2))(
      ragged_dot_ref, lhs, rhs, jnp.asarray(first_group_sizes(sizes, M)), cot
    )
    for g, r, name in zip(got, want, ["d lhs", "d rhs"], strict=True):
      np.testing.assert_allclose(g, r, err_msg=name, **tolerances(jnp.float32))


class TestExpertSharding:
  """Experts sharded over simulated CPU devices, group_offset per device."""

  @pytest.mark.slow
  def test_shard_map_forward_and_grad(self, rng):
    num_devices = 4
    groups = 8
    local = groups // num_devices
    mesh = jax.make_mesh((num_devices,), ("x",))
    spec = jax.sharding.PartitionSpec
    lhs, rhs = operands(rng, M, K, N, groups)
    rhs_sharded = jax.device_put(rhs, jax.NamedSharding(mesh, spec("x")))
    sizes = jnp.asarray(group_size_patterns(rng, M, groups, 16)["random_0"])
    cot = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)

    @functools.partial(
      jax.shard_map,
      mesh=mesh,
      in_specs=(spec(), spec("x"), spec()),
      out_specs=spec(),
    )
    def sharded(lhs, rhs_local, sizes):
      offset = lax.axis_index("x").astype(jnp.int32) * local
      out = gm.gmm(lhs, rhs_local, sizes, tiling=TILING, group_offset=offset)
      return lax.psum(out, "x")

    np.testing.assert_allclose(
      jax.jit(sharded)(lhs, rhs_sharded, sizes),
      ragged_dot_ref(lhs, rhs, sizes),
      **tolerances(jnp.float32),
    )
    got = jax.jit(jax.grad(_loss_fn, argnums=(1, 2)), static_argnums=0)(
      sharded, lhs, rhs_sharded, sizes, cot
    )
    want = jax.grad(_loss_fn, argnums=(1, 2))(
      ragged_dot_ref, lhs, rhs, sizes, cot
    )
    for g, r, name in zip(got, want, ["d lhs", "d rhs"], strict=True):
      np.testing.assert_allclose(g, r, err_msg=name, **tolerances(jnp.float32))

  def test_shard_map_tgmm(self, rng):
    num_devices = 2
    local = G // num_devices
    mesh = jax.make_mesh((num_devices,), ("x",))
    spec = jax.sharding.PartitionSpec
    x = jnp.asarray(rng.standard_normal((K, M)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((M, N)) / np.sqrt(M), jnp.float32)
    sizes = group_size_patterns(rng, M, G, 16)["random_1"]

    @functools.partial(
      jax.shard_map,
      mesh=mesh,
      in_specs=(spec(), spec(), spec()),
      out_specs=spec("x"),
    )
    def sharded(x, dy, sizes):
      offset = lax.axis_index("x").astype(jnp.int32) * local
      return gm.tgmm(
        x,
        dy,
        sizes,
        tiling=TILING,
        group_offset=offset,
        num_actual_groups=local,
      )

    np.testing.assert_allclose(
      jax.jit(sharded)(x, dy, jnp.asarray(sizes)),
      tgmm_ref(x, dy, sizes),
      **tolerances(jnp.float32),
    )


class TestSimulatorAgrees:
  """The faithful TPU simulator gives the fast path's answer (ragged K/N)."""

  @pytest.mark.slow
  def test_gmm_and_tgmm_in_tpu_simulator(self, rng):
    m, k, n, g = 32, 40, 24, 3
    lhs, rhs = operands(rng, m, k, n, g)
    sizes = jnp.asarray([9, 0, 17], jnp.int32)
    params = pltpu.InterpretParams()
    out = gm.gmm(lhs, rhs, sizes, tiling=(8, 32, 16), interpret=params)
    np.testing.assert_allclose(
      out, ragged_dot_ref(lhs, rhs, sizes), **tolerances(jnp.float32)
    )
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    out = gm.tgmm(lhs.T, dy, sizes, tiling=(8, 32, 16), interpret=params)
    np.testing.assert_allclose(
      out, tgmm_ref(lhs.T, dy, sizes), **tolerances(jnp.float32)
    )


class TestTpuCrossLowering:
  """Lowered for TPU on this CPU host: Mosaic custom calls in the module."""

  def lower(self, f, *args):
    with mpmd.tpu_target("v5e"):
      text = (
        jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
      )
    return text

  def shapes(self, dtype=jnp.bfloat16):
    s = jax.ShapeDtypeStruct
    return (
      s((512, 384), dtype),
      s((8, 384, 256), dtype),
      s((8,), jnp.int32),
    )

  @pytest.mark.parametrize("transpose_rhs", [False, True])
  def test_gmm(self, transpose_rhs):
    lhs, rhs, sizes = self.shapes()
    if transpose_rhs:
      rhs = jax.ShapeDtypeStruct((8, 256, 384), rhs.dtype)
    text = self.lower(
      functools.partial(gm.gmm, transpose_rhs=transpose_rhs), lhs, rhs, sizes
    )
    assert text.count("tpu_custom_call") == 1

  def test_tgmm_ragged(self):
    s = jax.ShapeDtypeStruct
    args = (s((200, 512), jnp.float32), s((512, 300), jnp.float32))
    text = self.lower(gm.tgmm, *args, s((8,), jnp.int32))
    # One launch, however many strips the ragged K and N need.
    assert text.count("tpu_custom_call") == 1

  def test_gradient_lowers_gmm_and_tgmm(self):
    lhs, rhs, sizes = self.shapes(jnp.float32)

    def loss(lhs, rhs, sizes):
      return jnp.sum(gm.gmm(lhs, rhs, sizes))

    text = self.lower(jax.grad(loss, argnums=(0, 1)), lhs, rhs, sizes)
    # d lhs (a gmm) and d rhs (a tgmm); the unused primal is dropped.
    assert text.count("tpu_custom_call") == 2

  def test_default_tiling_is_the_tpu_one_under_tpu_target(self):
    with mpmd.tpu_target("v5e"):
      assert gm.default_tiling(1024, 512, 512) == (128, 128, 128)
    assert gm.default_tiling(1024, 512, 512, num_groups=8) == (64, 512, 512)

  @pytest.mark.parametrize("name", ["gmm", "tgmm"])
  def test_registered_demos(self, name):
    from mpmd import demos

    demo = demos.registered()[name]()
    assert "tpu" in demo.platforms and "cpu" in demo.platforms
    assert "tpu_custom_call" in self.lower(demo.fn, *demo.args)


class TestErrors:
  """Bad arguments fail before tracing the kernel, naming the argument."""

  def setup_method(self):
    self.lhs = jnp.zeros((64, 32), jnp.float32)
    self.rhs = jnp.zeros((4, 32, 16), jnp.float32)
    self.sizes = jnp.full((4,), 16, jnp.int32)

  def test_gmm_lhs_rank(self):
    with pytest.raises(ValueError, match=r"gmm: expected 'lhs' of rank 2"):
      gm.gmm(self.lhs[None], self.rhs, self.sizes)

  def test_gmm_rhs_rank(self):
    with pytest.raises(ValueError, match=r"gmm: expected 'rhs' of rank 3"):
      gm.gmm(self.lhs, self.rhs[0], self.sizes)

  def test_group_sizes_dtype(self):
    with pytest.raises(
      TypeError,
      match=r"gmm: expected 'group_sizes' of dtype int32, got float32",
    ):
      gm.gmm(self.lhs, self.rhs, self.sizes.astype(jnp.float32))
    with pytest.raises(
      TypeError, match=r"tgmm: expected 'group_sizes' of dtype int32"
    ):
      gm.tgmm(self.lhs.T, self.lhs, self.sizes.astype(jnp.int16))

  def test_group_sizes_rank(self):
    with pytest.raises(ValueError, match=r"'group_sizes' of rank 1"):
      gm.gmm(self.lhs, self.rhs, self.sizes[None])

  def test_mismatched_k(self):
    with pytest.raises(
      ValueError, match=r"gmm: expected 'rhs' .* with k=32.*got shape"
    ):
      gm.gmm(self.lhs, jnp.zeros((4, 16, 32), jnp.float32), self.sizes)
    with pytest.raises(ValueError, match=r"tgmm: expected 'rhs' \(m, n\)"):
      gm.tgmm(self.lhs.T, self.lhs[:32], self.sizes)

  def test_transposed_rhs_hint(self):
    with pytest.raises(ValueError, match=r"transpose_rhs=True"):
      gm.gmm(self.lhs, jnp.zeros((4, 16, 32), jnp.float32), self.sizes)

  def test_tiling_does_not_fit(self):
    with pytest.raises(
      ValueError, match=r"gmm: expected the row tile tm=24 .* divide m=64"
    ):
      gm.gmm(self.lhs, self.rhs, self.sizes, tiling=(24, 32, 16))
    with pytest.raises(ValueError, match=r"positive 'tiling'"):
      gm.gmm(self.lhs, self.rhs, self.sizes, tiling=(0, 32, 16))
    with pytest.raises(TypeError, match=r"'tiling' to be a tuple"):
      gm.gmm(self.lhs, self.rhs, self.sizes, tiling=(16, 32))
    with pytest.raises(ValueError, match=r"'tiling' function returned None"):
      gm.tgmm(self.lhs.T, self.lhs, self.sizes, tiling=lambda m, k, n: None)

  def test_dtypes(self):
    with pytest.raises(TypeError, match=r"gmm: expected 'lhs' of dtype"):
      gm.gmm(self.lhs.astype(jnp.int32), self.rhs, self.sizes)
    with pytest.raises(
      TypeError, match=r"expected 'preferred_element_type' float32"
    ):
      gm.gmm(self.lhs, self.rhs, self.sizes, preferred_element_type=jnp.int8)

  def test_too_many_rhs_groups(self):
    with pytest.raises(ValueError, match=r"at most num_groups=2"):
      gm.gmm(self.lhs, self.rhs, self.sizes[:2])

  def test_existing_out(self):
    with pytest.raises(ValueError, match=r"'existing_out' of shape \(64, 16\)"):
      gm.gmm(self.lhs, self.rhs, self.sizes, existing_out=self.lhs)
    with pytest.raises(TypeError, match=r"'existing_out' of dtype float32"):
      gm.gmm(
        self.lhs,
        self.rhs,
        self.sizes,
        existing_out=jnp.zeros((64, 16), jnp.bfloat16),
      )

  def test_group_offset(self):
    with pytest.raises(TypeError, match=r"'group_offset' of dtype int32"):
      gm.gmm(self.lhs, self.rhs, self.sizes, group_offset=jnp.float32(1))
    with pytest.raises(ValueError, match=r"'group_offset' of shape \(\)"):
      gm.gmm(self.lhs, self.rhs, self.sizes, group_offset=self.sizes)
    # A concrete offset past the groups would be clamped by dynamic_slice.
    local = self.rhs[:2]
    for bad in (3, -1, jnp.int32(3)):
      with pytest.raises(
        ValueError,
        match=r"'group_offset' in \[0, 2\] "
        r"\(num_groups=4 minus the 2 local groups\)",
      ):
        gm.gmm(self.lhs, local, self.sizes, group_offset=bad)
    with pytest.raises(ValueError, match=r"'group_offset' in \[0, 2\]"):
      gm.tgmm(
        self.lhs.T, self.lhs, self.sizes, group_offset=3, num_actual_groups=2
      )

  def test_tpu_row_tile_is_whole_sublanes(self):
    with mpmd.tpu_target("v5e"):
      with pytest.raises(
        ValueError,
        match=r"row tile tm=4 of 'tiling' to be "
        r"a multiple of 8 \(TPU sublanes\) or all m=64",
      ):
        gm.gmm(self.lhs, self.rhs, self.sizes, tiling=(4, 16, 16))
    gm.gmm(self.lhs, self.rhs, self.sizes, tiling=(4, 16, 16))  # CPU: fine

  def test_num_actual_groups(self):
    with pytest.raises(
      ValueError, match=r"'num_actual_groups' in \[1, 4\].*got 5"
    ):
      gm.tgmm(self.lhs.T, self.lhs, self.sizes, num_actual_groups=5)
