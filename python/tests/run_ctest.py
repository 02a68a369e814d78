#!/usr/bin/env python3
"""ctest's entry to the Python tests (registered by tests/python.cmake).

    run_ctest.py [OPTIONS] [--launch EPX_TOOL -n N] -- PYTEST ARGS      pytest (on N ranks)
    run_ctest.py [OPTIONS] [--launch EPX_TOOL -n N] --script FILE ARGS  a script (on N ranks)
    OPTIONS: --needs M,...  --optional M,...

The modules a test needs: numpy and ml_dtypes always, pytest unless it runs a script, and
those --needs adds; --optional names a framework the test is about that the package does
not need (jax for the JAX tests). scripts/setup installs them all into the project's
.venv, whose python ctest runs this with. In CI (the CI variable set, not 0/false) any of
them missing is a failure (exit 1): CI must run every test. Elsewhere:
- a needed module missing: the test could not run, which is not a pass: the line says
  "COULD NOT RUN:", the exit status is 77 (ctest's SKIP_RETURN_CODE, so the other tests
  still run), and scripts/test lists it and fails;
- an optional module missing: "SKIP (optional):", exit 77, and scripts/test lists it as
  skipped.
"""

import os
import subprocess
import sys

SKIP = 77


def in_ci():
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def importable(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def main(argv):
    launch, ranks, script, needs, optional = None, 1, None, [], []
    while argv and argv[0] != "--":
        if argv[0] == "--launch":
            launch, argv = argv[1], argv[2:]
        elif argv[0] == "-n":
            ranks, argv = int(argv[1]), argv[2:]
        elif argv[0] == "--needs":
            needs, argv = argv[1].split(","), argv[2:]
        elif argv[0] == "--optional":
            optional, argv = argv[1].split(","), argv[2:]
        elif argv[0] == "--script":
            script, argv = argv[1], argv[2:]
            break
        else:
            sys.exit("run_ctest.py: unknown argument %s" % argv[0])
    if argv and argv[0] == "--":
        argv = argv[1:]
    needed = ["numpy", "ml_dtypes"] + ([] if script else ["pytest"]) + needs
    missing = [module for module in needed if not importable(module)]
    if missing:
        print("COULD NOT RUN: %s cannot import %s, which this test needs (scripts/setup "
              "installs the test dependencies into .venv)" % (sys.executable, ", ".join(missing)))
        return 1 if in_ci() else SKIP
    absent = [module for module in optional if not importable(module)]
    if absent:
        print("SKIP (optional): %s cannot import %s, which this test is about (scripts/setup "
              "installs it into .venv; CI requires it)" % (sys.executable, ", ".join(absent)))
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
