# The type checker's view of jaxinfer.shardings, which setuptools maps to the top-level
# shardings/ folder (pyproject.toml package-dir) where mypy cannot follow it.

BUILTIN: tuple[str, ...]
