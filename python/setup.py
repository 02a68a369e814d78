"""Build step of `pip install ./python`: build libepx.so with CMake and bundle it.

The library is built from the repository this directory sits in (../CMakeLists.txt) into
a temporary build directory, and the shared library is copied into the package as
epx/_lib/libepx.so, where epx/_library.py looks for it first (after EPX_LIBRARY).

Environment:
    EPX_CMAKE_ARGS      extra CMake arguments, e.g. "-DEPX_WITH_CUDA=OFF"
    EPX_SKIP_BUILD=1    bundle nothing (the package then finds the library through
                        EPX_LIBRARY, the repository's build/ or the system loader)
    EPX_BUILD_JOBS      parallel build jobs (default: CPU count)
"""

import glob
import os
import shlex
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _build_library(build_temp):
    if not os.path.exists(os.path.join(REPO, "CMakeLists.txt")):
        raise RuntimeError(
            "epx: cannot build libepx.so: %s has no CMakeLists.txt (install from a checkout "
            "of the repository with `pip install ./python`, or set EPX_SKIP_BUILD=1 and "
            "point EPX_LIBRARY at a built library)" % REPO)
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("epx: cmake (>= 3.25) and a C compiler are needed to build "
                           "libepx.so; install them (e.g. apt-get install cmake "
                           "build-essential) or set EPX_SKIP_BUILD=1")
    build_dir = os.path.join(build_temp, "libepx")
    configure = [cmake, "-S", REPO, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release"]
    configure += shlex.split(os.environ.get("EPX_CMAKE_ARGS", ""))
    subprocess.check_call(configure)
    jobs = os.environ.get("EPX_BUILD_JOBS") or str(os.cpu_count() or 2)
    subprocess.check_call([cmake, "--build", build_dir, "--target", "epx", "-j", jobs])
    found = sorted(glob.glob(os.path.join(build_dir, "libepx.so*")))
    if not found:
        raise RuntimeError("epx: the CMake build produced no libepx.so in %s" % build_dir)
    # The NVSHMEM plugin (low-latency mode on GPUs) exists when CMake found NVSHMEM.
    plugin = None
    if subprocess.call([cmake, "--build", build_dir, "--target", "epx_nvshmem", "-j", jobs]) == 0:
        plugin = os.path.join(build_dir, "libepx_nvshmem.so")
    # The real file (libepx.so.X.Y.Z), bundled under the name the loader looks for.
    return os.path.realpath(found[0]), plugin


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        if os.environ.get("EPX_SKIP_BUILD") == "1":
            return
        build_temp = os.path.join(HERE, "build", "cmake")
        library, plugin = _build_library(build_temp)
        target_dir = os.path.join(self.build_lib, "epx", "_lib")
        os.makedirs(target_dir, exist_ok=True)
        shutil.copyfile(library, os.path.join(target_dir, "libepx.so"))
        # libepx looks for its NVSHMEM plugin beside itself (it keeps NVSHMEM's path).
        if plugin and os.path.exists(plugin):
            shutil.copyfile(plugin, os.path.join(target_dir, "libepx_nvshmem.so"))


class BinaryDistribution(Distribution):
    """The wheel carries a shared library: tag it for this platform."""

    def has_ext_modules(self):
        return os.environ.get("EPX_SKIP_BUILD") != "1"


cmdclass = {"build_py": BuildWithLibrary}
try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

if bdist_wheel is not None:
    class PlatformWheel(bdist_wheel):
        """No Python extension inside: any Python 3, this platform only."""

        def get_tag(self):
            python, abi, platform = super().get_tag()
            if os.environ.get("EPX_SKIP_BUILD") == "1":
                return python, abi, platform
            return "py3", "none", platform

    cmdclass["bdist_wheel"] = PlatformWheel

setup(cmdclass=cmdclass, distclass=BinaryDistribution)
