"""``python -m metastore_plugins.cli`` (and ``torchrun -m metastore_plugins.cli``): the ``metastore`` command."""

import sys

from metastore_plugins.cli import main

if __name__ == "__main__":  # importing this module (a walk over the package) runs nothing
    sys.exit(main())
