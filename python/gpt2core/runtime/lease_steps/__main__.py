"""`python -m gpt2core.runtime.lease_steps NAME ROWS BUDGET CTX_JSON`: one step in this process (how the driver,
gpt2core.runtime.calibrate.run_bounded, starts each step)."""
import sys

from . import main

sys.exit(main(sys.argv[1:]))
