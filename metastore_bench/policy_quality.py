"""The default capture policy against ``policy="exact"`` on the examples: bytes, time, and what the reports find.

``python -m metastore_bench.policy_quality [--only hf|lightning] [--doc PATH] [--out JSON]`` runs each
example twice in fresh processes, ``--policy exact`` then ``--policy auto`` (the same seeds, so the
same training; and ``--policy exact --encoding fp32``, the reference for influence), and compares:

- store bytes and training time (``Trainer.fit`` / ``Trainer.train``, reports included);
- flipped labels in the top 10% by self-influence (the outlier report);
- influence on the report's validation samples: Spearman's rank correlation of the estimated
  (projected) scores with the exact ones over every training sample of the passes, per validation
  sample; overlap of the estimated top-5 proponents and opponents with the exact ones; and whether
  the report's refined top-5 (recomputed exactly) equals the exact top-5.

Writes ``metastore_bench/results/policies.json`` and the ``policies`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from metastore_plugins.core.policy.plan import summarize

from .example_runs import run_example
from .publish import bench_parser, keep_previous, publish, visible_machine

START, END = "<!-- policies:start -->", "<!-- policies:end -->"
#: example -> (script, store subdirectory of --out, extra arguments)
EXAMPLES = {
    "hf": ("examples/finetune_bert.py", "metastore", []),
    "lightning": ("examples/lightning_digits.py", "store", []),
}


def ranks(values: np.ndarray) -> np.ndarray:
    """Ranks along axis 0 (ties broken by position: scores here are continuous)."""
    order = np.argsort(values, axis=0, kind="stable")
    out = np.empty_like(order)
    np.put_along_axis(out, order, np.arange(values.shape[0])[:, None].repeat(values.shape[1], 1), axis=0)
    return out.astype(np.float64)


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per column: Pearson correlation of the ranks of ``a`` and ``b`` (``(N, M)`` each)."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(0), rb - rb.mean(0)
    return (ra * rb).sum(0) / np.sqrt((ra**2).sum(0) * (rb**2).sum(0))


def influence_quality(exact_dir: Path, auto_dir: Path) -> dict[str, Any]:
    from metastore_plugins import open_store
    from metastore_plugins.core.reports import INFLUENCE_SAMPLES
    from metastore_plugins.core.reports.tables import checkpoint_points

    exact, auto = open_store(exact_dir), open_store(auto_dir)
    train, val = checkpoint_points(exact, "train"), checkpoint_points(exact, "val")
    test_ids = sorted(set(exact.sample_ids(val[-1]).tolist()))[:INFLUENCE_SAMPLES]
    truth = exact.influence(train, val, test_ids=test_ids)
    estimate = auto.influence(train, val, test_ids=test_ids)
    assert np.array_equal(truth.row_ids, estimate.row_ids) and np.array_equal(truth.col_ids, estimate.col_ids)
    rho = spearman(estimate.scores, truth.scores)
    k = 5
    top_true, top_est = truth.top(k), estimate.top(k)
    overlap = [
        len({i for i, _ in t[side]} & {i for i, _ in e[side]}) / k
        for t, e in zip(top_true, top_est)
        for side in ("proponents", "opponents")
    ]
    refined = json.loads((auto_dir / "reports" / "influence.json").read_text())
    by_id = {row["sample_id"]: row for row in top_true}
    equal = [
        [p["sample_id"] for p in row[side]] == [i for i, _ in by_id[row["test_id"]][side]]
        for row in refined
        for side in ("proponents", "opponents")
    ]
    return {
        "test_samples": len(test_ids),
        "train_samples": len(truth.row_ids),
        "spearman_mean": float(rho.mean()),
        "spearman_min": float(rho.min()),
        "top5_overlap_estimated": float(np.mean(overlap)),
        "refined_rows_exact": all(row.get("exact", False) for row in refined),
        "refined_top5_equal_exact": float(np.mean(equal)),
    }


#: run name -> arguments: the example as it is with policy="exact" (fp16, today's figures), the exact
#: reference for influence (fp32: no encoding rounding in the order of close scores), the default policy
VARIANTS = {
    "exact": ["--policy", "exact"],
    "exact-fp32": ["--policy", "exact", "--encoding", "fp32"],
    "auto": ["--policy", "auto"],
}


def measure(name: str, keep: Path | None) -> dict[str, Any]:
    script, sub, extra = EXAMPLES[name]
    with tempfile.TemporaryDirectory(prefix="msbench-pol-") as tmp:
        where = keep / name if keep else Path(tmp)
        runs = {}
        for variant, arguments in VARIANTS.items():
            print(f"[policies] {name}: {variant}", file=sys.stderr, flush=True)
            runs[variant] = run_example(script, where / variant, [*extra, *arguments])
        quality = influence_quality(where / "exact-fp32" / sub, where / "auto" / sub)
        plan = json.loads((where / "auto" / sub / "manifest-rank0.json").read_text())["config"]["capture_plan"]
    return {
        "script": script,
        "measured": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "runs": runs,
        "influence": quality,
        "plan": {key: plan[key] for key in ("budget", "budget_source", "k", "snapshots", "planned")}
        | {"training steps": summarize(plan["train"], plan["k"]), "passes": summarize(plan["passes"], plan["k"])},
    }


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"### {meta['machine']}", ""]
    for entry in results.values():
        runs, quality, plan = entry["runs"], entry["influence"], entry["plan"]
        exact, auto = runs["exact"], runs["auto"]
        found = "found" if "found" in exact else "flipped_found"
        lines += [
            f"`{entry['script']}` ({entry['measured']}); default plan: budget {plan['budget'] / 2**20:.1f} MiB "
            f"({plan['budget_source']}); training steps: {plan['training steps']}; checkpoint passes: "
            f"{plan['passes']}; {plan['snapshots']} weight snapshots",
            "",
            "| | store | training time (reports included) | flipped labels in the top 10% |",
            "|---|---|---|---|",
            *(
                f"| `{policy}` | {r['store_bytes'] / 2**20:.1f} MiB | {r['seconds']:.1f} s | "
                f"{r.get(found, '?')} of {r['flipped']} |"
                for policy, r in (
                    ("policy='exact'", exact),
                    ("policy='exact', encoding='fp32' (the reference)", runs["exact-fp32"]),
                    ("policy='auto' (the default)", auto),
                )
            ),
            "",
            f"Influence on {quality['test_samples']} validation samples over {quality['train_samples']} training "
            "samples, against exact TracIn from the fp32 store: Spearman of the estimates "
            f"{quality['spearman_mean']:.3f} on average "
            f"(lowest {quality['spearman_min']:.3f}); estimated top-5 proponents and opponents share "
            f"{100 * quality['top5_overlap_estimated']:.0f}% with the exact ones; after exact refinement the report's "
            f"top-5 lists equal the exact ones in {100 * quality['refined_top5_equal_exact']:.0f}% of the lists "
            f"(rows marked exact: {quality['refined_rows_exact']}).",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("policy_quality", __doc__, "policies.json")
    parser.add_argument("--only", choices=sorted(EXAMPLES), action="append")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' directories under this one")
    args = parser.parse_args(argv)
    results = {name: measure(name, args.keep) for name in args.only or list(EXAMPLES)}
    if args.only and args.out.exists():
        results = keep_previous(args.out, results, EXAMPLES)
    meta = {"machine": visible_machine()}
    return publish(args.out, {"meta": meta, "results": results}, markdown(results, meta), args.doc, (START, END))


if __name__ == "__main__":
    raise SystemExit(main())
