"""Collective matmul kernels vs plain-JAX references, under jax.shard_map.

``CollectiveMatmulTest`` is the test base: the correctness cases, built on
``KernelRunner``, which binds the kernels to one implementation and one
execution path through its ``implementation`` and ``interpret``; each case
compares a kernel with the f32 HIGHEST-precision product of the global
operands (or, for gradients, with a plain-JAX collective). One subclass per
implementation, each run on simulated CPU devices with interpret=None (their
devices exchange data in step, so the CPU fallback runs them on the lockstep
path: remote DMAs as XLA collectives):

* ``TestDirect``: ``implementation="direct"``, the CPU fallback's default;
* ``TestRing``: ``implementation="ring"``, what a TPU runs;

and one class per other execution path:

* ``TestTpuSimulator`` reruns a selection of the base's cases in the threaded
  TPU simulator with its race detector on (every case there would take many
  minutes, so it reuses the base's methods rather than subclassing it);
* ``TestTpuLowering`` cross-lowers the kernels for TPU from this CPU host.

Ring lengths 2, 3, 4 and 8, both directions, 1/2/4 receive slots, f32 and
bf16, 1-D and 2-D meshes, explicit ring orders, multi-tile pipelines and
gradients are covered; the 8-device cases are marked slow (CI runs them).
Bad arguments are in ``test_collective_matmul_errors.py``.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collective_matmul_util import (
  HIGHEST,
  assert_close,
  make_mesh,
  operands,
  reference_matmul,
  sharded,
  trace_sharded,
)
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from launches import kernel_path
from lowerings import tpu_text
from python_runs import run_python

import mpmd
from mpmd import demos
from mpmd._lowering import paths
from mpmd.kernels import all_gather_matmul, matmul_reduce_scatter
from mpmd.kernels import collective_matmul as cm
from mpmd.kernels.collective_matmul import checks


class KernelRunner:
  """The kernels, partially applied with this class's ``interpret`` and
  ``implementation`` (None: the platform's default)."""

  interpret = None
  implementation = None

  def ag(self, **kwargs):
    kwargs = {"implementation": self.implementation, **kwargs}
    return functools.partial(
      all_gather_matmul,
      interpret=self.interpret,
      **kwargs,
    )

  def rs(self, **kwargs):
    kwargs = {"implementation": self.implementation, **kwargs}
    return functools.partial(
      matmul_reduce_scatter,
      interpret=self.interpret,
      **kwargs,
    )


class CollectiveMatmulTest(KernelRunner):
  """The correctness cases; subclasses pick the implementation and the
  execution path."""

  # -- all_gather_matmul ----------------------------------------------------

  @pytest.mark.parametrize(
    "ring,bidirectional,buffering,dtype,n",
    [
      (2, True, 2, jnp.float32, 16),
      (2, True, 2, jnp.float32, 9),  # odd n: unidirectional fallback
      (3, True, 2, jnp.bfloat16, 16),  # odd ring, both directions
      (3, False, 1, jnp.float32, 16),
      (4, True, 1, jnp.bfloat16, 16),
      (4, False, 4, jnp.float32, 16),
      pytest.param(8, True, 2, jnp.bfloat16, 16, marks=pytest.mark.slow),
      pytest.param(8, False, 4, jnp.float32, 8, marks=pytest.mark.slow),
    ],
  )
  def test_all_gather_matmul(
    self, rng, ring, bidirectional, buffering, dtype, n
  ):
    k_local, m = (16, 128) if ring == 8 else (128, 128)
    lhs, rhs = operands(rng, (n, k_local * ring), (k_local * ring, m), dtype)
    mesh = make_mesh((ring,), ("x",))
    out = sharded(
      self.ag(axis_name="x", bidirectional=bidirectional, buffering=buffering),
      mesh,
      (P(None, "x"), P()),
      P("x"),  # every device's copy, stacked: all must match
      lhs,
      rhs,
    )
    assert out.dtype == jnp.float32
    want = reference_matmul(lhs, rhs)
    assert_close(out, jnp.tile(want, (ring, 1)), jnp.float32)

  def test_all_gather_matmul_bf16_output(self, rng):
    lhs, rhs = operands(rng, (16, 4 * 128), (4 * 128, 256), jnp.bfloat16)
    out = sharded(
      self.ag(axis_name="x", preferred_element_type=jnp.bfloat16),
      make_mesh((4,), ("x",)),
      (P(None, "x"), P()),
      P("x"),
      lhs,
      rhs,
    )
    assert out.dtype == jnp.bfloat16
    assert_close(out, jnp.tile(reference_matmul(lhs, rhs), (4, 1)), out.dtype)

  def test_all_gather_matmul_multi_tile_pipeline(self, rng):
    # Every dimension spans several tiles (rows per direction 32 = 4 x 8,
    # k_local 256 = 2 x 128, m 384 = 3 x 128): exercises the prefetch of
    # the next tile pair across tile rows, columns and the K loop.
    lhs, rhs = operands(rng, (64, 2 * 256), (2 * 256, 384), jnp.float32)
    out = sharded(
      self.ag(
        axis_name="x",
        block_sizes=cm.BlockSizes(block_n=8, block_k=128, block_m=128),
      ),
      make_mesh((2,), ("x",)),
      (P(None, "x"), P()),
      P("x"),
      lhs,
      rhs,
    )
    assert_close(out, jnp.tile(reference_matmul(lhs, rhs), (2, 1)), jnp.float32)

  def test_all_gather_matmul_ring_of_one(self, rng):
    lhs, rhs = operands(rng, (16, 128), (128, 128), jnp.float32)
    out = sharded(
      self.ag(axis_name="x"), make_mesh((1,), ("x",)), (P(), P()), P(), lhs, rhs
    )
    assert_close(out, reference_matmul(lhs, rhs), jnp.float32)

  def test_all_gather_matmul_explicit_ring(self, rng):
    ring = (0, 2, 3, 1)
    lhs, rhs = operands(rng, (16, 4 * 128), (4 * 128, 128), jnp.float32)
    out = sharded(
      self.ag(axis_name="x", ring=ring, buffering=1),
      make_mesh((4,), ("x",)),
      (P(None, "x"), P()),
      P("x"),
      lhs,
      rhs,
    )
    assert_close(out, jnp.tile(reference_matmul(lhs, rhs), (4, 1)), jnp.float32)

  @pytest.mark.slow
  @pytest.mark.parametrize("ring_axis", ["x", "y"])
  def test_all_gather_matmul_2d_mesh(self, rng, ring_axis):
    # 2x4 mesh: each row (ring "y") or column (ring "x") is its own ring.
    # lhs rows are sharded over the other axis, so the rings gather
    # different data and must not mix.
    other = {"x": "y", "y": "x"}[ring_axis]
    mesh = make_mesh((2, 4), ("x", "y"))
    ring = mesh.shape[ring_axis]
    k_local = 16
    lhs, rhs = operands(
      rng,
      (8 * mesh.shape[other], k_local * ring),
      (k_local * ring, 128),
      jnp.float32,
    )
    out = sharded(
      self.ag(axis_name=ring_axis),
      mesh,
      (P(other, ring_axis), P()),
      P(other, None),
      lhs,
      rhs,
    )
    assert_close(out, reference_matmul(lhs, rhs), jnp.float32)

  @pytest.mark.slow
  def test_all_gather_matmul_ring_over_two_axes(self, rng):
    # axis_name=("x", "y"): one ring through all 8 devices of a 2x4 mesh,
    # visiting them in an explicit order that jumps between rows.
    mesh = make_mesh((2, 4), ("x", "y"))
    lhs, rhs = operands(rng, (8, 8 * 16), (8 * 16, 128), jnp.float32)
    out = sharded(
      self.ag(axis_name=("x", "y"), ring=(0, 4, 1, 5, 2, 6, 3, 7)),
      mesh,
      (P(None, ("x", "y")), P()),
      P(("x", "y")),
      lhs,
      rhs,
    )
    assert_close(out, jnp.tile(reference_matmul(lhs, rhs), (8, 1)), jnp.float32)

  # -- matmul_reduce_scatter ------------------------------------------------

  @pytest.mark.parametrize(
    "ring,scatter_dimension,bidirectional,buffering,dtype",
    [
      (2, 0, True, 2, jnp.float32),
      (3, 1, True, 1, jnp.bfloat16),
      (3, 0, False, 2, jnp.float32),
      (4, 0, False, 4, jnp.float32),
      (4, 1, True, 2, jnp.bfloat16),
      pytest.param(8, 0, True, 2, jnp.bfloat16, marks=pytest.mark.slow),
      pytest.param(8, 1, False, 1, jnp.float32, marks=pytest.mark.slow),
    ],
  )
  def test_matmul_reduce_scatter(
    self, rng, ring, scatter_dimension, bidirectional, buffering, dtype
  ):
    k_local = 16 if ring == 8 else 128
    n, m = (8 * ring, 128) if scatter_dimension == 0 else (16, 128 * ring)
    lhs, rhs = operands(rng, (n, k_local * ring), (k_local * ring, m), dtype)
    out_spec = P("x") if scatter_dimension == 0 else P(None, "x")
    out = sharded(
      self.rs(
        axis_name="x",
        scatter_dimension=scatter_dimension,
        bidirectional=bidirectional,
        buffering=buffering,
      ),
      make_mesh((ring,), ("x",)),
      (P(None, "x"), P("x")),
      out_spec,
      lhs,
      rhs,
    )
    assert out.shape == (n, m) and out.dtype == jnp.float32
    assert_close(out, reference_matmul(lhs, rhs), jnp.float32)

  def test_matmul_reduce_scatter_bf16_output_multi_tile(self, rng):
    lhs, rhs = operands(rng, (2 * 32, 2 * 256), (2 * 256, 256), jnp.bfloat16)
    out = sharded(
      self.rs(
        axis_name="x",
        preferred_element_type=jnp.bfloat16,
        block_sizes=cm.BlockSizes(block_n=16, block_k=128, block_m=128),
      ),
      make_mesh((2,), ("x",)),
      (P(None, "x"), P("x")),
      P("x"),
      lhs,
      rhs,
    )
    assert out.dtype == jnp.bfloat16
    assert_close(out, reference_matmul(lhs, rhs), jnp.bfloat16)

  def test_matmul_reduce_scatter_explicit_ring(self, rng):
    lhs, rhs = operands(rng, (32, 4 * 128), (4 * 128, 128), jnp.float32)
    out = sharded(
      self.rs(axis_name="x", ring=(3, 1, 0, 2)),
      make_mesh((4,), ("x",)),
      (P(None, "x"), P("x")),
      P("x"),
      lhs,
      rhs,
    )
    assert_close(out, reference_matmul(lhs, rhs), jnp.float32)

  @pytest.mark.slow
  @pytest.mark.parametrize("ring_axis", ["x", "y"])
  def test_matmul_reduce_scatter_2d_mesh(self, rng, ring_axis):
    other = {"x": "y", "y": "x"}[ring_axis]
    mesh = make_mesh((2, 4), ("x", "y"))
    ring = mesh.shape[ring_axis]
    lhs, rhs = operands(
      rng,
      (8 * ring, 16 * ring),
      (16 * ring, 128 * mesh.shape[other]),
      jnp.float32,
    )
    out = sharded(
      self.rs(axis_name=ring_axis),
      mesh,
      (P(None, ring_axis), P(ring_axis, other)),
      P(ring_axis, other),
      lhs,
      rhs,
    )
    assert_close(out, reference_matmul(lhs, rhs), jnp.float32)

  # -- gradients ------------------------------------------------------------

  def check_grads(self, rng, fn, ref_fn, lhs, rhs, mesh, in_specs, out_spec):
    placed = [
      jax.device_put(a, NamedSharding(mesh, s))
      for a, s in zip((lhs, rhs), in_specs, strict=True)
    ]

    def mapped(f):
      return jax.shard_map(
        f, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False
      )

    # Random output weights: every output element reaches the gradient.
    out_shape = jax.eval_shape(mapped(ref_fn), *placed).shape
    weights = jnp.asarray(rng.standard_normal(out_shape, np.float32))

    def grads(f):
      loss = lambda a, b: jnp.sum(mapped(f)(a, b) * weights)  # noqa: E731
      return jax.jit(jax.grad(loss, argnums=(0, 1)))(*placed)

    for g, w in zip(grads(fn), grads(ref_fn), strict=True):
      assert g.shape == w.shape and g.dtype == w.dtype
      assert_close(g, w, jnp.float32)

  # Ring 4 with the defaults, and ring 3 with one slot: the other
  # (unidirectional-capable, staging) schedule, in both forward and VJP.
  @pytest.mark.parametrize("ring, buffering", [(4, 2), (3, 1)])
  def test_all_gather_matmul_grad(self, rng, ring, buffering):
    lhs, rhs = operands(rng, (16, ring * 128), (ring * 128, 128), jnp.float32)

    def ref(a, b):
      gathered = lax.all_gather(a, "x", axis=1, tiled=True)
      return jnp.dot(gathered, b, precision=HIGHEST)

    self.check_grads(
      rng,
      self.ag(axis_name="x", buffering=buffering),
      ref,
      lhs,
      rhs,
      make_mesh((ring,), ("x",)),
      (P(None, "x"), P()),
      P("x"),
    )

  @pytest.mark.parametrize("scatter_dimension", [0, 1])
  def test_matmul_reduce_scatter_grad(self, rng, scatter_dimension):
    n, m = (32, 128) if scatter_dimension == 0 else (16, 4 * 128)
    lhs, rhs = operands(rng, (n, 4 * 128), (4 * 128, m), jnp.float32)

    def ref(a, b):
      product = jnp.dot(a, b, precision=HIGHEST)
      return lax.psum_scatter(
        product, "x", scatter_dimension=scatter_dimension, tiled=True
      )

    self.check_grads(
      rng,
      self.rs(axis_name="x", scatter_dimension=scatter_dimension),
      ref,
      lhs,
      rhs,
      make_mesh((4,), ("x",)),
      (P(None, "x"), P("x")),
      P("x") if scatter_dimension == 0 else P(None, "x"),
    )

  # -- check_vma=True ---------------------------------------------------------

  def test_check_vma(self, rng):
    lhs, rhs = operands(rng, (16, 2 * 128), (2 * 128, 128), jnp.float32)
    mesh = make_mesh((2,), ("x",))
    out = sharded(
      self.ag(axis_name="x"),
      mesh,
      (P(None, "x"), P()),
      P("x"),
      lhs,
      rhs,
      check_vma=True,
    )
    assert_close(out, jnp.tile(reference_matmul(lhs, rhs), (2, 1)), jnp.float32)
    out = sharded(
      self.rs(axis_name="x"),
      mesh,
      (P(None, "x"), P("x")),
      P("x"),
      lhs,
      rhs,
      check_vma=True,
    )
    assert_close(out, reference_matmul(lhs, rhs), jnp.float32)


def ring_of_two_path(kernel, rhs_spec) -> paths.Path:
  """The CPU-fallback path of ``kernel`` on a ring of 2 under shard_map."""
  mesh = make_mesh((2,), ("x",))
  in_specs = (P(None, "x"), rhs_spec)
  f = jax.shard_map(
    kernel, mesh=mesh, in_specs=in_specs, out_specs=P("x"), check_vma=False
  )
  shapes = ((16, 2 * 128), (2 * 128, 128))
  args = [
    jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, spec))
    for s, spec in zip(shapes, in_specs, strict=True)
  ]
  return kernel_path(f, *args)


