#!/bin/sh
# Command-level tests of the `epx` executable: tools_test.sh EPX CASE.
# Each case runs the command, then asserts on its exit status and output; a failure
# prints what was expected and what the command wrote.
EPX=$1
CASE=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

fail() {
    echo "FAIL [$CASE]: $*" >&2
    for f in out err; do
        [ -s "$TMP/$f" ] && sed "s/^/  std$f: /" "$TMP/$f" >&2
    done
    exit 1
}

# run CMD...: stdout to $TMP/out, stderr to $TMP/err, status in $rc, seconds in $took.
run() {
    start=$(date +%s)
    "$@" >"$TMP/out" 2>"$TMP/err"
    rc=$?
    took=$(($(date +%s) - start))
}

expect_rc() { [ "$rc" -eq "$1" ] || fail "exit status $rc, expected $1"; }
expect_out() { grep -q -e "$1" "$TMP/out" || fail "stdout lacks '$1'"; }
expect_err() { grep -q -e "$1" "$TMP/err" || fail "stderr lacks '$1'"; }
expect_fast() { [ "$took" -le "$1" ] || fail "took $took s, expected at most $1 s"; }
expect_count() { # PATTERN FILE COUNT
    n=$(grep -c -e "$1" "$TMP/$2")
    [ "$n" -eq "$3" ] || fail "$n lines of $2 match '$1', expected $3"
}

# Remove the MPS directory a failed run kept (named in its stderr), and only that one.
remove_mps_dir() {
    kept=$(sed -n 's@.*\(/tmp/epx-mps-[0-9][0-9]*\)/log.*@\1@p' "$TMP/err" | head -1)
    [ -n "$kept" ] && rm -rf "$kept"
}

case "$CASE" in
launch_env)
    run "$EPX" launch -n 3 -- sh -c \
        'echo "env $EPX_RANK $EPX_WORLD_SIZE $EPX_LOCAL_RANK $NVSHMEM_DISABLE_NVLS $NCCL_NVLS_ENABLE ${EPX_UNIQUE_ID:-none} ${EPX_RANKS_PER_NODE:-unset} ${EPX_BACKEND:-unset}"'
    expect_rc 0
    for r in 0 1 2; do
        expect_out "^\[rank $r\] env $r 3 $r 1 0 epx1:.* unset unset\$"
    done
    expect_count '^\[rank' out 3
    # Every rank gets the same id.
    ids=$(sed 's/.* \(epx1:[^ ]*\) .*/\1/' "$TMP/out" | sort -u | wc -l)
    [ "$ids" -eq 1 ] || fail "ranks got $ids different unique ids"
    # Optional settings, and NVLS values the user set are kept.
    run env NCCL_NVLS_ENABLE=1 "$EPX" launch -n 2 --ranks-per-node 1 --backend host -- sh -c \
        'echo "opt $EPX_RANKS_PER_NODE $EPX_BACKEND $NCCL_NVLS_ENABLE"'
    expect_rc 0
    expect_count '^\[rank [01]\] opt 1 host 1$' out 2
    ;;
launch_output)
    run "$EPX" launch -n 2 -- sh -c 'printf "one\ntwo\n"; echo oops >&2; printf "no newline"'
    expect_rc 0
    for r in 0 1; do
        expect_out "^\[rank $r\] one\$"
        expect_out "^\[rank $r\] two\$"
        expect_out "^\[rank $r\] no newline\$"
        expect_err "^\[rank $r\] oops\$"
    done
    expect_count 'oops' out 0
    ;;
launch_failure)
    # Rank 2 fails at once; the sleeping ranks must be stopped, not waited for.
    run "$EPX" launch -n 3 -- sh -c 'if [ "$EPX_RANK" = 2 ]; then echo bye; exit 7; fi; sleep 60'
    expect_rc 7
    expect_fast 10
    expect_err 'epx launch: rank 2 exited with status 7'
    expect_out '^\[rank 2\] bye$'
    # A rank killed by a signal: 128 + signal.
    run "$EPX" launch -n 2 -- sh -c 'if [ "$EPX_RANK" = 1 ]; then kill -9 $$; fi; sleep 60'
    expect_rc 137
    expect_fast 10
    expect_err 'epx launch: rank 1 killed by signal 9'
    # A rank that ignores SIGTERM gets SIGKILL after the grace period.
    run "$EPX" launch -n 2 -- sh -c 'trap "" TERM; if [ "$EPX_RANK" = 1 ]; then exit 3; fi; sleep 60'
    expect_rc 3
    expect_fast 10
    ;;
launch_exec_failure)
    run "$EPX" launch -n 2 -- /nonexistent/program
    expect_rc 127
    expect_err "cannot run '/nonexistent/program'"
    ;;
launch_timeout)
    run "$EPX" launch -n 2 --timeout 1 -- sh -c 'if [ "$EPX_RANK" = 0 ]; then exit 0; fi; sleep 60'
    expect_rc 124
    expect_fast 10
    expect_err 'ranks still running: 1$'
    # Without --timeout there is no overall limit (a training job runs for days).
    run "$EPX" launch --help
    expect_rc 0
    expect_out 'default: no limit'
    ;;
