"""The kernels' named implementations (``implementation=``), every family.

Each public kernel has two implementations, ``tpu`` (what a TPU runs) and
``cpu`` (the CPU fallback's default); their correctness against the XLA
references is in each family's test base, subclassed per implementation
(``test_collective_matmul.py``: ``TestRing`` / ``TestDirect``;
``test_grouped_matmul.py``: ``TestTiled`` / ``TestWindows``;
``test_ragged_all_to_all.py``: ``TestConditional`` / ``TestWindow``). Here:
which one ``implementation=None`` picks, that it traces exactly what naming
it traces, and the errors for a name or a platform that does not fit, each
raised while tracing, before anything is lowered.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from collective_matmul_util import make_mesh
from error_cases import Case, params, raises
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd import targets
from mpmd.kernels import all_gather_matmul, matmul_reduce_scatter
from mpmd.kernels import collective_matmul as cm
from mpmd.kernels import grouped_matmul as gm
from mpmd.kernels.moe import ragged

S = jax.ShapeDtypeStruct
F32 = jnp.float32

FAMILIES = {
  "collective_matmul": (cm.api.IMPLEMENTATIONS, ("ring", "direct")),
  "grouped_matmul": (gm.api.IMPLEMENTATIONS, ("tiled", "windows")),
  "ragged_all_to_all": (ragged.IMPLEMENTATIONS, ("conditional", "window")),
}


@pytest.fixture(autouse=True)
def _no_target_from_the_environment(monkeypatch):
  # $MPMD_TPU_TARGET would build for TPU on this host too.
  monkeypatch.delenv("MPMD_TPU_TARGET", raising=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_default_follows_the_platform(family):
  impls, (tpu, cpu) = FAMILIES[family]
  assert impls.names == (tpu, cpu)
  resolve = functools.partial(impls.resolve, "f")
  assert resolve(None, None) == cpu  # the CPU fallback
  assert resolve(None, True) == cpu  # the HLO interpreter, on CPU
  assert resolve(None, pltpu.InterpretParams()) == tpu  # simulating a TPU
  with mpmd.tpu_target():
    assert resolve(None, None) == tpu  # building for one
  # Named, each runs anywhere.
  assert resolve(tpu, None) == tpu
  with mpmd.tpu_target():
    assert resolve(cpu, None) == cpu


# -- the default traces what naming it traces --------------------------------


def _ag(**kwargs):
  mesh = make_mesh((2,), ("x",))
  f = jax.shard_map(
    functools.partial(all_gather_matmul, axis_name="x", **kwargs),
    mesh=mesh,
    in_specs=(P(None, "x"), P()),
    out_specs=P(),
    check_vma=False,
  )
  args = (
    S((8, 256), F32, sharding=NamedSharding(mesh, P(None, "x"))),
    S((256, 128), F32, sharding=NamedSharding(mesh, P())),
  )
  return f, args


def _rs(**kwargs):
  mesh = make_mesh((2,), ("x",))
  f = jax.shard_map(
    functools.partial(matmul_reduce_scatter, axis_name="x", **kwargs),
    mesh=mesh,
    in_specs=(P(None, "x"), P("x")),
    out_specs=P("x"),
    check_vma=False,
  )
  args = (
    S((16, 256), F32, sharding=NamedSharding(mesh, P(None, "x"))),
    S((256, 128), F32, sharding=NamedSharding(mesh, P("x"))),
  )
  return f, args


def _gmm(**kwargs):
  args = (S((64, 32), F32), S((4, 32, 16), F32), S((4,), jnp.int32))
  return functools.partial(gm.gmm, **kwargs), args


def _tgmm(**kwargs):
  args = (S((32, 64), F32), S((64, 16), F32), S((4,), jnp.int32))
  return functools.partial(gm.tgmm, **kwargs), args


def _ragged(**kwargs):
  mesh = make_mesh((2,), ("x",))
  f = jax.shard_map(
    functools.partial(mpmd.kernels.ragged_all_to_all, axis_name="x", **kwargs),
    mesh=mesh,
    in_specs=P("x"),
    out_specs=P("x"),
  )
  spec = NamedSharding(mesh, P("x"))
  args = [S((2 * 8, 4), F32, sharding=spec), S((2 * 8, 4), F32, sharding=spec)]
  return f, (*args, *[S((2 * 2,), jnp.int32, sharding=spec)] * 4)


KERNELS = {
  "all_gather_matmul": (_ag, "collective_matmul"),
  "matmul_reduce_scatter": (_rs, "collective_matmul"),
  "gmm": (_gmm, "grouped_matmul"),
  "tgmm": (_tgmm, "grouped_matmul"),
  "ragged_all_to_all": (_ragged, "ragged_all_to_all"),
}


def _jaxpr(make, **kwargs) -> str:
  f, args = make(**kwargs)
  return str(jax.make_jaxpr(f)(*args))


@pytest.mark.parametrize("kernel", KERNELS)
def test_default_is_the_named_implementation(kernel):
  make, family = KERNELS[kernel]
  tpu, cpu = FAMILIES[family][1]
  default, named_cpu = _jaxpr(make), _jaxpr(make, implementation=cpu)
  assert default == named_cpu
  assert default != _jaxpr(make, implementation=tpu)
  with mpmd.tpu_target():
    assert _jaxpr(make) == _jaxpr(make, implementation=tpu)


def test_a_tiling_selects_the_tiled_gmm():
  tiling = (16, 32, 16)
  got = _jaxpr(_gmm, tiling=tiling)
  assert got == _jaxpr(_gmm, tiling=tiling, implementation="tiled")


def test_tiled_without_a_tiling_takes_the_tpus_tiles():
  tpu_tiles = gm.default_tiling(64, 32, 16, platform="tpu")
  assert tpu_tiles is not None
  got = _jaxpr(_gmm, implementation="tiled")
  assert got == _jaxpr(_gmm, implementation="tiled", tiling=tpu_tiles)


@pytest.mark.parametrize(
  "kernel", ["all_gather_matmul", "matmul_reduce_scatter"]
)
def test_schedule_is_a_deprecated_alias(kernel):
  make = KERNELS[kernel][0]
  with pytest.warns(
    DeprecationWarning,
    match=rf"{kernel}: 'schedule' is deprecated, pass "
    r"implementation='ring' instead",
  ):
    got = _jaxpr(make, schedule="ring")
  assert got == _jaxpr(make, implementation="ring")


# -- errors, before lowering -------------------------------------------------


def _trace(kernel, **kwargs):
  return lambda: _jaxpr(KERNELS[kernel][0], **kwargs)


ERRORS = [
  Case(
    f"{kernel}-unknown",
    _trace(kernel, implementation="fast"),
    ValueError,
    rf"^{kernel}: expected 'implementation' in \('{tpu}', '{cpu}'\) or "
    r"None, got 'fast'",
  )
  for kernel, (_, family) in KERNELS.items()
  for tpu, cpu in [FAMILIES[family][1]]
] + [
  Case(
    "gmm-not-a-str",
    _trace("gmm", implementation=("tiled",)),
    TypeError,
    r"^gmm: expected 'implementation' to be a str in \('tiled', 'windows'\) "
    r"or None, got tuple: \('tiled',\)",
  ),
  Case(
    "gmm-windows-with-a-tiling",
    _trace("gmm", implementation="windows", tiling=(16, 32, 16)),
    ValueError,
    r"^gmm: 'tiling' applies to implementation='tiled' only \(the 'windows' "
    r"implementation runs no tiles\), got tiling=\(16, 32, 16\) with "
    r"implementation='windows'",
  ),
  Case(
    "tgmm-windows-with-a-tiling",
    _trace("tgmm", implementation="windows", tiling=(16, 32, 16)),
    ValueError,
    r"^tgmm: 'tiling' applies to implementation='tiled' only",
  ),
]


@pytest.mark.parametrize("case", params(ERRORS))
def test_error(case):
  raises(case)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("named", [False, True])
def test_no_implementation_lowers_for_cuda(monkeypatch, kernel, named):
  # On a GPU host (or under a CUDA abstract mesh), without an interpreter,
  # mpmd_map would fail only while lowering ("CUDA lowering needs Mosaic
  # GPU meshes"); the kernels say so while tracing, naming the fix.
  make, family = KERNELS[kernel]
  tpu = FAMILIES[family][1][0]
  monkeypatch.setattr(targets, "platform", lambda: "gpu")
  kwargs = {"implementation": tpu} if named else {}
  want = tpu if named else FAMILIES[family][1][1]
  raises(
    Case(
      kernel,
      _trace(kernel, **kwargs),
      ValueError,
      rf"^{kernel}: implementation '{want}' lowers for TPU \(Mosaic\) and "
      rf"runs on the CPU fallback, as every implementation of {kernel} "
      r"does; none lowers for platform 'gpu'. Build for TPU inside "
      r"mpmd.tpu_target\(\), or pass interpret=pltpu.InterpretParams\(\) "
      r"to run the TPU simulator",
    )
  )


def test_an_interpreter_runs_on_any_platform(monkeypatch):
  monkeypatch.setattr(targets, "platform", lambda: "gpu")
  impls = gm.api.IMPLEMENTATIONS
  assert impls.resolve("gmm", None, pltpu.InterpretParams()) == "tiled"
  assert impls.resolve("gmm", "windows", True) == "windows"
