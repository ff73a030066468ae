"""Compares the plain and with-reprules runs of JAX's shard_map_test.py (or of the test
files of a tagged run), test by test.

Usage: python compare.py V [V ...]   (reads results/V-plain.xml, results/V-reprules.xml)
       python compare.py TAG:V ...    (a tagged run: results/TAG-V-plain.xml, ...)
Prints one line per version and every test id whose outcome differs (with both tracebacks).
Exit status 1 if any version differs or is missing.
"""

import collections
import json
import os
import sys
import xml.etree.ElementTree as ET

H = os.path.dirname(os.path.abspath(__file__))


def outcomes(path):
    """{test id: (outcome, detail)} from a pytest junit xml."""
    root = ET.parse(path).getroot()
    out = {}
    for case in root.iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        outcome, detail = "passed", ""
        for child in case:
            tag = child.tag
            if tag in ("failure", "error"):
                outcome, detail = ("failed" if tag == "failure" else "error"), (child.get("message") or "") + "\n" + (child.text or "")
            elif tag == "skipped":
                kind = child.get("type") or ""
                outcome = "xfailed" if "xfail" in kind else "skipped"
                detail = child.get("message") or ""
        if tid in out:  # setup/teardown errors are reported as a second testcase entry
            prev = out[tid]
            if outcome != "passed":
                out[tid] = (prev[0] + "+" + outcome, prev[1] + "\n" + detail)
            continue
        out[tid] = (outcome, detail)
    return out


def summary(res):
    c = collections.Counter(o for o, _ in res.values())
    return c


def fmt(c):
    keys = ["passed", "failed", "error", "skipped", "xfailed"]
    extra = sorted(k for k in c if k not in keys)
    return ", ".join(f"{c[k]} {k}" for k in keys + extra if c.get(k))


def main(versions):
    bad = False
    rows = []
    for arg in versions:
        tag, _, v = arg.rpartition(":")
        name = f"{tag}-{v}" if tag else v
        a, b = f"{H}/results/{name}-plain.xml", f"{H}/results/{name}-reprules.xml"
        if not (os.path.exists(a) and os.path.exists(b)):
            print(f"{name}: MISSING {'plain' if not os.path.exists(a) else ''} {'reprules' if not os.path.exists(b) else ''}")
            bad = True
            continue
        pa, pb = outcomes(a), outcomes(b)
        ids = sorted(set(pa) | set(pb))
        diffs = [t for t in ids if pa.get(t, ("absent", ""))[0] != pb.get(t, ("absent", ""))[0]]
        # failures in both runs: do they fail with the same message?
        both_failed = [t for t in ids if t not in diffs and pa[t][0] in ("failed", "error")]
        msg = lambda d: d.split("\n", 1)[0][:300]
        msg_diffs = [t for t in both_failed if msg(pa[t][1]) != msg(pb[t][1])]
        marker = {}
        mpath = f"{H}/results/{name}-reprules.marker.json"
        if os.path.exists(mpath):
            marker = json.load(open(mpath))
        source = open(f"{H}/src/{v}/SOURCE").read().split()
        row = {
            "version": v, "tests": tag or "shard_map", "source": source[0], "commit": source[1],
            "collected_plain": len(pa), "collected_reprules": len(pb),
            "plain": fmt(summary(pa)), "reprules": fmt(summary(pb)),
            "identical": not diffs and set(pa) == set(pb),
            "failures_same_message": f"{len(both_failed) - len(msg_diffs)}/{len(both_failed)}",
            "marker": {k: marker.get(k) for k in ("active_after_registration", "active_at_end",
                                                  "all_patches_in_place_at_end", "sanity_checked_shard_map")},
            "n_patches": len(marker.get("patches_at_load", [])),
            "regime": (marker.get("jax_support") or {}).get("regime"),
            "packs_loaded": sum(p["state"] == "loaded" for p in marker.get("packs", [])),
            "packs_failed": [p for p in marker.get("packs", []) if p["state"] == "failed"],
        }
        rows.append(row)
        print(json.dumps(row))
        for t in diffs:
            bad = True
            print(f"  DIFF {t}: plain={pa.get(t, ('absent',))[0]} reprules={pb.get(t, ('absent',))[0]}")
            for label, res in (("plain", pa), ("reprules", pb)):
                detail = res.get(t, ("", ""))[1]
                if detail:
                    print(f"  --- {label} ---\n" + "\n".join("    " + line for line in detail.splitlines()[-60:]))
        for t in msg_diffs:
            print(f"  MESSAGE DIFF (same outcome) {t}:\n    plain:    {msg(pa[t][1])}\n    reprules: {msg(pb[t][1])}")
        if not row["identical"] or not all(row["marker"].values()):
            bad = True
    json.dump(rows, open(f"{H}/results/compare.json", "w"), indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
