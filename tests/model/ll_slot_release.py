"""Every interleaving of the low-latency slot releases (kernels 2), checked on the CPU.

Kernels 2 give a slot back in one of two ways, EPX_LL_RELEASE (src/ops/cuda/nvshmem/
ll2_device.cuh, "slot releases"; docs/LOW_LATENCY.md, "Giving a slot back"): 1, "done"
flags at the end of each combine; 2, inferred from the next dispatch and the
outputs-ready flags. This model runs the same program of low-latency calls on every
rank, each call as the sequence of events the kernels order (a wait is an event that
cannot happen yet), and explores every interleaving of the ranks, states memoised, for
both ways. It checks:

- no rank writes rows into a peer's slot while that peer still uses an older step's
  results there (the caller's contract: until it calls that step's combine, or until
  its dispatch two steps later);
- no rank writes its combine input (the caller's zero-copy writes, or x copied in), or
  pushes rows into a home's staging, while a home still reads an older combine there;
- every interleaving runs to the end (no wait is left waiting).

It also checks itself: with either of two deliberate bugs in the inferred form (a second
combine without its handshake, a dispatch that never waits for a release) it must find
the violation.

    python3 tests/model/ll_slot_release.py [--ranks N ...]

Links: every peer direct (stores), every other rank reached by puts (EPX_LL_FORCE_PUTS),
or two nodes, direct inside a node and puts across (the first ranks of the world in the
first node). One event per kernel phase, as the kernels' blocks end their phases in that
order (last-block barriers, flags).
"""

import argparse
import sys
from itertools import product

# One program, run by every rank: (call, step). Steps use slot step % 2. "D": dispatch
# (send and receive), "DS" / "DR": its send and its receive (EPX_LL_SEND_ONLY); "U": the
# caller writes the step's zero-copy combine input; "C": combine from that input; "Cx":
# combine of x copied in (every combine moves rows when some peer is reached by puts).
PROGRAMS = {
    "steady": "D0 U0 C0 D1 U1 C1 D2 U2 C2 D3 U3 C3",
    "two in flight": "D0 D1 U0 C0 U1 C1 D2 D3 U2 C2 U3 C3",
    "combine again": "D0 U0 C0 Cx0 D1 U1 Cx1 Cx1 D2 U2 C2 D3",
    "no combine": "D0 D1 D2 U2 C2 D3 D4 U4 C4",
    "split": "DS0 DS1 DR1 DR0 U0 C0 U1 Cx1 DS2 DR2 U2 C2",
    "combine late": "D0 D1 U1 C1 U0 C0 D2 U2 Cx2 D3 C3",
}

BUGS = ("no second-combine handshake", "no release wait")


def parse(program):
    calls = []
    for word in program.split():
        name = word.rstrip("0123456789")
        calls.append((name, int(word[len(name):]) % 2))
    return calls


LINKS = ("stores", "puts", "2 nodes")


def call_events(name, puts):
    """The events of one call, in the order its kernels reach them. A combine that moves
    rows (x copied in, or pushes) gives the results back from its send's last block, after
    its flags; one that moves nothing, from its receive's last block."""
    send = ["d_start", "d_give_back", "d_wait_release", "d_publish", "d_wait_lower",
            "d_write", "d_arrive"]
    if name == "D":
        return send + ["d_receive"]
    if name == "DS":
        return send
    if name == "DR":
        return ["d_receive"]
    if name == "U":
        return ["u_write"]
    if name in ("C", "Cx"):
        moves = name == "Cx" or puts
        if moves:
            return ["c_start", "c_tell", "c_wait_told", "c_copy", "c_ready", "c_give_back",
                    "c_wait_ready", "c_read_end", "c_end"]
        return ["c_start", "c_tell", "c_wait_told", "c_ready", "c_wait_ready", "c_read_end",
                "c_give_back", "c_end"]
    raise ValueError(name)


class Violation(Exception):
    pass


