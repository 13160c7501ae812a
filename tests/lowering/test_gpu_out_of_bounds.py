"""The Mosaic GPU simulator's out-of-bounds reports name the user's operand
(its Ref's name, role and type) and kernel, not the simulator's buffer key,
and are ``mpmd.OutOfBoundsError``s."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import mpmd

ROW = 128
OUT = jax.ShapeDtypeStruct((ROW,), jnp.float32)


def _raises_naming(f, *args, operand, kernel, access):
  with pytest.raises(mpmd.OutOfBoundsError) as caught:
    with mpmd.typed_errors():
      jax.block_until_ready(f(*args))
  message = str(caught.value)
  assert "HostAllocationKey" not in message
  assert re.search(
    rf"in kernel {kernel} at \S+test_gpu_out_of_bounds.py:\d+: "
    rf"Out-of-bounds {access} of {re.escape(operand)}:",
    message,
  ), message


def read_past_x(x_ref, start_ref, o_ref):
  o_ref[...] = x_ref[pl.ds(start_ref[0], ROW)]


def write_past_o(x_ref, start_ref, o_ref):
  o_ref[pl.ds(start_ref[0], ROW)] = x_ref[pl.ds(0, ROW)]


@pytest.mark.parametrize(
  "kernel, operand, access",
  [
    (read_past_x, "'x_ref' (input 0, f32[256])", "read"),
    (write_past_o, "'o_ref' (output 0, f32[128])", "swap"),
  ],
)
def test_an_access_out_of_bounds_names_the_operand_and_kernel(
  kernel, operand, access
):
  f = mpmd.mpmd_map([(plgpu.Mesh(), kernel)], OUT)
  x = jnp.ones((2 * ROW,), jnp.float32)
  start = jnp.array([200], jnp.int32)
  _raises_naming(
    f, x, start, operand=operand, kernel=kernel.__name__, access=access
  )
  # Under jit too, after a launch that allocated buffers of its own.
  jax.block_until_ready(f(x, start * 0))
  g = jax.jit(lambda x, s: f(2 * x, s))
  _raises_naming(
    g, x, start, operand=operand, kernel=kernel.__name__, access=access
  )


def test_smem_scratch_out_of_bounds_names_the_scratch():
  def past_scratch(x_ref, start_ref, o_ref, staged):
    staged[...] = x_ref[...]
    o_ref[...] = staged[pl.ds(start_ref[0], ROW)]

  f = mpmd.mpmd_map(
    [(plgpu.Mesh(), past_scratch)],
    OUT,
    scratch_types=[plgpu.SMEM((ROW,), jnp.float32)],
  )
  _raises_naming(
    f,
    jnp.ones((ROW,), jnp.float32),
    jnp.array([64], jnp.int32),
    operand="'staged' (scratch 0, f32[128])",
    kernel="past_scratch",
    access="read",
  )


def test_two_meshes_name_the_operand_by_each_meshs_name():
  memory = plgpu.Mesh(num_threads=1, thread_name="memory")
  compute = plgpu.Mesh(num_threads=1, thread_name="compute")

  def idle(x, start, o):
    del x, start, o

  def reads_past(x_gmem, start_gmem, o_gmem):
    o_gmem[...] = x_gmem[pl.ds(start_gmem[0], ROW)]

  f = mpmd.mpmd_map([(memory, idle), (compute, reads_past)], OUT)
  _raises_naming(
    f,
    jnp.ones((2 * ROW,), jnp.float32),
    jnp.array([200], jnp.int32),
    operand="'x' / 'x_gmem' (input 0, f32[256])",
    kernel=r"idle at \S+:\d+ \+ reads_past",
    access="read",
  )


def _slot_past_the_end(op):
  """A kernel whose ``op`` uses slot 3 of 2 (a barrier, an SMEM slot)."""

  def kernel(x_ref, o_ref, smem, barriers):
    slot = {"barrier": (3, 0), "smem": (0, 3)}[op]
    plgpu.copy_gmem_to_smem(x_ref, smem.at[slot[1] % 2], barriers.at[0])
    if op == "smem":
      plgpu.copy_gmem_to_smem(x_ref, smem.at[slot[1]], barriers.at[1])
    plgpu.barrier_wait(barriers.at[slot[0]])
    o_ref[...] = smem[0]

  return kernel


@pytest.mark.parametrize(
  "op, operation, operand",
  [
    ("barrier", "barrier_wait", "'barriers' (scratch_types leaf 1"),
    ("smem", "copy_gmem_to_smem", "'smem' (scratch_types leaf 0"),
  ],
)
def test_a_literal_index_past_a_gpu_ref_fails_at_trace_time(
  op, operation, operand
):
  """Pallas' GPU simulator would use another element silently, hardware
  other memory: a literal index is checked where it is written."""
  f = mpmd.mpmd_map(
    [(plgpu.Mesh(num_threads=1, thread_name="wg"), _slot_past_the_end(op))],
    OUT,
    scratch_types=[
      plgpu.SMEM((2, ROW), jnp.float32),
      plgpu.Barrier(num_arrivals=1, num_barriers=2),
    ],
  )
  # (A StaticOutOfBoundsError: an OutOfBoundsError and a ValueError.)
  with pytest.raises(mpmd.OutOfBoundsError) as caught:
    jax.jit(f).trace(jnp.ones((ROW,), jnp.float32))
  assert isinstance(caught.value, ValueError)
  message = str(caught.value)
  assert f": {operation} (at " in message
  assert "test_gpu_out_of_bounds.py:" in message
  assert f"index 3 of dimension 0 of {operand}" in message
  assert "is out of bounds (size 2)" in message
