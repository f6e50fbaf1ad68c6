"""`python -m semif` starts the adapter, like the `serve` console script."""

from .serving.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
