"""Built-in demos: the smallest programs that show each kernel and platform
work, for ``mpmd lower NAME`` and ``mpmd check``. Importing this module
registers them (``registered()``); kernel modules know nothing of demos."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

from mpmd import meshes, registry
from mpmd.api import mpmd_map
from mpmd.kernels import collective_matmul, grouped_matmul
from mpmd.kernels.gpu import matmul as gpu_matmul  # the function
from mpmd.registry import Demo, DemoFactory, register_demo
from mpmd.types import Interpret


def _axpy_kernel(x_hbm, y_hbm, o_hbm, x_vmem, y_vmem):
  pltpu.sync_copy(x_hbm, x_vmem)
  pltpu.sync_copy(y_hbm, y_vmem)
  x_vmem[...] = 2.0 * x_vmem[...] + y_vmem[...]
  pltpu.sync_copy(x_vmem, o_hbm)


def axpy(x: jax.Array, y: jax.Array) -> jax.Array:
  """``2 * x + y`` as a one-core TPU kernel (f32 ``(8k, 128m)`` operands)."""
  mesh = meshes.tensorcore_mesh("core", num_cores=1)
  return mpmd_map(
    [(mesh, _axpy_kernel)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[pltpu.VMEM(x.shape, x.dtype)] * 2,
  )(x, y)


def _ring_shift_kernel(x_hbm, o_hbm, send, recv):
  right = jax.lax.rem(jax.lax.axis_index("x") + 1, jax.lax.axis_size("x"))
  copy = pltpu.make_async_remote_copy(
    x_hbm, o_hbm, send, recv, device_id={"x": right}
  )
  copy.start()
  copy.wait()


def ring_shift(
  x: jax.Array,
  mesh: jax.sharding.Mesh,
  *,
  check_vma: bool = False,
  interpret: Interpret = None,
) -> jax.Array:
  """Each device's block of ``x`` (sharded along ``mesh``'s axis ``"x"``)
  moves one device on, by a remote DMA: ``np.roll(x, len(x) // D, 0)``.

  ``x``: ``(D * r, c)`` (e.g. float32), ``D`` the size of axis ``"x"``. On CPU
  the lockstep path runs it (``interpret=pltpu.InterpretParams()``: the TPU
  simulator).

  Example:
    >>> from mpmd import demos
    >>> mesh = jax.make_mesh((4,), ("x",))
    >>> x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    >>> x = jax.device_put(x, NamedSharding(mesh, P("x")))
    >>> out = jax.jit(functools.partial(demos.ring_shift, mesh=mesh))(x)
    >>> import numpy as np
    >>> np.array_equal(out, np.roll(np.asarray(x), 2, axis=0))
    True
  """

  def per_device(block):
    return mpmd_map(
      [(meshes.tensorcore_mesh("core", num_cores=1), _ring_shift_kernel)],
      # The block's type: under check_vma=True, how it varies too.
      jax.typeof(block),
      scratch_types=[pltpu.SemaphoreType.DMA(())] * 2,
      interpret=interpret,
    )(block)

  spec = jax.sharding.PartitionSpec("x")
  return jax.shard_map(
    per_device, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma
  )(x)


@register_demo("quickstart")
def _quickstart() -> Demo:
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  y = jnp.ones((8, 128), jnp.float32)
  return Demo(axpy, (x, y), ("tpu", "cpu"), reference=lambda x, y: 2 * x + y)


def gpu_add_one(x: jax.Array) -> jax.Array:
  """``x + 1`` over two warpgroups, each taking half the rows."""
  mesh = plgpu.Mesh(num_threads=2, thread_name="wg")

  def body(x_ref, o_ref):
    half = x_ref.shape[0] // 2
    rows = pl.ds(jax.lax.axis_index("wg") * half, half)
    o_ref[rows, :] = x_ref[rows, :] + 1.0

  return mpmd_map([(mesh, body)], jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def _gpu_load(x_ref, o_ref, smem, loaded):
  plgpu.copy_gmem_to_smem(x_ref, smem, loaded)


def _gpu_double(x_ref, o_ref, smem, loaded):
  rows = pl.ds(jax.lax.axis_index("compute") * 64, 64)
  plgpu.barrier_wait(loaded)
  o_ref[rows, :] = smem[rows, :] * 2.0


def gpu_two_meshes(x: jax.Array) -> jax.Array:
  """``2 * x`` (f32 ``(128, n)``): a memory warpgroup loads ``x`` into SMEM,
  two compute warpgroups wait on its barrier and double 64 rows each.

  Example:
    >>> from mpmd import demos
    >>> float(demos.gpu_two_meshes(jnp.ones((128, 128), jnp.float32)).max())
    2.0
  """
  memory = plgpu.Mesh(num_threads=1, thread_name="memory")
  compute = plgpu.Mesh(num_threads=2, thread_name="compute")
  return mpmd_map(
    [(memory, _gpu_load), (compute, _gpu_double)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier(num_arrivals=1)],
    name="gpu_two_meshes",
  )(x)


@register_demo("gpu_quickstart")
def _gpu_quickstart() -> Demo:
  x = jnp.arange(128 * 128, dtype=jnp.float32).reshape(128, 128)
  return Demo(gpu_add_one, (x,), ("cuda", "cpu"), reference=lambda x: x + 1)


# -- grouped matmul ------------------------------------------------------------


def _gmm_operands():
  m, k, n, groups = 256, 128, 128, 4
  lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)
  return lhs, rhs, sizes


@register_demo("gmm")
def _gmm_demo() -> Demo:
  lhs, rhs, sizes = _gmm_operands()
  fn = functools.partial(grouped_matmul.gmm, tiling=(128, 128, 128))
  return Demo(fn, (lhs, rhs, sizes), platforms=("tpu", "cpu"))


@register_demo("tgmm")
def _tgmm_demo() -> Demo:
  m, k, n, groups = 256, 128, 128, 4
  lhs = jax.ShapeDtypeStruct((k, m), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)
  fn = functools.partial(grouped_matmul.tgmm, tiling=(128, 128, 128))
  return Demo(fn, (lhs, rhs, sizes), platforms=("tpu", "cpu"))


# -- collective matmul ---------------------------------------------------------


_DEMO_RING = 4


def _reference_matmul(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  # On the gathered global operands, in f32 (sharded contracting dimensions
  # would make jnp.dot ask for an output sharding).
  lhs32, rhs32 = (np.asarray(x, np.float32) for x in (lhs, rhs))
  return jnp.asarray(np.matmul(lhs32, rhs32))


def _collective_demo(kernel, lhs_shape, rhs_shape, rhs_spec, out_spec) -> Demo:
  """``kernel`` on a ``_DEMO_RING``-device ring, bf16, lhs sharded along K."""
  P = jax.sharding.PartitionSpec
  mesh = jax.make_mesh(
    (_DEMO_RING,), ("x",), devices=jax.devices()[:_DEMO_RING]
  )
  fn = jax.shard_map(
    functools.partial(kernel, axis_name="x"),
    mesh=mesh,
    in_specs=(P(None, "x"), rhs_spec),
    out_specs=out_spec,
    check_vma=False,
  )
  args = [
    jax.device_put(
      jax.random.normal(jax.random.key(i), shape, jnp.bfloat16),
      jax.sharding.NamedSharding(mesh, spec),
    )
    for i, (shape, spec) in enumerate(
      [(lhs_shape, P(None, "x")), (rhs_shape, rhs_spec)]
    )
  ]
  return Demo(
    fn,
    tuple(args),
    platforms=("tpu", "cpu"),
    num_devices=_DEMO_RING,
    reference=_reference_matmul,
  )


@register_demo("all_gather_matmul")
def _all_gather_matmul_demo() -> Demo:
  P = jax.sharding.PartitionSpec
  return _collective_demo(
    collective_matmul.all_gather_matmul,
    lhs_shape=(16, 128 * _DEMO_RING),
    rhs_shape=(128 * _DEMO_RING, 128),
    rhs_spec=P(),
    out_spec=P(),
  )


@register_demo("matmul_reduce_scatter")
def _matmul_reduce_scatter_demo() -> Demo:
  P = jax.sharding.PartitionSpec
  return _collective_demo(
    collective_matmul.matmul_reduce_scatter,
    lhs_shape=(16 * _DEMO_RING, 128 * _DEMO_RING),
    rhs_shape=(128 * _DEMO_RING, 256),
    rhs_spec=P("x"),
    out_spec=P("x"),
  )


# -- GPU matmul ----------------------------------------------------------------


def _gpu_matmul(warp_specialized: bool) -> Demo:
  # One CTA row of two tiles, two K steps: small enough for the simulator.
  m, n, k = 128, 256, 128
  key_a, key_b = jax.random.split(jax.random.key(0))
  a = jax.random.normal(key_a, (m, k), jnp.float16)
  b = jax.random.normal(key_b, (k, n), jnp.float16)
  return Demo(
    fn=lambda a, b: gpu_matmul(a, b, warp_specialized=warp_specialized),
    args=(a, b),
    platforms=("cuda", "cpu"),
  )


register_demo("gpu_matmul")(lambda: _gpu_matmul(False))
register_demo("gpu_matmul_ws")(lambda: _gpu_matmul(True))


def registered() -> dict[str, DemoFactory]:
  """Every built-in demo, by name (``mpmd lower NAME``, ``mpmd check``)."""
  return registry.registered()