def top_level_collectives(fn, *args) -> list[str]:
  """The XLA collectives the compiled entry computation runs (those in
  conditional branches, the lockstep path's fallbacks, not counted): each
  is a rendezvous of every simulated device."""
  entry = fn.lower(*args).compile().as_text().split("\nENTRY ", 1)[1]
  return re.findall(r"= \S+ (all-gather|collective-permute)\(", entry)


class TestDirect(CollectiveMatmulTest):
  """Every case with ``implementation="direct"`` (the CPU's default) on
  simulated CPU devices (interpret=None: the CPU fallback)."""

  implementation = "direct"

  @pytest.mark.parametrize("kernel", ["ag", "rs"])
  def test_takes_lockstep_path(self, kernel):
    rhs_spec = P("x") if kernel == "rs" else P()
    path = ring_of_two_path(getattr(self, kernel)(axis_name="x"), rhs_spec)
    assert path.kind == paths.LOCKSTEP, path
    assert path.manual_axes == ("x",), path

  @pytest.mark.parametrize("implementation", ["direct", "ring"])
  @pytest.mark.parametrize("kernel", ["ag", "rs"])
  def test_exchanges_per_launch(self, rng, kernel, implementation):
    """The direct schedule's handshake and data travel in one exchange, the
    ring's data in one per ring step (the handshake with the first)."""
    ring = 4
    lhs, rhs = operands(rng, (32, ring * 128), (ring * 128, 128), jnp.float32)
    mesh = make_mesh((ring,), ("x",))
    rhs_spec = P("x") if kernel == "rs" else P()
    in_specs = (P(None, "x"), rhs_spec)
    fn = jax.jit(
      jax.shard_map(
        getattr(self, kernel)(axis_name="x", implementation=implementation),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=P("x"),
        check_vma=False,
      )
    )
    args = [
      jax.device_put(a, NamedSharding(mesh, spec))
      for a, spec in zip((lhs, rhs), in_specs, strict=True)
    ]
    # Less the last collective: every device's end-of-launch verdict.
    exchanges = len(top_level_collectives(fn, *args)) - 1
    assert exchanges == (1 if implementation == "direct" else ring - 1)


