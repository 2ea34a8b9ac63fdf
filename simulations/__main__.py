"""``python -m simulations``: dispatch to the command line in :mod:`simulations.cli`."""

import os
import sys
import threading

from simulations.cli import INTERRUPTED, main

if __name__ == "__main__":
    status = main(sys.argv[1:])
    if status == INTERRUPTED and any(not t.daemon and t is not threading.main_thread()
                                     for t in threading.enumerate()):
        # A Ctrl-C'd run whose ServerApp thread is still inside a step (an evaluation): its
        # files are kept atomically, so end now rather than wait for the thread at exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
