"""``python -m inference.worker``: the inference worker process (:mod:`inference.worker.main`)."""

from inference.worker.main import main

raise SystemExit(main())
