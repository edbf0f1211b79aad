#!/usr/bin/env python3
"""Min / median / max of every numeric field of a JSONL bench file, per cell.
Usage: bench/spread.py FILE.jsonl KEY[,KEY...]  (the fields that name a cell)"""
import json
import statistics
import sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
keys = sys.argv[2].split(",")
cells = {}
for r in rows:
    cells.setdefault(tuple(r.get(k) for k in keys), []).append(r)
for cell, rs in cells.items():
    out = dict(zip(keys, cell))
    out["runs"] = len(rs)
    for f in rs[0]:
        if f in keys or f == "rep" or not isinstance(rs[0][f], (int, float)) or isinstance(rs[0][f], bool):
            continue
        v = [r[f] for r in rs if isinstance(r.get(f), (int, float))]
        out[f] = {"min": min(v), "median": round(statistics.median(v), 3), "max": max(v)}
    print(json.dumps(out))
