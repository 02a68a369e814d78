"""Finding and loading libepx.so.

The places searched, in order (the first that exists is loaded; a file that exists but
fails to load is an error, not a reason to try the next place, so that a broken or
mismatched build is reported instead of silently replaced by another one):

1. ``EPX_LIBRARY`` -- a path to the library file (read here, in Python: the C library's
   own rule against ``getenv`` is about C code);
2. the copy bundled into the installed package (``epx/_lib/libepx.so`` or
   ``epx/_lib/libepx.so.0``, which ``pip install ./python`` builds with CMake);
3. the repository's ``build/`` directory next to the package source
   (``<repo>/build/libepx.so``), for a checkout used with ``PYTHONPATH=python``;
4. the system loader (``ctypes.util.find_library("epx")``, then ``libepx.so.0``).
"""

import ctypes
import ctypes.util
import os

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_BUNDLED_DIR = os.path.join(_PACKAGE_DIR, "_lib")
_REPO_BUILD_DIR = os.path.join(os.path.dirname(os.path.dirname(_PACKAGE_DIR)), "build")
_SONAMES = ("libepx.so", "libepx.so.0")


class LibraryNotFoundError(ImportError):
    """libepx.so was not found, or could not be loaded; the message says where we looked."""


def candidates():
    """The places that are searched, as (description, path or soname) pairs, in order."""
    places = []
    env = os.environ.get("EPX_LIBRARY", "")
    if env:
        places.append(("EPX_LIBRARY", env))
    for soname in _SONAMES:
        places.append(("bundled with the package", os.path.join(_BUNDLED_DIR, soname)))
    for soname in _SONAMES:
        places.append(("repository build directory", os.path.join(_REPO_BUILD_DIR, soname)))
    return places


def _load_file(path):
    # RTLD_GLOBAL is not needed: nothing links against symbols of libepx.so.
    return ctypes.CDLL(path)


def load():
    """Load libepx.so and return (ctypes.CDLL, path it was loaded from)."""
    tried = []
    env = os.environ.get("EPX_LIBRARY", "")
    if env:
        if not os.path.exists(env):
            raise LibraryNotFoundError(
                "EPX_LIBRARY=%s does not exist (unset it to search the usual places: %s)"
                % (env, ", ".join(p for _, p in candidates()[1:])))
        try:
            return _load_file(env), env
        except OSError as error:
            raise LibraryNotFoundError("EPX_LIBRARY=%s could not be loaded: %s" % (env, error))

    for what, path in candidates():
        if not os.path.exists(path):
            tried.append("%s (%s): not there" % (path, what))
            continue
        try:
            return _load_file(path), path
        except OSError as error:
            raise LibraryNotFoundError("%s (%s) exists but could not be loaded: %s"
                                       % (path, what, error))

    found = ctypes.util.find_library("epx")
    system_names = ([found] if found else []) + list(reversed(_SONAMES))
    for name in system_names:
        try:
            return _load_file(name), name
        except OSError as error:
            tried.append("%s (system loader): %s" % (name, error))

    raise LibraryNotFoundError(
        "libepx.so not found. Looked in:\n  " + "\n  ".join(tried) +
        "\nBuild it (cmake -S . -B build && cmake --build build) or install the package "
        "with `pip install ./python`, or point EPX_LIBRARY at the file.")