class Model:
    """The shared state of R ranks; a state is a frozen tuple of its dictionaries."""

    FIELDS = ("flags", "counts", "arrival", "seq", "released", "combined", "using",
              "reading", "op")

    def __init__(self, ranks, links, release, bug):
        self.R, self.links, self.bug = ranks, links, bug
        self.inferred = release == "inferred"
        self.puts = any(not self.direct(a, b) for a in range(ranks) for b in range(ranks))

    def direct(self, a, b):
        """Does rank a reach rank b by stores (else by NVSHMEM puts)?"""
        if self.links == "stores" or a == b:
            return True
        if self.links == "puts":
            return False
        half = (self.R + 1) // 2
        return a // half == b // half

    def initial(self):
        return {f: {} for f in self.FIELDS}

    def apply(self, state, rank, event, slot):
        """The state after `event` of `rank`, or None while it must wait."""
        s = {f: dict(v) for f, v in state.items()}
        peers = range(self.R)
        op = s["op"]
        flag = lambda kind, src, dst: s["flags"].get((kind, slot, src, dst), 0)

        if event == "d_start":
            d = s["seq"].get((rank, slot, "dispatch"), 0) + 1
            op[(rank, "d")] = d
            # The results of the slot's previous step last until this dispatch.
            s["using"].pop((rank, slot), None)
            return s
        d = op.get((rank, "d"), 0)
        if event == "d_give_back":  # block 0: a step without a combine
            if s["released"].get((rank, slot), 0) < d - 1:
                for p in peers:
                    s["flags"][("DISPATCH_DONE", slot, rank, p)] = d - 1
                s["released"][(rank, slot)] = d - 1
            return s
        if event == "d_wait_release":  # epx_ll2_wait_released
            combined = self.inferred and s["combined"].get((rank, slot), 0) == d - 1
            if self.bug == "no release wait":
                combined = True
            for p in peers:
                if d - 1 > 0 and not (combined and self.direct(rank, p)):
                    if flag("DISPATCH_DONE", p, rank) < d - 1:
                        return None
            return s
        if event == "d_publish":
            for p in peers:
                s["counts"][(slot, rank, p)] = d
            return s
        if event == "d_wait_lower":
            if any(s["counts"].get((slot, p, rank)) != d for p in range(rank)):
                return None
            return s
        if event == "d_write":
            for p in peers:
                used = s["using"].get((p, slot))
                if used is not None and used < d:
                    raise Violation("rank %d writes rank %d's results of slot %d (dispatch %d) "
                                    "while rank %d uses those of dispatch %d"
                                    % (rank, p, slot, d, p, used))
            return s
        if event == "d_arrive":
            for p in peers:
                s["arrival"][(slot, rank, p)] = s["arrival"].get((slot, rank, p), 0) + 1
            s["seq"][(rank, slot, "dispatch")] = d
            return s
        if event == "d_receive":
            d = s["seq"].get((rank, slot, "dispatch"), 0)
            for p in peers:
                if s["counts"].get((slot, p, rank)) != d or \
                        s["arrival"].get((slot, p, rank), 0) < d:
                    return None
            s["using"][(rank, slot)] = d
            return s
        if event in ("u_write", "c_copy"):
            for home in peers:
                c = s["reading"].get((home, rank, slot))
                if c is not None:
                    raise Violation("rank %d writes its combine input of slot %d (%s) while "
                                    "rank %d reads combine %d there"
                                    % (rank, slot, event, home, c))
            return s
        if event == "c_start":
            op[(rank, "c")] = s["seq"].get((rank, slot, "combine"), 0) + 1
            op[(rank, "cd")] = s["seq"].get((rank, slot, "dispatch"), 0)
            # The caller is done with the step's results once it calls combine.
            s["using"].pop((rank, slot), None)
            return s
        c, cd = op.get((rank, "c"), 0), op.get((rank, "cd"), 0)
        # epx_ll2_combine_waits
        if self.inferred:
            waits = s["combined"].get((rank, slot), 0) == cd and \
                self.bug != "no second-combine handshake"
        else:
            waits = c > 1
        if event == "c_tell":  # epx_ll2_tell_combined
            if waits and self.inferred:
                for p in peers:
                    s["flags"][("COMBINE_DONE", slot, rank, p)] = c - 1
            return s
        if event == "c_wait_told":
            if waits and any(flag("COMBINE_DONE", p, rank) < c - 1 for p in peers):
                return None
            return s
        if event == "c_ready":  # the outputs-ready flags (pushes, with puts)
            for p in peers:
                s["flags"][("READY", slot, rank, p)] = c
            return s
        if event == "c_give_back":  # epx_ll2_give_back (with done flags: tell_done's part)
            self.give_back(s, rank, slot, cd)
            return s
        if event == "c_wait_ready":
            if any(flag("READY", p, rank) < c for p in peers):
                return None
            for p in peers:
                s["reading"][(rank, p, slot)] = c
            return s
        if event == "c_read_end":
            for p in peers:
                s["reading"].pop((rank, p, slot), None)
            return s
        if event == "c_end":  # the receive's last block
            if not self.inferred:  # tell_done: the "done" flags
                for p in peers:
                    s["flags"][("COMBINE_DONE", slot, rank, p)] = c
            s["seq"][(rank, slot, "combine")] = c
            return s
        raise ValueError(event)

    def give_back(self, s, rank, slot, d):
        """epx_ll2_give_back: DISPATCH_DONE to every peer with done flags, to put peers
        only when inferred; records released and combined."""
        if s["released"].get((rank, slot), 0) >= d:
            return
        for p in range(self.R):
            if not self.inferred or not self.direct(rank, p):
                s["flags"][("DISPATCH_DONE", slot, rank, p)] = d
        s["released"][(rank, slot)] = d
        s["combined"][(rank, slot)] = d


