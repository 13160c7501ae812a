"""``mpmd.kernels.moe(..., fused=True)``: the one-launch dispatch + experts
+ combine kernel against the unfused layer and the dense reference; its
schedules on the checking executor; its TPU lowering.

Against the unfused layer: the same products summed in the same order,
bit for bit, in float32 and bfloat16. XLA:CPU rounds a row of a dot of
few rows (up to 40-80, depending on K and N) differently from one of
many, so both the fused kernel's tiles and ``gmm``'s windows multiply at
least ``_common.STABLE_DOT_ROWS`` rows on the CPU fallback (a row's
result then depends on no other row).
"""

import contextlib
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from launches import launch_eqns
from moe_util import (
  Problem,
  assert_close,
  dense_reference,
  expected_drops,
  tolerances,
)
from ragged_all_to_all_util import stacked_mesh

import mpmd
import mpmd.kernels
from mpmd.kernels.moe import _fused

SILU = jax.nn.silu


def assert_same(fused, unfused):
  """Fused against unfused: bit for bit (module doc)."""
  np.testing.assert_array_equal(np.asarray(fused), np.asarray(unfused))


def _both(p, **kwargs):
  """The fused and the unfused layer's outputs on ``p``."""
  args = p.placed()
  fused = jax.jit(p.layer(fused=True, **kwargs))(*args)
  kwargs.pop("tile_rows", None)
  unfused = jax.jit(p.layer(fused=False, **kwargs))(*args)
  return fused, unfused


@pytest.mark.parametrize(
  "devices,tokens,experts_local,top_k,dtype,routing,tile_rows",
  [
    (2, 5, 2, 2, jnp.float32, "random", None),
    (2, 13, 2, 2, jnp.float32, "random", 8),  # several tiles per slice
    (4, 7, 1, 2, jnp.float32, "skewed", 8),
    (2, 6, 2, 2, jnp.float32, "one_expert", 8),  # idle experts, devices
    (2, 6, 2, 1, jnp.float32, "own_device", None),  # nothing sent
    (3, 6, 1, 2, jnp.float32, "ties", 8),  # an odd device count
    (2, 7, 2, 1, jnp.bfloat16, "random", 8),
    # Tiles of several windows (one per 128 rows on CPU): an expert's rows
    # multiplied in the smallest that holds them, moved back at the end.
    (2, 150, 2, 2, jnp.float32, "random", 384),
    (2, 150, 2, 2, jnp.bfloat16, "skewed", 256),
    (2, 150, 2, 2, jnp.float32, "one_expert", 256),
    (2, 150, 2, 2, jnp.float32, "first_expert", 256),
    pytest.param(
      2, 3, 4, 8, jnp.float32, "random", 8, marks=pytest.mark.slow
    ),  # top-8: every expert
    pytest.param(
      4, 9, 2, 8, jnp.bfloat16, "random", 16, marks=pytest.mark.slow
    ),
    pytest.param(8, 5, 1, 2, jnp.float32, "random", 8, marks=pytest.mark.slow),
    pytest.param(
      8, 9, 2, 8, jnp.float32, "one_expert", 8, marks=pytest.mark.slow
    ),
  ],
)
def test_matches_unfused_and_reference(
  rng, devices, tokens, experts_local, top_k, dtype, routing, tile_rows
):
  p = Problem(
    rng,
    devices=devices,
    tokens=tokens,
    hidden=16,
    ffn=24,
    experts_local=experts_local,
    dtype=dtype,
    routing=routing,
  )
  fused, unfused = _both(p, top_k=top_k, tile_rows=tile_rows)
  assert fused.dtype == dtype and fused.shape == p.x.shape
  assert_same(fused, unfused)
  want = dense_reference(*p.args, top_k=top_k, activation=SILU)
  assert_close(fused, want, dtype)


@pytest.mark.parametrize(
  "activation",
  [jax.nn.gelu, functools.partial(jax.nn.gelu, approximate=False), jax.nn.tanh],
  ids=["gelu_tanh", "gelu_erf", "tanh"],
)
def test_any_activation_matches_unfused_from_the_first_call(rng, activation):
  # The checker's first runs of a kernel's math (before it has compiled
  # them for speed) round as XLA rounds the unfused layer: fresh caches.
  jax.clear_caches()
  p = Problem(
    rng,
    devices=2,
    tokens=13,
    hidden=24,
    ffn=8,
    experts_local=1,
    dtype=jnp.float32,
  )
  fused, unfused = _both(p, top_k=1, activation=activation)
  assert_same(fused, unfused)
  want = dense_reference(*p.args, top_k=1, activation=activation)
  assert_close(fused, want, jnp.float32)


