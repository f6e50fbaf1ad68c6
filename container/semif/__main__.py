"""`python -m semif` starts the adapter, like the `serve` console script.

The adapter's dependencies are the `serve` extra; the base install is the client alone. Without them, `serve`
says which install brings them (exit 7) instead of failing on an import."""

from __future__ import annotations

import importlib.util
import sys

# The import names of the `serve` extra's distributions (container/pyproject.toml).
SERVING_MODULES = ("llama_cpp", "starlette", "uvicorn", "pydantic", "numpy", "jinja2")
EXIT_MISSING_SERVING_DEPENDENCIES = 7


def missing_serving_modules() -> list[str]:
    missing = []
    for name in SERVING_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def main(argv: list[str] | None = None) -> int:
    missing = missing_serving_modules()
    if missing:
        print(f"serve: the adapter's dependencies are not installed ({', '.join(missing)}). This is the client "
              "install; for the adapter run: pip install 'semif[serve]' (from a clone: pip install './container[serve]')",
              file=sys.stderr)
        return EXIT_MISSING_SERVING_DEPENDENCIES
    from .serving.serve import main as serve

    return serve(argv)


if __name__ == "__main__":
    raise SystemExit(main())
