#!/bin/sh
# `cmake --install` and the README's C example against the installed tree:
#   c_example.sh SOURCE_DIR BUILD_DIR [EXTRA_CFLAGS]
# installs BUILD_DIR into a fresh prefix, checks what is there, builds
# examples/dispatch_combine.c with the README's compile line (pkg-config) and with
# find_package(epx) (examples/CMakeLists.txt), and runs both through the installed
# `PREFIX/bin/epx launch -n 4`. EXTRA_CFLAGS (the sanitizer build's flags) go to both.
set -u
SOURCE=$1
BUILD=$2
EXTRA=${3:-}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

fail() {
    echo "FAIL: $*" >&2
    exit 1
}
# step NAME COMMAND...: run it, output to $TMP/NAME.log, shown when it fails.
step() {
    name=$1
    shift
    if ! "$@" >"$TMP/$name.log" 2>&1; then
        sed "s/^/  $name: /" "$TMP/$name.log" >&2
        fail "$name: $*"
    fi
}

PREFIX=$TMP/prefix
export PREFIX
step install cmake --install "$BUILD" --prefix "$PREFIX"
for file in bin/epx include/epx.h lib/libepx.so lib/pkgconfig/epx.pc \
    lib/cmake/epx/epx-config.cmake lib/cmake/epx/epx-config-version.cmake \
    lib/cmake/epx/epx-targets.cmake; do
    [ -e "$PREFIX/$file" ] || fail "cmake --install did not install $file"
done
ls "$BUILD"/libepx_nvshmem.so >/dev/null 2>&1 && { [ -e "$PREFIX/lib/libepx_nvshmem.so" ] ||
    fail "the build has the NVSHMEM plugin but the install does not"; }
# The pkg-config file names the prefix given to --install, not the configured one.
grep -q "^prefix=$PREFIX\$" "$PREFIX/lib/pkgconfig/epx.pc" || fail "epx.pc: $(cat "$PREFIX/lib/pkgconfig/epx.pc")"
# The installed command finds the plugin in PREFIX/lib through its run path.
readelf -d "$PREFIX/bin/epx" | grep -q 'RUNPATH.*\$ORIGIN/\.\./lib' ||
    fail "bin/epx has no run path to ../lib: $(readelf -d "$PREFIX/bin/epx" | grep -i path)"
step version "$PREFIX/bin/epx" version

# The README's lines, run as written there (from the repository root, with $PREFIX set).
readme_lines=$(sed -n 's/^    \(export PKG_CONFIG_PATH=.*\)$/\1/p; s/^    \(cc examples\/dispatch_combine\.c .*\)$/\1/p' \
    "$SOURCE/README.md")
[ "$(printf '%s\n' "$readme_lines" | wc -l)" -eq 2 ] ||
    fail "README.md lacks the export PKG_CONFIG_PATH and cc lines of the C example: '$readme_lines'"
printf '%s\n' "$readme_lines" | sed "s@ -o @ $EXTRA -o $TMP/@" >"$TMP/compile.sh"
(cd "$SOURCE" && step compile sh -ex "$TMP/compile.sh") || exit 1
[ -x "$TMP/dispatch_combine" ] || fail "the README's compile line made no dispatch_combine"

# The README shows the example's code: each of its lines (but "/* ... */") is in the file,
# in the same order.
awk -v file="$SOURCE/examples/dispatch_combine.c" '
    function trim(s) { gsub(/^[ \t]+|[ \t]+$/, "", s); return s }
    BEGIN { while ((getline line < file) > 0) code[++n] = trim(line); at = 1 }
    /^```c$/ { inside = 1; next }
    /^```$/ { inside = 0; next }
    inside {
        want = trim($0)
        if (want == "" || want == "/* ... */") next
        while (at <= n && code[at] != want) at++
        if (at > n) { print "README line not in the example (or out of order): " want; bad = 1; exit }
        at++; shown++
    }
    END { if (!bad && shown < 20) { print "README shows " shown + 0 " lines of the example"; bad = 1 }
          exit bad }' "$SOURCE/README.md" || fail "README.md's C example differs from examples/dispatch_combine.c"

# find_package(epx): the examples' CMake project against the prefix.
step cmake_configure cmake -S "$SOURCE/examples" -B "$TMP/cmake-build" \
    -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_C_FLAGS="$EXTRA" -DCMAKE_EXE_LINKER_FLAGS="$EXTRA"
step cmake_build cmake --build "$TMP/cmake-build"

# Both programs, 4 ranks, through the installed launcher; every rank checks its result.
for program in "$TMP/dispatch_combine" "$TMP/cmake-build/dispatch_combine"; do
    step run "$PREFIX/bin/epx" launch -n 4 -- "$program"
    cat "$TMP/run.log"
    n=$(grep -c '^\[rank [0-3]\] rank [0-3] of 4: 128 tokens sent, [0-9]* received, combine correct$' "$TMP/run.log")
    [ "$n" -eq 4 ] || fail "$program: $n of 4 ranks say combine correct"
done
echo "PASS: installed into a prefix; the C example built with pkg-config and find_package(epx) and ran on 4 ranks"
