"""`python -m services.simulator --trace F ...`: the same as `reconfig simulate`."""

import sys

from services.simulator.cli import main

sys.exit(main())