launch_forward_signal)
    # The file exists before the launcher's shell opens it, so the wait below cannot read
    # a missing file as "not ready" and signal too early (seen under ASan).
    : >"$TMP/out"
    "$EPX" launch -n 2 -- sh -c 'trap "echo term; exit 5" TERM; echo ready; sleep 60 & wait' \
        >"$TMP/out" 2>"$TMP/err" &
    pid=$!
    # Signal only once both ranks run (the launcher has its handlers by then).
    waited=0
    while [ "$(grep -c ready "$TMP/out")" -lt 2 ] && [ $waited -lt 100 ]; do
        sleep 0.1
        waited=$((waited + 1))
    done
    kill -TERM $pid
    wait $pid
    rc=$?
    expect_rc 5
    expect_count '^\[rank [01]\] term$' out 2
    ;;
launch_bad_flag)
    run "$EPX" launch --bogus -n 2 -- true
    expect_rc 2
    expect_err "unknown option '--bogus'"
    expect_err 'usage: epx launch'
    run "$EPX" launch -n 0 -- true
    expect_rc 2
    run "$EPX" launch -n 2
    expect_rc 2
    run "$EPX" launch -n 4 --ranks-per-node 3 -- true
    expect_rc 2
    run "$EPX" launch --timeout soon -n 2 -- true
    expect_rc 2
    run "$EPX" frobnicate
    expect_rc 2
    ;;
launch_mps)
    # A stand-in for nvidia-cuda-mps-control that records how it was called.
    mkdir -p "$TMP/bin" "$TMP/nobin"
    cat >"$TMP/bin/nvidia-cuda-mps-control" <<MPS
#!/bin/sh
if [ "\$1" = -d ]; then input=-; else input=\$(cat); fi
echo "args=\$* pipe=\$CUDA_MPS_PIPE_DIRECTORY log=\$CUDA_MPS_LOG_DIRECTORY in=\$input" >>"$TMP/mps.log"
[ -z "\$MPS_HANG_QUIT" ] || [ "\$1" = -d ] || exec sleep 600
[ -z "\$MPS_FAIL_START" ] || [ "\$1" != -d ]
MPS
    chmod +x "$TMP/bin/nvidia-cuda-mps-control"
    run env PATH="$TMP/bin:$PATH" "$EPX" launch --mps -n 2 -- sh -c 'echo "dir $CUDA_MPS_PIPE_DIRECTORY"'
    expect_rc 0
    expect_count '^\[rank [01]\] dir /tmp/epx-mps-[0-9]*/pipe$' out 2
    dir=$(sed -n 's/^\[rank 0\] dir \(.*\)\/pipe$/\1/p' "$TMP/out")
    expect_count "^args=-d pipe=$dir/pipe log=$dir/log in=-\$" mps.log 1
    expect_count "^args= pipe=$dir/pipe log=$dir/log in=quit\$" mps.log 1
    [ ! -e "$dir" ] || fail "$dir is left behind after a successful run"
    # The daemon is stopped after a failing run too.
    rm -f "$TMP/mps.log"
    run env PATH="$TMP/bin:$PATH" "$EPX" launch --mps -n 2 -- sh -c 'exit 3'
    expect_rc 3
    expect_count 'in=quit$' mps.log 1
    expect_err 'MPS logs kept in /tmp/epx-mps-'
    remove_mps_dir
    # A daemon that does not start: no rank runs.
    run env MPS_FAIL_START=1 PATH="$TMP/bin:$PATH" "$EPX" launch --mps -n 2 -- sh -c 'echo ran'
    expect_rc 1
    expect_err "nvidia-cuda-mps-control -d' failed"
    expect_count 'ran' out 0
    remove_mps_dir
    # A control program that does not finish is stopped at --timeout (60 s without it).
    run env MPS_HANG_QUIT=1 PATH="$TMP/bin:$PATH" "$EPX" launch --mps --timeout 2 -n 2 -- true
    expect_rc 0
    expect_err "'nvidia-cuda-mps-control (quit)' did not finish within 2 s; stopped it"
    expect_err "'echo quit | nvidia-cuda-mps-control' failed"
    remove_mps_dir
    # Not installed: a clear message.
    run env PATH="$TMP/nobin" "$EPX" launch --mps -n 2 -- true
    expect_rc 1
    expect_err 'needs nvidia-cuda-mps-control, which is not in PATH'
    ;;
params_list)
    run env EPX_TIMEOUT_MS=1234 "$EPX" params
    expect_rc 0
    expect_out '^EPX_TIMEOUT_MS .*30000 *1234 '
    expect_out '^EPX_UNIQUE_ID'
    ;;
params_bad_value)
    run env EPX_TIMEOUT_MS=abc "$EPX" params
    expect_rc 1
    expect_err 'epx params: EPX_ERR_INVALID_ARG: .*EPX_TIMEOUT_MS'
    # The low-latency combine receive's loads: 1 or 2.
    run env EPX_LL_COMBINE_RECV=3 "$EPX" params
    expect_rc 1
    expect_err 'EPX_LL_COMBINE_RECV=3 is out of range; expected an integer in \[1, 2\]'
    # How low-latency slots are given back: 1 (done flags) or 2 (inferred).
    run env EPX_LL_RELEASE=3 "$EPX" params
    expect_rc 1
    expect_err 'EPX_LL_RELEASE=3 is out of range; expected an integer in \[1, 2\]'
    ;;
version)
    run "$EPX" version
    expect_rc 0
    expect_out '^epx [0-9]*\.[0-9]*\.[0-9]*$'
    expect_out 'cuda (\(not \)\{0,1\}built)'
    [ -z "${EPXTEST_CUDA:-}" ] || expect_out "cuda ($EPXTEST_CUDA)"
    ;;
