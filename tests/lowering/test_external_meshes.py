"""A launch that writes into the memory of a mesh it does not run on (issue
36, item 2): upstream's *external meshes*.

The program is upstream's (its MPMD async test, written again): a
SparseCore launch's outputs live in a TensorCore's memory
(``pltpu.VMEM(...) @ tc_mesh`` and a DMA semaphore ``@ tc_mesh``); its
program DMAs its input there with ``device_id={"tc": 0}`` and waits only
for the send; a later launch over ``tc_mesh`` waits for the DMA and adds 1.
It runs on the CPU fallback (the TensorCore's memory is the operand handed
from one launch to the next) and lowers for TPU as upstream's does.
"""

import base64
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import tpu_sc as plsc

import mpmd

TARGET = "v6e"  # a generation with SparseCores
SHAPE = (8, 128)


def _sparsecore_mesh(kind: str):
  if kind == "scalar":
    return plsc.ScalarSubcoreMesh(axis_name="s_core", num_cores=1)
  return plsc.VectorSubcoreMesh(
    core_axis_name="s_core",
    subcore_axis_name="subcore",
    num_cores=1,
    num_subcores=1,
  )


def _prefetch(kernel, kind: str, *, tc_cores=1, waits=1, as_ref=True):
  """Upstream's program: a SparseCore launch DMAs ``x`` into TensorCore
  VMEM; a TensorCore launch waits for it (``waits`` times) and adds 1.
  ``kernel`` is ``mpmd.kernel`` or upstream's ``pl.kernel``."""
  sc_mesh = _sparsecore_mesh(kind)
  tc_mesh = mpmd.tensorcore_mesh("tc", num_cores=tc_cores)

  def sc_fn(x_ref, out_tc_vmem, tc_sem, send_sem):
    pltpu.async_remote_copy(
      x_ref, out_tc_vmem, send_sem, tc_sem, device_id={"tc": 0}
    ).wait_send()

  def tc_fn(x_ref, out_tc_vmem, tc_sem):
    for _ in range(waits):
      pltpu.make_async_copy(x_ref, out_tc_vmem, tc_sem).wait()
    out_tc_vmem[...] += 1

  def f(x):
    x_in = jax.new_ref(x) if as_ref else x
    out, sem = kernel(
      mesh=sc_mesh,
      out_type=(
        pltpu.VMEM(x.shape, x.dtype) @ tc_mesh,
        pltpu.SemaphoreType.DMA(()) @ tc_mesh,
      ),
      scratch_types=[pltpu.SemaphoreType.DMA(())],
      name="sc_copy_start",
    )(sc_fn)(x_in)
    out_ref = jax.new_ref(out, memory_space=pltpu.VMEM @ tc_mesh)
    sem_ref = jax.new_ref(sem, memory_space=pltpu.SEMAPHORE @ tc_mesh)
    kernel(mesh=tc_mesh, out_type=(), name="tc_copy_end")(tc_fn)(
      x_in, out_ref, sem_ref
    )
    return jax.freeze(out_ref)

  return f


def _into_tensorcore_vmem(sc_fn):
  """A scalar-subcore launch of ``sc_fn`` whose outputs are a TensorCore's
  VMEM buffer and DMA semaphore (call within the TPU target)."""
  tc_mesh = mpmd.tensorcore_mesh("tc", num_cores=1)
  return mpmd.kernel(
    mesh=_sparsecore_mesh("scalar"),
    out_type=(
      pltpu.VMEM(SHAPE, jnp.int32) @ tc_mesh,
      pltpu.SemaphoreType.DMA(()) @ tc_mesh,
    ),
    scratch_types=[pltpu.SemaphoreType.DMA(())],
  )(sc_fn)


def _x():
  return jnp.arange(np.prod(SHAPE), dtype=jnp.int32).reshape(SHAPE)


@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_a_tensorcore_launch_awaits_what_a_sparsecore_launch_sent(kind):
  x = _x()
  with mpmd.tpu_target(TARGET):
    out = jax.jit(_prefetch(mpmd.kernel, kind))(x)
  np.testing.assert_array_equal(out, x + 1)


def _custom_calls(text: str):
  """Each Mosaic custom call: its operand and result types and its
  outputs' memory colours (where Mosaic places each buffer)."""
  calls = []
  for line in text.splitlines():
    if "stablehlo.custom_call @tpu_custom_call" not in line:
      continue
    colours = re.search(r"output_memory_space_colors\\22: (\[.*?\}\])", line)
    body = re.search(r"22body\\22: \\22(.*?)\\22", line).group(1)
    assert base64.b64decode(body).startswith(b"ML\xefR")  # a Mosaic module
    calls.append(
      (line.rsplit(" : ", 1)[1].strip(), colours and colours.group(1))
    )
  return calls


