"""Markdown tables and the scaling plot (PIL only) from a result dictionary."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

START, END = "<!-- results:start -->", "<!-- results:end -->"


def _fmt(value: float | None, unit: str = "", digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if unit == "B":
        for step, name in ((2**20, "MiB"), (2**10, "KiB")):
            if value >= step:
                return f"{value / step:.1f} {name}"
        return f"{value:.0f} B"
    return f"{value:.{digits}g}{unit}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def capture_table(results: list[dict[str, Any]]) -> list[str]:
    names = list(results[0]["methods"]) if results else []
    rows = []
    for r in results:
        row = [r["workload"], str(r["batch_size"]), f"{r['parameters'] / 1e6:.1f}M"]
        for name in names:
            m = r["methods"][name]
            row.append(
                f"{m['median_s'] * 1000:.0f} ms ({m['ratio_to_plain']:.2f}x)" if m["status"] == "ok" else m["status"]
            )
        rows.append(row)
    return _table(["workload", "batch", "params", *names], rows)


def storage_table(results: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in results:
        for enc, e in r["encodings"].items():
            rows.append(
                [
                    r["workload"],
                    f"{r['padding_fraction']:.0%}",
                    enc,
                    _fmt(r["dense_fp32_per_sample"], "B"),
                    _fmt(r["dense_fp32_per_sample_without_word_embeddings"], "B"),
                    _fmt(e["store_per_sample"], "B"),
                    _fmt(e["store_per_sample_unpruned"], "B"),
                    f"{e['ratio_dense_to_store']:.0f}x",
                    f"{e['ratio_dense_without_word_embeddings_to_store']:.1f}x",
                    f"{e['pruning_saves']:.2f}x",
                ]
            )
    return _table(
        [
            "workload",
            "padding",
            "encoding",
            "dense fp32",
            "dense fp32 w/o word emb.",
            "store",
            "store unpruned",
            "dense/store",
            "dense w/o word emb./store",
            "pruning saves",
        ],
        rows,
    )


def writer_table(results: list[dict[str, Any]]) -> list[str]:
    rows = [
        [
            r["workload"],
            _fmt(w["bytes"], "B"),
            f"{w['store_mb_s']:.0f} MB/s",
            f"{w['save_file_mb_s']:.0f} MB/s",
            f"{w['store_mb_s'] / w['save_file_mb_s']:.2f}x",
        ]
        for r in results
        if (w := r.get("writer_throughput"))
    ]
    return _table(["workload", "written", "StoreWriter (fsync, sha256)", "plain save_file", "ratio"], rows)


def analytics_table(results: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in results:
        i, n, a = r["influence_s"], r["norms_s"], r["agreement"]
        rows.append(
            [
                r["workload"],
                f"{r['n_train']}x{r['n_test']}",
                f"{r['parameters'] / 1e6:.2f}M",
                _fmt(n["store"], " s"),
                _fmt(n["torch.func"], " s"),
                _fmt(n["rebuild"], " s"),
                _fmt(i["store"], " s"),
                _fmt(i["torch.func"], " s"),
                _fmt(i["rebuild"], " s"),
                f"{r['speedup']['influence_vs_torch.func']:.1f}x",
                f"{r['speedup']['influence_vs_rebuild']:.1f}x",
                f"{a['influence_store_fp32']:.1e} / {a['norms_store_fp32']:.1e}",
                f"{a['influence_store_fp16']:.1e} / {a['norms_store_fp16']:.1e}",
            ]
        )
    return _table(
        [
            "workload",
            "N x M",
            "params",
            "norms: store",
            "torch.func",
            "rebuild",
            "influence: store",
            "torch.func",
            "rebuild",
            "store vs torch.func",
            "store vs rebuild",
            "rel. err fp32 (infl./norms)",
            "rel. err fp16",
        ],
        rows,
    )


def _pair(memory: dict[str, Any], key: str) -> str:
    return " / ".join(f"{memory[enc][key]:.0f}" for enc in ("fp32", "fp16")) + " MiB" if memory else "-"


def rate_table(results: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in results:
        rate, memory = r["influence_rate"], r.get("influence_memory_mib", {})
        rows.append(
            [
                r["workload"],
                f"{rate['plan_flops'] / 1e9:.3g} G",
                _fmt(r["influence_s"]["store"], " s"),
                f"{rate['plan_gflops_per_s']:.0f} GFLOP/s",
                f"{rate['matmul_gflops_per_s']:.0f} GFLOP/s ({rate['matmul_size']}^3)",
                f"{rate['ratio_to_matmul']:.2f}",
                _pair(memory, "extra_peak_mib"),
                _pair(memory, "anon_extra_peak_mib"),
                _pair(memory, "file_mapped_mib"),
            ]
        )
    return _table(
        [
            "workload",
            "plan flops",
            "store influence",
            "plan rate",
            "one fp32 matmul",
            "rate / matmul",
            "extra peak RSS fp32 / fp16",
            "of which anonymous (peak)",
            "shard pages mapped",
        ],
        rows,
    )


def sketch_table(results: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in results:
        k = r["sketch"]
        rows.append(
            [
                r["workload"],
                f"{k['dim']}x{k['dim']}",
                _fmt(k["build_s"], " s"),
                _fmt(k["query_s"], " s"),
                _fmt(r["influence_s"]["store"], " s"),
                f"{r['speedup']['exact_vs_sketched_query']:.0f}x",
                f"{k['spearman_vs_exact']:.3f}",
                _fmt(k["cache_bytes"], "B"),
            ]
        )
    return _table(
        [
            "workload",
            "sketch",
            "build once (train + test)",
            "query (kept sketches)",
            "exact store influence",
            "exact / sketched query",
            "Spearman vs exact",
            "kept on disk",
        ],
        rows,
    )


GB_MIB = 1e9 / 2**20  # the "1 GB" in MiB


def targets(results: dict[str, Any]) -> list[str]:
    """The operator targets of issue 4 on the text workload, met or not (computed, not written by hand)."""
    lines = []
    for r in results["analytics"]:
        if not r.get("influence_memory_mib"):
            continue
        s, rate, mem = r["speedup"], r["influence_rate"], r["influence_memory_mib"]["fp32"]

        def line(ok: bool, text: str, workload: str = r["workload"]) -> str:
            return f"- {'met' if ok else 'NOT met'}: {workload}: {text}"

        lines += [
            line(
                s["influence_vs_torch.func"] >= 2,
                f"exact influence {s['influence_vs_torch.func']:.1f}x faster than torch.func + matmul (target 2x)",
            ),
            line(
                mem["extra_peak_mib"] < GB_MIB,
                f"exact influence peak memory: resident set +{mem['extra_peak_mib']:.0f} MiB "
                f"(target < 1 GB = {GB_MIB:.0f} MiB), "
                f"of which the process's own memory +{mem['anon_extra_peak_mib']:.0f} MiB "
                f"and shard pages mapped from disk +{mem['file_mapped_mib']:.0f} MiB",
            ),
            line(
                rate["ratio_to_matmul"] >= 0.5,
                f"exact influence plan runs at {rate['plan_gflops_per_s']:.0f} GFLOP/s, "
                f"{rate['ratio_to_matmul']:.2f} of one {rate['matmul_size']}^3 fp32 matmul "
                f"({rate['matmul_gflops_per_s']:.0f} GFLOP/s; target 0.5)",
            ),
            line(
                s["exact_vs_sketched_query"] >= 50 and r["sketch"]["spearman_vs_exact"] >= 0.9,
                f"sketched influence query {s['exact_vs_sketched_query']:.0f}x faster than exact (target 50x), "
                f"Spearman {r['sketch']['spearman_vs_exact']:.3f} (target 0.9); "
                f"building the sketches once took {r['sketch']['build_s']:.3g} s",
            ),
            line(
                s["norms_vs_torch.func"] >= 20,
                f"norms {s['norms_vs_torch.func']:.0f}x faster than torch.func (target 20x)",
            ),
        ]
    return lines or ["- no text workload in this run."]


def captum_table(result: dict[str, Any]) -> list[str]:
    if result["status"] != "ok":
        return [f"Captum TracInCPFast: {result['status']}."]
    t = result["median_s"]
    return _table(
        [
            "workload",
            "layer",
            "N x M",
            "Captum TracInCPFast",
            "store (weight dots)",
            "store.influence(layers=[...])",
            "store vs Captum",
            "rel. err vs Captum",
        ],
        [
            [
                result["workload"],
                result["layer"],
                f"{result['n_train']}x{result['n_test']}",
                _fmt(t["captum"], " s"),
                _fmt(t["store_weight_dots"], " s"),
                _fmt(t["store_influence_layer"], " s"),
                f"{result['store_speedup_vs_captum']:.1f}x",
                f"{result['agreement_weight_only']:.1e}",
            ]
        ],
    )


def scaling_table(result: dict[str, Any]) -> list[str]:
    rows = [
        [
            str(p["n_train"]),
            p["method"],
            _fmt(p["median_s"], " s"),
            f"{p['extra_peak_mib']:.0f} MiB",
            f"{p['rss_peak_mib']:.0f} MiB",
            f"{p['dense_fp32_gradients_mib']:.0f} MiB",
        ]
        for p in result["points"]
    ]
    return _table(
        ["N", "method", "time", "extra peak RSS", "process peak RSS", "all N dense fp32 grads would be"], rows
    )


def peers_win(results: dict[str, Any]) -> list[str]:
    """Every measured case where another method beat capture+store or the store (computed, not written by hand)."""
    lines = []
    for r in results["capture"]:
        ours = r["methods"]["capture+store"]
        for name, m in r["methods"].items():
            if name not in ("plain", "capture+store") and m["status"] == "ok" and ours["status"] == "ok":
                if m["median_s"] < ours["median_s"]:
                    lines.append(
                        f"- capture, {r['workload']}: {name} steps in {m['median_s'] * 1000:.0f} ms, "
                        f"capture+store in {ours['median_s'] * 1000:.0f} ms."
                    )
    captum = results.get("captum", {})
    if captum.get("status") == "ok" and captum["median_s"]["captum"] < captum["median_s"]["store_weight_dots"]:
        lines.append(
            f"- last-layer influence: Captum TracInCPFast took {captum['median_s']['captum']:.3g} s, "
            f"the store {captum['median_s']['store_weight_dots']:.3g} s."
        )
    for r in results["analytics"]:
        for what in ("norms_s", "influence_s"):
            for name in ("torch.func", "rebuild"):
                if r[what][name] < r[what]["store"]:
                    lines.append(
                        f"- {what[:-2]}, {r['workload']}: {name} took {r[what][name]:.3g} s, "
                        f"the store {r[what]['store']:.3g} s."
                    )
    return lines or ["- none in this run."]


def plot(result: dict[str, Any], path: Path) -> None:
    """Two panels (time, extra peak memory) against N on a log2 axis, one line per method."""
    from PIL import Image, ImageDraw

    width, height, pad = 900, 380, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    colors = {"store": (31, 119, 180), "rebuild": (214, 39, 40)}
    sizes = sorted({p["n_train"] for p in result["points"]})
    panels = (("median time (s)", "median_s"), ("extra peak RSS (MiB)", "extra_peak_mib"))
    panel_w = (width - pad) // 2
    for k, (title, key) in enumerate(panels):
        x0, x1, y0, y1 = k * panel_w + pad, (k + 1) * panel_w - 10, 40, height - pad
        top = max(max(p[key] for p in result["points"]), 1e-9) * 1.1
        draw.rectangle([x0, y0, x1, y1], outline="black")
        draw.text((x0, 12), f"{title} vs N ({result['workload']}, M={result['n_test']})", fill="black")
        for frac in (0.0, 0.5, 1.0):
            y = y1 - frac * (y1 - y0)
            draw.text((x0 - 50, y - 6), f"{top * frac:.3g}", fill="black")
        xs = {n: x0 + 20 + (x1 - x0 - 40) * (i / max(1, len(sizes) - 1)) for i, n in enumerate(sizes)}
        for n, x in xs.items():
            draw.text((x - 12, y1 + 6), str(n), fill="black")
        for method, color in colors.items():
            pts = [(xs[p["n_train"]], y1 - p[key] / top * (y1 - y0)) for p in result["points"] if p["method"] == method]
            if len(pts) > 1:
                draw.line(pts, fill=color, width=2)
            for x, y in pts:
                draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=color)
        draw.text((x0 + 8, y1 + 24), "N (train samples, log2 spacing)", fill="black")
    for i, (method, color) in enumerate(colors.items()):
        draw.rectangle([width - 200, height - 34 + i * 14, width - 190, height - 24 + i * 14], fill=color)
        draw.text(
            (width - 185, height - 36 + i * 14),
            "store influence" if method == "store" else "rebuild dense + matmul",
            fill="black",
        )
    image.save(path)


def markdown(results: dict[str, Any], plot_name: str) -> str:
    meta = results["meta"]
    lines = [
        f"### {meta['mode']} run, {meta['started']}",
        "",
        f"- machine: {meta['machine']}; {meta['cpu_count']} CPUs visible, torch threads {meta['threads']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        f"- wall time of the run: {meta['duration_s']:.0f} s; JSON: `{meta['json']}`",
        *[f"- note: {n}" for n in meta["notes"]],
        "",
        "#### Capture: median step time (forward + backward + SGD step), ratio to plain",
        "",
        *capture_table(results["capture"]),
        "",
        "capture+store writer: bytes written over all steps / time of the final flush after the timed steps: "
        + "; ".join(
            f"{r['workload']} {_fmt(r['methods']['capture+store'].get('bytes_written'), 'B')} / "
            f"{_fmt(r['methods']['capture+store'].get('final_flush_s'), ' s')}"
            for r in results["capture"]
        ),
        "",
        "#### Storage: bytes per sample",
        "",
        *storage_table(results["storage"]),
        "",
        "Writer throughput: 8 batches through `StoreWriter` (fp32, background thread, fsync, sha256, manifest) "
        "against one `safetensors.torch.save_file` of the same tensors, same run:",
        "",
        *writer_table(results["storage"]),
        "",
        "#### Analytics: norms and exact influence (seconds; relative error against torch.func)",
        "",
        *analytics_table(results["analytics"]),
        "",
        "#### Exact store influence: arithmetic rate and memory",
        "",
        *rate_table(results["analytics"]),
        "",
        "Plan flops: the arithmetic of the methods the cost model chose for every record pair of every (train batch, "
        "test batch) pair (`ops.plan_total_dots`); rate = plan flops / median store influence time. The matmul is "
        "timed once per round, in the same rounds and thread count. Memory: `store.influence` once in a fresh "
        "subprocess per encoding, VmHWM reset through /proc/self/clear_refs; the resident set counts the shard pages "
        "the reader maps from disk (page cache, counted as mapped during the call) besides the process's own "
        "(anonymous) memory, sampled every 5 ms.",
        "",
        "#### Sketched influence: sketches built once and kept in the store",
        "",
        *sketch_table(results["analytics"]),
        "",
        "Build: `store.build_sketches` for the train and the test capture point, timed once. Query: "
        "`store.sketched_influence` reading the kept sketches, median over the rounds. Spearman: mean over test "
        "samples of the rank correlation with exact influence from torch.func.",
        "",
        "#### Issue 4 targets (computed from the figures above)",
        "",
        *targets(results),
        "",
        "#### Last-layer influence against Captum TracInCPFast (one checkpoint)",
        "",
        *captum_table(results["captum"]),
        "",
        "Captum recomputes the last layer's inputs and output gradients from the checkpoint and the data "
        "(a forward pass per sample) and keeps no storage; the store reads factors captured during training.",
        "",
        "#### Scaling of influence with N",
        "",
        f"![scaling]({plot_name})",
        "",
        *scaling_table(results["scaling"]),
        "",
        f"Memory: {results['scaling']['memory_measure']}.",
        "",
        "#### Where another method won in this run (computed from the figures above)",
        "",
        *peers_win(results),
        "",
        "#### Checks",
        "",
        *[f"- {'PASS' if c['passed'] else 'FAIL'}: {c['name']} ({c['detail']})" for c in results["checks"]],
    ]
    return "\n".join(lines) + "\n"


def write_doc(doc: Path, body: str, intro: str) -> None:
    """Replace the results section of ``doc`` (keeping its hand-written text), or create it."""
    text = doc.read_text() if doc.exists() else intro
    if START not in text or END not in text:
        text = text.rstrip() + f"\n\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(f"{head}{START}\n{body}{END}{tail}")
