"""`python -m enginesim`: run one simulated engine."""

from enginesim.cli import main

raise SystemExit(main())
