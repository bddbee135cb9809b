"""Where a test run's wall time went, from the timeline tests/conftest.py writes when
GRPO_TEST_TIMELINE names a file:

    GRPO_TEST_TIMELINE=/tmp/timeline.jsonl make test
    python tests/timeline.py /tmp/timeline.jsonl

Per worker: the seconds it ran tests, its share of the run's span, and how long it sat idle after
its last test while others still ran (a long tail means one long test started late). Then the
tests that ended in the last tenth of the run, longest first. Last line: JSON of the same.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict


def summary(records: list[dict], tail_share: float = 0.1) -> dict:
    """records: {worker, test, when, start, stop} per test phase (setup, call, teardown)."""
    if not records:
        return {"span_s": 0.0, "workers": {}, "tail": []}
    begin = min(r["start"] for r in records)
    end = max(r["stop"] for r in records)
    span = end - begin
    busy, last = defaultdict(float), {}
    per_test = defaultdict(lambda: [float("inf"), 0.0, None])
    for r in records:
        busy[r["worker"]] += r["stop"] - r["start"]
        last[r["worker"]] = max(last.get(r["worker"], begin), r["stop"])
        t = per_test[r["test"]]
        t[0], t[1], t[2] = min(t[0], r["start"]), max(t[1], r["stop"]), r["worker"]
    workers = {w: {"busy_s": round(busy[w], 1), "busy_share": round(busy[w] / span, 3) if span else 1.0,
                   "idle_at_end_s": round(end - last[w], 1)} for w in sorted(busy)}
    cut = end - tail_share * span
    tail = sorted(({"test": name, "worker": w, "seconds": round(stop - start, 1), "started_s": round(start - begin, 1)}
                   for name, (start, stop, w) in per_test.items() if stop > cut),
                  key=lambda t: -t["seconds"])
    return {"span_s": round(span, 1), "workers": workers, "tail": tail}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        result = summary([json.loads(line) for line in f if line.strip()])
    print(f"span {result['span_s']:.0f} s")
    for w, s in result["workers"].items():
        print(f"  {w}: busy {s['busy_s']:.0f} s ({100 * s['busy_share']:.0f}%), idle at the end {s['idle_at_end_s']:.0f} s")
    print("ended in the last tenth of the run, longest first:")
    for t in result["tail"][:15]:
        print(f"  {t['seconds']:7.1f} s  {t['worker']}  started at {t['started_s']:.0f} s  {t['test']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
