"""``python -m benchmarks.serving.engine``: see :mod:`benchmarks.serving.engine`."""

import sys

from benchmarks.serving.engine.cli import main

sys.exit(main())