bench_bad_flag)
    run "$EPX" bench --bogus
    expect_rc 2
    expect_err "unknown option '--bogus'"
    run "$EPX" bench --dtype fp16
    expect_rc 2
    run "$EPX" bench --tokens 12x
    expect_rc 2
    run "$EPX" bench --mode fast
    expect_rc 2
    expect_err "bad value for --mode: 'fast'"
    # Scale formats belong to low-latency fp8 dispatch.
    run "$EPX" bench --round-scale
    expect_rc 2
    expect_err 'need --mode ll'
    run "$EPX" bench --mode ll --dtype bf16 --ue8m0
    expect_rc 2
    expect_err 'apply to fp8 dispatch'
    # A buffer sized for fp8 rows cannot carry a bf16 dispatch; the sizing is ll's.
    run "$EPX" bench --mode ll --dtype all --ll-dtype fp8
    expect_rc 2
    expect_err 'give --ll-dtype bf16'
    run "$EPX" bench --mode ll --ll-dtype fp16
    expect_rc 2
    expect_err "bad value for --ll-dtype: 'fp16'"
    run "$EPX" bench --ll-dtype bf16
    expect_rc 2
    expect_err '--ll-dtype needs --mode ll'
    # A shape epx refuses is found once, before any rank starts and before the header.
    run "$EPX" bench -n 2 --topk 300
    expect_rc 2
    expect_count 'epx bench: these options give a buffer epx refuses for 2 ranks: EPX_ERR_INVALID_ARG: .*num_topk is 300' err 1
    expect_count '\[rank' err 0
    expect_count '.' out 0
    run "$EPX" bench -n 2 --mode ll --tokens 16 --hidden 512 --experts 7 --topk 4
    expect_rc 2
    expect_count 'epx bench: these options give a buffer epx refuses for 2 ranks: .*num_experts is 7' err 1
    expect_count '.' out 0
    # Inside a launch: rank 0 says it once, the launcher stops the others.
    run "$EPX" launch -n 2 -- "$EPX" bench --mode ll --tokens 16 --hidden 512 --experts 7 --topk 4
    expect_rc 2
    expect_count '^\[rank 0\] epx bench: these options give a buffer epx refuses for 2 ranks: .*num_experts is 7' err 1
    expect_count 'epx bench: these options' err 1
    expect_count '.' out 0
    ;;
bench_check)
    run "$EPX" bench -n 2 --tokens 64 --hidden 256 --experts 8 --topk 2 --check
    expect_rc 0
    expect_out '^# epx bench: backend host, 2 ranks, tokens 64 hidden 256 experts 8 topk 2 alignment 1 seed 1, warmup'
    # The floor's definition once; no GPU-only fields on the CPU backend.
    expect_count '^# floor: the bytes all ranks must read and write' out 1
    expect_count '^# floor/time = floor_us / the slowest' out 1
    expect_count 'SMs' out 0
    expect_count ' PASS$' out 14
    expect_count 'FAIL' out 0
    for op in layout dispatch cached_dispatch combine combine_copy combine_registered combine_weights; do
        expect_count "^  bf16  $op " out 1
        expect_count "^  fp8   $op " out 1
    done
    # One process without a launcher is a group of one.
    run "$EPX" bench --tokens 16 --hidden 128 --experts 4 --topk 2 --dtype bf16 --check --alignment 4
    expect_rc 0
    expect_count ' PASS$' out 7
    # combine_registered from a larger allocation than its rows: the same results.
    run "$EPX" bench -n 2 --tokens 16 --hidden 128 --experts 4 --topk 2 --dtype bf16 --check \
        --register-mb 2
    expect_rc 0
    expect_count ' PASS$' out 7
    expect_count '^  bf16  combine_registered ' out 1
    # ... and from an allocation of exactly its rows (the GPU's slower case; here the same).
    run "$EPX" bench -n 2 --tokens 16 --hidden 128 --experts 4 --topk 2 --dtype bf16 --check \
        --register-exact
    expect_rc 0
    expect_count ' PASS$' out 7
    ;;
bench_auto_register)
    # combine_copy's x mapped on demand (config.auto_register): said in the header and in
    # every JSON row; the CPU backend copies as before, so every check still passes.
    run "$EPX" bench -n 2 --tokens 16 --hidden 128 --experts 4 --topk 2 --dtype bf16 --check \
        --auto-register
    expect_rc 0
    expect_count ' PASS$' out 7
    expect_count '# --auto-register: combine_copy' out 1
    run "$EPX" bench -n 2 --tokens 16 --hidden 128 --experts 4 --topk 2 --dtype bf16 --check \
        --auto-register --json --iters 1
    expect_rc 0
    expect_count '"auto_register":1' out 7
    ;;
bench_json)
    run "$EPX" bench -n 3 --tokens 64 --hidden 256 --experts 12 --topk 2 --check --json --iters 2
    expect_rc 0
    expect_count '.' out 14
    expect_count '^{.*}$' out 14
    if command -v python3 >/dev/null 2>&1; then
        python3 - "$TMP/out" <<'PY' || fail "JSON lines do not hold what they should"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert len(rows) == 14, rows