def freeze(state):
    return tuple(tuple(sorted(state[f].items(), key=repr)) for f in Model.FIELDS)


def explore(program, ranks, links, release, bug=None):
    """Every interleaving of `program` on `ranks` ranks; returns the states seen, raises
    Violation on a broken rule or a wait that can never end."""
    model = Model(ranks, links, release, bug)
    calls = parse(program)
    events = [[(e, slot) for name, slot in calls for e in call_events(name, model.puts)]] * ranks
    end = tuple(len(events[r]) for r in range(ranks))
    seen = set()
    stack = [((0,) * ranks, model.initial())]
    while stack:
        pcs, state = stack.pop()
        key = (pcs, freeze(state))
        if key in seen:
            continue
        seen.add(key)
        if pcs == end:
            continue
        enabled = False
        for r in range(ranks):
            if pcs[r] == end[r]:
                continue
            event, slot = events[r][pcs[r]]
            after = model.apply(state, r, event, slot)
            if after is None:
                continue
            enabled = True
            stack.append((pcs[:r] + (pcs[r] + 1,) + pcs[r + 1:], after))
        if not enabled:
            raise Violation("every rank waits: %s" % ", ".join(
                "rank %d at %s of slot %d" % ((r,) + events[r][pcs[r]])
                for r in range(ranks) if pcs[r] < end[r]))
    return len(seen)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    failures = 0
    for ranks, release, links in product(args.ranks, ("flags", "inferred"), LINKS):
        if links == "2 nodes" and ranks < 3:
            continue  # 2 ranks as 2 nodes is "puts"
        for name, program in PROGRAMS.items():
            label = "%d ranks, %s, %s, %s" % (ranks, release, links, name)
            try:
                states = explore(program, ranks, links, release)
                print("ok    %-48s %6d states" % (label, states))
            except Violation as error:
                failures += 1
                print("FAIL  %-48s %s" % (label, error))
    # The check must catch each deliberate bug in the program that exercises it.
    for bug, name in zip(BUGS, ("combine again", "no combine")):
        try:
            explore(PROGRAMS[name], 2, "stores", "inferred", bug)
            failures += 1
            print("FAIL  with the bug \"%s\", \"%s\" passed: the model misses it" % (bug, name))
        except Violation as error:
            print("ok    the bug \"%s\" is caught: %s" % (bug, error))
    print("ll_slot_release: %s" % ("FAILED" if failures else "every interleaving ok"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