class TestRing(CollectiveMatmulTest):
  """Every case with ``implementation="ring"`` (what a TPU runs) on
  simulated CPU devices."""

  implementation = "ring"


class TestTpuSimulator(KernelRunner):
  """Base cases in the TPU simulator with its race detector on.

  A race makes the launch raise (mpmd's simulator path turns the detector's
  verdict into an error), so these pass only if the flow control (capacity
  semaphores, DMA waits) orders every access to the ring buffers.
  """

  interpret = pltpu.InterpretParams(detect_races=True)

  def test_takes_simulator_path(self):
    path = ring_of_two_path(self.ag(axis_name="x"), P())
    assert path.kind == paths.TPU_SIMULATOR, path

  @pytest.mark.parametrize("buffering", [1, 2])
  def test_all_gather_matmul_no_race(self, rng, buffering):
    CollectiveMatmulTest.test_all_gather_matmul(
      self, rng, 4, True, buffering, jnp.float32, 16
    )

  @pytest.mark.parametrize("buffering", [1, 2])
  def test_matmul_reduce_scatter_no_race(self, rng, buffering):
    CollectiveMatmulTest.test_matmul_reduce_scatter(
      self, rng, 4, 0, True, buffering, jnp.float32
    )

  def test_direct_implementation_no_race(self, rng):
    direct = TestTpuSimulator()
    direct.implementation = "direct"
    CollectiveMatmulTest.test_all_gather_matmul(
      direct, rng, 4, True, 2, jnp.float32, 16
    )
    CollectiveMatmulTest.test_matmul_reduce_scatter(
      direct, rng, 4, 1, True, 2, jnp.float32
    )

  @pytest.mark.slow
  def test_no_race_on_2d_mesh(self, rng):
    CollectiveMatmulTest.test_all_gather_matmul_2d_mesh(self, rng, "y")
    CollectiveMatmulTest.test_matmul_reduce_scatter_2d_mesh(self, rng, "x")

  def test_detector_finds_a_ring_race(self):
    # Control: a ring exchange *without* flow control (each device reads its
    # receive buffer while its neighbour may be writing it) must be caught,
    # or the no-race tests above would prove nothing. In a subprocess: a
    # detected race leaves the runtime's ordered-effects token failed, which
    # would fail every later launch in this process.
    result = run_python(_RACY_RING_PROGRAM, timeout=300)
    assert result.returncode != 0, result.stdout
    assert "RaceError" in result.stderr, result.stderr[-2000:]