for row in rows:
    assert row["ranks"] == 3 and row["tokens"] == 64 and row["iters"] == 2, row
    assert row["check"] == "PASS", row
    assert row["sms"] is None and "pct_of_floor" not in row, row  # CPU backend: no SM budget
    assert row["auto_register"] == 0, row
    assert row["median_us"] > 0 and row["p99_us"] >= row["median_us"], row
    # Per iteration the slowest rank took at least as long as rank 0.
    assert row["slowest_median_us"] >= row["median_us"], row
    if row["op"] == "layout":
        assert row["bytes_per_rank"] == 0 and row["floor_us"] is None, row
        assert row["floor_bytes"] == 0 and row["floor_over_time"] is None, row
        continue
    assert row["bytes_per_rank"] > 0 and row["total_bytes"] >= row["bytes_per_rank"], row
    assert row["gbps_per_rank"] > 0 and row["floor_us"] > 0, row
    # floor/time: the floor over the slowest rank's median.
    ratio = row["floor_us"] / row["slowest_median_us"]
    assert abs(row["floor_over_time"] - ratio) <= 1e-4 * ratio, row
    # Floors: 3 ranks x 64 source tokens read once, each received row written once
    # (hidden 256, top-2: ids int64 + weights fp32 = 24 bytes of routing per row).
    x_row = 256 * (2 if row["dtype"] == "bf16" else 1) + (0 if row["dtype"] == "bf16" else 2 * 4)
    received = row["total_bytes"] // (x_row if "dispatch" in row["op"] else 512)
    if row["op"] == "dispatch":
        assert row["floor_bytes"] == (3 * 64 + received) * (x_row + 24), row
    elif row["op"] == "cached_dispatch":
        assert row["floor_bytes"] == (3 * 64 + received) * x_row, row
    elif row["op"] == "combine_weights":  # ... each with its 2 fp32 weights
        assert row["floor_bytes"] == (received + 3 * 64) * (512 + 8), row
    else:  # combine: each received row read, each output row written
        assert row["floor_bytes"] == (received + 3 * 64) * 512, row
assert sorted({(r["dtype"], r["op"]) for r in rows}) == sorted(
    (d, o) for d in ("bf16", "fp8")
    for o in ("layout", "dispatch", "cached_dispatch", "combine", "combine_copy",
              "combine_registered", "combine_weights"))
# The CPU backend runs nothing back to back unless asked.
assert all("back_to_back_us" not in row for row in rows), rows
PY
    fi
    expect_count 'back to back' out 0
    # --back-to-back N: the fresh dispatch without a host wait, the cached dispatch and the
    # two in-place combines N times each in a row, after the table, a line each; in JSON a
    # key on those rows only.
    run "$EPX" bench -n 2 --tokens 32 --hidden 128 --experts 4 --topk 2 --dtype bf16 --check \
        --iters 1 --back-to-back 2
    expect_rc 0
    expect_count ' PASS$' out 7
    expect_count '^# back to back (2 calls of each between one pair of events.*EPX_DISPATCH_WORST_CASE' out 1
    for op in dispatch cached_dispatch combine combine_registered; do
        expect_count "^#   bf16  $op  *[0-9.]* us  floor/time [0-9.]*$" out 1
    done
    expect_count '^#   bf16  ' out 4
    run "$EPX" bench -n 2 --tokens 32 --hidden 128 --experts 4 --topk 2 --dtype bf16 \
        --iters 1 --back-to-back 2 --json
    expect_rc 0
    if command -v python3 >/dev/null 2>&1; then
        python3 - "$TMP/out" <<'PY' || fail "back-to-back JSON keys are not where they should be"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
timed = {r["op"] for r in rows if "back_to_back_us" in r}
assert timed == {"dispatch", "cached_dispatch", "combine", "combine_registered"}, timed
for r in rows:
    if "back_to_back_us" in r:
        assert r["back_to_back_us"] > 0, r
        ratio = r["floor_us"] / r["back_to_back_us"]
        assert abs(r["back_to_back_floor_over_time"] - ratio) <= 1e-4 * ratio, r
PY
    fi
    run "$EPX" bench -n 2 --tokens 32 --hidden 128 --experts 4 --topk 2 --back-to-back -1
    expect_rc 2
    expect_err "bad value for --back-to-back: '-1'"
    ;;
bench_fanout)
    # The copy of dispatch alone: every variant once per dtype, bytes as documented; the
    # sum of combine alone (fanin) for bf16 only.
    run "$EPX" bench -n 3 --mode fanout --tokens 64 --hidden 256 --experts 12 --topk 2 \
        --fanout 2.5 --iters 2
    expect_rc 0
    expect_out '^# epx bench --mode fanout: backend host, 3 ranks, rows 64 per rank, hidden 256, fanout 2.50'
    expect_count '^# copy bandwidth: [0-9.]* GB/s measured' out 1
    expect_count '^# span: from the first rank issuing a copy' out 1
    for kernel in vector bulk staged; do
        expect_count "^  bf16  $kernel  *2.50 " out 1
        expect_count "^  bf16  $kernel  *1.00 " out 1
        expect_count "^  fp8   $kernel  *1.00 " out 1
    done
    expect_count '^  bf16  bulk_2  *2.50 ' out 1
    expect_count '^  bf16  staged_4  *2.50 ' out 1
    expect_count '^  fp8   copy_engine  *2.50 ' out 1
    expect_count '^  bf16  fanin  *2.50 ' out 1
    expect_count '^  bf16  fanin  *1.00 ' out 1
    expect_count '^  fp8   fanin ' out 0
    expect_count '^  ' out 20
    run "$EPX" bench -n 2 --mode fanout --tokens 32 --hidden 256 --experts 8 --topk 2 \
        --dtype bf16 --iters 2 --json
    expect_rc 0
    expect_count '^{.*}$' out 11
    if command -v python3 >/dev/null 2>&1; then
        python3 - "$TMP/out" <<'PY' || fail "JSON lines do not hold what they should"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert len(rows) == 11, rows
