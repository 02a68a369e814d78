#!/usr/bin/env python3
"""Run `epx doctor` and check its output and exit status.

usage: check_doctor.py EPX json|text|plugin|internode PLUGIN

PLUGIN is the libepx_nvshmem.so this build made, or "none" when it made none.
json: the output is one JSON document (json.loads of all of it): "checks", a list of
objects with a known name and status, a string detail and fix, and "summary", whose
counts match the checks; the exit status is 1 exactly when a check failed. On a machine without an NVIDIA
driver (CI) every gpu.* check must say not-present, and the exit status must be 0.
nvshmem.plugin finds PLUGIN (or, without one, says not-present with the fix).
text: the checklist has a line per check, the summary, and the same exit status rule.
plugin: nvshmem.plugin alone, twice (with --no-smoke): started as `epx` from PATH in
another directory, so only the build-directory fallback can find PLUGIN; then with
EPX_NVSHMEM_PLUGIN=/nonexistent, which must give not-present with the fix.
internode: env.internode (with --no-smoke) lists every NVSHMEM setting of internode
traffic with its value and the plan (worst-case slots by default, rings with
EPX_XN_RING_TOKENS), and warns, with a fix naming the setting, for a shallow
NVSHMEM_QP_DEPTH, NVSHMEM_DISABLE_P2P=1, NVSHMEM_IBGDA_QP_DEPTH alone and an
EPX_TIMEOUT_MS under a second; EPX_XN_RING_TOKENS=12 fails env.epx. Without the CUDA
backend the line is a skip.
Only the standard library is used.
"""
import json
import os
import re
import subprocess
import sys

STATUSES = {"pass", "warn", "fail", "not-present", "skip"}
# Every check the doctor reports, in order (tools/doctor/doctor_checks.h). A check that
# crashes in its child process reports under the name of its group's first check, so
# names are checked against this set, and the groups must all be there.
KNOWN = [
    "epx.build",
    "gpu.driver", "gpu.runtime", "gpu.devices", "gpu.links", "gpu.peer_access",
    "gpu.mps", "gpu.ipc",
    "rdma.devices", "rdma.nic_affinity", "rdma.gpudirect", "rdma.gdrcopy",
    "rdma.ibgda_driver_options",
    "nvshmem.library", "nvshmem.plugin", "nvshmem.transports", "nvshmem.bootstrap",
    "env.epx", "env.nvshmem", "env.internode", "env.buffer_fit", "env.ll_buffer_fit",
    "smoke.run", "smoke.dispatch", "smoke.combine",
]
# Always reported, whatever the machine has.
REQUIRED = [
    "epx.build", "gpu.driver", "gpu.runtime", "gpu.devices", "gpu.links",
    "gpu.peer_access", "gpu.mps", "gpu.ipc", "rdma.devices", "rdma.gdrcopy",
    "rdma.ibgda_driver_options", "nvshmem.library", "nvshmem.plugin", "nvshmem.transports",
    "nvshmem.bootstrap", "env.epx", "env.nvshmem", "env.internode", "env.buffer_fit",
    "env.ll_buffer_fit", "smoke.run",
]


def fail(message):
    print("check_doctor: FAIL: " + message)
    sys.exit(1)


def has_nvidia_driver():
    # The same question the doctor asks: can the driver library be found? A machine
    # with the library but no GPU still gets not-present lines, so only its absence
    # pins the expectations down.
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")


def run(epx, args, extra_env=None, from_path=False):
    # A clean environment for the settings checks: no stray EPX_* from the caller.
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPX_")}
    env.update(extra_env or {})
    command, cwd = [epx, "doctor"] + args, None
    if from_path:
        # As a user starts it: `epx` found in PATH, from another directory.
        env["PATH"] = os.path.dirname(os.path.abspath(epx)) + os.pathsep + env.get("PATH", "")
        command[0], cwd = "epx", "/"
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                          cwd=cwd, timeout=280)
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


def read_json(out, err):
    """The document's check objects and its summary."""
    if not out.strip():
        fail("no output; stderr: " + err)
    try:
        document = json.loads(out)
    except ValueError as error:
        fail("the output is not one JSON document (%s): %r" % (error, out[:2000]))
    if not isinstance(document, dict) or sorted(document) != ["checks", "summary"]:
        fail("the document should have exactly checks and summary: %r" % document)
    if not isinstance(document["checks"], list) or not isinstance(document["summary"], dict):
        fail("checks is not a list or summary not an object: %r" % document)
    return document["checks"], document["summary"]


