"""Hopper matmul and fused-epilogue matmul: simulator runs, CUDA lowering.

``TestMatmulSimulator`` runs the kernels in the Mosaic GPU simulator on CPU
(``interpret=None``); ``TestMatmulCudaLowering`` lowers the same calls for
CUDA on this CPU host and checks for the Mosaic GPU custom call.
"""

import functools

import gpu_test_util as util
import jax
import jax.numpy as jnp
import pytest

import mpmd
from mpmd.kernels import gpu

DTYPES = [jnp.float16, jnp.bfloat16]
MODES = [
  pytest.param(dict(warp_specialized=False), id="software"),
  pytest.param(
    dict(warp_specialized=True, num_compute_wgs=2),
    id="ws2",
  ),
]
# Two CTAs (N) and two K steps: the smallest case that exercises the grid and
# the pipeline, fast enough for the simulator.
M, N, K = 128, 256, 128


def _inputs(rng, dtype, m=M, n=N, k=K):
  a = jnp.asarray(rng.standard_normal((m, k)), dtype)
  b = jnp.asarray(rng.standard_normal((k, n)), dtype)
  return a, b


class MatmulTestBase:
  def check(self, fn, args, expected):
    raise NotImplementedError

  def test_jaxpr_has_memory_and_compute_meshes(self, rng):
    a, b = _inputs(rng, jnp.float16)
    jaxpr = jax.make_jaxpr(
      functools.partial(gpu.matmul, warp_specialized=True)
    )(a, b)
    [eqn] = [e for e in jaxpr.eqns if e.primitive is mpmd.mpmd_map_p]
    meshes = eqn.params["meshes"]
    assert [m.thread_name for m in meshes] == ["compute", "memory"]
    assert [m.num_threads for m in meshes] == [2, 1]

  @pytest.mark.parametrize("mode", MODES)
  @pytest.mark.parametrize("dtype", DTYPES)
  def test_matmul(self, rng, dtype, mode):
    a, b = _inputs(rng, dtype)
    fn = functools.partial(gpu.matmul, **mode)
    self.check(fn, (a, b), util.matmul_reference(a, b))

  @pytest.mark.parametrize("mode", MODES)
  def test_f32_output(self, rng, mode):
    a, b = _inputs(rng, jnp.bfloat16)
    fn = functools.partial(gpu.matmul, out_dtype=jnp.float32, **mode)
    self.check(fn, (a, b), util.matmul_reference(a, b))

  @pytest.mark.parametrize("mode", MODES)
  @pytest.mark.parametrize("activation", ["relu", "gelu"])
  def test_fused_epilogue(self, rng, activation, mode):
    a, b = _inputs(rng, jnp.float16)
    c = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    fn = functools.partial(
      gpu.fused_matmul, activation=activation, out_dtype=jnp.float32, **mode
    )
    act = {
      "relu": jax.nn.relu,
      "gelu": functools.partial(jax.nn.gelu, approximate=True),
    }[activation]
    self.check(fn, (a, b, c), act(util.matmul_reference(a, b, c)))


class TestMatmulSimulator(MatmulTestBase):
  def check(self, fn, args, expected):
    out = fn(*args)
    assert out.shape == expected.shape
    util.assert_close(out, expected)

  @pytest.mark.parametrize("max_concurrent_steps", [1, 3])
  def test_stages_and_one_compute_wg(self, rng, max_concurrent_steps):
    # K = 3 steps with 1 or 3 stages; one compute warpgroup.
    a, b = _inputs(rng, jnp.float16, n=128, k=192)
    out = gpu.matmul(
      a,
      b,
      max_concurrent_steps=max_concurrent_steps,
      warp_specialized=True,
      num_compute_wgs=1,
      multi_mesh=False,
    )
    util.assert_close(out, util.matmul_reference(a, b))

  def test_fused_without_addend(self, rng):
    a, b = _inputs(rng, jnp.bfloat16)
    out = gpu.fused_matmul(a, b, activation="relu")
    util.assert_close(out, jax.nn.relu(util.matmul_reference(a, b)))

  @pytest.mark.parametrize("mode", MODES)
  def test_no_race(self, rng, mode):
    # One CTA: the simulator runs CTAs one after another without syncing its
    # clocks, so shared scratch of a multi-CTA grid reports false races.
    a, b = _inputs(rng, jnp.float16, n=128, k=192)
    out = gpu.matmul(a, b, interpret=util.race_detecting_params(), **mode)
    assert not util.races_found()
    util.assert_close(out, util.matmul_reference(a, b))

  def test_warp_specialized_single_mesh_form(self, rng):
    a, b = _inputs(rng, jnp.float16, n=128)
    out = gpu.matmul(a, b, warp_specialized=True, multi_mesh=False)
    util.assert_close(out, util.matmul_reference(a, b))

  @pytest.mark.slow
  @pytest.mark.parametrize("mode", MODES)
  def test_bigger(self, rng, mode):
    a, b = _inputs(rng, jnp.bfloat16, m=256, n=512, k=512)
    out = gpu.matmul(a, b, max_concurrent_steps=4, **mode)
    util.assert_close(out, util.matmul_reference(a, b))