for row in rows:
    assert row["mode"] == "fanout" and row["ranks"] == 2 and row["rows"] == 32, row
    # Fanout not given: 5.25 capped at the 2 ranks; fanout 2 writes each row twice (the
    # fan-in reads each row's 2 sources and writes it once: the same bytes).
    fanout = row["fanout"]
    assert fanout in (1, 2), row
    row_bytes = 256 * 2
    written = 32 * fanout
    per_rank = 2 * written * row_bytes if row["kernel"] == "copy_engine" else (32 + written) * row_bytes
    assert row["total_bytes"] == 2 * per_rank, row
    assert abs(row["gbps"] - row["total_bytes"] / (row["slowest_median_us"] * 1e3)) <= 1e-3 * row["gbps"], row
    assert row["of_copy"] > 0 and abs(row["of_copy"] - row["gbps"] / row["copy_gbps"]) <= 1e-3 * row["of_copy"], row
    # The span (first rank issuing to last rank finished) holds every rank's copy.
    assert row["span_median_us"] >= row["slowest_median_us"] * (1 - 1e-6), row
    assert row["span_of_floor"] <= row["of_floor"] * (1 + 1e-6), row
assert [r["kernel"] for r in rows] == ["vector", "bulk", "bulk_2", "staged", "staged_4", "vector",
                                      "bulk", "staged", "copy_engine", "fanin", "fanin"], rows
assert [r["fanout"] for r in rows[-2:]] == [2, 1], rows
assert all(r["dtype"] == "bf16" for r in rows), rows
PY
    fi
    # Refused: no checks in this mode, --fanout only in it, more than the ranks.
    run "$EPX" bench --mode fanout --check
    expect_rc 2
    expect_err 'no --check'
    run "$EPX" bench --fanout 2
    expect_rc 2
    expect_err '--fanout needs --mode fanout'
    run "$EPX" bench --mode fanout --fanout 0.5
    expect_rc 2
    expect_err "bad value for --fanout: '0.5'"
    run "$EPX" bench -n 2 --mode fanout --fanout 3 --tokens 8 --hidden 128 --experts 4 --topk 2
    expect_rc 2
    expect_err 'fanout 3.00 is more than the 2 ranks'
    ;;
bench_nodes)
    # Two virtual nodes of 2 ranks: checked results (combine sums node by node) and the
    # expected traffic across nodes, which must agree with the bench's own byte counts.
    run "$EPX" bench -n 4 --ranks-per-node 2 --tokens 64 --hidden 256 --experts 8 --topk 2 \
        --check --json --iters 2
    expect_rc 0
    expect_count '"check":"PASS"' out 14
    expect_count '"traffic":"expected"' out 4
    if command -v python3 >/dev/null 2>&1; then
        python3 - "$TMP/out" <<'PY' || fail "traffic lines do not hold what they should"
import json, sys
lines = [json.loads(line) for line in open(sys.argv[1])]
timed = {(r["dtype"], r["op"]): r for r in lines if "op" in r}
traffic = {(r["dtype"], r["traffic_op"]): r for r in lines if r.get("traffic") == "expected"}
assert len(timed) == 14 and len(traffic) == 4, lines
for (dtype, op), t in traffic.items():
    assert t["ranks"] == 4 and t["ranks_per_node"] == 2 and t["nodes"] == 2, t
    assert t["tokens_total"] == 4 * 64, t
    record = t["payload_bytes_per_record"] + t["overhead_bytes_per_record"]
    assert t["network_bytes_total"] == t["records_total"] * record, t
    assert t["network_bytes_per_rank"] == t["records_rank0"] * record, t
    # With top-2 a token reaches at most one node besides its own.
    assert 0 < t["records_total"] <= t["tokens_total"], t
    # Every row delivered once inside a node: what the timed op counted over all ranks.
    rows = t["home_rows_total"] + t["forwarded_rows_total"]
    assert t["local_bytes_total"] == rows * t["local_row_bytes"], t
    bench_op = "dispatch" if op == "dispatch" else "combine"
    assert t["local_bytes_total"] == timed[(dtype, bench_op)]["total_bytes"], (t, timed)
    assert abs(t["network_messages_per_token"] - t["records_total"] / 256) < 1e-5, t
# fp8 records carry 256 fp8 bytes and 2 fp32 scales; bf16 512 bytes; combine one bf16 row.
assert traffic[("fp8", "dispatch")]["payload_bytes_per_record"] == 264
assert traffic[("bf16", "dispatch")]["payload_bytes_per_record"] == 512
assert traffic[("fp8", "combine")]["payload_bytes_per_record"] == 512
# ids (2 x 8) + weights (2 x 4) + destination rows (2 ranks x 4); combine: weights.
assert traffic[("bf16", "dispatch")]["overhead_bytes_per_record"] == 32
assert traffic[("bf16", "combine")]["overhead_bytes_per_record"] == 8
# The routing does not depend on the dtype.
assert traffic[("bf16", "dispatch")]["records_total"] == traffic[("fp8", "combine")]["records_total"]
PY
    fi
    # The table: the traffic block after each dtype's rows.
    run "$EPX" bench -n 4 --ranks-per-node 2 --tokens 32 --hidden 256 --experts 8 --topk 2 \
        --check --iters 1
    expect_rc 0
    expect_count ' PASS$' out 14
    expect_count '^# traffic, 2 nodes x 2 ranks:$' out 2
    expect_count '^  bf16  dispatch  *[0-9]* ' out 2
    # One node: nothing crosses the network.
    run "$EPX" bench -n 2 --ranks-per-node 2 --tokens 32 --hidden 256 --experts 8 --topk 2 \
        --dtype bf16 --iters 1 --json
    expect_rc 0
    expect_count '"traffic_op":"dispatch".*"records_total":0,' out 1
    # No node split asked for, one node: no traffic lines.
    run "$EPX" bench -n 2 --tokens 32 --hidden 256 --experts 8 --topk 2 --dtype bf16 --iters 1
    expect_rc 0
    expect_count 'traffic' out 0
    # A node size that does not divide the ranks; a group whose node size differs.
    run "$EPX" bench -n 4 --ranks-per-node 3
    expect_rc 2
    expect_err 'ranks-per-node 3 does not divide -n 4'
    run "$EPX" launch -n 2 -- "$EPX" bench --ranks-per-node 1 --tokens 8 --hidden 128 \
        --experts 4 --topk 2
    expect_rc 2
    expect_err 'ranks-per-node 1, but the group has 2 ranks per node'
    ;;