@pytest.mark.parametrize(
  "devices,capacity_factor,routing",
  [
    (2, 0.5, "random"),
    (4, 0.75, "skewed"),
    pytest.param(2, 1.0, "one_expert", marks=pytest.mark.slow),
  ],
)
def test_capacity_drops_as_unfused(rng, devices, capacity_factor, routing):
  p = Problem(
    rng,
    devices=devices,
    tokens=11,
    hidden=8,
    ffn=12,
    experts_local=2,
    routing=routing,
  )
  kwargs = dict(top_k=2, capacity_factor=capacity_factor, return_dropped=True)
  (fused, dropped), (unfused, unfused_dropped) = _both(p, tile_rows=8, **kwargs)
  want_dropped = expected_drops(p.logits, 2, devices, capacity_factor)
  assert want_dropped.any()
  np.testing.assert_array_equal(np.asarray(dropped), want_dropped)
  np.testing.assert_array_equal(np.asarray(unfused_dropped), want_dropped)
  assert_same(fused, unfused)
  want = dense_reference(
    *p.args, top_k=2, activation=SILU, dropped=want_dropped
  )
  assert_close(fused, want, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grad(rng, dtype):
  p = Problem(
    rng, devices=2, tokens=5, hidden=8, ffn=16, experts_local=2, dtype=dtype
  )
  weights = jnp.asarray(rng.standard_normal(p.x.shape), jnp.float32)

  def loss(fn):
    return lambda *args: jnp.sum(fn(*args).astype(jnp.float32) * weights)

  argnums = (0, 1, 2, 3)
  grad = jax.jit(jax.grad(loss(p.layer(top_k=2, fused=True)), argnums))
  got = grad(*p.placed())
  reference = functools.partial(dense_reference, top_k=2, activation=SILU)
  want = jax.grad(loss(reference), argnums)(*p.args)
  for g, w in zip(got, want, strict=True):
    scale = float(np.max(np.abs(np.asarray(w, np.float32)))) or 1.0
    np.testing.assert_allclose(
      np.asarray(g, np.float32) / scale,
      np.asarray(w, np.float32) / scale,
      **tolerances(dtype),
    )


def test_schedule_independent(rng):
  # Several tiles per slice on 2 devices, 3 in flight per direction: the
  # checking executor explores orders of sends, relays and returns.
  p = Problem(rng, devices=2, tokens=11, hidden=8, ffn=8, experts_local=2)
  layer = jax.jit(p.layer(top_k=2, fused=True, tile_rows=8))
  report = mpmd.testing.assert_schedule_independent(
    layer, *p.placed(), schedules=6
  )
  assert report.schedules_run == 6


@pytest.mark.parametrize(
  "devices", [2, pytest.param(4, marks=pytest.mark.slow)]
)
def test_tpu_simulator_finds_no_race(rng, devices):
  # Pallas' threaded TPU simulator, its race detector on (it reports the
  # race when the compute program does not wait for a tile to land).
  p = Problem(rng, devices=devices, tokens=11, hidden=8, ffn=8, experts_local=2)
  simulated = pltpu.InterpretParams(detect_races=True)
  layer = p.layer(top_k=2, fused=True, tile_rows=8, interpret=simulated)
  with mpmd.race_policy("record"):
    got = jax.block_until_ready(jax.jit(layer)(*p.placed()))
    assert not mpmd.get_races().races_found
  want = jax.jit(p.layer(top_k=2))(*p.placed())
  # Not bit for bit: the simulator evaluates the kernel body its own way
  # (4 devices: 4 of 352 elements differ by one f32 ulp; why is not yet
  # known, the dots there also run on 128 rows).
  np.testing.assert_allclose(
    np.asarray(got), np.asarray(want), rtol=1e-6, atol=2e-6
  )


def _lowered(target: str, devices: int = 4, fused: bool = True) -> str:
  mesh = stacked_mesh((devices,), ("x",))
  layer = jax.shard_map(
    functools.partial(mpmd.kernels.moe, top_k=2, axis_name="x", fused=fused),
    mesh=mesh,
    in_specs=P("x"),
    out_specs=P("x"),
  )
  spec = NamedSharding(mesh, P("x"))
  d = devices
  shapes = [
    ((d * 64, 256), jnp.bfloat16),
    ((d * 64, 2 * d), jnp.float32),
    ((d * 2, 256, 512), jnp.bfloat16),
    ((d * 2, 512, 256), jnp.bfloat16),
  ]
  args = [jax.ShapeDtypeStruct(s, d, sharding=spec) for s, d in shapes]
  with mpmd.tpu_target(target):
    return jax.jit(layer).trace(*args).lower(lowering_platforms=("tpu",))


@pytest.mark.parametrize("target", ["v5e", "v7x"])  # v7x: with SparseCores
def test_lowers_for_tpu_as_one_kernel(target):
  text = _lowered(target).as_text()
  # Dispatch, experts and combine: one Mosaic kernel.
  assert text.count("tpu_custom_call") == 1
  assert "moe_fused" in text
  assert re.search(r"has_communication\\22: true", text)


@pytest.mark.parametrize("fused", [True, False])
def test_lowers_for_tpu_on_one_device(fused):
  # No peer: no barrier handshake, and no collective id (Mosaic rejects
  # one without a barrier semaphore).
  text = _lowered("v5e", devices=1, fused=fused).as_text()
  assert "tpu_custom_call" in text


@pytest.mark.parametrize(
  ("target", "outputs"), [(None, 1), ("v5e", 3)], ids=["cpu", "tpu"]
)
def test_staging_buffers_are_outputs_only_on_tpu(rng, target, outputs):
  # On the CPU fallback every output of a launch is copied back to XLA:
  # the exchange's staging buffers are scratch there; on TPU they stay
  # outputs (remote DMA targets, as upstream's distributed kernels hold
  # them), so the TPU kernel is the one cross-lowered above.
  p = Problem(rng, devices=2, tokens=5, hidden=8, ffn=8, experts_local=1)
  layer = p.layer(top_k=1, fused=True, tile_rows=8)
  with contextlib.ExitStack() as stack:
    if target is not None:
      stack.enter_context(mpmd.tpu_target(target))
    [launch] = [
      e
      for e in launch_eqns(layer, *p.placed())
      if e.params["name"] == "moe_fused"
    ]
  assert len(launch.outvars) == outputs


def test_vmap_over_token_sets_as_unfused(rng):
  p = Problem(rng, devices=2, tokens=5, hidden=8, ffn=12, experts_local=2)
  xs = jnp.stack([p.x, 2 * p.x])
  logits = jnp.stack([p.logits, -p.logits])
  specs = (P(None, "x"), P(None, "x"), P("x"), P("x"))
  args = [
    jax.device_put(a, NamedSharding(p.mesh, spec))
    for a, spec in zip((xs, logits, p.w_in, p.w_out), specs, strict=True)
  ]

  def layer(fused):
    batched = jax.vmap(
      functools.partial(
        mpmd.kernels.moe, top_k=2, axis_name="x", fused=fused, tile_rows=8
      )
      if fused
      else functools.partial(mpmd.kernels.moe, top_k=2, axis_name="x"),
      in_axes=(0, 0, None, None),
    )
    return jax.jit(
      jax.shard_map(
        batched, mesh=p.mesh, in_specs=specs, out_specs=P(None, "x")
      )
    )

  assert_same(layer(True)(*args), layer(False)(*args))


def test_a_sync_bug_is_reported_with_the_kernels_ref_names(rng, monkeypatch):
  # The compute program stops waiting for its tiles to land (every
  # ``pl.semaphore_wait`` of the fused kernel's module is dropped): the
  # checker's report names the kernel's Refs as the kernel names them,
  # not as operands of a ``*refs`` function (``refs[14]``).
  no_waits = types.SimpleNamespace(**vars(pl))
  no_waits.semaphore_wait = lambda *args, **kwargs: None
  monkeypatch.setattr(_fused, "pl", no_waits)
  p = Problem(rng, devices=2, tokens=11, hidden=8, ffn=8, experts_local=2)
  layer = jax.jit(p.layer(top_k=2, fused=True, tile_rows=8))
  with pytest.raises(AssertionError) as failed:
    mpmd.testing.assert_schedule_independent(layer, *p.placed(), schedules=4)
  message = str(failed.value)
  assert re.search(r"reads 'x_tile'|data race on 'received'", message)
  assert "refs[" not in message