_RACY_RING_PROGRAM = """
import jax
jax.config.update("jax_num_cpu_devices", 2)
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P
import mpmd

def body(x_ref, o_ref, buf_ref, vmem, send_sem, recv_sem):
  right = {"x": lax.rem(lax.axis_index("x") + 1, 2)}
  copy = pltpu.make_async_remote_copy(
      x_ref, buf_ref, send_sem, recv_sem, device_id=right)
  copy.start()
  pltpu.sync_copy(buf_ref, vmem)  # no wait_recv first: races with the DMA
  copy.wait_send()
  copy.wait_recv()
  pltpu.sync_copy(vmem, o_ref)

def racy(x):
  return mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), body)],
      (jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2,
      scratch_types=(pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA,
                     pltpu.SemaphoreType.DMA),
      compiler_params=pltpu.CompilerParams(collective_id=0),
      interpret=pltpu.InterpretParams(detect_races=True))(x)[0]

mesh = jax.make_mesh((2,), ("x",))
x = jax.device_put(jnp.ones((16, 128)), NamedSharding(mesh, P("x")))
f = jax.shard_map(racy, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                  check_vma=False)
jax.block_until_ready(jax.jit(f)(x))
jax.effects_barrier()
"""


# -- TPU cross-lowering from this CPU host -----------------------------------


