"""Packaging, the jax._src door, and the command line."""

import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from python_runs import run_python

import mpmd

ROOT = Path(__file__).resolve().parent.parent


_PACKAGE_DIRS = {
  "mpmd": "mpmd",
  "primitives": "mpmd._primitives",
  "lowering": "mpmd._lowering",
  "kernels": "mpmd.kernels",
}


def test_every_package_of_the_tree_is_listed_in_pyproject():
  import tomllib

  setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "setuptools"
  ]
  listed = set(setuptools["packages"])
  found = set()
  for d, package in _PACKAGE_DIRS.items():
    for init in (ROOT / d).rglob("__init__.py"):
      rel = init.parent.relative_to(ROOT / d).parts
      found.add(".".join((package, *rel)))
  assert found == listed


@pytest.mark.slow
def test_wheel_holds_only_the_mpmd_namespace(tmp_path):
  subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "wheel",
      str(ROOT),
      "--no-deps",
      "--no-build-isolation",
      "-q",
      "-w",
      str(tmp_path),
    ],
    check=True,
  )
  [wheel] = tmp_path.glob("jax_mpmd-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  top = {n.split("/")[0] for n in names if not n.startswith("jax_mpmd-")}
  assert top == {"mpmd"}
  for package in (
    "_primitives",
    "_lowering",
    "_lowering/check",
    "kernels",
    "kernels/gpu",
    "kernels/moe",
  ):
    assert f"mpmd/{package}/__init__.py" in names
  assert "mpmd/_lowering/merge.py" in names
  # Every module of the source tree is in the wheel (a subpackage missing
  # from pyproject's list would leave its modules out).
  for d, package in _PACKAGE_DIRS.items():
    for module in sorted((ROOT / d).rglob("*.py")):
      rel = module.relative_to(ROOT / d).as_posix()
      assert f"{package.replace('.', '/')}/{rel}" in names, rel
  # The license travels with the wheel, and its metadata names it.
  [license_file] = [
    n for n in names if n.endswith(".dist-info/licenses/LICENSE")
  ]
  with zipfile.ZipFile(wheel) as z:
    assert z.read(license_file) == (ROOT / "LICENSE").read_bytes()
    [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
    lines = z.read(metadata).decode().splitlines()
  assert "License-Expression: Apache-2.0" in lines
  assert "License-File: LICENSE" in lines


def test_license_is_apache_2_and_pyproject_says_so():
  import tomllib

  text = (ROOT / "LICENSE").read_text()
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert "END OF TERMS AND CONDITIONS" in text
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert project["license"] == "Apache-2.0"
  assert project["license-files"] == ["LICENSE"]


# The project's library code (a virtual environment or a build inside the
# checkout is not ours to police).
LIBRARY_DIRS = ("mpmd", "primitives", "lowering", "kernels")


def test_only_one_module_imports_jax_internals():
  offenders = []
  for path in (p for d in LIBRARY_DIRS for p in (ROOT / d).rglob("*.py")):
    rel = path.relative_to(ROOT)
    if rel == Path("mpmd/_jax.py"):
      continue
    for line in path.read_text().splitlines():
      if line.lstrip().startswith(("from jax._src", "import jax._src")):
        offenders.append(f"{rel}: {line.strip()}")
  assert not offenders, offenders


@pytest.mark.parametrize("version", ["0.10.1", "0.13.0", "1.0.0", "0.9.99"])
def test_version_door_names_installed_and_supported(monkeypatch, version):
  import jax

  monkeypatch.setattr(jax, "__version__", version)
  sys.modules.pop("mpmd._jax")
  try:
    with pytest.raises(ImportError) as e:
      importlib.import_module("mpmd._jax")
    assert "jax>=0.10.2,<0.13" in str(e.value)
    assert f"found jax=={version}" in str(e.value)
  finally:
    monkeypatch.undo()
    sys.modules.pop("mpmd._jax", None)
    importlib.import_module("mpmd._jax")


@pytest.mark.parametrize(
  "version", ["0.10.2", "0.11.0", "0.11.2", "0.12.0", "0.12.0.1", "0.12.9"]
)
def test_version_door_accepts_the_range(version):
  from mpmd import _jax

  _jax.check_version("jax", version)  # does not raise


def test_subpackages_import_under_the_mpmd_namespace():
  import mpmd._lowering
  import mpmd._primitives
  import mpmd.kernels

  for module in (mpmd.kernels, mpmd._lowering, mpmd._primitives):
    assert module.__name__.startswith("mpmd.")


def test_mpmd_check_exits_zero(capsys):
  from mpmd import cli

  assert cli.main(["check"]) == 0
  out = capsys.readouterr().out
  import jax

  assert f"jax      {jax.__version__}" in out
  assert "quickstart      cpu" in out and "max |error| 0" in out
  assert "FAILED" not in out


def test_mpmd_lower_a_registered_kernel(capsys):
  from mpmd import cli

  assert cli.main(["lower", "quickstart", "--platform", "tpu"]) == 0
  assert "tpu_custom_call" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="unknown kernel 'nope'"):
    cli.main(["lower", "nope"])


@pytest.mark.timeout(120)
def test_mpmd_bench_leaves_the_cpu_devices_to_the_benchmark():
  # check and lower ask for 8 CPU devices; a benchmark asks for what it
  # needs, as more devices slow one device's small dots (see cli.py). A
  # fresh process: this one's backend already has its devices.
  code = (
    "import jax\n"
    "from mpmd import cli\n"
    "cli._bench = lambda args: print('devices', jax.device_count())\n"
    "cli.main(['bench', 'any'])\n"
  )
  run = run_python(code, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  out = run.stdout
  assert "devices 1" in out, out


def test_version():
  assert mpmd.__version__ == "0.1.0"
