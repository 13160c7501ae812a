"""jax.export of mpmd_map launches (issue #11, point 5).

Exports for the hardware alone (``("tpu",)``, ``("cuda",)``) of every
shipped kernel serialize, deserialize and lower again, whatever their CPU
path. A ``("cpu", "tpu")`` export round-trips when the CPU lowering is plain
HLO (the fast path without callbacks); when the CPU path runs Python host
callbacks (a simulator, the lockstep path, or the fast path's run-time
checks) it is refused at export time, naming the path and saying to export
for the hardware only.
"""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd import kernels
from mpmd._lowering import paths
from mpmd.demos import gpu_two_meshes
from mpmd.kernels import gpu

S = jax.ShapeDtypeStruct
ROWS = (8, 128)
# What a lowering for the hardware holds: a Mosaic (TPU) custom call, or the
# Mosaic GPU one (as tests/kernels/gpu/gpu_test_util.MOSAIC_GPU_CALL).
CUSTOM_CALL = {
  "tpu": re.compile(r"tpu_custom_call"),
  "cuda": re.compile(r"custom_call @mosaic_gpu"),
}


# -- kernels: each case gives (function, argument types) ---------------------


def scale(x):
  """One TensorCore, local DMAs only: the fast path, no callbacks."""

  def kernel(x_hbm, o_hbm, buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] = buf[...] * 2.0
    pltpu.sync_copy(buf, o_hbm)

  return mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    S(x.shape, x.dtype),
    scratch_types=[pltpu.VMEM(x.shape, x.dtype)],
  )(x)


def producer_consumer(x, interpret=None):
  """Two meshes synchronising by semaphores: the TPU simulator on CPU."""
  producer = mpmd.tensorcore_mesh("producer", num_cores=1)
  consumer = mpmd.tensorcore_mesh("consumer", num_cores=2)

  def produce(x_hbm, o_hbm, staged, ready, buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] = buf[...] * 2.0
    pltpu.sync_copy(buf, staged)
    for c in range(2):
      pl.semaphore_signal(ready, 1, device_id={"consumer": c})

  def consume(x_hbm, o_hbm, staged, ready, buf):
    pl.semaphore_wait(ready, 1)
    pltpu.sync_copy(staged, buf)
    pltpu.sync_copy(buf, o_hbm.at[jax.lax.axis_index("consumer")])

  return mpmd.mpmd_map(
    [(consumer, consume), (producer, produce)],
    S((2, *x.shape), x.dtype),
    scratch_types=[
      pltpu.HBM(x.shape, x.dtype),
      pltpu.SemaphoreType.REGULAR @ consumer,
      pltpu.VMEM(x.shape, x.dtype) @ consumer,
    ],
    interpret=interpret,
    name="producer_consumer",
  )(x)