class TestMatmulCudaLowering(MatmulTestBase):
  def check(self, fn, args, expected):
    del expected
    lowered = util.cuda_lowering_text(
      functools.partial(fn, interpret=False), *args
    )
    assert len(util.MOSAIC_GPU_CALL.findall(lowered)) == 1

  def test_demos_lower(self):
    from mpmd import demos

    registered = demos.registered()
    for name in ("gpu_matmul", "gpu_matmul_ws"):
      demo = registered[name]()
      assert "cuda" in demo.platforms
      lowered = util.cuda_lowering_text(
        lambda *xs, demo=demo: demo.fn(*xs), *demo.args
      )
      assert len(util.MOSAIC_GPU_CALL.findall(lowered)) == 1


# Keyword arguments that gpu.matmul rejects: (id, kwargs, error, match).
BAD_KWARGS = [
  (
    "bad_block_k",
    dict(block_k=48),
    ValueError,
    r"'block_k' .* multiple of 64.*got 48",
  ),
  (
    "bad_block_m",
    dict(block_m=96),
    ValueError,
    r"'block_m' .* multiple of 64.*got 96",
  ),
  (
    "block_n_too_small_for_compute_wgs",
    dict(block_n=64, warp_specialized=True, num_compute_wgs=2),
    ValueError,
    r"'block_n' .* multiple of 128",
  ),
  (
    "bad_max_concurrent_steps",
    dict(max_concurrent_steps=0),
    ValueError,
    r"matmul: expected 'max_concurrent_steps' >= 1, got 0",
  ),
  (
    "warp_specialized_not_a_bool",
    dict(warp_specialized=1),
    TypeError,
    r"expected 'warp_specialized' to be a bool, got 1",
  ),
  (
    "unsupported_out_dtype",
    dict(out_dtype=jnp.int8),
    TypeError,
    r"expected 'out_dtype' float16, bfloat16 or float32, got int8",
  ),
]


class TestMatmulErrors:
  def _ab(self, m=M, n=N, k=K, dtype=jnp.float16):
    return jnp.zeros((m, k), dtype), jnp.zeros((k, n), dtype)

  @pytest.mark.parametrize(
    "kwargs, error, match",
    [case[1:] for case in BAD_KWARGS],
    ids=[case[0] for case in BAD_KWARGS],
  )
  def test_bad_keyword(self, kwargs, error, match):
    a, b = self._ab()
    with pytest.raises(error, match=match):
      gpu.matmul(a, b, **kwargs)

  def test_shape_not_multiple_of_block(self):
    a, b = self._ab(m=192)
    with pytest.raises(ValueError, match=r"expected M=192 to be a multiple"):
      gpu.matmul(a, b)

  def test_float32_inputs(self):
    a, b = self._ab(dtype=jnp.float32)
    with pytest.raises(TypeError, match=r"'a' of dtype float16 or bfloat16"):
      gpu.matmul(a, b)

  def test_mixed_dtypes(self):
    a, _ = self._ab()
    b = jnp.zeros((K, N), jnp.bfloat16)
    with pytest.raises(TypeError, match=r"'b' of the dtype of 'a'"):
      gpu.matmul(a, b)

  def test_contracting_mismatch(self):
    a = jnp.zeros((M, K), jnp.float16)
    b = jnp.zeros((K + 64, N), jnp.float16)
    with pytest.raises(ValueError, match=r"'b' with 128 rows"):
      gpu.matmul(a, b)

  def test_not_an_array(self):
    _, b = self._ab()
    with pytest.raises(TypeError, match=r"'a' to be an array"):
      gpu.matmul([[1.0]], b)

  def test_too_much_shared_memory(self):
    a, b = self._ab(m=256, n=256, k=1024)
    with pytest.raises(
      ValueError, match=r"fit the 232448 bytes of shared memory of a Hopper"
    ):
      gpu.matmul(
        a, b, block_m=256, block_n=256, block_k=128, max_concurrent_steps=8
      )

  def test_bad_activation(self):
    a, b = self._ab()
    with pytest.raises(ValueError, match=r"'activation' None or one of"):
      gpu.fused_matmul(a, b, activation="tanh")

  def test_addend_shape(self):
    a, b = self._ab()
    c = jnp.zeros((M, N + 1), jnp.float16)
    with pytest.raises(
      ValueError,
      match=r"fused_matmul: expected 'c' of shape \(m, n\) = \(128, 256\), "
      r"got shape \(128, 257\)",
    ):
      gpu.fused_matmul(a, b, c)

  def test_addend_dtype(self):
    a, b = self._ab()
    c = jnp.zeros((M, N), jnp.float32)
    with pytest.raises(
      TypeError, match=r"fused_matmul: expected 'c' of dtype float16, got "
    ):
      gpu.fused_matmul(a, b, c)

  def test_fused_names_itself(self):
    a, b = self._ab()
    with pytest.raises(ValueError, match=r"^fused_matmul: expected 'block_k'"):
      gpu.fused_matmul(a, b, block_k=48)

  @pytest.mark.parametrize(
    "arg, bad",
    [("block_k", 64.0), ("block_m", "128"), ("num_compute_wgs", 2.0)],
  )
  def test_not_an_int(self, arg, bad):
    a, b = self._ab()
    with pytest.raises(
      TypeError, match=rf"matmul: expected '{arg}' to be an int, got {bad!r}"
    ):
      gpu.matmul(a, b, **{arg: bad})
