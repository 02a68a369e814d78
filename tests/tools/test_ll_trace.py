"""scripts/ll-trace on hand-made traces of 2 ranks (the file layout of
src/ops/cuda/ll_plugin.h): every printed time is checked against what was written."""
import os
import struct
import subprocess
import sys
import tempfile

CALLS, BLOCKS = 256, 2
RECEIVE = 7  # dispatch events from here on are the receive's: block 0's
EVENTS_OF = {b"EPXLLTR2": 9, b"EPXLLTR3": 10, b"EPXLLTR1": 8}


def write(prefix, rank, steps, magic=b"EPXLLTR3"):
    """Dispatch event ev at t0 + ev us (+0.5 us in block 1), combine event ev at t0 + 100 +
    ev us; EVENTS_OF[magic] event slots."""
    EVENTS = EVENTS_OF[magic]
    times = [0] * (CALLS * 2 * BLOCKS * EVENTS)
    ids = [0] * (CALLS * 2)
    for step in range(steps):
        op = (step + 1) * 2  # seq step + 1, slot 0
        call = op % CALLS
        t0 = 1_000_000 * step + rank * 1000  # ns: rank 1 starts 1 us later
        for kind in (0, 1):
            ids[call * 2 + kind] = op + 1
            for b in range(BLOCKS):
                for ev in range(EVENTS if kind == 0 else 7):
                    if kind == 0 and ev >= RECEIVE and b != 0:
                        # The receive's events are block 0's; block 1's slot keeps a time
                        # an earlier operation left there (older than this one's start):
                        # the reader must ignore it.
                        times[((call * 2 + kind) * BLOCKS + b) * EVENTS + ev] = t0 - 5000 if t0 > 5000 else 0
                        continue
                    # block 1 is 500 ns behind block 0 (the slowest block is reported)
                    times[((call * 2 + kind) * BLOCKS + b) * EVENTS + ev] = \
                        t0 + kind * 100_000 + ev * 1000 + b * 500 + 1
    with open(f"{prefix}.{rank}", "wb") as f:
        f.write(struct.pack("<8s7q", magic, rank, 2, BLOCKS, CALLS, EVENTS, 2, 0))
        f.write(struct.pack(f"<{len(times) + len(ids)}Q", *times, *ids))


def phases_of(out):
    """The phases table: label -> us."""
    return {line[:52].strip(): float(line.split()[-2]) for line in out.splitlines()
            if line.startswith("  ") and line.rstrip().endswith(" us") and "/" not in line}


def main():
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "ll-trace")
    EVENTS = EVENTS_OF[b"EPXLLTR3"]
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "t")
        for rank in (0, 1):
            write(prefix, rank, steps=5)
        # A file beside the traces that is not one (scripts/gpu-check writes its summary
        # there) is left alone.
        with open(prefix + ".txt", "w") as f:
            f.write("not a trace\n")
        out = subprocess.run([sys.executable, script, prefix], check=True, capture_output=True,
                             text=True).stdout
        print(out)
        rows = {int(line.split()[0]): [float(v) for v in line.split()[1:]]
                for line in out.splitlines() if line.split() and line.split()[0].isdigit()}
        assert sorted(rows) == [0, 1], rows
        for rank in (0, 1):
            expect = [rank + 0.0] + [rank + ev + (0.5 if ev < RECEIVE else 0.0)
                                     for ev in range(1, EVENTS)] + \
                     [rank + 100.0] + [rank + 100 + ev + 0.5 for ev in range(1, 7)]
            assert rows[rank] == expect, (rank, rows[rank], expect)
        assert "5 steps" in out and "median 107.5 us" in out and "median 1000.0 us" in out, out
        # Phases: rank 1's lengths are the longest where block 1 lags (0.5 us).
        phases = phases_of(out)
        assert phases["DISPATCH ROWS STORED"] == 1.0, phases          # base 4.5 -> stored 5.5
        assert phases["dispatch start->routed (routing preamble)"] == 1.5, phases
        assert phases["dispatch routed->base (release, counts)"] == 3.0, phases
        # The receive's three parts (stored 5.5 -> counts 7 -> booked 8 -> arrived 9).
        assert phases["dispatch stored->counts (arrival adds, counts)"] == 1.5, phases
        assert phases["dispatch counts->booked (receive bookkeeping)"] == 1.0, phases
        assert phases["dispatch booked->arrived (every source's rows)"] == 1.0, phases
        assert not any(label.startswith("dispatch stored->arrived") for label in phases), phases
        assert phases["kernel boundary (arrived->combine start)"] == 91.0, phases
        assert phases["COMBINE ROWS SUMMED"] == 1.0, phases
        # --blocks 1: rank 1's blocks; block 1 passed no receive event (its stale ones
        # are ignored) and lags block 0 by 0.5 us elsewhere.
        out = subprocess.run([sys.executable, script, prefix, "--blocks", "1"], check=True,
                             capture_output=True, text=True).stdout
        lines = out.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("rank 1, each block"))
        block_rows = {int(line.split()[0]): line.split()[1:] for line in lines[at + 2:at + 4]}
        assert block_rows[0][:EVENTS] == [f"{1 + ev:.1f}" for ev in range(EVENTS)], block_rows
        assert block_rows[1][:EVENTS] == [f"{1 + ev + 0.5:.1f}" for ev in range(RECEIVE)] + \
            ["-"] * (EVENTS - RECEIVE), block_rows
        assert block_rows[1][EVENTS:] == [f"{101 + ev + 0.5:.1f}" for ev in range(7)], block_rows
        # The layout before "booked" (EPXLLTR2, 9 events) is still read, with the receive
        # as one phase.
        two = os.path.join(tmp, "two")
        for rank in (0, 1):
            write(two, rank, steps=3, magic=b"EPXLLTR2")
        out = subprocess.run([sys.executable, script, two], check=True, capture_output=True,
                             text=True).stdout
        assert "d.booked" not in out and "d.arrived" in out, out
        phases = phases_of(out)
        assert phases["dispatch stored->arrived (arrival, receive)"] == 2.5, phases  # 5.5 -> 8
        assert phases["kernel boundary (arrived->combine start)"] == 92.0, phases
        assert not any("booked" in label for label in phases), phases
        # Files of both layouts under one prefix are refused.
        write(two, 1, steps=3)
        r = subprocess.run([sys.executable, script, two], capture_output=True, text=True)
        assert r.returncode != 0 and "another layout" in r.stderr, r
        old = os.path.join(tmp, "old")
        write(old, 0, steps=1, magic=b"EPXLLTR1")
        r = subprocess.run([sys.executable, script, old], capture_output=True, text=True)
        assert r.returncode != 0 and "older layout" in r.stderr, r
        bad = os.path.join(tmp, "bad")
        with open(bad + ".0", "wb") as f:
            f.write(b"NOTATRACE" * 10)
        r = subprocess.run([sys.executable, script, bad], capture_output=True, text=True)
        assert r.returncode != 0 and "not an EPX_LL_TRACE file" in r.stderr, r
    print("ll-trace: ok")


if __name__ == "__main__":
    main()
