"""`python -m kvrelay.enginesim`: run one simulated engine."""

from kvrelay.enginesim.cli import main

raise SystemExit(main())
