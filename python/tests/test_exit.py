"""epx._exit: a process dying on an uncaught exception is known to the package (so its
buffers abort and free locally instead of voting with peers who are elsewhere), and the
exception is still reported as before. Single process, no library needed."""

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

SCRIPT = """
import atexit
import sys
import epx._exit as leaving
atexit.register(lambda: print("leaving:", leaving.leaving(), flush=True))
if {interactive}:
    sys.ps1 = ">>> "  # as in an interactive session, whose hook reports and goes on
if {fail}:
    raise ValueError("boom on this rank")
"""


def run(fail, interactive=False):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c",
                           SCRIPT.format(fail=fail, interactive=interactive)], env=env,
                          capture_output=True, text=True, timeout=60)


def test_uncaught_exception_is_noted_and_still_reported():
    done = run(True)
    assert done.returncode == 1
    assert "leaving: ValueError: boom on this rank" in done.stdout
    # The interpreter's own report (the hook before epx's) still runs.
    assert "Traceback" in done.stderr and "ValueError: boom on this rank" in done.stderr


def test_normal_exit_is_not_leaving():
    done = run(False)
    assert done.returncode == 0, done.stderr
    assert "leaving: None" in done.stdout


def test_interactive_session_is_not_leaving():
    """An interactive session's hook reports an error and the session goes on: not noted."""
    done = run(True, interactive=True)
    assert "leaving: None" in done.stdout
    assert "ValueError: boom on this rank" in done.stderr
