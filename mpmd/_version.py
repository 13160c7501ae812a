"""The range of jax releases jax-mpmd supports, checked at import.

``mpmd/_jax.py`` (the one door to ``jax._src``) checks it first thing.
"""

# The jax releases we test against, both ends of the range in CI: 0.10.2 is
# the newest release for Python 3.11, 0.12.x the newest for Python 3.12+.
MIN_JAX_VERSION = (0, 10, 2)
MAX_JAX_VERSION = (0, 13)  # exclusive
SUPPORTED_RANGE = ">=0.10.2,<0.13"


def version_tuple(version: str) -> tuple[int, ...]:
  """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; stops at the first non-number
  (``"0.13.0.dev20260101"`` -> ``(0, 13, 0)``)."""
  parts = []
  for part in version.split("."):
    if not part.isdigit():
      break
    parts.append(int(part))
  return tuple(parts)


def check_version(name: str, version: str) -> None:
  """Raises ImportError if ``version`` of ``name`` is outside our range."""
  got = version_tuple(version)
  if not MIN_JAX_VERSION <= got < MAX_JAX_VERSION:
    raise ImportError(
      f"jax-mpmd supports {name}{SUPPORTED_RANGE} (it uses jax._src "
      f"internals), but found {name}=={version}. Run: pip install "
      f"'jax{SUPPORTED_RANGE}' 'jaxlib{SUPPORTED_RANGE}'"
    )
