"""The `epx` console command of the installed package (`pip install ./python`): runs the
epx executable bundled with it (epx/_bin/epx, which uses the bundled epx/_lib/libepx.so.0),
so that `epx launch`, `epx bench`, `epx doctor` and `epx params` work from the
environment's bin/ directory."""

import os
import sys

BUNDLED_EXECUTABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", "epx")


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
