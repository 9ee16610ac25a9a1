"""python -m tests.lab.engine_sim ... (the same as tests/lab/engine_sim.py ...)."""

import sys

from . import main

sys.exit(main())
