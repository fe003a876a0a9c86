"""``python -m benchmarks.serving.chaos``: see :mod:`benchmarks.serving.chaos`."""

from benchmarks.serving.chaos.cli import main

raise SystemExit(main())
