"""The default capture policy at scale: a MiniLM fine-tune on many reviews, and BERT-base's bytes on paper.

``python -m metastore_bench.policy_scale [--reviews 20000] [--no-run] [--doc PATH] [--out JSON]``:

- **scale run**: ``examples/finetune_bert.py`` on ``--reviews`` composed reviews for one epoch
  (checkpoint passes over the callback's default 256-sample training subset and the 128
  validation reviews), without the callback and with the default policy, each in a fresh
  process: training time (reports included), report time, store size, peak resident memory;
- **on paper**: one batch of BERT-base (``BertConfig()``: 110M parameters, built from its config,
  nothing downloaded) is captured at T = 128; its records measure each layer's bytes per sample
  in every representation, which give the store of a 100k-example, 3-epoch fine-tune for each
  policy rung, and the plan the default policy makes for it.

Writes ``metastore_bench/results/policy_scale.json`` and the ``policy-scale`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from .example_runs import run_example
from .publish import bench_parser, publish, visible_machine

START, END = "<!-- policy-scale:start -->", "<!-- policy-scale:end -->"
GIB = 2**30


def scale_run(reviews: int) -> dict[str, Any]:
    out: dict[str, Any] = {"reviews": reviews}
    for variant, extra in (("no callback", ["--no-callback"]), ("default policy", [])):
        with tempfile.TemporaryDirectory(prefix="msbench-scale-") as tmp:
            print(f"[policy-scale] {reviews} reviews: {variant}", file=sys.stderr, flush=True)
            args = ["--train-size", str(reviews), "--epochs", "1", "--checkpoint-train-samples", "256"]
            result = run_example("examples/finetune_bert.py", tmp, [*args, *extra])
            if variant != "no callback":
                manifest = json.loads((Path(tmp) / "metastore" / "manifest-rank0.json").read_text())
                result["plan"] = manifest["config"]["capture_plan"]
            out[variant] = result
    out["overhead"] = out["default policy"]["seconds"] / out["no callback"]["seconds"]
    return out


def bert_base_on_paper(tokens: int = 128, examples: int = 100_000, epochs: int = 3) -> dict[str, Any]:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from metastore_plugins import CaptureSession
    from metastore_plugins.core.ops.cost import SAMPLE_METADATA_BYTES
    from metastore_plugins.core.policy.budget import Budget, RunShape
    from metastore_plugins.core.policy.plan import LADDER, make_plan, measure

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=2))
    ids = torch.randint(1000, 30000, (2, tokens))
    with CaptureSession(model) as session:
        model(input_ids=ids, labels=torch.tensor([0, 1])).loss.backward()
    records = session.factors()
    passes, pass_samples, batch = epochs, 512, 32
    costs = measure(records, "fp16", batch)  # header entries shared by the run's batch of 32
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    samples = examples * epochs + passes * pass_samples
    snapshots = passes * 4 * params
    rows = {}
    for rep, k in LADDER:
        per_sample = sum(c.bytes(rep, k, "fp16") for c in costs.values()) + SAMPLE_METADATA_BYTES
        label = f"{rep} {k}x{k}" if rep == "projected" else rep
        rows[label] = {"bytes_per_sample": per_sample, "gradients_gib": per_sample * samples / GIB}
    shape = RunShape(examples * epochs // batch, batch, passes, pass_samples, 4 * params)
    plan = make_plan(records, shape, budget=Budget("auto"), encoding="fp16")
    return {
        "parameters": params,
        "layers": len(costs),
        "tokens": tokens,
        "samples": samples,
        "snapshots_gib": snapshots / GIB,
        "rungs": rows,
        "default_budget_gib": plan.budget / GIB,  # type: ignore[operator]
        "default_plan": {"k": plan.k, "train": sorted(set(plan.train.values())), "planned": plan.planned},
    }


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"### {meta['machine']}", ""]
    run = results.get("scale_run")
    if run:
        base, pol = run["no callback"], run["default policy"]
        plan = pol["plan"]
        lines += [
            f"**Scale run**: all-MiniLM-L6-v2 on {run['reviews']:,} composed reviews, 1 epoch, batch 32, passes over "
            "256 training and 128 validation reviews, default policy (plan: "
            f"projection {plan['k']}x{plan['k']}, budget {plan['budget'] / 2**20:,.0f} MiB).",
            "",
            "| | training time (reports included) | report time | store | peak RSS |",
            "|---|---|---|---|---|",
            f"| no callback | {base['seconds']:.1f} s | | | {base['peak_rss_mib']:,.0f} MiB |",
            f"| default policy | {pol['seconds']:.1f} s ({run['overhead']:.2f}x) "
            f"| {pol.get('report_seconds', 0):.1f} s | {pol['store_bytes'] / 2**20:,.1f} MiB "
            f"| {pol['peak_rss_mib']:,.0f} MiB |",
            "",
        ]
    paper = results["bert_base"]
    lines += [
        f"**On paper: BERT-base** ({paper['parameters'] / 1e6:.0f}M parameters, {paper['layers']} captured layers, "
        f"T = {paper['tokens']}), 100k examples x 3 epochs plus 3 passes of 512 samples ({paper['samples']:,} "
        f"samples); bytes per sample measured from one captured batch; snapshots {paper['snapshots_gib']:.2f} GiB "
        "(3 full fp32 snapshots, before the row-sparse saving).",
        "",
        "| every layer kept as | bytes per sample | gradients for the run |",
        "|---|---|---|",
        *(
            f"| {label} | {row['bytes_per_sample']:,.0f} | {row['gradients_gib']:,.1f} GiB |"
            for label, row in paper["rungs"].items()
        ),
        "",
        f"The default budget for this run is {paper['default_budget_gib']:.2f} GiB; its plan keeps "
        f"{', '.join(paper['default_plan']['train'])} at k = {paper['default_plan']['k']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("policy_scale", __doc__, "policy_scale.json")
    parser.add_argument("--reviews", type=int, default=20_000)
    parser.add_argument("--no-run", action="store_true", help="only the on-paper figures (keep the last scale run)")
    args = parser.parse_args(argv)
    previous = json.loads(args.out.read_text()).get("results", {}) if args.out.exists() else {}
    results = {"bert_base": bert_base_on_paper()}
    results["scale_run"] = previous.get("scale_run") if args.no_run else scale_run(args.reviews)
    meta = {"machine": visible_machine()}
    return publish(args.out, {"meta": meta, "results": results}, markdown(results, meta), args.doc, (START, END))


if __name__ == "__main__":
    raise SystemExit(main())
