"""``python -m astrai_kernels``: the ``astrai-kernels`` command (bench, verify, compile-check,
build)."""

import sys

from .cli import main

sys.exit(main())
