"""Sphinx configuration for the jax-mpmd documentation.

Build (from the repository root, with ``pip install -e '.[docs]'``)::

  python -m sphinx -W docs docs/_build

Every tutorial is a MyST notebook (``.md`` with jupytext front matter) that
is executed on CPU at every build: a cell that raises, or writes to stderr,
fails the build.
"""

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The notebooks' kernels inherit this environment: CPU only, whatever
# accelerator the build machine has. Each notebook sets its own simulated
# device count in its first cell (jax.config.update("jax_num_cpu_devices"),
# before JAX starts its backends).
os.environ["JAX_PLATFORMS"] = "cpu"
# The kernels forward the C++ side's stderr too, and a notebook's stderr
# fails the build (below). XLA's C++ log lines (a "slow compile" alarm on a
# busy machine) are not the page's: failures reach Python as exceptions.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("PYTHONWARNINGS", "default")

import mpmd  # noqa: E402

project = "jax-mpmd"
author = "The jax-mpmd authors"
copyright = "2026, The jax-mpmd authors"
release = mpmd.__version__
version = release

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints", "README.md"]
root_doc = "index"

html_theme = "furo"
html_title = f"jax-mpmd {release}"

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Executed notebooks: always run, an error anywhere fails the build.
# MPMD_DOCS_EXECUTE=off skips the notebooks, to iterate on the other pages.
nb_execution_mode = os.environ.get("MPMD_DOCS_EXECUTE", "force")
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_timeout = 600
nb_execution_in_temp = True  # files a notebook writes stay out of docs/
nb_output_stderr = "warn"  # with -W: anything on stderr fails the build
nb_merge_streams = True

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False


# Every public name is in the API reference: the names each public module
# exports (its ``__all__``) must each be documented somewhere.
PUBLIC_MODULES = (
  "mpmd",
  "mpmd.kernels",
  "mpmd.kernels.collective_matmul",
  "mpmd.kernels.grouped_matmul",
  "mpmd.kernels.gpu",
  "mpmd.testing",
)


def _resolve(name):
  """The object a dotted name documents, or None."""
  import importlib

  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    try:
      for attr in parts[i:]:
        obj = getattr(obj, attr)
    except AttributeError:
      return None
    return obj
  return None


def _check_api_coverage(app, env):
  import importlib

  from sphinx.util import logging

  documented = set(env.domaindata["py"]["objects"])
  documented |= set(env.domaindata["py"]["modules"])
  # A name re-exported from several modules is documented once.
  documented_ids = {id(_resolve(n)) for n in documented} - {id(None)}
  for name in PUBLIC_MODULES:
    module = importlib.import_module(name)
    public_names = getattr(module, "__all__", None) or [
      n
      for n, v in vars(module).items()
      if not n.startswith("_") and getattr(v, "__module__", None) == name
    ]
    for public in public_names:
      full = f"{name}.{public}"
      if full in documented or id(getattr(module, public)) in documented_ids:
        continue
      logging.getLogger(__name__).warning(
        f"{full} is public but not in the API reference"
        " (add it to a page under docs/api/)"
      )


_NAMES_SO_FAR = re.compile(r"\s+\w+(, \w+)*,\s*")
_NAMES_THEN_TEXT = re.compile(r"\s+\w+(, \w+)*: ")


def _join_shared_arguments(app, what, name, obj, options, lines):
  """Joins an Args entry that names several arguments over several lines
  (``a, b,`` then ``c: shared text``) into one line, which napoleon
  parses; it runs before napoleon."""
  i = 0
  while i + 1 < len(lines):
    line, after = lines[i], lines[i + 1]
    if _NAMES_SO_FAR.fullmatch(line) and _NAMES_THEN_TEXT.match(after):
      lines[i : i + 2] = [line.rstrip() + " " + after.strip()]
      continue
    i += 1


def setup(app):
  app.connect("autodoc-process-docstring", _join_shared_arguments, 400)
  app.connect("env-check-consistency", _check_api_coverage)
