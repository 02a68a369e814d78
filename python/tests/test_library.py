"""Where `import epx` finds libepx.so, and what it says when it cannot (single process;
each case runs in a fresh interpreter with its own environment and package copy)."""

import os
import shutil
import subprocess
import sys

import pytest

import epx

PACKAGE = os.path.dirname(os.path.abspath(epx.__file__))
PROBE = "import epx; print(epx.library_path())"


def loaded_library():
    return os.path.realpath(epx.library_path())


def run(code, cwd, **env):
    environment = {k: v for k, v in os.environ.items() if k not in ("EPX_LIBRARY", "PYTHONPATH")}
    environment.update(env)
    environment["LD_LIBRARY_PATH"] = ""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=environment,
                          capture_output=True, text=True)


def copy_package(root):
    target = os.path.join(root, "epx")
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("_lib", "__pycache__"))
    return target


def test_epx_library_variable(tmp_path):
    copy_package(str(tmp_path))
    library = loaded_library()
    ok = run(PROBE, str(tmp_path), EPX_LIBRARY=library, PYTHONPATH=str(tmp_path))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == library
    missing = run(PROBE, str(tmp_path), EPX_LIBRARY="/nonexistent/libepx.so",
                  PYTHONPATH=str(tmp_path))
    assert missing.returncode != 0
    assert "EPX_LIBRARY=/nonexistent/libepx.so does not exist" in missing.stderr


def test_bundled_copy(tmp_path):
    package = copy_package(str(tmp_path))
    os.makedirs(os.path.join(package, "_lib"))
    shutil.copy(loaded_library(), os.path.join(package, "_lib", "libepx.so"))
    ok = run(PROBE, str(tmp_path), PYTHONPATH=str(tmp_path))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == os.path.join(package, "_lib", "libepx.so")


def test_repository_build_directory(tmp_path):
    python_dir = tmp_path / "python"
    python_dir.mkdir()
    copy_package(str(python_dir))
    (tmp_path / "build").mkdir()
    shutil.copy(loaded_library(), str(tmp_path / "build" / "libepx.so"))
    ok = run(PROBE, str(tmp_path), PYTHONPATH=str(python_dir))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == str(tmp_path / "build" / "libepx.so")


def test_not_found_says_where_it_looked(tmp_path):
    copy_package(str(tmp_path))
    result = run(PROBE, str(tmp_path), PYTHONPATH=str(tmp_path))
    if result.returncode == 0:
        pytest.skip("a system-wide libepx is installed: %s" % result.stdout.strip())
    for words in ("libepx.so not found", "bundled with the package",
                  "repository build directory", "system loader", "EPX_LIBRARY"):
        assert words in result.stderr, result.stderr
    # `import epx` alone still works: the library loads on first use.
    assert run("import epx", str(tmp_path), PYTHONPATH=str(tmp_path)).returncode == 0
