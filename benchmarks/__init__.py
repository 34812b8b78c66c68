"""Reproducible benchmarks of metastore_plugins against the ways users would otherwise get
per-sample gradients: ``python -m benchmarks run --quick|--full [--out DIR] [--doc PATH]``.

Run it from the repository root (``opacus`` 1.6 installs a top-level ``benchmarks`` package of
its own into site-packages; the current directory comes first on ``sys.path``).
"""
