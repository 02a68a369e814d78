"""scripts/normal-bars on a real `epx bench` table (CPU backend, 2 ranks, with
--back-to-back): every op's floor/time is read from the table and the back-to-back lines
and set beside the bar of its budget, marked when under it.

    python3 tests/tools/test_normal_bars.py EPX_BINARY"""
import os
import re
import subprocess
import sys
import tempfile


def check(epx, script, floor_bw):
    """One bench at a given floor bandwidth (10^-4 GB/s: every op far above its bar on the
    CPU backend, sanitizer builds included; 10^9: every op far under it), read by
    normal-bars as two budgets."""
    bench = subprocess.run([epx, "bench", "-n", "2", "--tokens", "32", "--hidden", "128",
                            "--experts", "4", "--topk", "2", "--iters", "1",
                            "--back-to-back", "2", "--floor-bw", str(floor_bw)],
                           capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr
    # The table's floor/time column and the back-to-back lines, read here on their own.
    table, back = {}, {}
    for line in bench.stdout.splitlines():
        line = re.sub(r"^\[rank 0\]", "", line)
        m = re.match(r"^\s+(bf16|fp8)\s+(\w+)\s+(?:\S+\s+){5}([0-9.]+)\s+\S+$", line)
        if m:
            table[(m.group(1), m.group(2))] = float(m.group(3))
        m = re.match(r"^#\s+(bf16|fp8)\s+(\w+)\s+[0-9.]+ us\s+floor/time ([0-9.]+)$", line)
        if m:
            back[(m.group(1), m.group(2))] = float(m.group(3))
    assert len(table) == 12 and len(back) == 8, (table, back)
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "bench.log")
        with open(log, "w") as f:
            f.write(bench.stdout)
        out = subprocess.run([sys.executable, script, "16:" + log, "8:" + log],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        print(out.stdout)
        rows = {}
        for line in out.stdout.splitlines()[1:]:
            m = re.match(r"^\s+(bf16|fp8) (\w+)\s+(\S+) / (\S+)\s+(\S+) / (\S+)$", line)
            if m:
                rows[(m.group(1), m.group(2))] = m.groups()[2:]
        assert "16 SMs (bar 0.90)" in out.stdout and "8 SMs (bar 0.85)" in out.stdout, out.stdout
        assert sorted(rows) == sorted(table), (sorted(rows), sorted(table))

        def cell(value, bar):
            return "-" if value is None else "%.2f%s" % (value, "" if value >= bar else "<")
        for key, got in rows.items():
            want = (cell(table[key], 0.90), cell(back.get(key), 0.90),
                    cell(table[key], 0.85), cell(back.get(key), 0.85))
            assert got == want, (key, got, want)
            marked = [c.endswith("<") for c in got if c != "-"]
            assert all(marked) if floor_bw > 1 else not any(marked), (key, got)
        # No rows: an error, not an empty table.
        empty = os.path.join(tmp, "empty.log")
        open(empty, "w").close()
        bad = subprocess.run([sys.executable, script, "16:" + empty], capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode != 0 and "no epx bench rows" in bad.stderr, bad.stderr


def main():
    epx = sys.argv[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "scripts", "normal-bars")
    for floor_bw in (0.0001, 1000000000):
        check(epx, script, floor_bw)
    print("normal-bars: ok")


if __name__ == "__main__":
    main()
