#!/usr/bin/env python3
"""ctest's entry to the Python tests (registered by tests/python.cmake).

    run_ctest.py [--launch EPX_TOOL -n N] -- PYTEST ARGS      pytest (on N ranks)
    run_ctest.py [--launch EPX_TOOL -n N] --script FILE ARGS  a script (on N ranks)

Exits 77 (ctest's SKIP_RETURN_CODE) with a message when numpy, pytest or ml_dtypes is
not importable: `pip install numpy pytest ml_dtypes` enables these tests.
"""

import subprocess
import sys


def main(argv):
    launch, ranks, script = None, 1, None
    while argv and argv[0] != "--":
        if argv[0] == "--launch":
            launch, argv = argv[1], argv[2:]
        elif argv[0] == "-n":
            ranks, argv = int(argv[1]), argv[2:]
        elif argv[0] == "--script":
            script, argv = argv[1], argv[2:]
            break
        else:
            sys.exit("run_ctest.py: unknown argument %s" % argv[0])
    if argv and argv[0] == "--":
        argv = argv[1:]
    needed = ["numpy", "ml_dtypes"] + ([] if script else ["pytest"])
    missing = []
    for module in needed:
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        print("SKIP: the Python tests need %s (pip install numpy pytest ml_dtypes)"
              % ", ".join(missing))
        return 77
    if script:
        command = [sys.executable, script] + argv
    else:
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"] + argv
    if launch:
        command = [launch, "launch", "-n", str(ranks), "--"] + command
    print("+ " + " ".join(command), flush=True)
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
