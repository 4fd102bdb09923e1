"""`python -m kava_ray.cli`: the `kava-ray` command (tests and multi-node scripts run it this way)."""

import sys

from kava_ray.cli import main

sys.exit(main())
