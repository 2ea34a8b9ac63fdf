"""``python -m simulations``: dispatch to the command line in :mod:`simulations.cli`."""

import sys

from simulations.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
