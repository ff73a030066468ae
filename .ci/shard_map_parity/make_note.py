"""Writes /tmp/note/shardmap.md from results/compare.json (run compare.py first)."""
import json
import os

H = "/tmp/jaxtests"
ALL = "0.4.28 0.4.38 0.5.3 0.6.2 0.7.2 0.8.3 0.9.2 0.10.2 0.11.2 0.12.0.1".split()
rows = {r["version"]: r for r in json.load(open(f"{H}/results/compare.json"))}
timings = {}
if os.path.exists(f"{H}/results/timings.txt"):
    for line in open(f"{H}/results/timings.txt"):
        p = line.split()
        if len(p) == 4:
            timings[(p[0], p[1])] = p[3].split("=")[1]
snap_head = open(f"{H}/snapshot/HEAD").read().strip()
snap_status = open(f"{H}/snapshot/status").read().strip() or "clean"
snap_time = open(f"{H}/snapshot/taken_at").read().strip()

out = ["# reprules vs JAX's own `tests/shard_map_test.py`", ""]
out.append(f"reprules code under test: snapshot of `/work/main/reprules` taken {snap_time}, "
           f"`/work/main` at HEAD `{snap_head}`, working tree {snap_status} (copy in "
           "`/tmp/jaxtests/snapshot/reprules`, imported ahead of the editable install through PYTHONPATH).")
out.append("")
out.append("| JAX version | source (tag or main commit) | tests collected | outcomes plain (passed/failed/skipped) | outcomes with reprules | identical? |")
out.append("|---|---|---|---|---|---|")
for v in ALL:
    r = rows.get(v)
    src = open(f"{H}/src/{v}/SOURCE").read().split()
    source = f"tag `{src[0]}`" if src[0].startswith("jax-v") else f"no tag; main `{src[1][:12]}`"
    if r is None:
        out.append(f"| {v} | {source} | not run | not run (time budget) | not run | – |")
        continue
    coll = str(r["collected_plain"]) if r["collected_plain"] == r["collected_reprules"] else f"{r['collected_plain']} / {r['collected_reprules']}"
    ident = "**yes**" if r["identical"] else "**NO**"
    ident += f" (failures with same message: {r['failures_same_message']})" if r["failures_same_message"] != "0/0" else ""
    out.append(f"| {v} | {source} | {coll} | {r['plain']} | {r['reprules']} | {ident} |")
out.append("")
out.append("Evidence that reprules was active in each with-reprules run (from `results/V-reprules.marker.json`):")
out.append("")
out.append("| JAX | regime | JAX patches live | still in place at session end | packs loaded | rule works at end (checked shard_map) | run time plain / reprules (s) |")
out.append("|---|---|---|---|---|---|---|")
for v in ALL:
    r = rows.get(v)
    if r is None:
        continue
    m = r["marker"]
    out.append(f"| {v} | {r['regime']} | {r['n_patches']} (active at load: {m['active_after_registration']}) | "
               f"{m['all_patches_in_place_at_end']} (active: {m['active_at_end']}) | {r['packs_loaded']} loaded, "
               f"{len(r['packs_failed'])} failed | {m['sanity_checked_shard_map']} | "
               f"{timings.get((v, 'plain'), '?')} / {timings.get((v, 'reprules'), '?')} |")
open("/tmp/note/shardmap.md", "w").write("\n".join(out) + "\n" + open(f"{H}/note_tail.md").read())
print("\n".join(out))
