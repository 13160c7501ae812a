"""The Pallas fuser's ``physicalize`` through a launch (issue 36, item 4):
as upstream registers a rule for its mpmd_map, ours has one, so a kernel
that computes on a fusion dtype inside (``pack`` then ``unpack``) runs on
CPU and lowers for TPU once physicalized (upstream's own test, written
again)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.fuser import fusible_dtype
from jax.experimental.pallas import fuser
from jax.experimental.pallas import tpu as pltpu

import mpmd

SHAPE = (8, 128)


@dataclasses.dataclass(frozen=True)
class PairDType(fusible_dtype.FusionDType):
  """Two f32 arrays as one value."""

  def __str__(self):
    return "pair"

  def abstract_unpack(self, x):
    return (x.update(dtype=jnp.float32), x.update(dtype=jnp.float32))

  def abstract_pack(self, x, y):
    return x.update(dtype=self)

  def pull_block_spec_one_step(self, aval_out, block_spec):
    return block_spec, block_spec

  def unpack_push_block_spec(self, aval_in, block_spec):
    return block_spec, block_spec

  def unpack_pull_block_spec(self, aval_in, block_spec1, block_spec2):
    return (block_spec1,)

  def pack_eval_rule(self, eval_ctx, x, y):
    return fusible_dtype.pack_dtype_p.bind(x, y, dtype=self)

  def unpack_eval_rule(self, eval_ctx, x):
    return fusible_dtype.unpack(x)


def _add_through_a_pair(x_hbm, y_hbm, o_hbm, x_vmem, y_vmem, o_vmem):
  pltpu.sync_copy(x_hbm, x_vmem)
  pltpu.sync_copy(y_hbm, y_vmem)
  pair = fusible_dtype.pack(x_vmem[...], y_vmem[...], dtype=PairDType())
  a, b = fusible_dtype.unpack(pair)
  o_vmem[...] = a - 2 * b
  pltpu.sync_copy(o_vmem, o_hbm)


def _physicalized():
  mesh = mpmd.tensorcore_mesh("core", num_cores=1)

  @fuser.fusible
  def f(x_fn, y_fn, z_fn):
    x, y = x_fn(), y_fn()
    out = mpmd.kernel(
      body=_add_through_a_pair,
      mesh=mesh,
      out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_types=[pltpu.VMEM(x.shape, x.dtype)] * 3,
    )(x, y)
    return out if z_fn is None else z_fn(out)

  return fusible_dtype.physicalize(f)


def _inputs():
  rng = np.random.default_rng(0)
  x, y = (
    jnp.asarray(rng.standard_normal(SHAPE), jnp.float32) for _ in range(2)
  )
  return x, y


def test_a_physicalized_kernel_runs_on_cpu():
  x, y = _inputs()
  np.testing.assert_array_equal(_physicalized()(x, y), x - 2 * y)


def test_a_physicalized_kernel_lowers_for_tpu():
  x, y = _inputs()
  with mpmd.tpu_target("v5e"):
    lowered = jax.jit(_physicalized()).trace(x, y)
    text = lowered.lower(lowering_platforms=("tpu",)).as_text()
  assert text.count("tpu_custom_call") == 1
  # The kernel keeps its name through the rewrite.
  assert "_add_through_a_pair" in text


def test_without_physicalize_the_fusion_dtype_does_not_lower():
  """What the rule is for: Mosaic has no rule for a fusion dtype."""
  mesh = mpmd.tensorcore_mesh("core", num_cores=1)
  f = mpmd.kernel(
    body=_add_through_a_pair,
    mesh=mesh,
    out_type=jax.ShapeDtypeStruct(SHAPE, jnp.float32),
    scratch_types=[pltpu.VMEM(SHAPE, jnp.float32)] * 3,
  )
  with mpmd.tpu_target("v5e"), pytest.raises(NotImplementedError, match="pack"):
    jax.jit(f).trace(*_inputs()).lower(lowering_platforms=("tpu",))
