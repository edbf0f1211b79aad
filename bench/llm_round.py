#!/usr/bin/env python3
"""One JSON line that sums up an LLM round's run directory (memfl mpi or
memfl launch): per role peak RSS ÷ model, anonymous and file-backed peaks,
the seconds of each phase, and the server's transfer and commit figures.

Usage: llm_round.py RUN_DIR [KEY=VALUE ...]   (pairs are copied into the line)
"""
import csv
import json
import os
import sys


def role_dirs(run):
    for name in sorted(os.listdir(run)):
        d = os.path.join(run, name)
        if os.path.isfile(os.path.join(d, "memory.json")):
            yield name, d


def phases(mem):
    out = {}
    for p in mem.get("phases", []):
        key = p["phase"] if p["round"] == 0 else f"r{p['round']}_{p['phase']}"
        out[key] = round(out.get(key, 0.0) + (p["end_ms"] - p["start_ms"]) / 1000.0, 3)
    return out


def main():
    run = sys.argv[1]
    line = dict(a.split("=", 1) for a in sys.argv[2:])
    roles = {}
    model = None
    for name, d in role_dirs(run):
        mem = json.load(open(os.path.join(d, "memory.json")))
        summ = json.load(open(os.path.join(d, "summary.json"))) if os.path.exists(os.path.join(d, "summary.json")) else {}
        model = summ.get("model_bytes", model)
        r = {
            "peak_rss_bytes": mem["peak_rss_bytes"],
            "peak_rss_anon_bytes": mem.get("peak_rss_anon_bytes"),
            "peak_rss_file_bytes": mem.get("peak_rss_file_bytes"),
            "vm_hwm_bytes": mem.get("vm_hwm_bytes"),
            "phase_seconds": phases(mem),
        }
        if model:
            r["peak_over_model"] = round(mem["peak_rss_bytes"] / model, 4)
            if mem.get("peak_rss_anon_bytes") is not None:
                r["anon_over_model"] = round(mem["peak_rss_anon_bytes"] / model, 4)
        metrics = os.path.join(d, "metrics.csv")
        if os.path.exists(metrics):
            rows = list(csv.DictReader(open(metrics)))
            r["rounds"] = [{k: float(v) for k, v in row.items() if k in (
                "round", "round_seconds", "download_seconds", "upload_seconds", "bytes_down", "bytes_up",
                "commit_seconds", "peak_rss_bytes")} for row in rows]
            for x in r["rounds"]:
                if x.get("download_seconds"):
                    x["down_gb_s"] = round(x["bytes_down"] / x["download_seconds"] / 1e9, 3)
                if x.get("upload_seconds"):
                    x["up_gb_s"] = round(x["bytes_up"] / x["upload_seconds"] / 1e9, 3)
        roles[name] = r
    line["model_bytes"] = model
    line["roles"] = roles
    print(json.dumps(line))


if __name__ == "__main__":
    main()
