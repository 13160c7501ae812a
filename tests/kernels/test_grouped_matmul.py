"""gmm / tgmm on mpmd_map vs jax.lax.ragged_dot.

``GroupedMatmulTest`` is the test base: the correctness cases of gmm, tgmm
and their gradients (the custom VJP runs both kernels), built on
``KernelRunner``, which binds the kernels to one implementation and one
execution path through its ``implementation`` and ``interpret``. One
subclass per implementation, each running every case on the CPU fallback
(interpret=None; the fast path, as the kernels have no cross-program
synchronisation):

* ``TestTiled``: ``implementation="tiled"`` (what a TPU runs), at CPU-sized
  tiles; also its tiling forms, the path choice, and that a second call
  does not recompile;
* ``TestWindows``: ``implementation="windows"`` (the CPU fallback's
  default); also its chunks and tail windows.

Other execution paths:

* ``TestTpuSimulator`` runs small ragged cases in the TPU simulator
  (``pltpu.InterpretParams``), slow;
* ``TestTpuCrossLowering`` lowers the kernels for TPU from this CPU host.

Group sizes are generated property-style (``grouped_matmul_util``): every
pattern the kernel's visit list has a special case for plus seeded random
compositions. Shapes are shared between tests so that one compilation serves
many patterns: group sizes are data, not part of the kernel. Sizes outside
the documented contract are in ``test_grouped_matmul_group_sizes.py``, bad
arguments in ``test_grouped_matmul_errors.py``.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grouped_matmul_util import (
  TILING,
  G,
  K,
  M,
  N,
  group_size_patterns,
  loss_fn,
  operands,
  ragged_dot_ref,
  tgmm_ref,
  tolerances,
)
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from launches import eqns, kernel_path, launch_eqns

import mpmd
from mpmd import _jax
from mpmd._lowering import paths
from mpmd.kernels import grouped_matmul as gm
from mpmd.kernels.grouped_matmul import _windows as windows


class KernelRunner:
  """gmm and tgmm, partially applied with this class's ``interpret`` and
  ``implementation`` (None: the default)."""

  interpret = None
  implementation = None

  def gmm(self, **kwargs):
    kwargs = {"implementation": self.implementation, **kwargs}
    return functools.partial(gm.gmm, interpret=self.interpret, **kwargs)

  def tgmm(self, **kwargs):
    kwargs = {"implementation": self.implementation, **kwargs}
    return functools.partial(gm.tgmm, interpret=self.interpret, **kwargs)


class GroupedMatmulTest(KernelRunner):
  """The correctness cases; subclasses pick the implementation and its
  ``tiling`` (None for ``"windows"``, which runs no tiles)."""

  tiling = TILING

  # -- gmm ------------------------------------------------------------------

  def test_gmm_group_size_patterns(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    f = jax.jit(self.gmm(tiling=self.tiling))
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

  def test_gmm_transpose_rhs(self, rng):
    lhs, rhs_t = operands(rng, M, K, N, G, transpose=True)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["straddle_tiles"])
    out = self.gmm(tiling=self.tiling, transpose_rhs=True)(lhs, rhs_t, sizes)
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
  def test_gmm_dtypes(self, rng, lhs_dtype, rhs_dtype, out_dtype):
    lhs, _ = operands(rng, M, K, N, G, lhs_dtype)
    _, rhs = operands(rng, M, K, N, G, rhs_dtype)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["random_1"])
    out = self.gmm(preferred_element_type=out_dtype, tiling=self.tiling)(
      lhs, rhs, sizes
    )
    assert out.dtype == out_dtype
    np.testing.assert_allclose(
      out.astype(jnp.float32),
      ragged_dot_ref(lhs, rhs, sizes),
      **tolerances(out_dtype),
    )

  def test_gmm_group_offset_computes_only_local_groups(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["random_2"])
    full = np.asarray(ragged_dot_ref(lhs, rhs, sizes))
    ends = np.cumsum(np.asarray(sizes))
    starts = ends - np.asarray(sizes)
    f = jax.jit(self.gmm(tiling=self.tiling))
    local = 2
    for offset in range(0, G, local):
      out = f(lhs, rhs[offset : offset + local], sizes, group_offset=offset)
      rows = np.zeros(M, bool)
      rows[starts[offset] : ends[offset + local - 1]] = True
      want = np.where(rows[:, None], full, 0.0)
      np.testing.assert_allclose(
        out, want, err_msg=f"offset {offset}", **tolerances(jnp.float32)
      )

  def test_gmm_existing_out_keeps_rows_of_other_groups(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["random_0"])
    full = np.asarray(ragged_dot_ref(lhs, rhs, sizes))
    existing = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    offset, local = 2, 3
    out = self.gmm(
      tiling=self.tiling,
      group_offset=jnp.asarray(offset, jnp.int32),
      existing_out=existing,
    )(lhs, rhs[offset : offset + local], sizes)
    ends = np.cumsum(np.asarray(sizes))
    lo, hi = ends[offset] - sizes[offset], ends[offset + local - 1]
    want = np.asarray(existing).copy()
    want[lo:hi] = full[lo:hi]
    np.testing.assert_allclose(out, want, **tolerances(jnp.float32))

  # -- gradients (the VJP runs gmm for d lhs and tgmm for d rhs) -------------

  @pytest.mark.parametrize("transpose_rhs", [False, True])
  def test_grad_matches_ragged_dot(self, rng, transpose_rhs):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["first_empty"])
    cot = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    w = rhs.swapaxes(1, 2) if transpose_rhs else rhs
    ours = self.gmm(tiling=self.tiling, transpose_rhs=transpose_rhs)

    def ref(lhs, w, sizes):
      rhs = w.swapaxes(1, 2) if transpose_rhs else w
      return ragged_dot_ref(lhs, rhs, sizes)

    got = jax.grad(loss_fn, argnums=(1, 2))(ours, lhs, w, sizes, cot)
    want = jax.grad(loss_fn, argnums=(1, 2))(ref, lhs, w, sizes, cot)
    for g, r, name in zip(got, want, ["d lhs", "d rhs"], strict=True):
      assert g.shape == r.shape, name
      np.testing.assert_allclose(g, r, err_msg=name, **tolerances(jnp.float32))

  def test_grad_of_existing_out_and_sharded_rhs(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["random_1"])
    existing = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    offset, local = 1, 3
    gmm = self.gmm(tiling=self.tiling, group_offset=offset)

    def ours(lhs, rhs_local, existing):
      out = gmm(lhs, rhs_local, sizes, existing_out=existing)
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

  # -- tgmm -----------------------------------------------------------------

  def test_tgmm_group_size_patterns(self, rng):
    # tgmm(lhs (k, m), rhs (m, n)): K and N are output dims, both ragged.
    x = jnp.asarray(rng.standard_normal((K, M)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((M, N)) / np.sqrt(M), jnp.float32)
    f = jax.jit(self.tgmm(tiling=self.tiling))
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

  def test_tgmm_offset_num_actual_groups_existing_out(self, rng):
    x = jnp.asarray(rng.standard_normal((K, M)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((M, N)) / np.sqrt(M), jnp.bfloat16)
    sizes = group_size_patterns(rng, M, G, 16)["straddle_tiles"]
    offset, local = 3, 2
    existing = jnp.asarray(rng.standard_normal((local, K, N)), jnp.float32)
    out = self.tgmm(
      tiling=self.tiling,
      group_offset=offset,
      num_actual_groups=local,
      existing_out=existing,
    )(x, dy, jnp.asarray(sizes))
    want = tgmm_ref(x.astype(jnp.float32), dy.astype(jnp.float32), sizes)
    want = want[offset : offset + local] + np.asarray(existing)
    np.testing.assert_allclose(out, want, **tolerances(jnp.float32))

  # -- experts sharded over simulated CPU devices, group_offset per device --

  @pytest.mark.slow
  def test_expert_sharding_gmm_forward_and_grad(self, rng):
    num_devices = 4
    groups = 8
    local = groups // num_devices
    mesh = jax.make_mesh((num_devices,), ("x",))
    spec = jax.sharding.PartitionSpec
    lhs, rhs = operands(rng, M, K, N, groups)
    rhs_sharded = jax.device_put(rhs, jax.NamedSharding(mesh, spec("x")))
    sizes = jnp.asarray(group_size_patterns(rng, M, groups, 16)["random_0"])
    cot = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    gmm = self.gmm(tiling=self.tiling)

    @functools.partial(
      jax.shard_map,
      mesh=mesh,
      in_specs=(spec(), spec("x"), spec()),
      out_specs=spec(),
    )
    def sharded(lhs, rhs_local, sizes):
      offset = lax.axis_index("x").astype(jnp.int32) * local
      out = gmm(lhs, rhs_local, sizes, group_offset=offset)
      return lax.psum(out, "x")

    np.testing.assert_allclose(
      jax.jit(sharded)(lhs, rhs_sharded, sizes),
      ragged_dot_ref(lhs, rhs, sizes),
      **tolerances(jnp.float32),
    )
    got = jax.jit(jax.grad(loss_fn, argnums=(1, 2)), static_argnums=0)(
      sharded, lhs, rhs_sharded, sizes, cot
    )
    want = jax.grad(loss_fn, argnums=(1, 2))(
      ragged_dot_ref, lhs, rhs, sizes, cot
    )
    for g, r, name in zip(got, want, ["d lhs", "d rhs"], strict=True):
      np.testing.assert_allclose(g, r, err_msg=name, **tolerances(jnp.float32))

  def test_expert_sharding_tgmm(self, rng):
    num_devices = 2
    local = G // num_devices
    mesh = jax.make_mesh((num_devices,), ("x",))
    spec = jax.sharding.PartitionSpec
    x = jnp.asarray(rng.standard_normal((K, M)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((M, N)) / np.sqrt(M), jnp.float32)
    sizes = group_size_patterns(rng, M, G, 16)["random_1"]
    tgmm = self.tgmm(tiling=self.tiling, num_actual_groups=local)

    @functools.partial(
      jax.shard_map,
      mesh=mesh,
      in_specs=(spec(), spec(), spec()),
      out_specs=spec("x"),
    )
    def sharded(x, dy, sizes):
      offset = lax.axis_index("x").astype(jnp.int32) * local
      return tgmm(x, dy, sizes, group_offset=offset)

    np.testing.assert_allclose(
      jax.jit(sharded)(x, dy, jnp.asarray(sizes)),
      tgmm_ref(x, dy, sizes),
      **tolerances(jnp.float32),
    )


class TestTiled(GroupedMatmulTest):
  """Every case with ``implementation="tiled"`` (what a TPU runs) at
  CPU-sized tiles, on the CPU fallback (interpret=None on a CPU host)."""

  implementation = "tiled"

  @pytest.mark.parametrize(
    "tiling",
    [
      pytest.param((16, 32, 16), id="aligned-tuple"),
      pytest.param((32, 40, 48), id="ragged-K-and-N"),
      pytest.param((64, 512, 512), id="tile-larger-than-dims"),
      pytest.param(lambda m, k, n: (m // 4, k, n // 2), id="callable"),
      pytest.param(None, id="default-the-tpus"),
    ],
  )
  def test_gmm_tiling_forms(self, rng, tiling):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["random_0"])
    out = self.gmm(tiling=tiling)(lhs, rhs, sizes)
    np.testing.assert_allclose(
      out, ragged_dot_ref(lhs, rhs, sizes), **tolerances(jnp.float32)
    )

  @pytest.mark.parametrize(
    "tiling",
    [
      pytest.param((16, 32, 16), id="aligned"),
      pytest.param(lambda m, k, n: (m, k // 2, n), id="callable"),
      pytest.param(None, id="default-the-tpus"),
    ],
  )
  def test_tgmm_tiling_forms(self, rng, tiling):
    x = jnp.asarray(rng.standard_normal((K, M)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((M, N)) / np.sqrt(M), jnp.float32)
    sizes = group_size_patterns(rng, M, G, 16)["random_0"]
    out = self.tgmm(tiling=tiling)(x, dy, jnp.asarray(sizes))
    np.testing.assert_allclose(
      out, tgmm_ref(x, dy, sizes), **tolerances(jnp.float32)
    )

  def test_gmm_takes_fast_path(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.full((G,), M // G, jnp.int32)
    path = kernel_path(self.gmm(tiling=TILING), lhs, rhs, sizes)
    assert path.kind == paths.FAST, path

  def test_tgmm_takes_fast_path(self, rng):
    lhs, rhs = operands(rng, M, K, N, 1)
    sizes = jnp.full((G,), M // G, jnp.int32)
    path = kernel_path(self.tgmm(tiling=TILING), lhs.T, rhs[0][:M], sizes)
    assert path.kind == paths.FAST, path

  def test_second_call_does_not_recompile(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.full((G,), 4, jnp.int32)
    gmm = self.gmm(tiling=(32, 64, 64))  # a tiling no other test uses
    gmm(lhs, rhs, sizes).block_until_ready()
    sizes = (sizes + 1).block_until_ready()
    with jax.log_compiles(True):
      records = []
      handler = logging.Handler()
      handler.emit = records.append
      logger = logging.getLogger("jax")
      logger.addHandler(handler)
      try:
        gmm(lhs, rhs, sizes).block_until_ready()
      finally:
        logger.removeHandler(handler)
    compiles = [r for r in records if "Compiling" in r.getMessage()]
    assert not compiles, [r.getMessage() for r in compiles]


class TestWindows(GroupedMatmulTest):
  """Every case with ``implementation="windows"`` (the CPU fallback's
  default): per group, whole chunks of its rows, then one tail window
  (``grouped_matmul.windows``)."""

  implementation = "windows"
  tiling = None

  def test_chunks_then_a_tail_window(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.full((G,), M // G, jnp.int32)
    # One branch per tail size, and one for no tail.
    branches = len(windows.schedule(M).tails) + 1
    for f, args in [
      (self.gmm(), (lhs, rhs, sizes)),
      (self.tgmm(), (lhs.T, rhs[0][:M], sizes)),
    ]:
      (launch,) = launch_eqns(f, *args)
      assert launch.params["cpu_path"].kind == paths.FAST
      kernel = list(eqns(launch.params["jaxprs"][0]))
      # A loop over the groups, holding a loop over whole chunks, and a
      # switch over the tail sizes: one switch, or a pl.when per size where
      # XLA copies what a switch updates.
      loops = [e for e in kernel if e.primitive in (lax.while_p, lax.scan_p)]
      assert len(loops) == 2, [e.primitive for e in kernel]
      conds = [
        len(e.params["branches"]) for e in kernel if e.primitive is lax.cond_p
      ]
      if _jax.SWITCH_COPIES_UPDATED_BUFFERS:
        assert conds.count(2) >= branches, conds
      else:
        assert [c for c in conds if c > 2] == [branches], conds

  @pytest.mark.parametrize("kernel", ["gmm", "tgmm"])
  def test_both_forms_of_the_tail_switch(self, rng, monkeypatch, kernel):
    # The other jax versions' form of the tail switch (see _switch).
    monkeypatch.setattr(
      _jax,
      "SWITCH_COPIES_UPDATED_BUFFERS",
      not _jax.SWITCH_COPIES_UPDATED_BUFFERS,
    )
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.asarray(group_size_patterns(rng, M, G, 16)["random_0"])
    f32 = jnp.dtype(jnp.float32)
    if kernel == "gmm":
      cfg = gm.api.GmmConfig(None, f32, False, None, 1)
      call, args = windows.gmm_windows_call, (lhs, rhs)
      want = ragged_dot_ref(lhs, rhs, sizes)
    else:
      cfg = gm.api.TgmmConfig(None, f32, G, None, 1)
      dy = rhs[0][:M]
      call, args = windows.tgmm_windows_call, (lhs.T, dy)
      want = tgmm_ref(lhs.T, dy, np.asarray(sizes))
    got = jax.jit(call, static_argnums=5)(*args, sizes, jnp.int32(0), None, cfg)
    np.testing.assert_allclose(got, want, **tolerances(jnp.float32))

  def test_schedule(self):
    assert windows.schedule(1024) == (256, tuple(range(16, 257, 16)))
    assert windows.schedule(300) == (256, tuple(range(16, 257, 16)))
    assert windows.schedule(40) == (40, (16, 32, 40))
    assert windows.schedule(128) == (128, tuple(range(16, 129, 16)))
    assert windows.schedule(5) == (5, (5,))
    for m in (1, 8, 61, 100, 255, 300, 1024, 4096):
      chunk, tails = windows.schedule(m)
      assert chunk == min(windows.CHUNK, m) and tails[-1] == chunk, m
      assert len(tails) <= windows.TAILS, (m, tails)
      # Equal steps of whole sublanes: a tail computes fewer than one
      # step's rows that it does not own.
      steps = np.diff((0, *tails))
      assert (steps[:-1] == steps[0]).all() and steps[-1] <= steps[0], m
      assert steps[0] % 8 == 0 or len(tails) == 1, (m, tails)
      assert steps[0] >= windows.MIN_STEP or len(tails) == 1, (m, tails)

  @pytest.mark.parametrize(
    "m, cases",
    [
      (
        1100,
        (
          [256, 3, 0, 841],
          [512, 1, 87, 500],
          [0, 1099, 0, 1],
          [1, 0, 0, 1099],
          [768, 256, 0, 76],
        ),
      ),
      # Fewer than two chunks of rows: a chunk and a tail window moved back
      # over the group's own chunk, or over the groups before.
      (300, ([10, 290, 0, 0], [290, 10, 0, 0], [3, 0, 0, 297], [0, 0, 0, 300])),
    ],
  )
  def test_groups_longer_than_a_chunk(self, rng, m, cases):
    # m > CHUNK: groups of whole chunks, chunks and a tail, a tail moved
    # back over the group's own last chunk at the end of the array.
    k, n = 16, 24
    lhs, rhs = operands(rng, m, k, n, 4)
    x = jnp.asarray(rng.standard_normal((m, n)) / np.sqrt(m), jnp.float32)
    existing = jnp.asarray(rng.standard_normal((4, k, n)), jnp.float32)
    for sizes in cases:
      sizes = np.asarray(sizes, np.int32)
      s = jnp.asarray(sizes)
      np.testing.assert_allclose(
        self.gmm()(lhs, rhs, s),
        ragged_dot_ref(lhs, rhs, s),
        err_msg=f"gmm {sizes}",
        **tolerances(jnp.float32),
      )
      np.testing.assert_allclose(
        self.tgmm()(lhs.T, x, s, existing_out=existing),
        tgmm_ref(lhs.T, x, sizes) + existing,
        err_msg=f"tgmm {sizes}",
        **tolerances(jnp.float32),
      )

  @pytest.mark.parametrize("m", [5, 61])
  def test_rows_not_a_multiple_of_eight(self, rng, m):
    # Windows clamped at the end of the array: the last group's window
    # starts before the group and must leave the earlier rows alone.
    lhs, rhs = operands(rng, m, K, N, 3)
    x = jnp.asarray(rng.standard_normal((m, N)) / np.sqrt(m), jnp.float32)
    for sizes in ([m - 3, 0, 3], [1, m - 2, 1], [0, 0, m], [2, 1, 0]):
      sizes = np.asarray(sizes, np.int32)
      np.testing.assert_allclose(
        self.gmm()(lhs, rhs, jnp.asarray(sizes)),
        ragged_dot_ref(lhs, rhs, jnp.asarray(sizes)),
        err_msg=f"gmm {sizes}",
        **tolerances(jnp.float32),
      )
      np.testing.assert_allclose(
        self.tgmm()(lhs.T, x, jnp.asarray(sizes)),
        tgmm_ref(lhs.T, x, sizes),
        err_msg=f"tgmm {sizes}",
        **tolerances(jnp.float32),
      )

  def test_tgmm_ignores_inf_in_other_groups_rows(self, rng):
    # A window reaches into neighbouring groups' rows; 0 * inf would be nan.
    lhs, rhs = operands(rng, M, K, N, 1)
    dy = rhs[0][:M]
    sizes = np.asarray([5, 3, M - 8], np.int32)
    x = np.asarray(lhs.T).copy()
    x[:, 5:8] = np.inf  # group 1, inside group 0's window
    out = self.tgmm()(jnp.asarray(x), dy, jnp.asarray(sizes))
    want = tgmm_ref(x[:, :5], dy[:5], sizes[:1])
    np.testing.assert_allclose(out[0], want[0], **tolerances(jnp.float32))
    assert np.isinf(np.asarray(out[1])).any()


class TestTpuSimulator(KernelRunner):
  """The faithful TPU simulator gives the fast path's answer (ragged K/N).

  Not a subclass of the base: every case in the simulator would take many
  minutes on CPU; this small case covers both kernels.
  """

  interpret = pltpu.InterpretParams()

  def test_takes_simulator_path(self, rng):
    lhs, rhs = operands(rng, M, K, N, G)
    sizes = jnp.full((G,), M // G, jnp.int32)
    path = kernel_path(self.gmm(tiling=TILING), lhs, rhs, sizes)
    assert path.kind == paths.TPU_SIMULATOR, path

  @pytest.mark.slow
  def test_gmm_and_tgmm(self, rng):
    m, k, n, g = 32, 40, 24, 3
    lhs, rhs = operands(rng, m, k, n, g)
    sizes = jnp.asarray([9, 0, 17], jnp.int32)
    out = self.gmm(tiling=(8, 32, 16))(lhs, rhs, sizes)
    np.testing.assert_allclose(
      out, ragged_dot_ref(lhs, rhs, sizes), **tolerances(jnp.float32)
    )
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    out = self.tgmm(tiling=(8, 32, 16))(lhs.T, dy, sizes)
    np.testing.assert_allclose(
      out, tgmm_ref(lhs.T, dy, sizes), **tolerances(jnp.float32)
    )

  def test_windows_implementation(self, rng):
    # Named, the CPU fallback's default runs in the simulator too.
    m, k, n = 32, 40, 24
    lhs, rhs = operands(rng, m, k, n, 3)
    sizes = jnp.asarray([9, 0, 17], jnp.int32)
    np.testing.assert_allclose(
      self.gmm(implementation="windows")(lhs, rhs, sizes),
      ragged_dot_ref(lhs, rhs, sizes),
      **tolerances(jnp.float32),
    )
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    np.testing.assert_allclose(
      self.tgmm(implementation="windows")(lhs.T, dy, sizes),
      tgmm_ref(lhs.T, dy, sizes),
      **tolerances(jnp.float32),
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
    # Off TPU: no tiles, the CPU fallback's chunks and tail windows.
    assert gm.default_tiling(1024, 512, 512) is None

  @pytest.mark.parametrize("name", ["gmm", "tgmm"])
  def test_registered_demos(self, name):
    from mpmd import demos

    demo = demos.registered()[name]()
    assert "tpu" in demo.platforms and "cpu" in demo.platforms
    assert "tpu_custom_call" in self.lower(demo.fn, *demo.args)