bench_ll_nodes)
    # Low latency on two virtual nodes of 2 ranks: checked results, and the put path's
    # traffic counted from the routing, consistent with its model (docs/LOW_LATENCY.md).
    run "$EPX" bench -n 4 --mode ll --ranks-per-node 2 --tokens 16 --hidden 256 --experts 8 \
        --topk 4 --dtype all --check --json --iters 2
    expect_rc 0
    expect_count '"check":"PASS"' out 20
    expect_count '"traffic":"expected"' out 4
    if command -v python3 >/dev/null 2>&1; then
        python3 - "$TMP/out" <<'PY' || fail "traffic lines do not hold what they should"
import json, sys
lines = [json.loads(line) for line in open(sys.argv[1])]
traffic = {(r["dtype"], r["traffic_op"]): r for r in lines if r.get("traffic") == "expected"}
assert len(traffic) == 4, lines
for (dtype, op), t in traffic.items():
    assert t["mode"] == "ll" and t["nodes"] == 2 and t["ranks_per_node"] == 2, t
    assert t["tokens_total"] == 4 * 16 and t["peers_total"] == 4 * 2, t
    # A row per distinct (token, expert in another node): at most k a token; at least one
    # per (token, rank) pair, and per batch.
    assert 0 < t["pairs_total"] <= t["rows_total"] <= 4 * 16 * 4, t
    assert 0 < t["batches_total"] <= min(t["rows_total"], 4 * 4), t
    rows, row_bytes = t["rows_total"], 256 + 2 * 4 if dtype == "fp8" else 512
    if op == "dispatch":
        assert t["messages_total"] == t["batches_total"] * (4 if dtype == "fp8" else 3) + 8, t
        assert t["network_bytes_total"] == rows * (row_bytes + 8) + 8 * (8 + 1) * 8, t
        assert abs(t["row_bytes_per_token_if_per_rank"] - t["pairs_total"] * row_bytes / 64) < 1e-3
    else:
        assert t["messages_total"] == rows and t["network_bytes_total"] == rows * 512, t
# The routing does not depend on the dtype.
assert traffic[("bf16", "dispatch")]["rows_total"] == traffic[("fp8", "combine")]["rows_total"]
PY
    fi
    # One node: no put path, no traffic lines.
    run "$EPX" bench -n 2 --mode ll --ranks-per-node 2 --tokens 8 --hidden 256 --experts 4 \
        --topk 2 --iters 1
    expect_rc 0
    expect_count 'put-path' out 0
    ;;
