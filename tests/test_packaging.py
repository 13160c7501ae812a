"""Packaging, the jax._src door, and the command line."""

import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import mpmd

ROOT = Path(__file__).resolve().parent.parent


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
  for package in ("primitives", "lowering", "kernels", "kernels/gpu"):
    assert f"mpmd/{package}/__init__.py" in names
  assert "mpmd/lowering/merge.py" in names


def test_only_one_module_imports_jax_internals():
  offenders = []
  for path in ROOT.glob("*/**/*.py"):
    rel = path.relative_to(ROOT)
    if rel.parts[0] in ("tests", "benchmarks", "build") or rel == Path(
      "mpmd/_jax.py"
    ):
      continue
    for line in path.read_text().splitlines():
      if line.lstrip().startswith(("from jax._src", "import jax._src")):
        offenders.append(f"{rel}: {line.strip()}")
  assert not offenders, offenders


def test_version_door_names_the_supported_version(monkeypatch):
  import jax

  monkeypatch.setattr(jax, "__version__", "0.0.1")
  sys.modules.pop("mpmd._jax")
  try:
    with pytest.raises(ImportError, match=r"supports exactly jax==0\.10\.2"):
      importlib.import_module("mpmd._jax")
  finally:
    monkeypatch.undo()
    sys.modules.pop("mpmd._jax", None)
    importlib.import_module("mpmd._jax")


def test_subpackages_import_under_the_mpmd_namespace():
  import mpmd.kernels
  import mpmd.lowering
  import mpmd.primitives

  for module in (mpmd.kernels, mpmd.lowering, mpmd.primitives):
    assert module.__name__.startswith("mpmd.")


def test_mpmd_check_exits_zero(capsys):
  from mpmd import cli

  assert cli.main(["check"]) == 0
  out = capsys.readouterr().out
  assert "jax      0.10.2" in out
  assert "quickstart      cpu" in out and "max |error| 0" in out
  assert "FAILED" not in out


def test_mpmd_lower_a_registered_kernel(capsys):
  from mpmd import cli

  assert cli.main(["lower", "quickstart", "--platform", "tpu"]) == 0
  assert "tpu_custom_call" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="unknown kernel 'nope'"):
    cli.main(["lower", "nope"])


def test_version():
  assert mpmd.__version__ == "0.1.0"
