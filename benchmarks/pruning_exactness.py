"""Branch and bound against the exhaustive search on every golden case: the same plan?

Run: ``.venv/bin/python benchmarks/pruning_exactness.py [CASE-ID ...]`` (the golden cases of
tests/golden.py; all by default). Each case is compiled twice, once as ``partita compile`` does
(``plan_search`` pruning: group lower bounds, the cut DP under a cap and inside its windows, the
probes) and once with ``plan_search(prune=False)``, which cuts every group in full. The table gives
both plans' mesh, schedule and predicted step, the search CPU seconds of each, and whether the plans
agree (mesh, training settings and predicted step, to the last bit). tests/unit/test_search_pruning.py
checks the same on three cases within the unit tier; this runs the whole golden set (about 4 minutes
on 2 cores). Results: docs/measurements.md, "Planning time".
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import partita.compiler.compile as compile_module
from tests.golden import CASES, plan_of


def planned(case, prune: bool) -> tuple[dict, float]:
    search = compile_module.plan_search
    seconds = []

    def timed(*args, **kwargs):
        t = time.process_time()
        try:
            return search(*args, prune=prune, **kwargs)
        finally:
            seconds.append(time.process_time() - t)

    compile_module.plan_search = functools.wraps(search)(timed)
    try:
        return plan_of(case), sum(seconds)
    finally:
        compile_module.plan_search = search


def main() -> None:
    picked = set(sys.argv[1:])
    print("| case | pruned: mesh, schedule, step | exhaustive | search CPU (pruned / exhaustive) | same plan |")
    print("|---|---|---|---|---|")
    differ = 0
    for case in CASES:
        if picked and case.id not in picked:
            continue
        (a, ta), (b, tb) = planned(case, True), planned(case, False)
        same = (a["mesh"], a["training"], a["predicted"]["step_time_s"]) == \
            (b["mesh"], b["training"], b["predicted"]["step_time_s"])
        differ += not same

        def row(p: dict) -> str:
            m = p["mesh"]
            return (f"dp={m['dp']} tp={m['tp']} pp={m['pp']}" + (f" ep={m['ep']}" if m.get("ep", 1) > 1 else "")
                    + f", {p['training']['schedule']}, {p['predicted']['step_time_s'] * 1e3:.4g} ms")
        print(f"| {case.id} | {row(a)} | {row(b)} | {ta:.2f} / {tb:.2f} s | {'yes' if same else '**no**'} |",
              flush=True)
    print(f"\n{differ} case(s) differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