def _lowered(kernel, kind: str) -> str:
  with mpmd.tpu_target(TARGET):
    f = _prefetch(kernel, kind, as_ref=False)
    return jax.jit(f).trace(_x()).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_both_launches_lower_for_tpu_like_upstream(kind):
  ours = _custom_calls(_lowered(mpmd.kernel, kind))
  upstream = _custom_calls(_lowered(pl.kernel, kind))
  assert len(ours) == 2
  assert ours == upstream
  (start, start_colours), (end, end_colours) = ours
  # The SparseCore launch returns the TensorCore's VMEM buffer (colour 1)
  # and the semaphore; the TensorCore launch takes both back.
  assert start == "(tensor<8x128xi32>) -> (tensor<8x128xi32>, tensor<i32>)"
  assert "\\22color\\22:1,\\22shape_index\\22:[0]" in start_colours
  assert end.startswith("(tensor<8x128xi32>, tensor<8x128xi32>, tensor<i32>)")
  assert "\\22color\\22:1,\\22shape_index\\22:[0]" in end_colours


def test_the_send_semaphore_is_the_callers_own():
  """Left out, the wait for the send leaves the SparseCore's own semaphore
  counting: the DMA did signal it (on the CPU fallback as on TPU)."""

  def sc_fn(x_ref, out_tc_vmem, tc_sem, send_sem):
    pltpu.async_remote_copy(
      x_ref, out_tc_vmem, send_sem, tc_sem, device_id={"tc": 0}
    )

  with mpmd.tpu_target(TARGET):
    f = _into_tensorcore_vmem(sc_fn)
    with pytest.raises(mpmd.LeftoverError, match="semaphores not back to zero"):
      with mpmd.typed_errors():
        jax.block_until_ready(jax.jit(lambda x: f(x)[0])(_x()))


def test_waiting_for_a_second_dma_that_never_came_is_a_deadlock():
  """The semaphore handed over counts the one DMA the SparseCore sent."""
  with mpmd.tpu_target(TARGET):
    f = jax.jit(_prefetch(mpmd.kernel, "scalar", waits=2))
    with pytest.raises(mpmd.DeadlockError), mpmd.typed_errors():
      jax.block_until_ready(f(_x()))


def test_an_external_mesh_of_several_programs_lowers_but_does_not_run():
  """Which TensorCore's VMEM one operand would be is not defined on CPU:
  a clear error there, while the launch lowers for TPU."""
  with mpmd.tpu_target("v5p"):  # two TensorCores, and SparseCores
    f = _prefetch(mpmd.kernel, "scalar", tc_cores=2, as_ref=False)
    text = jax.jit(f).trace(_x()).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 2
    with pytest.raises(NotImplementedError, match="external mesh of one"):
      jax.jit(f)(_x())


def test_a_device_id_naming_no_mesh_of_the_launch_is_still_an_error():
  """Without an operand in the TensorCore's memory, ``{"tc": 0}`` names
  no mesh the launch reaches."""

  def sc_fn(x_ref, o_ref, recv, send):
    pltpu.async_remote_copy(
      x_ref, o_ref, send, recv, device_id={"tc": 0}
    ).wait_send()

  with mpmd.tpu_target(TARGET):
    f = mpmd.kernel(
      mesh=_sparsecore_mesh("scalar"),
      out_type=jax.ShapeDtypeStruct(SHAPE, jnp.int32),
      scratch_types=[pltpu.SemaphoreType.DMA(())] * 2,
    )(sc_fn)
    with pytest.raises(ValueError, match="names device_id axis 'tc'"):
      jax.jit(f)(_x())


def test_an_index_past_the_external_mesh_is_an_error():
  def sc_fn(x_ref, out_tc_vmem, tc_sem, send_sem):
    pltpu.async_remote_copy(
      x_ref, out_tc_vmem, send_sem, tc_sem, device_id={"tc": 1}
    ).wait_send()

  with mpmd.tpu_target(TARGET):
    f = _into_tensorcore_vmem(sc_fn)
    with pytest.raises(ValueError, match=r"expected an index in \[0, 1\)"):
      jax.jit(f)(_x())
