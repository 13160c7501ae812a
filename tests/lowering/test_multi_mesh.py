"""Several (mesh, function) pairs in one launch: CPU fallback and lowering."""

import functools

import jax
import jax.numpy as jnp
import lowerings
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd import _jax, cli, registry, simulators

ROWS = (8, 128)


def tc(name, n):
  return mpmd.tensorcore_mesh(name, num_cores=n)


def producer_consumer(x, *, consumers=2, wait=True, interpret=None):
  """One producer stages 2x in shared HBM and signals every consumer."""
  producer, consumer = tc("producer", 1), tc("consumer", consumers)

  def produce(x_hbm, o_hbm, staged, ready, buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] = buf[...] * 2.0
    pltpu.sync_copy(buf, staged)
    for c in range(consumers):
      pl.semaphore_signal(ready, 1, device_id={"consumer": c})

  def consume(x_hbm, o_hbm, staged, ready, buf):
    c = jax.lax.axis_index("consumer")
    if wait:
      pl.semaphore_wait(ready, 1)
    pltpu.sync_copy(staged, buf)
    buf[...] = buf[...] + c.astype(jnp.float32)
    pltpu.sync_copy(buf, o_hbm.at[c])

  return mpmd.mpmd_map(
    # The consumers are listed first: they must wait for a later mesh.
    [(consumer, consume), (producer, produce)],
    jax.ShapeDtypeStruct((consumers, *x.shape), x.dtype),
    scratch_types=[
      pltpu.HBM(x.shape, x.dtype),
      pltpu.SemaphoreType.REGULAR @ consumer,
      pltpu.VMEM @ consumer,
    ][:2]
    + [(pltpu.VMEM @ consumer)(x.shape, x.dtype)],
    interpret=interpret,
  )(x)


def pc_reference(x, consumers=2):
  c = jnp.arange(consumers, dtype=x.dtype)[:, None, None]
  return 2.0 * x[None] + c


def test_producer_consumer_consumer_listed_first(rng):
  x = jnp.asarray(rng.standard_normal(ROWS), jnp.float32)
  np.testing.assert_allclose(producer_consumer(x), pc_reference(x))


def test_producer_consumer_takes_the_checking_executor(capsys):
  x = jnp.ones(ROWS, jnp.float32)
  producer = tc("producer", 1)

  def produce(x_hbm, o_hbm, sem):
    pltpu.sync_copy(x_hbm, o_hbm)
    pl.semaphore_signal(sem, 1, device_id={"producer": 0})
    pl.semaphore_wait(sem, 1)

  mpmd.mpmd_map(
    [(producer, produce)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR(())],
    debug=True,
  )(x)
  # Programs that wait on each other run on the checking executor (it
  # covers every operation here), not the threaded simulator.
  out = capsys.readouterr().out
  assert (
    "takes the check path: it signals a semaphore of another program" in out
  )
  assert "the checking executor runs it" in out


def test_two_independent_meshes_write_their_own_outputs(rng, capsys):
  x = jnp.asarray(rng.standard_normal(ROWS), jnp.float32)

  def doubles(x_hbm, o2, o3, buf):
    del o3
    pltpu.sync_copy(x_hbm, buf)
    buf[...] *= 2.0
    pltpu.sync_copy(buf, o2)

  def triples(x_hbm, o2, o3, buf):
    del o2
    pltpu.sync_copy(x_hbm, buf)
    buf[...] *= 3.0
    pltpu.sync_copy(buf, o3)

  a, b = tc("a", 1), tc("b", 1)
  out = jax.ShapeDtypeStruct(ROWS, jnp.float32)
  o2, o3 = mpmd.mpmd_map(
    [(a, doubles), (b, triples)],
    (out, out),
    scratch_types=[(pltpu.VMEM @ a)(ROWS, jnp.float32)],
    debug=True,
  )(x)
  assert "takes the fast path" in capsys.readouterr().out
  np.testing.assert_allclose(o2, 2.0 * x)
  np.testing.assert_allclose(o3, 3.0 * x)