def ring(kernel, rhs_spec, out_spec):
  """``kernel`` in a shard_map over a ring of 4 devices (lhs columns split)."""
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  specs = (P(None, "x"), rhs_spec)
  f = jax.shard_map(
    partial(kernel, axis_name="x"),
    mesh=mesh,
    in_specs=specs,
    out_specs=out_spec,
    check_vma=False,
  )
  shapes = ((128, 1024), (1024, 256))
  return f, [
    S(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    for shape, spec in zip(shapes, specs, strict=True)
  ]


def types(*shapes, dtype=jnp.bfloat16):
  return [S(shape, dtype) for shape in shapes]


# name: (function, argument types)
TPU_CASES = {
  "all_gather_matmul": ring(kernels.all_gather_matmul, P(), P()),
  "matmul_reduce_scatter": ring(kernels.matmul_reduce_scatter, P("x"), P("x")),
  # Four groups: group sizes are an int32[4] operand.
  "gmm": (kernels.gmm, types((128, 256), (4, 256, 128)) + [S((4,), jnp.int32)]),
  "tgmm": (kernels.tgmm, types((256, 128), (128, 128)) + [S((4,), jnp.int32)]),
  "producer_consumer": (producer_consumer, types(ROWS, dtype=jnp.float32)),
  "scale": (scale, types(ROWS, dtype=jnp.float32)),
}
AB = types((128, 128), (128, 256), dtype=jnp.float16)
CUDA_CASES = {
  "matmul_software": (partial(gpu.matmul, warp_specialized=False), AB),
  "matmul_ws2": (
    partial(gpu.matmul, warp_specialized=True, num_compute_wgs=2),
    AB,
  ),
  "fused_matmul_relu": (
    partial(gpu.fused_matmul, activation="relu", out_dtype=jnp.float32),
    AB + types((128, 256), dtype=jnp.float32),
  ),
  "gpu_two_meshes": (gpu_two_meshes, types((128, 128), dtype=jnp.float32)),
}


def export(f, args, platforms):
  return jax.export.export(jax.jit(f), platforms=platforms)(*args)


def round_trip(exp):
  back = jax.export.deserialize(exp.serialize())
  assert back.platforms == exp.platforms
  assert back.in_avals == exp.in_avals
  assert back.out_avals == exp.out_avals
  assert back.ordered_effects == exp.ordered_effects
  assert back.unordered_effects == exp.unordered_effects
  assert back.nr_devices == exp.nr_devices
  return back


# -- exports for the hardware only --------------------------------------------


@pytest.mark.parametrize(
  "platform,case",
  [("tpu", c) for c in TPU_CASES] + [("cuda", c) for c in CUDA_CASES],
)
def test_hardware_export_serializes_and_lowers_again(platform, case):
  f, args = {**TPU_CASES, **CUDA_CASES}[case]
  with mpmd.tpu_target("v5e"):  # the TPU kernels pick TPU tile sizes
    exp = export(f, args, (platform,))
  back = round_trip(exp)
  assert back.platforms == (platform,)
  assert CUSTOM_CALL[platform].search(back.mlir_module())
  traced = jax.jit(back.call).trace(*args)  # a call of the deserialized export
  text = traced.lower(lowering_platforms=(platform,)).as_text()
  assert CUSTOM_CALL[platform].search(text)


# -- exports that carry a CPU lowering ----------------------------------------


def test_fast_path_cpu_tpu_export_round_trips_and_runs(rng):
  x = jnp.asarray(rng.standard_normal(ROWS), jnp.float32)
  exp = export(scale, [x], ("cpu", "tpu"))
  assert exp.ordered_effects == () and exp.unordered_effects == ()
  back = round_trip(exp)
  assert back.platforms == ("cpu", "tpu")
  assert CUSTOM_CALL["tpu"].search(back.mlir_module())
  np.testing.assert_array_equal(back.call(x), 2.0 * x)


def refused(case, platforms, kind, reason, fn=None, marks=()):
  """A CPU lowering that runs host callbacks: the export must refuse it."""
  f, args = {**TPU_CASES, **CUDA_CASES}[case]
  return pytest.param(
    fn or f,
    args,
    platforms,
    rf"kernel '{case}': it takes the CPU fallback's {re.escape(kind)} path "
    rf"\([^)]*{re.escape(reason)}.*\)",
    id=f"{case}-interpret" if fn else case,
    marks=marks,
  )


CPU_TPU = ("cpu", "tpu")


@pytest.mark.parametrize(
  "f,args,platforms,path",
  [
    refused("producer_consumer", CPU_TPU, paths.CHECK, "signals a semaphore"),
    refused(
      "producer_consumer",
      CPU_TPU,
      paths.TPU_SIMULATOR,
      "interpret= gave TPU InterpretParams",
      fn=partial(producer_consumer, interpret=pltpu.InterpretParams()),
    ),
    refused("all_gather_matmul", CPU_TPU, paths.LOCKSTEP, "barrier semaphore"),
    refused(
      "matmul_reduce_scatter",
      CPU_TPU,
      paths.LOCKSTEP,
      "barrier semaphore",
      marks=pytest.mark.slow,
    ),
    refused("gpu_two_meshes", ("cpu", "cuda"), paths.GPU_SIMULATOR, "GPU mesh"),
  ],
)
def test_callback_path_cpu_export_is_refused(f, args, platforms, path):
  with pytest.raises(
    NotImplementedError,
    match=rf"cannot export the CPU lowering of {path}, which runs Python host "
    r"callbacks, and jax.export cannot serialize those. Export for the "
    r"hardware only",
  ):
    export(f, args, platforms)


@pytest.mark.parametrize("case", ["gmm", "tgmm"])
def test_grouped_matmul_cpu_export_names_its_run_time_checks(case, rng):
  # The fast path, but group sizes make DMA windows data dependent: they are
  # checked at run time by a host callback, which cannot be serialized.
  f, (*operands, _) = TPU_CASES[case]
  args = [jnp.asarray(rng.standard_normal(t.shape), t.dtype) for t in operands]
  args.append(jnp.asarray([32, 0, 64, 32], jnp.int32))  # sums to m = 128
  with pytest.raises(
    NotImplementedError,
    match=rf"CPU fallback's {paths.FAST} path, whose run-time checks \(DMA "
    r"windows that depend on run-time values.*Export for the hardware only",
  ):
    export(f, args, ("cpu", "tpu"))


def test_interpret_export_for_hardware_is_refused_clearly():
  f = partial(producer_consumer, interpret=pltpu.InterpretParams())
  _, args = TPU_CASES["producer_consumer"]
  with pytest.raises(
    NotImplementedError,
    match=r"cannot export kernel 'producer_consumer' with interpret=.*"
    r"Export with interpret=None",
  ):
    export(f, args, ("tpu",))
