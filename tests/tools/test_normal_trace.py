"""scripts/normal-trace on hand-made traces of 2 ranks (the file layout of
src/ops/cuda/launch.h, EPX_NORMAL_TRACE): the printed phases are checked against what
was written, a combine that one rank did not stamp whole is left out, and --first /
--every / --count pick the calls."""
import os
import struct
import subprocess
import sys
import tempfile

CALLS, EVENTS = 256, 8


def record(t0, rank):
    """One rank's stamps of a combine starting at t0 (ns); rank 1 starts 4 us later and
    its loop ends 10 us later."""
    s = t0 + rank * 4000
    ready_done = t0 + 5000                     # both ranks: after the last start
    pull_first = ready_done + 1000
    rows_last = t0 + 100_000 + rank * 10_000
    done_end = t0 + 120_000                    # aligned by the done exchange
    return [s, ready_done, pull_first, pull_first + 500, rows_last - 20_000, rows_last,
            rows_last + 2000, done_end]


def write(prefix, rank, calls, skip_whole=()):
    words = [0] * (2 + CALLS * EVENTS)
    words[0] = calls
    words[1] = calls - 1
    for call in range(calls):
        rec = record(1_000_000 * (call + 1), rank)
        if call in skip_whole and rank == 1:
            rec[5] = 0  # this rank's loop end not stamped (another combine form)
        base = 2 + (call % CALLS) * EVENTS
        words[base:base + EVENTS] = rec
    with open(f"{prefix}.{rank}", "wb") as f:
        f.write(struct.pack("<8s7q", b"EPXNMTR1", rank, 2, CALLS, EVENTS, 0, 0, 0))
        f.write(struct.pack(f"<{len(words)}Q", *words))


def run(script, prefix, *extra):
    out = subprocess.run([sys.executable, script, prefix, *extra], check=True,
                         capture_output=True, text=True).stdout
    print(out)
    values = {}
    for line in out.splitlines():
        if line.startswith("  "):
            name = line[2:62].strip()
            values[name] = float(line[62:].split()[0])
    return out, values


def main():
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "normal-trace")
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "t")
        for rank in (0, 1):
            write(prefix, rank, calls=6, skip_whole=(2,))
        out, v = run(script, prefix)
        assert "2 ranks, 5 combines (calls 0-5)" in out, out
        # Every row the reader prints, in us, as record() wrote the two ranks' stamps.
        expected = {
            "ranks start, last after first": 4.0,
            "ready exchange done, slowest rank, from the first start": 5.0,
            "ready done to the pull kernel's first block": 1.0,
            "pull blocks' starts, spread in a rank (longest)": 0.5,
            "row loop, first block start to last warp end: median rank": 99.0,
            "row loop: slowest rank": 104.0,
            "first warp done to last warp done in a rank: median rank": 20.0,
            "last warp done to the done exchange: median rank": 2.0,
            "done exchange: median rank": 13.0,
            "ranks' loops end, last after first": 10.0,
            "ready start to done end: median rank": 118.0,
            "ready start to done end: longest rank": 120.0,
        }
        assert sorted(v) == sorted(expected), v
        for name, want in expected.items():
            assert v[name] == want, (name, v[name], want)
        out, _ = run(script, prefix, "--first", "1", "--every", "2")
        assert "2 ranks, 3 combines (calls 1-5)" in out, out
        out, _ = run(script, prefix, "--first", "1", "--every", "2", "--count", "2")
        assert "2 ranks, 2 combines (calls 1-3)" in out, out
        bad = subprocess.run([sys.executable, script, os.path.join(tmp, "none")],
                             capture_output=True, text=True)
        assert bad.returncode != 0 and "no " in bad.stderr, bad.stderr
    print("normal-trace: ok")


if __name__ == "__main__":
    main()