class TestTpuLowering:
  """The kernels lower to Mosaic with the collective set up, built for TPU
  (``tpu_target``: the ring, TPU tiles) unless a case names its
  implementation."""

  def lower(self, fn, mesh, in_specs, out_specs, *shapes) -> str:
    with mpmd.tpu_target():
      return (
        trace_sharded(fn, mesh, in_specs, out_specs, *shapes)
        .lower(lowering_platforms=("tpu",))
        .as_text()
      )

  def assert_collective_kernel(self, text: str, count: int = 1):
    assert text.count("tpu_custom_call") == count
    # Remote DMAs and the barrier semaphore need both of these.
    assert re.search(r"has_communication\\22: true", text)
    assert re.search(r"collective_id\\22: 0", text)

  @pytest.mark.parametrize(
    "mesh_shape,ring_axis,implementation",
    [
      ((4,), "x", None),
      ((2, 4), "y", None),
      ((2, 4), "x", None),
      ((2, 4), "y", "direct"),
    ],
  )
  def test_all_gather_matmul(self, mesh_shape, ring_axis, implementation):
    names = ("x", "y")[: len(mesh_shape)]
    mesh = make_mesh(mesh_shape, names)
    ring = mesh.shape[ring_axis]
    text = self.lower(
      functools.partial(
        all_gather_matmul,
        axis_name=ring_axis,
        implementation=implementation,
      ),
      mesh,
      (P(None, ring_axis), P()),
      P(),
      ((256, 512 * ring), jnp.bfloat16),
      ((512 * ring, 1024), jnp.bfloat16),
    )
    self.assert_collective_kernel(text)

  @pytest.mark.parametrize("implementation", [None, "direct"])
  @pytest.mark.parametrize("scatter_dimension", [0, 1])
  def test_matmul_reduce_scatter(self, scatter_dimension, implementation):
    mesh = make_mesh((2, 4), ("x", "y"))
    text = self.lower(
      functools.partial(
        matmul_reduce_scatter,
        axis_name="y",
        scatter_dimension=scatter_dimension,
        implementation=implementation,
      ),
      mesh,
      (P(None, "y"), P("y")),
      P("y") if scatter_dimension == 0 else P(None, "y"),
      ((512, 4 * 256), jnp.bfloat16),
      ((4 * 256, 1024), jnp.bfloat16),
    )
    self.assert_collective_kernel(text)

  def test_grad_lowers(self):
    # Forward kernel + both backward kernels (reduce-scatter and all-gather).
    mesh = make_mesh((4,), ("x",))

    def loss(a, b):
      f = jax.shard_map(
        functools.partial(all_gather_matmul, axis_name="x"),
        mesh=mesh,
        in_specs=(P(None, "x"), P()),
        out_specs=P("x"),
        check_vma=False,
      )
      return jnp.sum(f(a, b))

    args = [
      jax.ShapeDtypeStruct(
        (128, 4 * 256), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "x"))
      ),
      jax.ShapeDtypeStruct(
        (4 * 256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P())
      ),
    ]
    with mpmd.tpu_target():
      text = tpu_text(jax.grad(loss, argnums=(0, 1)), *args)
    self.assert_collective_kernel(text, count=2)

  @pytest.mark.parametrize(
    "name", ["all_gather_matmul", "matmul_reduce_scatter"]
  )
  def test_registered_demo_lowers(self, name):
    demo = demos.registered()[name]()
    assert demo.platforms == ("tpu", "cpu")
    with mpmd.tpu_target():
      text = (
        jax.jit(demo.fn)
        .trace(*demo.args)
        .lower(lowering_platforms=("tpu",))
        .as_text()
      )
    self.assert_collective_kernel(text)


def test_pick_block_tiles_large_dimensions():
  # Large dims are tiled (so no operand has to fit in VMEM), small ones not.
  pick = functools.partial(checks.pick_block, "f", "block_k", requested=None)
  assert pick(4096, platform="tpu") == 512
  assert pick(640, platform="tpu") == 128
  assert pick(384, platform="tpu") == 384
  assert pick(1000, platform="tpu") == 1000
  # The CPU fallback prefers fewer, larger tiles; inside tpu_target the
  # kernel is built for TPU.
  assert pick(4096, platform="cpu") == 2048
  assert pick(1024) == 1024
  with mpmd.tpu_target():
    assert pick(1024) == 512
