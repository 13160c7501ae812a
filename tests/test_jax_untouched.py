"""JAX as JAX wrote it: ``import mpmd`` changes nothing, each adaptation of
JAX behaviour is installed on first use and takes effect on this version,
private JAX names are reached only through ``mpmd/_jax.py``, and the
package's modules import without cycles.

The before/after checks run in fresh interpreters: in this one, other tests
have long since used the features that install the adaptations.
"""

import ast
import functools
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from mpmd import _jax

ROOT = Path(__file__).resolve().parent.parent
LIBRARY_DIRS = ("mpmd", "primitives", "lowering", "kernels")
DOOR = Path("mpmd/_jax.py")


def _run(script: str) -> str:
  result = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(script)],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
    env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
  )
  assert result.returncode == 0, result.stderr[-4000:]
  return result.stdout.strip().splitlines()[-1]


# -- import mpmd leaves JAX unmodified ----------------------------------------

_SNAPSHOT = """
import sys

def snapshot():
  # Every attribute of every jax module, and of every class it defines,
  # by identity: a patch rebinds one of them.
  state = {}
  for name, module in list(sys.modules.items()):
    ours = name == "jax" or name.startswith(("jax.", "jaxlib"))
    if module is None or not ours:
      continue
    for key, value in list(vars(module).items()):
      state[f"{name}.{key}"] = id(value)
      if isinstance(value, type) and value.__module__ == name:
        for attr, member in list(vars(value).items()):
          state[f"{name}.{key}.{attr}"] = id(member)
  return state
"""


def test_import_mpmd_leaves_jax_unmodified():
  # Which jax modules mpmd brings in (its TPU and GPU doors included), so
  # that the second interpreter imports them all before taking the picture.
  modules = json.loads(
    _run("""
      import json, sys
      import mpmd
      from mpmd import _jax
      _jax.tpu(), _jax.gpu()
      print(json.dumps(sorted(
        n for n in sys.modules if n == "jax" or n.startswith(("jax.", "jaxlib"))
      )))
    """)
  )
  assert "jax._src.pallas.mosaic.interpret.shared_memory" in modules
  changed = json.loads(
    _run(
      _SNAPSHOT
      + f"""
import importlib, json
for name in {modules!r}:
  importlib.import_module(name)
before = snapshot()
import mpmd
from mpmd import _jax, _patches
_jax.tpu(), _jax.gpu()
after = snapshot()
print(json.dumps({{
  "changed": sorted(k for k in before if after.get(k) != before[k]),
  "added": sorted(k for k in after if k not in before),
  "installed": _patches.installed(),
}}))
"""
    )
  )
  # Registering our own config option (JAX's mechanism for options, and
  # what keys jit caches on the TPU target) adds its property; nothing else.
  assert changed == {
    "changed": [],
    "added": ["jax._src.config.Config.mpmd_tpu_target"],
    "installed": {},
  }


def test_the_snapshot_sees_a_patch():
  """The comparison above can fail: a patch of a module attribute or a class
  method shows."""
  out = json.loads(
    _run(
      _SNAPSHOT
      + """
import json
from jax._src import callback
from jax._src.pallas.mosaic.interpret import shared_memory
before = snapshot()
callback.io_callback_impl = lambda *a, **k: None
shared_memory.Semaphore.wait = lambda *a, **k: None
after = snapshot()
print(json.dumps(sorted(k for k in before if after.get(k) != before[k])))
"""
    )
  )
  assert out == [
    "jax._src.callback.io_callback_impl",
    "jax._src.pallas.mosaic.interpret.shared_memory.Semaphore.wait",
  ]


# -- each adaptation: on first use, on this version, scoped --------------------


