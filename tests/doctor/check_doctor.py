#!/usr/bin/env python3
"""Run `epx doctor` and check its output and exit status.

usage: check_doctor.py EPX json|text

json: every line is one JSON object; check lines carry a known name and status, a
string detail and fix; the last line is the summary, whose counts match the lines;
the exit status is 1 exactly when a check failed. On a machine without an NVIDIA
driver (CI) every gpu.* check must say not-present, and the exit status must be 0.
text: the checklist has a line per check, the summary, and the same exit status rule.
Only the standard library is used.
"""
import json
import os
import re
import subprocess
import sys

STATUSES = {"pass", "warn", "fail", "not-present", "skip"}
# Every check the doctor reports, in order (tools/doctor_checks.h). A check that
# crashes in its child process reports under the name of its group's first check, so
# names are checked against this set, and the groups must all be there.
KNOWN = [
    "epx.build",
    "gpu.driver", "gpu.runtime", "gpu.devices", "gpu.links", "gpu.peer_access",
    "gpu.mps", "gpu.ipc",
    "rdma.devices", "rdma.nic_affinity", "rdma.gpudirect", "rdma.gdrcopy",
    "rdma.ibgda_driver_options",
    "nvshmem.library", "nvshmem.transports", "nvshmem.bootstrap",
    "env.epx", "env.nvshmem", "env.buffer_fit",
    "smoke.run", "smoke.dispatch", "smoke.combine",
]
# Always reported, whatever the machine has.
REQUIRED = [
    "epx.build", "gpu.driver", "gpu.runtime", "gpu.devices", "gpu.links",
    "gpu.peer_access", "gpu.mps", "gpu.ipc", "rdma.devices", "rdma.gdrcopy",
    "rdma.ibgda_driver_options", "nvshmem.library", "nvshmem.transports",
    "nvshmem.bootstrap", "env.epx", "env.nvshmem", "env.buffer_fit", "smoke.run",
]


def fail(message):
    print("check_doctor: FAIL: " + message)
    sys.exit(1)


def has_nvidia_driver():
    # The same question the doctor asks: can the driver library be found? A machine
    # with the library but no GPU still gets not-present lines, so only its absence
    # pins the expectations down.
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")


def run(epx, args):
    # A clean environment for the settings checks: no stray EPX_* from the caller.
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPX_")}
    proc = subprocess.run([epx, "doctor"] + args, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env, timeout=280)
    return proc.returncode, proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8", "replace")


def check_common(checks, returncode):
    names = [name for name, _ in checks]
    for name in names:
        if name not in KNOWN:
            fail("unknown check name %r" % name)
    for name in REQUIRED:
        if name not in names:
            fail("check %r missing" % name)
    if len(set(names)) != len(names):
        fail("a check is reported twice: %r" % names)
    statuses = dict(checks)
    failed = any(status == "fail" for status in statuses.values())
    if returncode != (1 if failed else 0):
        fail("exit status %d, but %s check failed" % (returncode, "a" if failed else "no"))
    if statuses.get("smoke.run") == "pass":
        for name in ("smoke.dispatch", "smoke.combine"):
            if name not in statuses:
                fail("smoke.run passed without a %s line" % name)
    if not has_nvidia_driver():
        for name, status in checks:
            if name.startswith("gpu.") and status != "not-present":
                fail("no NVIDIA driver here, but %s says %s" % (name, status))
        for name in ("rdma.ibgda_driver_options", "nvshmem.bootstrap"):
            if statuses[name] != "not-present":
                fail("no NVIDIA driver here, but %s says %s" % (name, statuses[name]))
        if returncode != 0:
            fail("exit status %d on a machine without GPUs (nothing may fail)" % returncode)


def check_json(epx):
    returncode, out, err = run(epx, ["--json"])
    lines = out.splitlines()
    if not lines:
        fail("no output; stderr: " + err)
    objects = []
    for number, line in enumerate(lines, 1):
        try:
            objects.append(json.loads(line))
        except ValueError as error:
            fail("line %d is not JSON (%s): %r" % (number, error, line))
    checks = []
    for obj in objects[:-1]:
        if obj.get("type") != "check":
            fail("not a check object: %r" % obj)
        for key in ("check", "status", "detail", "fix"):
            if not isinstance(obj.get(key), str):
                fail("%s is not a string in %r" % (key, obj))
        if obj["status"] not in STATUSES:
            fail("unknown status %r" % obj)
        if obj["status"] in ("warn", "fail") and not obj["fix"]:
            fail("a %s line without a fix: %r" % (obj["status"], obj))
        checks.append((obj["check"], obj["status"]))
    summary = objects[-1]
    if summary.get("type") != "summary":
        fail("the last line is not the summary: %r" % summary)
    for status in STATUSES:
        count = sum(1 for _, s in checks if s == status)
        if summary.get(status) != count:
            fail("summary says %s=%r, lines say %d" % (status, summary.get(status), count))
    if summary.get("exit_status") != returncode:
        fail("summary exit_status %r, process exit status %d"
             % (summary.get("exit_status"), returncode))
    check_common(checks, returncode)
    print("check_doctor: json: %d checks, exit status %d: %s"
          % (len(checks), returncode,
             ", ".join("%d %s" % (summary[s], s) for s in sorted(STATUSES))))


def check_text(epx):
    returncode, out, err = run(epx, [])
    pattern = re.compile(r"^\[(pass|warn|fail|not-present|skip)\]\s+(\S+)\s")
    checks = []
    for line in out.splitlines():
        match = pattern.match(line)
        if match:
            checks.append((match.group(2), match.group(1)))
    if not checks:
        fail("no checklist lines; stdout: %r stderr: %r" % (out, err))
    if "\nsummary: " not in out:
        fail("no summary line")
    check_common(checks, returncode)
    print("check_doctor: text: %d checks, exit status %d" % (len(checks), returncode))


def main():
    if len(sys.argv) != 3 or sys.argv[2] not in ("json", "text"):
        fail("usage: check_doctor.py EPX json|text")
    if sys.argv[2] == "json":
        check_json(sys.argv[1])
    else:
        check_text(sys.argv[1])


if __name__ == "__main__":
    main()