def find_check(objects, name):
    for obj in objects:
        if obj.get("check") == name:
            return obj
    fail("check %r missing" % name)


def check_buffer_fit(objects):
    """env.buffer_fit and env.ll_buffer_fit name their shape and the memory they need."""
    for name, words in (("env.buffer_fit", "4096 tokens/rank"),
                        ("env.ll_buffer_fit", "low-latency mode, 128 tokens/rank (fp8 rows)")):
        line = find_check(objects, name)
        if line["status"] == "fail" and "refused" in line["detail"]:
            fail("the standard %s shape is refused: %r" % (name, line))
        if words not in line["detail"]:
            fail("%s does not name its shape (%r): %r" % (name, words, line))
    ll_line = find_check(objects, "env.ll_buffer_fit")
    if ll_line["status"] in ("pass", "warn") and "on the CPU backend" in ll_line["detail"]:
        # The CPU low-latency benchmark needs about 1.83 GiB of /dev/shm per rank.
        match = re.search(r"\(([0-9.]+) GiB per rank\)", ll_line["detail"])
        if not match or not 1.5 < float(match.group(1)) < 2.5:
            fail("env.ll_buffer_fit should say about 1.8 GiB per rank: %r" % ll_line)


def cuda_built(objects):
    return "the CUDA backend built" in find_check(objects, "epx.build")["detail"]


PLUGIN_FOUND = re.compile(r"^libepx_nvshmem\.so found at (.+), NVSHMEM \d+\.\d+\.\d+$")


def check_plugin_line(objects, plugin):
    """nvshmem.plugin found `plugin` ("none": says not-present with the fix)."""
    line = find_check(objects, "nvshmem.plugin")
    if not cuda_built(objects):
        if line["status"] != "skip":
            fail("no CUDA backend, but nvshmem.plugin says %r" % line)
        return
    if plugin == "none":
        check_plugin_missing(line)
        return
    match = PLUGIN_FOUND.match(line["detail"].split("\n")[0])
    # warn: found, but NVSHMEM versions differ on this machine (the detail says which).
    if line["status"] not in ("pass", "warn") or not match:
        fail("nvshmem.plugin should find %s: %r" % (plugin, line))
    if os.path.realpath(match.group(1)) != os.path.realpath(plugin):
        fail("nvshmem.plugin found %s, not this build's %s" % (match.group(1), plugin))


def check_plugin_missing(line):
    if line["status"] != "not-present":
        fail("nvshmem.plugin should say not-present: %r" % line)
    for text in ("pip install nvidia-nvshmem-cu13", "EPX_NVSHMEM_PLUGIN"):
        if text not in line["fix"]:
            fail("nvshmem.plugin's fix lacks %r: %r" % (text, line))
    if "low-latency mode on GPUs is unavailable" not in line["detail"]:
        fail("nvshmem.plugin does not say what is lost: %r" % line)


def check_json(epx, plugin):
    returncode, out, err = run(epx, ["--json"])
    objects, summary = read_json(out, err)
    checks = []
    for obj in objects:
        if sorted(obj) != ["check", "detail", "fix", "status"]:
            fail("not a check object: %r" % obj)
        for key in ("check", "status", "detail", "fix"):
            if not isinstance(obj.get(key), str):
                fail("%s is not a string in %r" % (key, obj))
        if obj["status"] not in STATUSES:
            fail("unknown status %r" % obj)
        if obj["status"] in ("warn", "fail") and not obj["fix"]:
            fail("a %s line without a fix: %r" % (obj["status"], obj))
        checks.append((obj["check"], obj["status"]))
    for status in STATUSES:
        count = sum(1 for _, s in checks if s == status)
        if summary.get(status) != count:
            fail("summary says %s=%r, lines say %d" % (status, summary.get(status), count))
    if summary.get("exit_status") != returncode:
        fail("summary exit_status %r, process exit status %d"
             % (summary.get("exit_status"), returncode))
    check_common(checks, returncode)
    check_plugin_line(objects, plugin)
    check_buffer_fit(objects)
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


def check_plugin(epx, plugin):
    _, out, err = run(epx, ["--json", "--no-smoke"], from_path=True)
    objects, _ = read_json(out, err)
    check_plugin_line(objects, plugin)
    found = find_check(objects, "nvshmem.plugin")
    _, out, err = run(epx, ["--json", "--no-smoke"], {"EPX_NVSHMEM_PLUGIN": "/nonexistent"})
    objects, _ = read_json(out, err)
    missing = find_check(objects, "nvshmem.plugin")
    if cuda_built(objects):
        check_plugin_missing(missing)
        if "EPX_NVSHMEM_PLUGIN=/nonexistent" not in missing["detail"]:
            fail("nvshmem.plugin does not say where it looked: %r" % missing)
    elif missing["status"] != "skip":
        fail("no CUDA backend, but nvshmem.plugin says %r" % missing)
    print("check_doctor: plugin: %s (%s); with EPX_NVSHMEM_PLUGIN=/nonexistent: %s"
          % (found["status"], found["detail"].split("\n")[0], missing["status"]))


