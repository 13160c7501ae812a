"""``mpmd.kernels.moe`` against a dense per-token reference.

The reference computes, for every token, each of its top-k experts' MLP with
that expert's full weights (no routing machinery, no exchange), in float32
at HIGHEST precision; the layer runs in ``jax.shard_map`` on simulated CPU
devices (its exchanges on the CPU fallback's lockstep path). Routings:
random, all tokens to one expert (the other experts get nothing, the other
devices receive nothing), ties. Gradients in ``x``, ``router_logits``,
``w_in`` and ``w_out``. Errors for bad routing inputs, before lowering.
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
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

HIGHEST = lax.Precision.HIGHEST


@pytest.mark.parametrize(
  "devices,tokens,experts_local,top_k,dtype,routing",
  [
    (2, 5, 2, 2, jnp.float32, "random"),
    (2, 7, 2, 1, jnp.bfloat16, "random"),
    (2, 3, 2, 4, jnp.float32, "random"),  # every expert
    (2, 6, 2, 2, jnp.float32, "one_expert"),
    (3, 6, 1, 2, jnp.float32, "ties"),  # an odd device count
    pytest.param(2, 3, 4, 8, jnp.float32, "random", marks=pytest.mark.slow),
    pytest.param(4, 7, 1, 2, jnp.bfloat16, "random", marks=pytest.mark.slow),
    pytest.param(8, 5, 1, 2, jnp.float32, "random", marks=pytest.mark.slow),
    pytest.param(
      8, 9, 2, 8, jnp.bfloat16, "one_expert", marks=pytest.mark.slow
    ),
  ],
)
def test_matches_dense_reference(
  rng, devices, tokens, experts_local, top_k, dtype, routing
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
  got = jax.jit(p.layer(top_k=top_k))(*p.placed())
  assert got.dtype == dtype and got.shape == p.x.shape
  want = dense_reference(*p.args, top_k=top_k, activation=jax.nn.silu)
  assert_close(got, want, dtype)


@pytest.mark.slow
def test_other_activation_and_bf16_tokens_with_f32_logits(rng):
  p = Problem(
    rng,
    devices=2,
    tokens=4,
    hidden=8,
    ffn=16,
    experts_local=2,
    dtype=jnp.bfloat16,
  )
  assert p.logits.dtype == jnp.float32
  got = jax.jit(p.layer(top_k=2, activation=jax.nn.gelu))(*p.placed())
  want = dense_reference(*p.args, top_k=2, activation=jax.nn.gelu)
  assert_close(got, want, jnp.bfloat16)


@pytest.mark.parametrize(
  "devices,routing,dtype",
  [
    (2, "random", jnp.float32),
    pytest.param(2, "one_expert", jnp.float32, marks=pytest.mark.slow),
    pytest.param(4, "random", jnp.bfloat16, marks=pytest.mark.slow),
  ],
)
def test_grad(rng, devices, routing, dtype):
  p = Problem(
    rng,
    devices=devices,
    tokens=5,
    hidden=8,
    ffn=16,
    experts_local=2,
    dtype=dtype,
    routing=routing,
  )
  # Random output weights: every output element reaches the gradient.
  weights = jnp.asarray(rng.standard_normal(p.x.shape), jnp.float32)
  layer = p.layer(top_k=2)

  def loss(fn):
    return lambda *args: jnp.sum(fn(*args).astype(jnp.float32) * weights)

  got = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2, 3)))(*p.placed())
  reference = functools.partial(
    dense_reference, top_k=2, activation=jax.nn.silu
  )
  want = jax.grad(loss(reference), argnums=(0, 1, 2, 3))(*p.args)
  for g, w in zip(got, want, strict=True):
    assert g.dtype == w.dtype or dtype == jnp.bfloat16
    # Gradients are sums of more products than the outputs.
    scale = float(np.max(np.abs(np.asarray(w, np.float32)))) or 1.0
    np.testing.assert_allclose(
      np.asarray(g, np.float32) / scale,
      np.asarray(w, np.float32) / scale,
      **tolerances(dtype),
    )


@pytest.mark.parametrize(
  "devices,capacity_factor,routing",
  [
    (2, 0.5, "random"),
    pytest.param(2, 1.0, "one_expert", marks=pytest.mark.slow),
    pytest.param(4, 0.75, "random", marks=pytest.mark.slow),
  ],
)
def test_capacity_drops(rng, devices, capacity_factor, routing):
  p = Problem(
    rng,
    devices=devices,
    tokens=6,
    hidden=8,
    ffn=12,
    experts_local=2,
    routing=routing,
  )
  layer = p.layer(top_k=2, capacity_factor=capacity_factor, return_dropped=True)
  got, dropped = jax.jit(layer)(*p.placed())
  want_dropped = expected_drops(p.logits, 2, devices, capacity_factor)
  assert want_dropped.any()
  np.testing.assert_array_equal(np.asarray(dropped), want_dropped)
  want = dense_reference(
    *p.args, top_k=2, activation=jax.nn.silu, dropped=want_dropped
  )
  assert_close(got, want, jnp.float32)
  # Gradients flow through the kept pairs only.
  weights = jnp.asarray(rng.standard_normal(p.x.shape), jnp.float32)

  def loss(fn):
    return lambda *args: jnp.sum(fn(*args) * weights)

  got = jax.jit(jax.grad(loss(lambda *a: layer(*a)[0]), argnums=(0, 2)))(
    *p.placed()
  )
  reference = functools.partial(
    dense_reference, top_k=2, activation=jax.nn.silu, dropped=want_dropped
  )
  want = jax.grad(loss(reference), argnums=(0, 2))(*p.args)
  for g, w in zip(got, want, strict=True):
    assert_close(g, w, jnp.float32)


@pytest.mark.parametrize("capacity_factor", [math.inf, 1e308, 1e9, 4.0])
def test_a_capacity_no_expert_can_fill_is_dropless(rng, capacity_factor):
  # 4 experts: a factor of 4 lets each take every row of every device.
  p = Problem(rng, devices=2, tokens=5, hidden=8, ffn=16, experts_local=2)
  layer = p.layer(top_k=2, capacity_factor=capacity_factor, return_dropped=True)
  got, dropped = jax.jit(layer)(*p.placed())
  assert not np.asarray(dropped).any()
  np.testing.assert_array_equal(got, jax.jit(p.layer(top_k=2))(*p.placed()))


@pytest.mark.parametrize("fused", [False, True])
def test_an_empty_batch(rng, fused):
  p = Problem(rng, devices=2, tokens=0, hidden=8, ffn=16, experts_local=2)
  layer = p.layer(top_k=2, fused=fused, return_dropped=True)
  y, dropped = jax.jit(layer)(*p.placed())
  assert y.shape == (0, 8) and y.dtype == jnp.float32
  assert dropped.shape == (0, 2) and dropped.dtype == jnp.bool_

  def loss(*args):
    return jnp.sum(layer(*args)[0])

  with jax.set_mesh(p.mesh):  # jit places the empty cotangents on it
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*p.placed())
  assert [g.shape for g in grads] == [a.shape for a in p.args]
  # No token reaches an expert: the experts' weights get no gradient.
  assert not np.asarray(grads[2]).any() and not np.asarray(grads[3]).any()


@pytest.mark.parametrize("fused", [False, True])
def test_eager_shard_map(rng, fused):
  # Not under jit: each launch is lowered inside the shard_map's own
  # (manual) mesh context.
  p = Problem(rng, devices=2, tokens=5, hidden=8, ffn=16, experts_local=2)
  got = p.layer(top_k=2, fused=fused)(*p.placed())
  want = dense_reference(*p.args, top_k=2, activation=jax.nn.silu)
  assert_close(got, want, jnp.float32)


@dataclasses.dataclass
class _Scaled:
  """An activation that does not hash (a dataclass with ``eq``)."""

  scale: float

  def __call__(self, h):
    return self.scale * jax.nn.silu(h)


def test_an_activation_that_does_not_hash(rng):
  """An activation need not hash (the layer keys no cache by it)."""
  p = Problem(rng, devices=2, tokens=5, hidden=8, ffn=16, experts_local=2)
  activation = _Scaled(2.0)
  got = jax.jit(p.layer(top_k=2, activation=activation))(*p.placed())
  want = dense_reference(*p.args, top_k=2, activation=activation)
  assert_close(got, want, jnp.float32)


@pytest.mark.slow
def test_vmap_over_token_sets(rng):
  p = Problem(rng, devices=2, tokens=5, hidden=8, ffn=12, experts_local=2)
  xs = jnp.stack([p.x, 2 * p.x])
  logits = jnp.stack([p.logits, -p.logits])
  layer = jax.vmap(
    functools.partial(mpmd.kernels.moe, top_k=2, axis_name="x"),
    in_axes=(0, 0, None, None),
  )
  specs = (P(None, "x"), P(None, "x"), P("x"), P("x"))
  f = jax.shard_map(layer, mesh=p.mesh, in_specs=specs, out_specs=P(None, "x"))
  args = [
    jax.device_put(a, NamedSharding(p.mesh, spec))
    for a, spec in zip((xs, logits, p.w_in, p.w_out), specs, strict=True)
  ]
  got = jax.jit(f)(*args)
  for b in range(2):
    want = dense_reference(
      xs[b], logits[b], p.w_in, p.w_out, top_k=2, activation=jax.nn.silu
    )
    assert_close(got[b], want, jnp.float32)


@pytest.mark.parametrize(
  "axis_name",
  ["y", pytest.param(("x", "y"), marks=pytest.mark.slow)],
)
def test_2d_mesh(rng, axis_name):
  # Tokens over both axes, experts over axis_name (replicated along the
  # other axis, if any).
  mesh = stacked_mesh((2, 2), ("x", "y"))
  spread = 2 if axis_name == "y" else 4
  tokens, hidden, ffn, experts_local = 5, 8, 12, 2
  experts = spread * experts_local
  x = jnp.asarray(rng.standard_normal((4 * tokens, hidden)), jnp.float32)
  logits = jnp.asarray(rng.standard_normal((4 * tokens, experts)), jnp.float32)
  w_in = jnp.asarray(rng.standard_normal((experts, hidden, ffn)), jnp.float32)
  w_out = jnp.asarray(rng.standard_normal((experts, ffn, hidden)), jnp.float32)
  token_spec, expert_spec = P(("x", "y")), P(axis_name)
  specs = (token_spec, token_spec, expert_spec, expert_spec)
  layer = jax.shard_map(
    functools.partial(mpmd.kernels.moe, top_k=2, axis_name=axis_name),
    mesh=mesh,
    in_specs=specs,
    out_specs=token_spec,
  )
  args = (x, logits, w_in, w_out)
  placed = [
    jax.device_put(a, NamedSharding(mesh, spec))
    for a, spec in zip(args, specs, strict=True)
  ]
  got = jax.jit(layer)(*placed)
  want = dense_reference(*args, top_k=2, activation=jax.nn.silu)
  assert_close(got, want, jnp.float32)


def test_lowers_for_tpu():
  mesh = stacked_mesh((4,), ("x",))
  layer = jax.shard_map(
    functools.partial(mpmd.kernels.moe, top_k=2, axis_name="x"),
    mesh=mesh,
    in_specs=P("x"),
    out_specs=P("x"),
  )
  spec = NamedSharding(mesh, P("x"))
  shapes = [
    ((4 * 64, 256), jnp.bfloat16),
    ((4 * 64, 8), jnp.float32),
    ((4 * 2, 256, 512), jnp.bfloat16),
    ((4 * 2, 512, 256), jnp.bfloat16),
  ]
  args = [jax.ShapeDtypeStruct(s, d, sharding=spec) for s, d in shapes]
  with mpmd.tpu_target():
    text = jax.jit(layer).trace(*args).lower(lowering_platforms=("tpu",))
    text = text.as_text()
  # Dispatch, two grouped matmuls, combine.
  assert text.count("tpu_custom_call") == 4
  assert re.search(r"has_communication\\22: true", text)


# -- errors before lowering ---------------------------------------------------


def _trace(shapes, **kwargs):
  mesh = stacked_mesh((2,), ("x",))
  kwargs.setdefault("top_k", 2)
  kwargs.setdefault("axis_name", "x")
  layer = jax.shard_map(
    functools.partial(mpmd.kernels.moe, **kwargs),
    mesh=mesh,
    in_specs=P("x"),
    out_specs=P("x"),
  )
  spec = NamedSharding(mesh, P("x"))
  args = [
    jax.ShapeDtypeStruct((2 * s[0], *s[1:]), d, sharding=spec)
    for s, d in shapes
  ]
  return jax.jit(layer).trace(*args)


_F32 = jnp.float32
_GOOD = [((4, 8), _F32), ((4, 4), _F32), ((2, 8, 16), _F32), ((2, 16, 8), _F32)]


def _with(index, shape_dtype):
  shapes = list(_GOOD)
  shapes[index] = shape_dtype
  return shapes


@pytest.mark.parametrize(
  "shapes,kwargs,error,match",
  [
    (_GOOD, dict(top_k=5), ValueError, "'top_k' <= the expert count 4, got 5"),
    (_GOOD, dict(top_k=0), ValueError, "'top_k' >= 1"),
    (_GOOD, dict(top_k=1.5), TypeError, "'top_k' to be an int"),
    (
      _with(1, ((4, 5), _F32)),
      {},
      ValueError,
      "expert count .* = 5\\) to be divisible by the 2 devices",
    ),
    (
      _with(1, ((4, 6), _F32)),
      {},
      ValueError,
      "to equal experts_local x devices = 2 x 2",
    ),
    (
      _with(1, ((4, 4), jnp.int32)),
      {},
      TypeError,
      "'router_logits' of a floating dtype, got int32",
    ),
    (
      _with(0, ((4, 8), jnp.int32)),
      {},
      TypeError,
      "'x' of dtype float32, bfloat16 or float16, got int32",
    ),
    (
      _with(2, ((2, 8, 16), jnp.bfloat16)),
      {},
      TypeError,
      "'w_in' of x's dtype float32, got bfloat16",
    ),
    (
      _with(1, ((3, 4), _F32)),
      {},
      ValueError,
      "'router_logits' \\(tokens, experts\\) with x's tokens=4",
    ),
    (
      _with(2, ((2, 9, 16), _F32)),
      {},
      ValueError,
      "'w_in' \\(experts_local, hidden, ffn\\) with x's hidden=8",
    ),
    (
      _with(3, ((2, 16, 9), _F32)),
      {},
      ValueError,
      "'w_out' \\(experts_local, ffn, hidden\\) = \\(2, 16, 8\\)",
    ),
    (_with(0, ((4,), _F32)), {}, ValueError, "'x' of rank 2"),
    (_GOOD, dict(activation="relu"), TypeError, "'activation' to be a"),
    (
      _GOOD,
      dict(activation=lambda h: h[:, :4]),
      ValueError,
      r"'activation' to be elementwise.*maps \(8, \d+\) to \(8, 4\)",
    ),
    (_GOOD, dict(axis_name="y"), ValueError, "'y' is not an axis"),
    (_GOOD, dict(fused=1), TypeError, "'fused' to be a bool"),
    (
      _GOOD,
      dict(fused=True, tile_rows=12),
      ValueError,
      "'tile_rows' to be a multiple of 8",
    ),
    (_GOOD, dict(tile_rows=8), ValueError, "pass fused=True with it"),
    (_GOOD, dict(capacity_factor=0.0), ValueError, "'capacity_factor' > 0"),
    (
      _GOOD,
      dict(capacity_factor="1"),
      TypeError,
      "'capacity_factor' to be None or a number",
    ),
    (_GOOD, dict(return_dropped=1), TypeError, "'return_dropped' to be a"),
  ],
)
def test_errors(shapes, kwargs, error, match):
  with pytest.raises(error, match=match):
    _trace(shapes, **kwargs)


def test_outside_shard_map():
  args = [jnp.zeros(s, d) for s, d in _GOOD]
  with pytest.raises(ValueError, match="inside jax.shard_map"):
    mpmd.kernels.moe(*args, top_k=2, axis_name="x")
