"""Reproducible benchmarks of metastore_plugins against the ways users would otherwise get
per-sample gradients: ``python -m metastore_bench run --quick|--full [--out DIR] [--doc PATH]``.

Run it from the repository root. The package has a name of its own: ``opacus`` 1.6 installs a
top-level ``benchmarks`` package into site-packages, which the old name ``benchmarks`` shadowed
only while the current directory came first on ``sys.path`` (docs/benchmarks.md).
"""
