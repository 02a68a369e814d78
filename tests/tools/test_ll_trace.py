"""scripts/ll-trace on hand-made traces of 2 ranks (the file layout of
src/ops/cuda/ll_plugin.h): every printed time is checked against what was written."""
import os
import struct
import subprocess
import sys
import tempfile

CALLS, EVENTS, BLOCKS = 256, 8, 2


def write(prefix, rank, steps):
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
                    if kind == 0 and ev >= 6 and b != 0:
                        continue  # the receive's events are block 0's
                    # block 1 is 500 ns behind block 0 (the slowest block is reported)
                    times[((call * 2 + kind) * BLOCKS + b) * EVENTS + ev] = \
                        t0 + kind * 100_000 + ev * 1000 + b * 500 + 1
    with open(f"{prefix}.{rank}", "wb") as f:
        f.write(struct.pack("<8s7q", b"EPXLLTR1", rank, 2, BLOCKS, CALLS, EVENTS, 2, 0))
        f.write(struct.pack(f"<{len(times) + len(ids)}Q", *times, *ids))


def main():
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "ll-trace")
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "t")
        for rank in (0, 1):
            write(prefix, rank, steps=5)
        out = subprocess.run([sys.executable, script, prefix], check=True, capture_output=True,
                             text=True).stdout
        print(out)
        rows = {int(line.split()[0]): [float(v) for v in line.split()[1:]]
                for line in out.splitlines() if line.split() and line.split()[0].isdigit()}
        assert sorted(rows) == [0, 1], rows
        for rank in (0, 1):
            expect = [rank + 0.0] + [rank + ev + (0.5 if ev < 6 else 0.0) for ev in range(1, 8)] + \
                     [rank + 100.0] + [rank + 100 + ev + 0.5 for ev in range(1, 7)]
            assert rows[rank] == expect, (rank, rows[rank], expect)
        assert "5 steps" in out and "median 107.5 us" in out and "median 1000.0 us" in out, out
        # Phases: rank 1's lengths are the longest where block 1 lags (0.5 us).
        phases = {line[:52].strip(): float(line.split()[-2]) for line in out.splitlines()
                  if line.startswith("  ") and line.rstrip().endswith(" us")
                  and "/" not in line}
        assert phases["DISPATCH ROWS STORED"] == 1.0, phases          # base 3.5 -> stored 4.5
        assert phases["dispatch start->base (routing, release, counts)"] == 3.5, phases
        assert phases["kernel boundary (arrived->combine start)"] == 93.0, phases
        assert phases["COMBINE ROWS SUMMED"] == 1.0, phases
        bad = os.path.join(tmp, "bad")
        with open(bad + ".0", "wb") as f:
            f.write(b"NOTATRACE" * 10)
        r = subprocess.run([sys.executable, script, bad], capture_output=True, text=True)
        assert r.returncode != 0 and "not an EPX_LL_TRACE file" in r.stderr, r
    print("ll-trace: ok")


if __name__ == "__main__":
    main()
