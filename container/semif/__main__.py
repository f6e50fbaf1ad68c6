"""`python -m semif` starts the adapter, like the `serve` console script; the operator tools' console scripts
(`semif-eval`, `semif-gate`, …) start here too.

The base install is the client alone. The adapter's dependencies are the `serve` extra, the operator tools'
the `tools` extra. Without them, each command says which install brings them (exit 7) instead of failing on an
import: `command_needing(...)` checks the extra's import names before the command's module is imported."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Callable, Optional, Sequence

# The import names of each extra's distributions (container/pyproject.toml [project.optional-dependencies]).
EXTRA_MODULES = {
    "serve": ("llama_cpp", "starlette", "uvicorn", "pydantic", "numpy", "jinja2"),
    "tools": ("pydantic", "numpy", "jinja2", "gguf", "rich", "matplotlib"),
}
EXTRA_OWNERS = {"serve": "the adapter's", "tools": "the operator tools'"}
EXIT_MISSING_DEPENDENCIES = 7


def missing_modules(names: Sequence[str]) -> list[str]:
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def command_needing(command: str, target: str, extras: Sequence[str] = ("tools",)) -> Callable[..., int]:
    """The entry point of ``command``: runs ``target`` (``module:function``) once every module of ``extras`` is
    importable, else prints the one install that brings them and returns 7."""

    def main(argv: Optional[list[str]] = None) -> int:
        missing = missing_modules(sorted({name for extra in extras for name in EXTRA_MODULES[extra]}))
        if missing:
            spec = ",".join(extras)
            owners = " and ".join(EXTRA_OWNERS[extra] for extra in extras)
            print(f"{command}: {owners} dependencies are not installed ({', '.join(missing)}). This is the client "
                  f"install; for {command} run: pip install 'semif[{spec}]' (from a clone: pip install './container[{spec}]')",
                  file=sys.stderr)
            return EXIT_MISSING_DEPENDENCIES
        module, function = target.split(":")
        return getattr(importlib.import_module(module), function)(argv)

    main.__name__ = main.__qualname__ = command.replace("-", "_")
    main.__doc__ = f"`{command}`: {target}, once the {' and '.join(extras)} extra is installed."
    return main


# The console scripts of container/pyproject.toml [project.scripts].
main = command_needing("serve", "semif.serving.serve:main", ("serve",))
package_model = command_needing("semif-package-model", "semif.tools.package_model:main")
evaluate = command_needing("semif-eval", "semif.tools.evaluate:main")
calibrate = command_needing("semif-calibrate", "semif.tools.calibrate:main")
batch = command_needing("semif-batch", "semif.tools.batch:main")  # its in-process local run also needs `serve`
gate = command_needing("semif-gate", "semif.tools.gate:main")
loadcheck = command_needing("semif-loadcheck", "semif.tools.loadcheck:main")
# It loads the GGUF with llama-cpp-python itself.
recompute = command_needing("semif-recompute", "semif.tools.recompute:main", ("serve", "tools"))


if __name__ == "__main__":
    raise SystemExit(main())