bench_ll_check)
    # Low-latency mode, both dispatch dtypes, checked: ten ops each.
    run "$EPX" bench -n 2 --mode ll --tokens 16 --hidden 512 --experts 8 --topk 4 --dtype all \
        --check --iters 3
    expect_rc 0
    expect_out '^# epx bench --mode ll: backend host, 2 ranks, tokens 16 hidden 512 experts 8 topk 4 seed 1, warmup'
    expect_out '^# buffer: .* per rank (epx_buffer_size), .* of it for low latency'
    expect_count '^# floor/time = floor_us / the slowest' out 1
    # The same metric as normal mode, and no GPU-only fields on the CPU backend: no SM
    # budget, no CUDA-graph row.
    expect_count 'time/floor\|SMs\|step_graph' out 0
    expect_count ' PASS$' out 20
    expect_count 'FAIL' out 0
    for op in dispatch combine dispatch_send dispatch_recv combine_send combine_recv \
        dispatch_loop combine_loop step_loop step_split_loop; do
        expect_count "^  bf16  $op " out 1
        expect_count "^  fp8   $op " out 1
        expect_count "^#   fp8   $op  *[0-9.]*  *[0-9.]*\$" out 1
    done
    # --wait-stats: the calls pass wait_recv_cost_stats, still checked; the sums after the
    # rows, a line per (op, rank) with an entry per rank, or one JSON line.
    run "$EPX" bench -n 2 --mode ll --tokens 16 --hidden 512 --experts 8 --topk 4 --dtype bf16 \
        --check --iters 2 --wait-stats
    expect_rc 0
    expect_count ' PASS$' out 10
    expect_count '^# bf16 wait_recv_cost_stats (--wait-stats): ms each rank' out 1
    expect_count '^#   \(dispatch\|combine \) rank [01]   *[0-9.]*  *[0-9.]*$' out 4
    run "$EPX" bench -n 2 --mode ll --tokens 16 --hidden 512 --experts 8 --topk 4 --dtype bf16 \
        --iters 2 --wait-stats --json
    expect_rc 0
    expect_count '^{"dtype":"bf16","wait_recv_cost_stats_ns":{"dispatch":\[\[[0-9]*,[0-9]*\],\[[0-9]*,[0-9]*\]\],"combine":' out 1
    run "$EPX" bench --wait-stats
    expect_rc 2
    expect_err '--wait-stats needs --mode ll'
    # The standard case's defaults: 128 tokens, fp8 dispatch only.
    run "$EPX" bench --mode ll --hidden 256 --experts 4 --topk 2 --check --iters 2
    expect_rc 0
    expect_out '^# epx bench --mode ll: backend host, 1 ranks, tokens 128 hidden 256 experts 4 topk 2'
    expect_count ' PASS$' out 10
    expect_count '^  bf16 ' out 0
    # fp8 dispatch only: the buffer's low-latency rows are sized for fp8.
    expect_out '^# buffer: .* (max_low_latency_tokens 128, low_latency_dtype fp8: '
    # --ll-dtype bf16 measures a buffer sized for bf16 rows: same results, more memory.
    run "$EPX" bench --mode ll --hidden 256 --experts 4 --topk 2 --check --iters 2 --json
    expect_rc 0
    fp8_bytes=$(sed -n 's/.*"ll_buffer_bytes_per_rank":\([0-9]*\),"ll_dtype":"fp8".*/\1/p' \
        "$TMP/out" | sort -u)
    run "$EPX" bench --mode ll --hidden 256 --experts 4 --topk 2 --check --iters 2 --json \
        --ll-dtype bf16
    expect_rc 0
    expect_count '"dtype":"fp8".*"ll_dtype":"bf16".*"check":"PASS"' out 10
    bf16_bytes=$(sed -n 's/.*"ll_buffer_bytes_per_rank":\([0-9]*\),"ll_dtype":"bf16".*/\1/p' \
        "$TMP/out" | sort -u)
    [ -n "$fp8_bytes" ] && [ -n "$bf16_bytes" ] && [ "$fp8_bytes" -lt "$bf16_bytes" ] ||
        fail "low-latency bytes: '$fp8_bytes' with fp8 rows, '$bf16_bytes' with bf16 rows"
    ;;
bench_ll_json)
    run "$EPX" bench -n 3 --mode ll --tokens 16 --hidden 1024 --experts 12 --topk 4 --ue8m0 \
        --check --json --iters 4
    expect_rc 0
    expect_count '.' out 10
    expect_count '^{.*}$' out 10
    if command -v python3 >/dev/null 2>&1; then
        python3 - "$TMP/out" <<'PY' || fail "JSON lines do not hold what they should"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
# No step_graph row: CUDA graphs exist on the GPU backend only.
ops = ["dispatch", "combine", "dispatch_send", "dispatch_recv", "combine_send", "combine_recv",
       "dispatch_loop", "combine_loop", "step_loop", "step_split_loop"]
assert [r["op"] for r in rows] == ops, rows
by_op = {r["op"]: r for r in rows}
for row in rows:
    assert row["mode"] == "ll" and row["ranks"] == 3 and row["tokens"] == 16, row
    assert row["sms"] is None and "time_over_floor" not in row, row
    assert row["iters"] == 4 and row["dtype"] == "fp8", row
    assert row["round_scale"] == 1 and row["use_ue8m0"] == 1, row
    assert row["check"] == "PASS", row
    assert 0 < row["median_us"] <= row["p99_us"], row
    assert row["mean_us"] > 0 and row["slowest_p99_us"] >= row["slowest_median_us"], row
    # Per iteration the slowest rank took at least as long as rank 0 ...
    assert row["slowest_median_us"] >= row["median_us"], row
    for key in ("per_rank_median_us", "per_rank_p99_us", "per_rank_mean_us"):
        assert len(row[key]) == 3, row
    assert row["per_rank_median_us"][0] == row["median_us"], row
    # ... and than every other rank, so its median is at least every rank's.
    assert row["slowest_median_us"] >= max(row["per_rank_median_us"]), row
    assert row["buffer_bytes_per_rank"] >= row["ll_buffer_bytes_per_rank"] > 0, row
    assert row["bytes_per_rank"] > 0 and row["total_bytes"] >= row["bytes_per_rank"], row
# fp8 rows: hidden bytes + 4 scale bytes per 128 channels; combine rows: bf16.
dispatch, combine = by_op["dispatch"], by_op["combine"]
assert dispatch["bytes_per_rank"] % (1024 + 32) == 0, dispatch
assert combine["bytes_per_rank"] % 2048 == 0, combine
# Every row sent in dispatch comes back in combine (over all ranks).
assert dispatch["total_bytes"] // 1056 == combine["total_bytes"] // 2048
# Floors: dispatch reads each source token once (bf16 x + 4 int64 ids) and writes each row
# sent once; combine reads each row sent back once and, per token, its ids, weights and
# output row once.
assert dispatch["floor_bytes"] == 3 * 16 * (1024 * 2 + 4 * 8) + dispatch["total_bytes"], dispatch
assert combine["floor_bytes"] == combine["total_bytes"] + 3 * 16 * (2048 + 4 * 12), combine
for row in (dispatch, combine):
    assert row["floor_us"] > 0, row
    ratio = row["floor_us"] / row["slowest_median_us"]
    assert abs(row["floor_over_time"] - ratio) <= 1e-4 * ratio, row
for op in ops[2:6]:
    assert by_op[op]["floor_us"] is None and by_op[op]["floor_bytes"] == 0, by_op[op]
    assert by_op[op]["floor_over_time"] is None, by_op[op]
