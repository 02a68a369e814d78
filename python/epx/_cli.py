"""The `epx` console command of the installed package (`pip install ./python`): runs the
epx executable bundled beside libepx.so (epx/_lib/epx), so that `epx launch`, `epx bench`,
`epx doctor` and `epx params` work from the environment's bin/ directory."""

import os
import sys

from ._library import _BUNDLED_DIR

BUNDLED_EXECUTABLE = os.path.join(_BUNDLED_DIR, "epx")


def main():
    if not os.access(BUNDLED_EXECUTABLE, os.X_OK):
        sys.stderr.write(
            "epx: this installation of the Python package has no bundled epx executable "
            "(%s): it was installed with EPXPY_SKIP_BUILD=1. Run the one of your build "
            "(build/epx) or reinstall with `pip install ./python`.\n" % BUNDLED_EXECUTABLE)
        return 127
    # The program replaces this process: signals and the exit status are its own.
    os.execv(BUNDLED_EXECUTABLE, [BUNDLED_EXECUTABLE] + sys.argv[1:])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