def internode_line(epx, extra_env):
    _, out, err = run(epx, ["--json", "--no-smoke"], extra_env)
    objects, _ = read_json(out, err)
    return objects, find_check(objects, "env.internode")


def check_internode(epx):
    """env.internode: every setting with its value, and a warning for each known bad one."""
    objects, line = internode_line(epx, {"NVSHMEM_QP_DEPTH": "4096"})
    for text in ("internode normal mode, 8 ranks as 2 nodes x 4, 4096 tokens/rank",
                 "NVSHMEM_IB_ENABLE_IBGDA=", "NVSHMEM_IBGDA_NUM_RC_PER_PE=",
                 "NVSHMEM_QP_DEPTH=4096", "NVSHMEM_DISABLE_P2P=", "NVSHMEM_DISABLE_NVLS=",
                 "EPX_TIMEOUT_MS=30000"):
        if text not in line["detail"]:
            fail("env.internode lacks %r: %r" % (text, line))
    cuda = cuda_built(objects)
    if not cuda:
        # Nothing to plan without the CUDA backend: skip, with the reason.
        if line["status"] != "skip" or "CUDA backend" not in line["detail"]:
            fail("no CUDA backend, but env.internode says %r" % line)
        print("check_doctor: internode: skip without the CUDA backend")
        return
    if "slots for the worst case, 4096 tokens per (rank, node) channel" not in line["detail"]:
        fail("env.internode does not describe the default plan: %r" % line)
    cases = [
        ({"EPX_XN_RING_TOKENS": "16", "NVSHMEM_QP_DEPTH": "4096",
          "NVSHMEM_DISABLE_NVLS": "1"}, None,
         "rings of 16 tokens per (rank, node) channel, chunks of 4"),
        ({"NVSHMEM_QP_DEPTH": "64"}, "NVSHMEM_QP_DEPTH", "shallower than"),
        ({"NVSHMEM_DISABLE_P2P": "1"}, "unset NVSHMEM_DISABLE_P2P", "is refused"),
        ({"NVSHMEM_IBGDA_QP_DEPTH": "2048"}, "NVSHMEM_QP_DEPTH",
         "is not read by NVSHMEM 3"),
        ({"EPX_TIMEOUT_MS": "100"}, "EPX_TIMEOUT_MS", "under a second"),
    ]
    for extra, fix, detail in cases:
        _, line = internode_line(epx, extra)
        if detail not in line["detail"]:
            fail("with %r env.internode lacks %r: %r" % (extra, detail, line))
        if fix is None:
            if line["status"] == "warn" and "problem:" in line["detail"]:
                # Only machine facts (NVLS, several ranks on a GPU) may warn here.
                if "NVLS" not in line["detail"].split("problem:", 1)[1]:
                    fail("with %r env.internode warns: %r" % (extra, line))
        elif line["status"] != "warn" or fix not in line["fix"]:
            fail("with %r env.internode should warn with a fix naming %r: %r"
                 % (extra, fix, line))
    # A bad ring size is refused by the tunables table: env.epx fails, naming it.
    returncode, out, err = run(epx, ["--json", "--no-smoke"], {"EPX_XN_RING_TOKENS": "12"})
    objects, _ = read_json(out, err)
    bad = find_check(objects, "env.epx")
    if bad["status"] != "fail" or "EPX_XN_RING_TOKENS=12" not in bad["detail"] \
            or "power of two" not in bad["detail"] or returncode != 1:
        fail("EPX_XN_RING_TOKENS=12 should fail env.epx (exit 1): %r" % bad)
    print("check_doctor: internode: %d settings cases and a bad ring size" % len(cases))


def main():
    if len(sys.argv) != 4 or sys.argv[2] not in ("json", "text", "plugin", "internode"):
        fail("usage: check_doctor.py EPX json|text|plugin|internode PLUGIN")
    epx, mode, plugin = sys.argv[1:]
    if mode == "json":
        check_json(epx, plugin)
    elif mode == "text":
        check_text(epx)
    elif mode == "internode":
        check_internode(epx)
    else:
        check_plugin(epx, plugin)


if __name__ == "__main__":
    main()