# The loops: the same floors; a whole step has both.
assert by_op["dispatch_loop"]["floor_bytes"] == dispatch["floor_bytes"]
assert by_op["combine_loop"]["floor_bytes"] == combine["floor_bytes"]
for op in ("step_loop", "step_split_loop"):
    assert by_op[op]["floor_bytes"] == dispatch["floor_bytes"] + combine["floor_bytes"]
PY
    fi
    ;;
soak)
    # The stability check in short: 4 ranks on the CPU backend, both modes, 20 s.
    run "$EPX" bench -n 4 --backend host --soak 20s --window 5s --check-every 2 --tokens 48 \
        --hidden 512 --experts 16 --topk 4 --ll-tokens 12 --json
    expect_rc 0
    if command -v python3 >/dev/null 2>&1; then
        python3 - "$TMP/out" <<'PY' || fail "the soak's JSON lines do not hold what they should"
import json, sys
lines = [json.loads(line) for line in open(sys.argv[1])]
windows = [l for l in lines if "soak_window" in l]
summary = lines[-1]
assert summary.get("soak_summary") is True, summary
assert len(windows) >= 3 and summary["windows"] == len(windows), summary
assert summary["mismatches"] == 0 and summary["failed"] == 0, summary
assert summary["checked"] > 0 and summary["rounds"] > 0, summary
assert summary["peer_losses"] == 0, summary
for w in windows:
    assert w["ranks"] == 4 and w["rounds"] > 0 and w["host_rss_mb"] > 0, w
    assert w["end_s"] >= w["start_s"], w
    for op in ("dispatch", "combine", "ll_dispatch", "ll_combine"):
        s = w["ops"][op]
        assert s["count"] > 0 and 0 < s["p50_us"] <= s["p99_us"] <= s["p999_us"] <= s["max_us"], w
assert set(summary["p99_drift"]) >= {"dispatch", "combine", "ll_dispatch", "ll_combine"}
PY
    fi
    ;;
soak_inject)
    # Rank 2 is killed 4 s into a low-latency soak: the others mask it and keep serving.
    run env EPX_TIMEOUT_MS=3000 "$EPX" bench -n 4 --backend host --soak 10s --window 3s \
        --tokens 32 --hidden 512 --experts 16 --topk 4 --ll-tokens 8 --soak-modes ll \
        --inject kill 2@4 --json
    expect_rc 0
    expect_err 'rank 2: killing myself'
    expect_err 'lost a peer after .*rank 2'
    if command -v python3 >/dev/null 2>&1; then
        python3 - "$TMP/out" <<'PY' || fail "the soak's summary does not show the loss"
import json, sys
summary = [json.loads(line) for line in open(sys.argv[1])][-1]
assert summary["soak_summary"] and summary["failed"] == 0 and summary["mismatches"] == 0, summary
assert summary["peer_losses"] >= 1 and 0 < summary["detect_ms"] < 3000, summary
assert summary["checked"] > 0, summary
PY
    fi
    ;;
soak_rejoin)
    # Rank 0 (the first group's rendezvous hub) is killed 3 s in; 2 s later a new process
    # takes its place and rejoins; every later round is checked with it in.
    run env EPX_TIMEOUT_MS=3000 "$EPX" bench -n 4 --backend host --soak 10s --window 3s \
        --tokens 32 --hidden 512 --experts 16 --topk 4 --ll-tokens 8 --soak-modes ll \
        --inject kill 0@3 --rejoin-after 2s --json
    expect_rc 0
    expect_err 'rank 0: starting a replacement process'
    expect_err 'rank 0 rejoined at'
    if command -v python3 >/dev/null 2>&1; then
        python3 - "$TMP/out" <<'PY' || fail "the soak's summary does not show the rejoin"
import json, sys
lines = [json.loads(line) for line in open(sys.argv[1])]
summary = lines[-1]
assert summary["soak_summary"] and summary["failed"] == 0 and summary["mismatches"] == 0, summary
assert summary["peer_losses"] >= 1 and 0 < summary["detect_ms"] < 3000, summary
assert summary["rejoined"] is True and summary["rejoin_ms"] > 0, summary
assert summary["checked_after_rejoin"] > 0 and summary["mismatches_after_rejoin"] == 0, summary
# After the rejoin the windows are every rank's again.
assert lines[-2]["ranks"] == 4 and lines[-2]["peer_losses"] == 0, lines[-2]
PY
    fi
    ;;
soak_bad_flag)
    run "$EPX" bench --soak 10x
    expect_rc 2
    expect_err "bad value for --soak: '10x'"
    run "$EPX" bench --soak 5s --inject kill 1
    expect_rc 2
    expect_err "bad value for --inject"
    run "$EPX" bench -n 2 --backend host --soak 5s --inject kill 1@2 --tokens 8 --hidden 128 \
        --experts 4 --topk 2
    expect_rc 2
    expect_err "inject needs --soak-modes ll"
    run "$EPX" bench --soak 5s --rejoin-after 0s
    expect_rc 2
    expect_err "bad value for --rejoin-after: '0s'"
    run "$EPX" bench -n 2 --backend host --soak 5s --soak-modes ll --inject stop 1@2 \
        --rejoin-after 1s --tokens 8 --hidden 128 --experts 4 --topk 2
    expect_rc 2
    expect_err "rejoin-after needs --inject kill and the CPU backend"
    ;;
*)
    fail "unknown case"
    ;;
esac
echo "PASS [$CASE]"
