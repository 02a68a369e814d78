"""Build step of `pip install ./python`: build epx with CMake and bundle it.

CMake builds the repository this directory sits in (../CMakeLists.txt) and installs it
into a staging directory (`cmake --install`, with the package's own directory names, so
that the run paths CMake writes hold inside the package); the package then carries:

    _lib/libepx.so.0         the library (epx/_library.py loads it)
    _bin/epx                 the `epx` command (launch, bench, doctor, params), which the
                             console script `epx` runs (epx/_cli.py); it finds
                             libepx.so.0 through its run path, $ORIGIN/../_lib
    _lib/libepx_nvshmem.so   the NVSHMEM plugin (low-latency mode on GPUs), when the build
                             found NVSHMEM: NVSHMEM_HOME, or the nvidia-nvshmem-cu13
                             wheel of the Python that runs this (so use
                             --no-build-isolation from an environment that has it); libepx
                             loads it from beside itself. Its runtime, libnvshmem_host.so.3,
                             comes from the nvidia-nvshmem-cu13 wheel in the same
                             site-packages (`pip install "./python[gpu]"`), else from where
                             it was at build time.

Environment (not EPX_*: the library warns about EPX_* names it does not know):
    CMAKE_ARGS                  extra CMake arguments, e.g. "-DEPX_WITH_CUDA=OFF"
    CMAKE_BUILD_PARALLEL_LEVEL  parallel build jobs (CMake's own variable; default: CPUs)
    EPXPY_BUILD_DIR             the CMake build directory (default python/build/cmake); it
                                is kept, so a second install rebuilds only what changed
    EPXPY_SKIP_BUILD=1          bundle nothing (the package then finds the library through
                                EPX_LIBRARY, the repository's build/ or the system loader,
                                and the `epx` console script says it has no executable)
EPX_CMAKE_ARGS, EPX_BUILD_JOBS and EPX_SKIP_BUILD are still read (deprecated names).
"""

import glob
import os
import shlex
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# Where the bundled plugin finds NVSHMEM's runtime in an installed environment:
# site-packages/epx/_lib/ -> site-packages/nvidia/nvshmem/lib/ (the nvidia-nvshmem-cu13 wheel).
NVSHMEM_WHEEL_RPATH = "$ORIGIN/../../nvidia/nvshmem/lib"


def _env(name, old_name, default=""):
    value = os.environ.get(name)
    if value is None:
        value = os.environ.get(old_name, default)
    return value


def _skip_build():
    return _env("EPXPY_SKIP_BUILD", "EPX_SKIP_BUILD") == "1"


def _build_and_stage(build_dir, stage_dir):
    """Configure, build and install epx into stage_dir; return the files to bundle."""
    if not os.path.exists(os.path.join(REPO, "CMakeLists.txt")):
        raise RuntimeError(
            "epx: cannot build libepx.so: %s has no CMakeLists.txt (install from a checkout "
            "of the repository with `pip install ./python`, or set EPXPY_SKIP_BUILD=1 and "
            "point EPX_LIBRARY at a built library)" % REPO)
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("epx: cmake (>= 3.25) and a C compiler are needed to build "
                           "libepx.so; install them (e.g. apt-get install cmake "
                           "build-essential) or set EPXPY_SKIP_BUILD=1")
    configure = [cmake, "-S", REPO, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                 "-DCMAKE_INSTALL_LIBDIR=_lib", "-DCMAKE_INSTALL_BINDIR=_bin",
                 "-DPython3_EXECUTABLE=" + sys.executable,
                 "-DEPX_NVSHMEM_RPATH=" + NVSHMEM_WHEEL_RPATH]
    configure += shlex.split(_env("CMAKE_ARGS", "EPX_CMAKE_ARGS"))
    configured = subprocess.run(configure, stdout=subprocess.PIPE, universal_newlines=True)
    sys.stdout.write(configured.stdout)
    if configured.returncode != 0:
        raise RuntimeError("epx: CMake configure failed (see above)")
    targets = ["epx", "epx_tool"]
    with_plugin = "epx: NVSHMEM plugin ON" in configured.stdout
    if with_plugin:
        targets.append("epx_nvshmem")
    jobs = (_env("CMAKE_BUILD_PARALLEL_LEVEL", "EPX_BUILD_JOBS") or str(os.cpu_count() or 2))
    subprocess.check_call([cmake, "--build", build_dir, "-j", jobs, "--target"] + targets)
    shutil.rmtree(stage_dir, ignore_errors=True)
    subprocess.check_call([cmake, "--install", build_dir, "--prefix", stage_dir],
                          stdout=subprocess.DEVNULL)
    library = os.path.join(stage_dir, "_lib", "libepx.so.0")
    if not os.path.exists(library):
        raise RuntimeError("epx: `cmake --install` put no libepx.so.0 in %s/_lib" % stage_dir)
    # The real file (libepx.so.X.Y.Z) under its soname, which the epx executable needs and
    # epx/_library.py looks for.
    files = {"_lib/libepx.so.0": os.path.realpath(library),
             "_bin/epx": os.path.join(stage_dir, "_bin", "epx")}
    if with_plugin:
        files["_lib/libepx_nvshmem.so"] = os.path.join(stage_dir, "_lib", "libepx_nvshmem.so")
    return files


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        if _skip_build():
            return
        build_dir = os.path.abspath(os.environ.get("EPXPY_BUILD_DIR") or
                                    os.path.join(HERE, "build", "cmake"))
        files = _build_and_stage(build_dir, os.path.join(build_dir, "stage"))
        # A build directory reused from an earlier install may hold files this build
        # does not make (a library under another name): start the bundle afresh.
        for directory in ("_lib", "_bin"):
            shutil.rmtree(os.path.join(self.build_lib, "epx", directory), ignore_errors=True)
        for name, source in files.items():
            target = os.path.join(self.build_lib, "epx", name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy(source, target)  # keeps the mode (+x)


class BinaryDistribution(Distribution):
    """The wheel carries a shared library and a program: tag it for this platform."""

    def has_ext_modules(self):
        return not _skip_build()


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
            if _skip_build():
                return python, abi, platform
            return "py3", "none", platform

    cmdclass["bdist_wheel"] = PlatformWheel

setup(cmdclass=cmdclass, distclass=BinaryDistribution)
