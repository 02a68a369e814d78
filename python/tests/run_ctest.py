#!/usr/bin/env python3
"""ctest's entry to the Python tests (registered by tests/python.cmake).

    run_ctest.py [--needs M,...] [--launch EPX_TOOL -n N] -- PYTEST ARGS      pytest (on N ranks)
    run_ctest.py [--needs M,...] [--launch EPX_TOOL -n N] --script FILE ARGS  a script (on N ranks)

The modules a test needs: numpy and ml_dtypes always, pytest unless it runs a script, and
those --needs adds (jax for the JAX tests). scripts/setup installs them all into the
project's .venv, whose python ctest runs this with. When one cannot be imported the test
could not run, which is not a pass: the line says "COULD NOT RUN:" (scripts/test lists
those), and the exit status is 1 (a failure) in CI (the CI variable set, not 0/false), else
77 (ctest's SKIP_RETURN_CODE, so a machine without them still runs the other tests).
"""

import os
import subprocess
import sys

SKIP = 77


def in_ci():
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def main(argv):
    launch, ranks, script, needs = None, 1, None, []
    while argv and argv[0] != "--":
        if argv[0] == "--launch":
            launch, argv = argv[1], argv[2:]
        elif argv[0] == "-n":
            ranks, argv = int(argv[1]), argv[2:]
        elif argv[0] == "--needs":
            needs, argv = argv[1].split(","), argv[2:]
        elif argv[0] == "--script":
            script, argv = argv[1], argv[2:]
            break
        else:
            sys.exit("run_ctest.py: unknown argument %s" % argv[0])
    if argv and argv[0] == "--":
        argv = argv[1:]
    needed = ["numpy", "ml_dtypes"] + ([] if script else ["pytest"]) + needs
    missing = []
    for module in needed:
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        print("COULD NOT RUN: %s cannot import %s, which this test needs (scripts/setup "
              "installs the test dependencies into .venv)" % (sys.executable, ", ".join(missing)))
        return 1 if in_ci() else SKIP
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