def three_meshes(x, interpret=None):
  """Meshes of 1, 2 and 4 programs: a chain of signals 1 -> 2 -> 4."""
  m1, m2, m4 = tc("one", 1), tc("two", 2), tc("four", 4)

  def first(x_hbm, o_hbm, stage, sem, buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] += 1.0
    pltpu.sync_copy(buf, stage.at[0])
    for k in range(2):
      pl.semaphore_signal(sem, 1, device_id={"two": k})

  def second(x_hbm, o_hbm, stage, sem, buf):
    k = jax.lax.axis_index("two")
    pl.semaphore_wait(sem, 1)
    pltpu.sync_copy(stage.at[0], buf)
    buf[...] *= (k + 2).astype(jnp.float32)
    pltpu.sync_copy(buf, stage.at[1 + k])
    for j in range(2):
      pl.semaphore_signal(sem, 1, device_id={"four": 2 * k + j})

  def third(x_hbm, o_hbm, stage, sem, buf):
    j = jax.lax.axis_index("four")
    pl.semaphore_wait(sem, 1)
    pltpu.sync_copy(stage.at[1 + j // 2], buf)
    buf[...] += j.astype(jnp.float32)
    pltpu.sync_copy(buf, o_hbm.at[j])

  return mpmd.mpmd_map(
    [(m4, third), (m1, first), (m2, second)],
    jax.ShapeDtypeStruct((4, *x.shape), x.dtype),
    scratch_types=[
      pltpu.HBM((3, *x.shape), x.dtype),
      pltpu.SemaphoreType.REGULAR @ m2,
      (pltpu.VMEM @ m1)(x.shape, x.dtype),
    ],
    interpret=interpret,
  )(x)


def three_reference(x):
  j = jnp.arange(4, dtype=x.dtype)
  return (x[None] + 1.0) * (j // 2 + 2)[:, None, None] + j[:, None, None]


def test_three_meshes_of_sizes_1_2_4(rng):
  x = jnp.asarray(rng.standard_normal(ROWS), jnp.float32)
  np.testing.assert_allclose(three_meshes(x), three_reference(x), rtol=1e-6)


def test_vmap_over_a_two_mesh_call(rng):
  xs = jnp.asarray(rng.standard_normal((3, *ROWS)), jnp.float32)
  got = jax.vmap(producer_consumer)(xs)
  np.testing.assert_allclose(got, jnp.stack([pc_reference(x) for x in xs]))


def test_tpu_cross_lowering_of_two_tensorcore_meshes():
  x = jnp.ones(ROWS, jnp.float32)
  for target in ("v5e", "v7x"):
    with mpmd.tpu_target(target):
      text = lowerings.tpu_text(producer_consumer, x)
    assert text.count("tpu_custom_call") == 1


# -- no hangs, and races ------------------------------------------------------


@pytest.mark.parametrize(
  "interpret, message",
  [
    # The default for programs that wait on each other: the checking
    # executor reports at once, with the count held now and the line.
    (
      None,
      r"deadlocks(.|\n)*mesh 1 program \{'b': 1\} waits \(semaphore_wait "
      r"at .*test_multi_mesh.py:\d+.*\) on 'sem' .* for 1; it holds 0 now",
    ),
    (
      pltpu.InterpretParams(),
      r"mpmd_map deadlock(.|\n)*mesh 1 "
      r"program 1 \(b=1\) waits on the semaphore 'sem' \(scratch 0, "
      r"semaphore\[\]\) for 1 \(it holds 0 now\) at .*test_multi_mesh.py:\d+",
    ),
  ],
  ids=["checker", "simulator"],
)
def test_deadlock_names_mesh_program_and_semaphore(interpret, message):
  x = jnp.ones(ROWS, jnp.float32)
  a, b = tc("a", 1), tc("b", 2)

  def signals_one(x_hbm, o_hbm, sem):
    pltpu.sync_copy(x_hbm, o_hbm)
    pl.semaphore_signal(sem, 1, device_id={"b": 0})  # b=1 never signalled

  def waits(x_hbm, o_hbm, sem):
    pl.semaphore_wait(sem, 1)

  f = mpmd.mpmd_map(
    [(a, signals_one), (b, waits)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR @ b],
    interpret=interpret,
  )
  with mpmd.deadlock_timeout(1.0):
    with pytest.raises(Exception, match=message):
      jax.block_until_ready(f(x))
  # The process recovers: the next launch runs.
  np.testing.assert_allclose(producer_consumer(x), pc_reference(x))


def test_deadlock_timeout_is_validated():
  with pytest.raises(ValueError, match="expected 'seconds' > 0, got 0"):
    mpmd.set_deadlock_timeout(0)


def test_race_detector_flags_a_racy_kernel_and_passes_a_synchronised_one():
  x = jnp.ones(ROWS, jnp.float32)
  detect = pltpu.InterpretParams(detect_races=True)
  np.testing.assert_allclose(
    producer_consumer(x, interpret=detect), pc_reference(x)
  )
  with (
    pytest.raises(mpmd.RaceError, match="race detector found programs racing"),
    mpmd.typed_errors(),
  ):
    jax.block_until_ready(producer_consumer(x, wait=False, interpret=detect))


def test_races_can_be_recorded_for_the_caller_instead():
  """Upstream's simulators record races for the caller to read; with the
  "record" policy, so do we, on every jax version."""
  x = jnp.ones(ROWS, jnp.float32)
  detect = pltpu.InterpretParams(detect_races=True)
  with mpmd.race_policy("record"):
    jax.block_until_ready(producer_consumer(x, wait=False, interpret=detect))
    assert mpmd.get_races() == mpmd.Races(races_found=True)
    out = producer_consumer(x, interpret=detect)
    assert mpmd.get_races() == mpmd.Races(races_found=False)
  np.testing.assert_allclose(out, pc_reference(x))
  assert mpmd.get_race_policy() == "raise"  # restored
  with pytest.raises(mpmd.RaceError, match="set_race_policy\\('record'\\)"):
    jax.block_until_ready(producer_consumer(x, wait=False, interpret=detect))
  assert mpmd.get_races().races_found


def test_on_race_warn_only_records(caplog):
  if not hasattr(pltpu.InterpretParams(), "on_race"):
    # Before 0.12 upstream only records; the "record" policy says so.
    assert _jax.JAX_VERSION < (0, 12)
    return
  x = jnp.ones(ROWS, jnp.float32)
  warn = pltpu.InterpretParams(detect_races=True, on_race="warn")
  jax.block_until_ready(producer_consumer(x, wait=False, interpret=warn))
  assert mpmd.get_races().races_found
  assert "RACE DETECTED" in caplog.text


def test_race_policy_and_get_races_are_validated(monkeypatch):
  with pytest.raises(
    ValueError, match=r"expected 'policy' in \('raise', 'record'\), got 'warn'"
  ):
    mpmd.set_race_policy("warn")
  monkeypatch.setattr(simulators, "_races", [])
  with pytest.raises(ValueError, match="no simulator launch with detect_races"):
    mpmd.get_races()


# -- validation ---------------------------------------------------------------


def _noop(*refs):
  del refs


def test_error_unowned_vmem_with_several_meshes():
  # Upstream raises NotImplementedError for it too. Every unowned leaf is
  # named, and the meshes one may own it.
  with pytest.raises(
    NotImplementedError,
    match=r"scratch_types leaf 0 in vmem, leaf 1 in semaphore_mem without "
    r"an owner in a launch of several meshes: .*`pltpu.VMEM\(...\) @ mesh`.*"
    r"here the mesh of axes \['a'\] or \['b'\]",
  ):
    mpmd.mpmd_map(
      [(tc("a", 1), _noop), (tc("b", 1), _noop)],
      (),
      scratch_types=[pltpu.VMEM(ROWS, jnp.float32), pltpu.SemaphoreType.DMA],
    )


def test_error_unowned_scratch_names_the_kernels_parameters():
  def first(x_ref, o_ref, buf, sem):
    del x_ref, o_ref, buf, sem

  def second(x_ref, o_ref, stage, sem):
    del x_ref, o_ref, stage, sem

  types = [pltpu.VMEM(ROWS, jnp.float32), pltpu.SemaphoreType.DMA]
  with pytest.raises(
    NotImplementedError,
    match=r"scratch_types leaf 0 \('buf' / 'stage'\) in vmem, leaf 1 "
    r"\('sem'\) in semaphore_mem without an owner",
  ):
    mpmd.mpmd_map(
      [(tc("a", 1), first), (tc("b", 1), second)], (), scratch_types=types
    )
  # Scratch by keyword: the keys.
  with pytest.raises(
    NotImplementedError, match=r"leaf 0 \('buf'\) in vmem, leaf 1 \('sem'\)"
  ):
    mpmd.mpmd_map(
      [(tc("a", 1), _noop), (tc("b", 1), _noop)],
      (),
      scratch_types={"buf": types[0], "sem": types[1]},
    )
  with pytest.raises(
    ValueError, match=r"scratch_types leaf 1 \('sem'\) is owned"
  ):
    mpmd.mpmd_map(
      [(tc("a", 1), first)],
      (),
      scratch_types=[types[0], pltpu.SemaphoreType.REGULAR @ tc("z", 3)],
    )


def test_error_scratch_owned_by_a_foreign_mesh():
  with pytest.raises(
    ValueError,
    match=r"scratch_types leaf 0 is owned \(`@ mesh`\) by a mesh \{'z': 3\} "
    r"of core type tc that is not in this launch \(its meshes: \{'a': 1\}\)",
  ):
    mpmd.mpmd_map(
      [(tc("a", 1), _noop)],
      (),
      scratch_types=[pltpu.SemaphoreType.REGULAR @ tc("z", 3)],
    )


def test_error_signal_naming_two_meshes():
  a, b = tc("a", 1), tc("b", 1)

  def bad(x_hbm, o_hbm, sem):
    pl.semaphore_signal(sem, 1, device_id={"a": 0, "b": 0})

  f = mpmd.mpmd_map(
    [(a, bad), (b, _noop)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR @ a],
  )
  # Several TensorCore meshes (our extension): device_id picks the mesh.
  with pytest.raises(
    ValueError,
    match=r"names device_id axes \['a', 'b'\] of several meshes "
    r"\[\"mesh 0 \{'a': 1\} \(tc\)\", \"mesh 1 \{'b': 1\} \(tc\)\"\]",
  ):
    f(jnp.ones(ROWS, jnp.float32))


def test_error_gpu_meshes_with_different_grids():
  m1 = plgpu.Mesh(
    grid=(2,), grid_names=("g",), num_threads=1, thread_name="memory"
  )
  m2 = plgpu.Mesh(
    grid=(4,), grid_names=("h",), num_threads=1, thread_name="compute"
  )
  f = mpmd.mpmd_map(
    [(m1, _noop), (m2, _noop)], jax.ShapeDtypeStruct((128,), jnp.float32)
  )
  with pytest.raises(ValueError, match="share the grid and cluster"):
    f(jnp.ones((128,), jnp.float32))


# -- the CLI on the examples --------------------------------------------------


@pytest.mark.parametrize(
  "example, platform, marker",
  [
    ("examples/producer_consumer.py", "tpu", "tpu_custom_call"),
    ("examples/warp_specialized_copy.py", "cuda", "mosaic_gpu"),
  ],
)
def test_mpmd_lower_on_the_examples(tmp_path, example, platform, marker):
  out = tmp_path / "module.mlir"
  assert (
    cli.main(["lower", example, "--platform", platform, "-o", str(out)]) == 0
  )
  assert marker in out.read_text()


@pytest.mark.parametrize(
  "example",
  [
    "examples/producer_consumer.py",
    "examples/warp_specialized_copy.py",
  ],
)
def test_examples_run_correctly_on_cpu(example):
  demo = cli._load_demo(example)
  assert registry.check(demo) == "max |error| 0"


# -- TPU core types -----------------------------------------------------------


def sparsecore_copy(x, *, with_tensorcore=False):
  from jax.experimental.pallas import tpu_sc as plsc

  scalar = plsc.ScalarSubcoreMesh(axis_name="sc", num_cores=2)
  vector = plsc.VectorSubcoreMesh(
    core_axis_name="sc", subcore_axis_name="subcore", num_cores=2
  )
  first = tc("tc", 1) if with_tensorcore else scalar

  def idle(x_hbm, o_hbm):
    del x_hbm, o_hbm

  def copy(x_hbm, o_hbm):
    first_program = (jax.lax.axis_index("sc") == 0) & (
      jax.lax.axis_index("subcore") == 0
    )

    @pl.when(first_program)
    def _():
      pltpu.sync_copy(x_hbm, o_hbm)

  return mpmd.mpmd_map(
    [(first, idle), (vector, copy)], jax.ShapeDtypeStruct(x.shape, x.dtype)
  )(x)


def test_sparsecore_scalar_and_vector_meshes_lower_natively_and_run():
  x = jnp.arange(16, dtype=jnp.float32)
  with mpmd.tpu_target("v7x"):  # a generation with SparseCores
    np.testing.assert_array_equal(sparsecore_copy(x), x)
    text = lowerings.tpu_text(sparsecore_copy, x)
  # Mosaic's own MPMD: one custom call carrying both kernels.
  assert text.count("tpu_custom_call") == 1


def test_tensorcore_next_to_sparsecore_is_not_lowerable_yet():
  x = jnp.arange(16, dtype=jnp.float32)
  f = lambda x: sparsecore_copy(x, with_tensorcore=True)  # noqa: E731
  with mpmd.tpu_target("v7x"):
    np.testing.assert_array_equal(f(x), x)  # the CPU fallback runs it
    with pytest.raises(
      NotImplementedError,
      match=r"cannot launch a "
      r"TensorCore kernel next to SparseCore kernels; got "
      r"meshes of core types \['sc_vector_subcore', 'tc'\]",
    ):
      jax.jit(f).trace(x).lower(lowering_platforms=("tpu",))


def test_fast_path_reports_a_wait_nothing_signals():
  mesh = tc("core", 2)

  def kernel(x_hbm, o_hbm, sem):
    c = jax.lax.axis_index("core")
    pltpu.sync_copy(x_hbm.at[c], o_hbm.at[c])

    @pl.when(c == 0)
    def _():
      pl.semaphore_signal(sem, 1)  # its own semaphore

    pl.semaphore_wait(sem, 1)  # core 1 never signals its own

  f = mpmd.mpmd_map(
    [(mesh, kernel)],
    jax.ShapeDtypeStruct((2, *ROWS), jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR(())],
  )
  with open(__file__) as source:  # the wait's line, for the message
    line = next(n for n, t in enumerate(source, 1) if "never signals" in t)
  with pytest.raises(
    Exception,
    match=r"mpmd_map deadlock: on the CPU fast "
    r"path .*\n  mesh 0 program 1 \(core=1\): 'sem' \(scratch 0, "
    rf"semaphore\[\]\), waited on at \S+test_multi_mesh.py:{line}:\d+ ",
  ):
    jax.block_until_ready(f(jnp.ones((2, *ROWS), jnp.float32)))


# -- independent multi-core meshes (issue 11, item 9) -------------------------


def independent_meshes(x, sizes, *, interpret=None, debug=False):
  """Sync-free meshes of ``sizes`` cores: program c of mesh i writes
  ``(i + 1) * x + c`` to block c of output i, through its own VMEM."""
  n = len(sizes)
  meshes = [tc(f"m{i}", size) for i, size in enumerate(sizes)]

  def kernel(x_hbm, *refs, i):
    outs, bufs = refs[:n], refs[n:]
    c = jax.lax.axis_index(f"m{i}")
    pltpu.sync_copy(x_hbm, bufs[i])
    bufs[i][...] = bufs[i][...] * float(i + 1) + c.astype(jnp.float32)
    pltpu.sync_copy(bufs[i], outs[i].at[c])

  return mpmd.mpmd_map(
    [(m, functools.partial(kernel, i=i)) for i, m in enumerate(meshes)],
    tuple(jax.ShapeDtypeStruct((size, *x.shape), x.dtype) for size in sizes),
    scratch_types=[(pltpu.VMEM @ m)(x.shape, x.dtype) for m in meshes],
    interpret=interpret,
    debug=debug,
  )(x)


# XLA may fuse x * s + c into one FMA on one side only: 1 ulp near 0.
FMA_TOL = dict(rtol=1e-6, atol=1e-6)


def independent_reference(x, sizes):
  return tuple(
    (i + 1) * x[None] + jnp.arange(size, dtype=x.dtype)[:, None, None]
    for i, size in enumerate(sizes)
  )


@pytest.mark.parametrize(
  "sizes", [(1, 2), (2, 1), (2, 2), (1, 2, 3), (3, 1, 2)], ids=str
)
def test_independent_multicore_meshes_take_the_fast_path(rng, capsys, sizes):
  x = jnp.asarray(rng.standard_normal(ROWS), jnp.float32)
  got = independent_meshes(x, sizes, debug=True)
  assert "takes the fast path" in capsys.readouterr().out
  for g, want in zip(got, independent_reference(x, sizes), strict=True):
    np.testing.assert_allclose(g, want, **FMA_TOL)


def _batched(transform, sizes):
  """``independent_meshes`` over a leading batch axis, three ways."""
  f = functools.partial(independent_meshes, sizes=sizes)
  if transform == "jit_loop":
    return lambda xs: tuple(
      jnp.stack(o) for o in zip(*(jax.jit(f)(x) for x in xs), strict=True)
    )
  if transform == "vmap":
    return jax.vmap(f)
  return jax.vmap(functools.partial(f, interpret=True))


@pytest.mark.parametrize("transform", ["jit_loop", "vmap", "vmap_interpret"])
@pytest.mark.parametrize("sizes", [(1, 2), (2, 1, 3)], ids=str)
def test_independent_multicore_meshes_under_jit_and_vmap(rng, sizes, transform):
  xs = jnp.asarray(rng.standard_normal((2, *ROWS)), jnp.float32)
  got = _batched(transform, sizes)(xs)
  want = [
    jnp.stack(o)
    for o in zip(*(independent_reference(x, sizes) for x in xs), strict=True)
  ]
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, **FMA_TOL)


def test_fast_path_deadlock_label_counts_meshes_by_position():
  """The same multi-core mesh twice: the stuck program is in mesh 1."""
  mesh = tc("core", 2)

  def fine(x_hbm, o_hbm, sem):
    c = jax.lax.axis_index("core")
    pltpu.sync_copy(x_hbm.at[c], o_hbm.at[c])

  def stuck(x_hbm, o_hbm, sem):
    @pl.when(jax.lax.axis_index("core") == 1)
    def _():
      pl.semaphore_wait(sem, 1)  # nothing signals it

  f = mpmd.mpmd_map(
    [(mesh, fine), (mesh, stuck)],
    jax.ShapeDtypeStruct((2, *ROWS), jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR @ mesh],
  )
  stuck_program = r"\n  mesh 1 program 1 \(core=1\): 'sem'"
  with (
    pytest.raises(mpmd.DeadlockError, match=stuck_program),
    mpmd.typed_errors(),
  ):
    jax.block_until_ready(f(jnp.ones((2, *ROWS), jnp.float32)))


def test_fast_path_deadlock_names_the_stuck_kernel_and_its_names():
  """Kernels name their operands as they like: the message uses the stuck
  program's kernel and its names, not the first kernel's."""
  a, b = tc("a", 1), tc("b", 1)

  def first(x_hbm, o_hbm, unused_sem):
    pltpu.sync_copy(x_hbm, o_hbm)

  def second(x_hbm, o_hbm, waited_on):
    pl.semaphore_wait(waited_on, 1)  # nothing signals it

  f = mpmd.mpmd_map(
    [(a, first), (b, second)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR @ b],
  )
  with (
    pytest.raises(
      mpmd.DeadlockError,
      match=rf"in kernel second at {__file__}:\d+, these programs .*\n"
      r"  mesh 1 program 0 \(b=0\): 'waited_on' \(scratch 0",
    ),
    mpmd.typed_errors(),
  ):
    jax.block_until_ready(f(jnp.ones(ROWS, jnp.float32)))


def test_fast_path_race_names_the_buffer_as_each_kernel_does():
  a, b = tc("a", 1), tc("b", 1)

  def writer(x_hbm, o_hbm, staged):
    pltpu.sync_copy(x_hbm, staged)

  def reader(x_hbm, o_hbm, incoming):
    pltpu.sync_copy(incoming, o_hbm)  # nothing orders it after the write

  f = mpmd.mpmd_map(
    [(a, writer), (b, reader)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.HBM(ROWS, jnp.float32)],
  )
  with pytest.raises(
    mpmd.RaceError,
    match=r"data race on 'staged' \(scratch 0, .*\) \('incoming' "
    r"\(scratch 0, .*\) in mesh 1 program 0 \(b=0\)\): mesh 0 program 0",
  ):
    jax.block_until_ready(f(jnp.ones(ROWS, jnp.float32)))


def test_a_dma_semaphore_of_the_wrong_mesh_names_it_and_the_fix():
  """The producer's own DMA counts on a semaphore the consumers own: the
  message names the semaphore and the DMA's line, and says that the owner
  (``@ mesh``) is the target."""
  producer, consumer = tc("producer", 1), tc("consumer", 2)
  x = jnp.ones(ROWS, jnp.float32)

  def produce(x_hbm, o_hbm, staged, dsem, buf):
    pltpu.sync_copy(x_hbm, buf)
    pltpu.make_async_copy(buf, staged, dsem).start()

  def consume(x_hbm, o_hbm, staged, dsem, buf):
    pass

  launch = mpmd.mpmd_map(
    [(consumer, consume), (producer, produce)],
    jax.ShapeDtypeStruct((2, *ROWS), jnp.float32),
    scratch_types=[
      pltpu.HBM(ROWS, jnp.float32),
      pltpu.SemaphoreType.DMA(()) @ consumer,
      pltpu.VMEM(ROWS, jnp.float32) @ producer,
    ],
  )
  with pytest.raises(
    ValueError,
    match=r"kernel produce at .*: a DMA \(dma_start\) \(at .*test_multi_mesh"
    r"\.py:\d+:\d+ .*\) of 'dsem' \(scratch_types leaf 1, .*\) addresses "
    r"mesh 0 .* the following axes are missing from the mesh: \{'consumer'\}"
    r".* give it the caller's mesh as its owner \(`type @ mesh`\)",
  ):
    launch(x)


@pytest.mark.parametrize(
  "interpret", [None, mpmd.CheckParams()], ids=["default", "checker"]
)
def test_a_run_time_device_id_past_the_target_mesh_is_out_of_bounds(
  interpret,
):
  """Consumer 2 of a 2-program mesh, known at run time: on hardware no such
  program; merged, its flat index would be the producer's own."""
  producer, consumers = tc("producer", 1), tc("consumer", 2)

  def produce(x_hbm, o_hbm, ready):
    c = jnp.int32(2) + 0 * jax.lax.axis_index("producer")
    pl.semaphore_signal(ready, 1, device_id={"consumer": c})
    pl.semaphore_wait(ready, 1)
    pltpu.sync_copy(x_hbm, o_hbm)

  f = mpmd.mpmd_map(
    [(consumers, _noop), (producer, produce)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR @ consumers],
    interpret=interpret,
  )
  with pytest.raises(
    mpmd.OutOfBoundsError,
    match=r"semaphore_signal at .*test_multi_mesh.py:\d+:\d+ \(\S*produce\): "
    r"device_id names a program outside its target mesh",
  ):
    f(jnp.ones(ROWS, jnp.float32))
