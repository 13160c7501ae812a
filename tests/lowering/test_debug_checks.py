"""A kernel's ``pl.debug_check`` on the CPU fallback: upstream's meaning.

With ``pl.enable_debug_checks`` on when the launch is lowered, Mosaic
asserts the check on hardware; on every CPU path a failed check is an
``mpmd.DebugCheckError`` naming the kernel, the program (and device) and
the line, then the user's message. With it off the check is nothing, on
every path (it used to surface as an ``OutOfBoundsError`` on the fast path
of a kernel with run-time window checks, and the checking executor refused
it)."""

import base64
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rings
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd

LINE = r"\S*test_debug_checks.py:\d+"
INPUT = jnp.arange(8, dtype=jnp.int32)


def first_is_zero(x_hbm, o_hbm, s):
  """Checks ``x[0] == 0``; copies ``x[x[1]]`` to ``o[0]`` (a window known
  at run time only: the fast path checks it too)."""
  pltpu.sync_copy(x_hbm, s)
  pl.debug_check(s[0] == 0, "x[0] is not zero {as Mosaic prints it}")
  pltpu.sync_copy(x_hbm.at[pl.ds(s[1], 1)], o_hbm.at[pl.ds(0, 1)])
  pltpu.sync_copy(x_hbm.at[pl.ds(1, 7)], o_hbm.at[pl.ds(1, 7)])


def expected(x):
  return x.at[0].set(x[x[1]])


def launch(interpret=None):
  return jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), first_is_zero)],
      jax.ShapeDtypeStruct((8,), jnp.int32),
      scratch_types=[pltpu.SMEM((8,), jnp.int32)],
      interpret=interpret,
    )
  )


@pytest.mark.parametrize(
  "interpret, program",
  [(None, r"mesh 0 program 0 \(core=0\)"), (mpmd.CheckParams(), "mesh 0 ")],
  ids=["fast", "checker"],
)
def test_a_failed_check_is_a_debug_check_error(interpret, program):
  f = launch(interpret)
  passing = INPUT.at[0].set(0)
  failing = INPUT.at[0].set(3)
  with pl.enable_debug_checks(True):
    np.testing.assert_array_equal(f(passing), expected(passing))
    for _ in range(2):  # typed on every call, not only the first
      with (
        pytest.raises(
          mpmd.DebugCheckError,
          match=rf"pl.debug_check failed in kernel first_is_zero at {LINE}, "
          rf"{program}.* at {LINE}:\d+ \(first_is_zero\): x\[0\] is not zero "
          r"\{as Mosaic "
          r"prints it\}",
        ),
        mpmd.typed_errors(),
      ):
        jax.block_until_ready(f(failing))
  # Off (the default): no check at all, on every path.
  np.testing.assert_array_equal(f(failing), expected(failing))


def test_explore_reports_a_debug_check():
  with pl.enable_debug_checks(True):
    report = mpmd.explore(launch(), INPUT.at[0].set(1), schedules=2)
  assert [f.kind for f in report.failures] == ["debug_check"]


def test_the_device_is_named_on_the_lockstep_path():
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])

  def kernel(x_hbm, o_hbm, s, send, recv):
    pltpu.sync_copy(x_hbm, s)
    pl.debug_check(s[0] < 2, "the value is too large")
    rings.copy_to_right(x_hbm, o_hbm, send, recv, 4).wait()

  def f(x):
    return mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_types=[
        pltpu.SMEM(x.shape, x.dtype),
        pltpu.SemaphoreType.DMA,
        pltpu.SemaphoreType.DMA,
      ],
    )(x)

  g = jax.jit(
    jax.shard_map(
      f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False
    )
  )
  x = jax.device_put(
    jnp.repeat(jnp.arange(4, dtype=jnp.int32), 8), NamedSharding(mesh, P("x"))
  )
  with pl.enable_debug_checks(True):
    with (
      pytest.raises(
        mpmd.DebugCheckError,
        match=r"in kernel kernel at .*, device \(x=2\) at "
        rf"{LINE}:\d+ \(\S*kernel\): the value is too large",
      ),
      mpmd.typed_errors(),
    ):
      jax.block_until_ready(g(x))
  expected = np.roll(np.asarray(x).reshape(4, 8), 1, axis=0).reshape(-1)
  np.testing.assert_array_equal(g(x), expected)


def _mosaic_bodies(f, *args) -> list[bytes]:
  text = f.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
  bodies = []
  for config in re.findall(r'backend_config = "(.*?)"[,}]', text):
    body = re.search(r"\\22body\\22: \\22(.*?)\\22", config)
    if body is not None:
      bodies.append(base64.b64decode(body.group(1)))
  return bodies


def test_mosaic_asserts_the_check_only_when_enabled():
  with pl.enable_debug_checks(True):
    [on] = _mosaic_bodies(launch(), INPUT)
  [off] = _mosaic_bodies(launch(), INPUT)
  assert b"x[0] is not zero" in on
  assert b"x[0] is not zero" not in off


def test_gpu_meshes_on_the_checker():
  mesh = plgpu.Mesh(num_threads=2, thread_name="wg")

  def kernel(x_ref, o_ref):
    wg = jax.lax.axis_index("wg")
    pl.debug_check(x_ref[0, 0] == 0.0, "first is not zero")
    cols = pl.ds(wg * 64, 64)
    o_ref[:, cols] = x_ref[:, cols] + 1.0

  f = mpmd.mpmd_map(
    [(mesh, kernel)],
    jax.ShapeDtypeStruct((8, 128), jnp.float32),
    interpret=mpmd.CheckParams(),
  )
  x = jnp.ones((8, 128), jnp.float32)
  np.testing.assert_array_equal(f(x), x + 1.0)  # off: no check
  with (
    pl.enable_debug_checks(True),
    pytest.raises(
      mpmd.DebugCheckError,
      match=r"warpgroup \{'wg': 0\} at .*: first is not zero",
    ),
  ):
    f(x)