def test_adaptations_install_on_first_use_and_take_effect():
  out = json.loads(
    _run("""
      import json
      import jax, jax.numpy as jnp, numpy as np
      from jax.experimental import io_callback
      from jax.experimental import pallas as pl
      from jax.experimental.pallas import mosaic_gpu as plgpu
      from jax.experimental.pallas import tpu as pltpu
      import mpmd
      from mpmd import _jax
      from mpmd import _patches as patches
      report = {"at_import": patches.installed()}

      def tpu_kernel(x_hbm, o_hbm, sem, buf):
        c = jax.lax.axis_index("core")
        pl.semaphore_signal(sem, 1, core_index=1 - c)
        pl.semaphore_wait(sem, 1)
        pltpu.sync_copy(x_hbm.at[c], buf)
        buf[...] += 1.0
        pltpu.sync_copy(buf, o_hbm.at[c])

      x = jnp.ones((2, 8, 128), jnp.float32)
      f = mpmd.mpmd_map(
        [(mpmd.tensorcore_mesh("core", num_cores=2), tpu_kernel)],
        jax.ShapeDtypeStruct(x.shape, jnp.float32),
        scratch_types=[pltpu.SemaphoreType.REGULAR(()),
                       pltpu.VMEM((8, 128), jnp.float32)],
        interpret=pltpu.InterpretParams(),
      )
      np.testing.assert_array_equal(f(x), x + 1.0)

      def gpu_kernel(x_ref, o_ref):
        rows = pl.ds(jax.lax.axis_index("wg") * 4, 4)
        o_ref[rows, :] = x_ref[rows, :] + 1.0

      g = mpmd.mpmd_map(
        [(plgpu.Mesh(num_threads=2, thread_name="wg"), gpu_kernel)],
        jax.ShapeDtypeStruct((8, 128), jnp.float32),
        interpret=mpmd.GPUInterpretParams(),
      )
      np.testing.assert_array_equal(g(x[0]), x[0] + 1.0)
      report["installed"] = patches.installed()

      # Outside our traces and launches, JAX answers as it would.
      info = _jax.tpu().info
      report["device_kind"] = info.get_device_kind()
      report["is_tpu"] = info.is_tpu_device()
      with mpmd.tpu_target("v6e"):
        report["target_kind"] = info.get_device_kind()
        report["target_is_tpu"] = info.is_tpu_device()
      seen = []
      def record(y):
        seen.append(type(y).__module__.split(".")[0])
        return y
      jax.block_until_ready(jax.jit(
        lambda y: io_callback(record, y, y, ordered=True))(x))
      report["user_callback_gets"] = seen
      print(json.dumps(report))
    """)
  )
  expected = {
    "tpu_device_kind",
    "tpu_num_device_cores",
    "tpu_info",
    "io_callback_impl",
    "tpu_semaphore_wait",
    "tpu_start_barrier",
    "tpu_end_barrier",
    "gpu_barrier_wait",
    "runtime_token_errors",
    "simulator_programs",
  }
  if _jax.JAX_VERSION < (0, 11):
    expected.add("tpu_simulator_run_jaxpr")  # 0.11 compiles once itself
    expected.add("tpu_create_tensorcore_mesh")  # counts its cores inline
  else:
    expected.add("gpu_simulator_to_int")  # 0.10 takes numpy already
    expected |= {"tpu_default_num_cores", "tpu_tensorcore_mesh_cores"}
  assert out["at_import"] == {}
  assert out["installed"] == dict.fromkeys(expected, True)
  assert out["device_kind"] == "cpu" and not out["is_tpu"]
  assert out["target_kind"] == "TPU v6 lite" and out["target_is_tpu"]
  # A user's io_callback still gets what JAX gives it (a jax Array).
  assert out["user_callback_gets"] == ["jaxlib"]


# -- private JAX attributes only through the door -----------------------------


