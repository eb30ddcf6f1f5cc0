"""`python -m kvdiag.sim [serve] ...`: the simulated engine's API server."""

import sys

from kvdiag.sim.api_server import main

if __name__ == "__main__":
    sys.exit(main())
