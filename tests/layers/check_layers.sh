#!/bin/sh
# The layers point one way (docs/DESIGN.md): checked on the built objects with nm.
#
#   check_layers.sh LIST             check every object named in LIST (one path a line,
#                                    written by tests/layers.cmake: the library, the
#                                    NVSHMEM plugin, the epx tool); each object's source
#                                    path is its path after "<target>.dir/"
#   check_layers.sh --self-test      build two small objects that break a rule and make
#                                    sure the check fails on them
#
# Layers, from the source path of each object (rank: a layer may use symbols defined in
# its own rank or below):
#   core  src/core/ 0   bootstrap  src/bootstrap/ 1   transport  src/transport/ 2
#   ops   src/ops/ (the backend interface src/ops/*.c and the backends below it) 3
#   api   src/*.c 4
# and the epx tool (tools/): it may use no epx__ symbol that it does not define itself.
set -eu

layer_of() {
    case "$1" in
    src/core/*) echo 0 ;;
    src/bootstrap/*) echo 1 ;;
    src/transport/*) echo 2 ;;
    src/ops/*) echo 3 ;;
    src/*/*) echo 9 ;;  # a new folder: give it a place in this list first
    src/*) echo 4 ;;
    tools/*) echo tool ;;
    *) echo 9 ;;
    esac
}

check() {
    objects="$1"
    list="$(mktemp)"
    defs="$(mktemp)"
    uses="$(mktemp)"
    trap 'rm -f "$list" "$defs" "$uses"' EXIT
    # "<source path> <object path>" for every object: the path after "<target>.dir/".
    sed -n 's#^\(.*/[^/]*\.dir/\)\(.*\)\.o$#\2 \1\2.o#p' "$objects" | sort >"$list"
    if [ ! -s "$list" ]; then
        echo "check_layers: no objects named in $objects" >&2
        exit 1
    fi
    while read -r source object; do
        layer="$(layer_of "$source")"
        if [ "$layer" = 9 ]; then
            echo "check_layers: $source is in no known layer (add it to check_layers.sh)" >&2
            exit 1
        fi
        nm -g --defined-only "$object" | awk -v s="$source" -v l="$layer" \
            'NF >= 3 && $2 ~ /^[TDBRVWGS]$/ { print $3, l, s }' >>"$defs"
        nm -u "$object" | awk -v s="$source" -v l="$layer" 'NF >= 2 { print $2, l, s }' >>"$uses"
    done <"$list"
    for layer in 0 1 2 3 4; do
        if ! awk -v l="$layer" '$2 == l { found = 1 } END { exit !found }' "$defs"; then
            echo "check_layers: no object of layer $layer in $objects (paths changed?)" >&2
            exit 1
        fi
    done
    # Every use whose symbol is defined in a higher layer, or an epx__ symbol a tool
    # object uses without a tool object defining it.
    awk '
        FNR == NR { if (!($1 in layer)) { layer[$1] = $2; where[$1] = $3 }
                    if ($2 == "tool") tool[$1] = 1; next }
        $2 == "tool" {
            if ($1 ~ /^epx__/ && !($1 in tool)) {
                printf "%s (tool) uses %s, defined in %s: tools use the public API\n", \
                       $3, $1, ($1 in where) ? where[$1] : "the library"
                bad++
            }
            next
        }
        ($1 in layer) && layer[$1] != "tool" && layer[$1] + 0 > $2 + 0 {
            printf "%s (layer %d) uses %s, defined in %s (layer %d)\n", $3, $2, $1, \
                   where[$1], layer[$1]
            bad++
        }
        END { exit bad > 0 }
    ' "$defs" "$uses" && status=0 || status=1
    if [ "$status" -ne 0 ]; then
        echo "check_layers: a lower layer uses a higher one (see above)" >&2
        exit 1
    fi
    echo "check_layers: $(wc -l <"$list") objects, every arrow points down"
}

self_test() {
    dir="$(mktemp -d)"
    trap 'rm -rf "$dir"' EXIT
    mkdir -p "$dir/t.dir/src/core" "$dir/t.dir/src/bootstrap" "$dir/t.dir/src/transport" \
             "$dir/t.dir/src/ops" "$dir/t.dir/tools"
    cc=${CC:-cc}
    # One object per layer; the transport calls up into the API layer, the tool calls
    # an internal function.
    printf 'int epx__core(void) { return 1; }\n' >"$dir/core.c"
    printf 'int epx__core(void);\nint epx__boot(void) { return epx__core(); }\n' >"$dir/boot.c"
    printf 'int epx__api(void);\nint epx__shm(void) { return epx__api(); }\n' >"$dir/shm.c"
    printf 'int epx__shm(void);\nint epx__op(void) { return epx__shm(); }\n' >"$dir/op.c"
    printf 'int epx__op(void);\nint epx__api(void) { return epx__op(); }\n' >"$dir/api.c"
    printf 'int epx__core(void);\nint main(void) { return epx__core(); }\n' >"$dir/main.c"
    "$cc" -c "$dir/core.c" -o "$dir/t.dir/src/core/core.c.o"
    "$cc" -c "$dir/boot.c" -o "$dir/t.dir/src/bootstrap/boot.c.o"
    "$cc" -c "$dir/shm.c" -o "$dir/t.dir/src/transport/shm.c.o"
    "$cc" -c "$dir/op.c" -o "$dir/t.dir/src/ops/op.c.o"
    "$cc" -c "$dir/api.c" -o "$dir/t.dir/src/api.c.o"
    "$cc" -c "$dir/main.c" -o "$dir/t.dir/tools/main.c.o"
    find "$dir/t.dir" -name '*.o' >"$dir/objects.txt"
    out="$(sh "$0" "$dir/objects.txt" 2>&1)" && {
        echo "check_layers --self-test: the check passed objects that break two rules" >&2
        exit 1
    }
    for want in "src/transport/shm.c (layer 2) uses epx__api" "tools/main.c (tool) uses epx__core"; do
        case "$out" in
        *"$want"*) ;;
        *) echo "check_layers --self-test: expected '$want' in:" >&2
           echo "$out" >&2
           exit 1 ;;
        esac
    done
    echo "check_layers --self-test: both violations found"
}

if [ "${1:-}" = "--self-test" ]; then
    self_test
else
    check "${1:?usage: check_layers.sh LIST | --self-test}"
fi