def _door_names(tree: ast.Module) -> set[str]:
  """Names a module binds to ``mpmd._jax`` or to something imported from it."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module == "mpmd._jax":
      names.update(a.asname or a.name for a in node.names)
    if isinstance(node, ast.ImportFrom) and node.module == "mpmd":
      names.update(a.asname or a.name for a in node.names if a.name == "_jax")
  return names


def _root(node: ast.AST) -> ast.AST:
  while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
    node = node.func if isinstance(node, ast.Call) else node.value
  return node


def _our_private_names(trees) -> set[str]:
  """Private attribute names the package itself defines (on its classes,
  its objects, namedtuples' ``_replace`` & co)."""
  names = {"_replace", "_fields", "_asdict", "_make"}
  for tree in trees:
    for node in ast.walk(tree):
      if isinstance(node, ast.ClassDef):
        for item in node.body:
          if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(item.name)
          targets = []
          if isinstance(item, ast.Assign):
            targets = item.targets
          elif isinstance(item, ast.AnnAssign):
            targets = [item.target]
          names.update(t.id for t in targets if isinstance(t, ast.Name))
      if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        names.add(node.attr)
  return {n for n in names if n.startswith("_")}


def private_jax_accesses(sources: dict[str, str]) -> list[str]:
  """``path:line: expr`` for every private attribute read outside the door:
  on anything reached from ``mpmd._jax`` (``callback._OrderedIOEffect``,
  ``_jax.tpu().simulator._shared_memory``), and on any other object unless
  the package defines that name itself (``error._pred``, ``x._trace``)."""
  trees = {path: ast.parse(text) for path, text in sources.items()}
  ours = _our_private_names(trees.values())
  found = []
  for path, tree in trees.items():
    door = _door_names(tree)
    for node in ast.walk(tree):
      if not isinstance(node, ast.Attribute):
        continue
      name = node.attr
      if not name.startswith("_") or name.startswith("__"):
        continue
      root = _root(node)
      from_door = isinstance(root, ast.Name) and root.id in door
      if from_door or name not in ours:
        found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
  return found


def test_private_jax_attributes_only_through_the_door():
  sources = {
    str(p.relative_to(ROOT)): p.read_text()
    for d in LIBRARY_DIRS
    for p in sorted((ROOT / d).rglob("*.py"))
    if p.relative_to(ROOT) != DOOR
  }
  assert len(sources) > 20
  assert private_jax_accesses(sources) == []


@pytest.mark.parametrize(
  "line",
  [
    "from mpmd._jax import config\nconfig._check_vma(False)",
    "from mpmd import _jax\n_jax.tpu().simulator._shared_memory",
    "from mpmd._jax import tpu\ntpu().simulator._shared_memory._failure",
    "def f(error):\n  return error._pred",
    "import jax\njax.core.Tracer._trace",
  ],
)
def test_the_scan_sees_a_private_access(line):
  assert private_jax_accesses({"x.py": line})


def test_the_scan_lets_our_own_private_names_be():
  source = textwrap.dedent("""
    class Pipe:
      def __init__(self):
        self._once = ()
    def f(pipe, cfg):
      return pipe._once, cfg._replace(a=1)
  """)
  assert private_jax_accesses({"x.py": source}) == []


# -- no import cycles ---------------------------------------------------------


@functools.cache
def _packages_by_folder() -> dict[str, str]:
  """pyproject's package-dir, the one map of folders to import names."""
  with open(ROOT / "pyproject.toml", "rb") as f:
    dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
  return {folder: package for package, folder in dirs.items()}


def _module_name(path: Path) -> str:
  rel = path.relative_to(ROOT).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join([_packages_by_folder()[parts[0]], *parts[1:]])


def import_graph(inside_functions: bool = True) -> dict[str, set[str]]:
  """Module -> the package modules it imports, at import time and (with
  ``inside_functions``) in any of its functions."""
  paths = [p for d in LIBRARY_DIRS for p in (ROOT / d).rglob("*.py")]
  modules = {_module_name(p): p for p in paths}
  graph = {}
  for name, path in modules.items():
    edges = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if inside_functions else tree.body:
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        base = node.module or ""
        targets = [
          f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
          for a in node.names
        ]
      else:
        continue
      edges.update(t for t in targets if t in modules and t != name)
    graph[name] = edges
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


@pytest.mark.parametrize("inside_functions", [False, True])
def test_no_import_cycles(inside_functions):
  graph = import_graph(inside_functions)
  assert "mpmd._lowering.cpu" in graph
  # The platform rules import their lowering lazily (inside the rule).
  assert ("mpmd._lowering.cpu" in graph["mpmd._lowering.register"]) == (
    inside_functions
  )
  # A package's __init__ importing its own modules is not a cycle: they
  # are imported through it. Only module-to-module edges count.
  packages = {
    _module_name(p)
    for d in LIBRARY_DIRS
    for p in (ROOT / d).rglob("__init__.py")
  }
  modules_only = {
    v: {w for w in ws if w not in packages}
    for v, ws in graph.items()
    if v not in packages
  }
  assert cycles(modules_only) == []


def test_the_cycle_check_sees_a_cycle():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
    ["a", "b", "c"]
  ]


# -- launches leave JAX's config as they found it ----------------------------


def test_launches_leave_the_config_values_unchanged():
  """Upstream's ``jtu.JaxTestCase`` fails any test after which
  ``jax.config.values`` differ; the simulators' settings are read by every
  launch, and a read must not define them (only setting them does)."""
  out = json.loads(
    _run("""
      import json
      import jax, jax.numpy as jnp
      from jax.experimental import pallas as pl
      from jax.experimental.pallas import mosaic_gpu as plgpu
      from jax.experimental.pallas import tpu as pltpu
      import mpmd

      def gpu_body(o_gmem):
        o_gmem[...] = jnp.full(o_gmem.shape, 1.0, jnp.float32)

      def tpu_body(o_hbm, buf):
        buf[...] = jnp.full(buf.shape, 2.0, jnp.float32)
        pltpu.sync_copy(buf, o_hbm)

      out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
      gpu = plgpu.Mesh(num_threads=1, thread_name="wg")
      tpu = mpmd.tensorcore_mesh("core", num_cores=1)
      before = dict(jax.config.values)
      sums = [
        float(mpmd.kernel(gpu_body, out, mesh=gpu)().sum()),
        float(mpmd.kernel(gpu_body, out, mesh=gpu,
                          interpret=mpmd.GPUInterpretParams())().sum()),
        float(mpmd.kernel(tpu_body, out, mesh=tpu,
                          scratch_types=[pltpu.VMEM((8, 128), jnp.float32)],
                          interpret=pltpu.InterpretParams())().sum()),
      ]
      unchanged = dict(jax.config.values) == before
      read = [mpmd.get_deadlock_timeout(), mpmd.get_race_policy()]
      mpmd.set_race_policy("record")
      mpmd.set_deadlock_timeout(3.0)
      set_ = [mpmd.get_deadlock_timeout(), mpmd.get_race_policy()]
      print(json.dumps([sums, unchanged, read, set_]))
    """)
  )
  assert out == [
    [1024.0, 1024.0, 2048.0],
    True,
    [10.0, "raise"],
    [3.0, "record"],
  ]
