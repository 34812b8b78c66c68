"""Capture rules: the generic rule against the specific ones, on the same layers.

``python -m metastore_bench.capture_families [--size full|tiny] [--repeats 11] [--threads N] [--doc PATH] [--out JSON]``

Per layer family (``nn.Linear``, ``nn.LayerNorm``, ``nn.Conv2d``, ``nn.Embedding``), one layer at a
realistic size runs forward + backward of one batch three ways, round-robin (one step each per
round, median over rounds, :func:`metastore_bench.timing.round_robin`), each on its own copy of the layer:

- ``no capture``: plain autograd;
- ``specific rule``: a :class:`CaptureSession` with the family's built-in rule (records read and reset
  every step, as a training loop does);
- ``generic rule``: the same, with the built-in rule unregistered while the session attaches, so the
  layer goes through the generic rule (a per-sample ``vmap`` of the module, fp32, dense records).

Both sessions' per-sample gradients are compared (largest relative difference, a check, not a timing).
Then whole transformers models built from configs (random weights, nothing downloaded): capture with
the parameters only the generic rule covers (Llama's RMSNorm weights, ViT's ``cls_token`` and
``position_embeddings``) captured (the default) or left out (``generic=False``), to show what the
generic rule costs inside a model.

To add a layer family, append a :class:`Case` to :func:`layer_cases`; a model, to :func:`model_cases`.
Writes ``metastore_bench/results/capture_families.json`` and the ``capture-families`` section of
``docs/benchmarks.md``. ``--size tiny`` is a smoke run (seconds), not a measurement.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession, find_rule, register_capture, restore_all, unregister_capture
from metastore_plugins.testing import max_relative_error

from .publish import publish, round_robin_meta, round_robin_parser
from .timing import median, round_robin

START, END = "<!-- capture-families:start -->", "<!-- capture-families:end -->"

Loss = Callable[[nn.Module, Any], Tensor]


@dataclass
class Case:
    """One module and one batch. ``variants``: session keyword arguments per variant (None: no session);
    ``generic_for``: variants whose session attaches with the module's own rule unregistered."""

    name: str
    shape: str  # the batch, in words, for the table
    build: Callable[[], nn.Module]
    batch: Callable[[], Any]
    loss: Loss
    variants: dict[str, dict[str, Any] | None]
    generic_for: tuple[str, ...] = ()
    compare: tuple[str, str] | None = None  # two variants whose per-sample gradients must agree
    results: dict[str, Any] = field(default_factory=dict)


def output_loss(model: nn.Module, batch: Tensor) -> Tensor:
    """A loss that reads every output entry: the mean over samples of a fixed projection of the output."""
    out = model(batch)
    return (out * torch.linspace(-1, 1, out.shape[-1])).sum() / out.shape[0]


def hf_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(**batch).loss


LAYER_VARIANTS: dict[str, dict[str, Any] | None] = {"no capture": None, "specific rule": {}, "generic rule": {}}


def layer_cases(size: str) -> list[Case]:
    """The layer families, each with its specific rule and forced through the generic rule."""
    full = size == "full"
    b, t = (16, 128) if full else (2, 4)
    d, channels, pixels, vocab = (768, 64, 32, 4096) if full else (8, 4, 6, 32)

    def case(name: str, shape: str, build: Callable[[], nn.Module], batch: Callable[[], Any]) -> Case:
        return Case(name, shape, build, batch, output_loss, dict(LAYER_VARIANTS), ("generic rule",),
                    ("specific rule", "generic rule"))  # fmt: skip

    return [
        case(f"nn.Linear({d}, {d})", f"({b}, {t}, {d})", lambda: nn.Linear(d, d), lambda: torch.randn(b, t, d)),
        case(f"nn.LayerNorm({d})", f"({b}, {t}, {d})", lambda: nn.LayerNorm(d), lambda: torch.randn(b, t, d)),
        case(
            f"nn.Conv2d({channels}, {channels}, 3, padding=1)",
            f"({b}, {channels}, {pixels}, {pixels})",
            lambda: nn.Conv2d(channels, channels, 3, padding=1),
            lambda: torch.randn(b, channels, pixels, pixels),
        ),
        case(
            f"nn.Embedding({vocab}, {d // 3})",
            f"ids ({b}, {t})",
            lambda: nn.Embedding(vocab, d // 3),
            lambda: torch.randint(0, vocab, (b, t)),
        ),
    ]


def model_cases(size: str) -> list[Case]:
    """Whole transformers models: the generic rule's parameters captured (default) or left out."""
    from transformers import LlamaConfig, LlamaForCausalLM, ViTConfig, ViTForImageClassification

    full = size == "full"
    b, t = (8, 128) if full else (2, 4)
    hidden, layers = (256, 4) if full else (8, 1)
    variants: dict[str, dict[str, Any] | None] = {
        "no capture": None,
        "generic=False (those parameters not captured)": {"generic": False, "unsupported": "skip"},
        "generic rule (the default)": {},
    }

    def llama() -> nn.Module:
        config = LlamaConfig(
            vocab_size=4096 if full else 32, hidden_size=hidden, intermediate_size=2 * hidden + hidden // 2,
            num_hidden_layers=layers, num_attention_heads=4 if full else 2, num_key_value_heads=2 if full else 1,
            max_position_embeddings=max(t, 16),
        )  # fmt: skip
        return LlamaForCausalLM(config)

    def llama_batch() -> dict[str, Tensor]:
        ids = torch.randint(0, 4096 if full else 32, (b, t))
        return {"input_ids": ids, "labels": ids}

    image, patch = (64, 8) if full else (8, 4)

    def vit() -> nn.Module:
        config = ViTConfig(  # type: ignore[call-arg]
            image_size=image, patch_size=patch, hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=4 if full else 2, intermediate_size=2 * hidden, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=10,
        )  # fmt: skip
        return ViTForImageClassification(config)

    def vit_batch() -> dict[str, Tensor]:
        return {"pixel_values": torch.randn(2 * b, 3, image, image), "labels": torch.randint(0, 10, (2 * b,))}

    return [
        Case(f"Llama ({layers} layers, d={hidden}, GQA)", f"ids ({b}, {t})", llama, llama_batch, hf_loss,
             dict(variants)),
        Case(f"ViT ({layers} layers, d={hidden})", f"images ({2 * b}, 3, {image}, {image})", vit, vit_batch, hf_loss,
             dict(variants)),
    ]  # fmt: skip


@contextmanager
def specific_rule_removed(module: nn.Module) -> Iterator[None]:
    """Inside the block, ``module``'s registered rule is gone (a session attached there uses the generic rule)."""
    rule = find_rule(module)
    if rule is not None:
        unregister_capture(rule.module_type)
    try:
        yield
    finally:
        if rule is not None:
            register_capture(rule.module_type, params=rule.params, covers_children=rule.covers_children)(rule.forward)


def step_of(model: nn.Module, batch: Any, loss: Loss, session: CaptureSession | None) -> Callable[[], Any]:
    """One forward + backward (and the records read and dropped, as a training step does)."""

    def step() -> Any:
        model.zero_grad(set_to_none=True)
        loss(model, batch).backward()
        if session is not None:
            records = session.factors()
            session.reset()
            return records
        return None

    return step


def measure(case: Case, repeats: int, warmup: int) -> dict[str, Any]:
    """Median seconds per step of each variant of ``case``, overheads, and the agreement check."""
    torch.manual_seed(0)
    template, batch = case.build().train(), case.batch()
    steps: dict[str, Callable[[], Any]] = {}
    sessions: dict[str, CaptureSession] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap over SDPA: "There is a performance drop"
        try:
            for variant, options in case.variants.items():
                model = copy.deepcopy(template)
                if options is not None:
                    session = CaptureSession(model, **options)
                    if variant in case.generic_for:
                        with specific_rule_removed(model):
                            session.attach()
                    else:
                        session.attach()
                    sessions[variant] = session
                steps[variant] = step_of(model, batch, case.loss, sessions.get(variant))
            times = round_robin(steps, repeats, warmup)
            check = agreement(case, steps)
        finally:
            for session in sessions.values():
                session.close()
    base = median(times[next(iter(times))])
    return {
        "shape": case.shape,
        "variants": {v: {"median_s": median(t), "times_s": t, "overhead": median(t) / base} for v, t in times.items()},
        "generic_parameters": {v: s.generic_parameters() for v, s in sessions.items()},
        "max_relative_difference": check,
    }


def agreement(case: Case, steps: dict[str, Callable[[], Any]]) -> float | None:
    """Largest relative difference between the per-sample gradients of the two compared variants
    (same weights, same batch: each variant's model is a copy of the same one, and no step updates it)."""
    if case.compare is None:
        return None
    first, second = (restore_all(steps[variant]()) for variant in case.compare)
    return max_relative_error(second, first)


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    layers = results["layers"]
    slowdowns = [e["variants"]["generic rule"]["median_s"] / e["variants"]["specific rule"]["median_s"]
                 for e in layers.values()]  # fmt: skip
    lines = [
        f"### {meta['machine']}, {meta['threads']} thread(s); torch {meta['versions'].get('torch')}",
        "",
        f"`python -m metastore_bench.capture_families` ({meta['measured']}, size `{meta['size']}`): median of "
        f"{meta['repeats']} round-robin rounds of forward + backward of one batch, each variant on its own copy of "
        "the module; records read and reset every step. Overheads are against no capture. The generic rule is "
        "forced on each layer by unregistering its specific rule while the session attaches; the last column "
        "compares the two rules' per-sample gradients.",
        "",
        "| layer | batch | no capture | specific rule | generic rule | generic / specific | max. relative difference |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, entry in layers.items():
        v = entry["variants"]
        plain, specific, generic = v["no capture"], v["specific rule"], v["generic rule"]
        diff = entry["max_relative_difference"]
        lines.append(
            f"| `{name}` | {entry['shape']} | {_ms(plain)} | {_ms(specific)} ({specific['overhead']:.2f}x) | "
            f"{_ms(generic)} ({generic['overhead']:.2f}x) | {generic['median_s'] / specific['median_s']:.2f}x | "
            f"{'-' if diff is None else format(diff, '.1e')} |"
        )
    if slowdowns:
        lines += ["", f"On these layers a step with the generic rule takes {min(slowdowns):.2f}x to "
                  f"{max(slowdowns):.2f}x the time of one with the specific rule."]  # fmt: skip
    lines += [
        "",
        "Whole models: the parameters only the generic rule covers captured (the default) or left out "
        "(`generic=False`, `unsupported='skip'`); the last column counts the parameters it took.",
        "",
        "| model | batch | variant | forward + backward | overhead | generic-rule parameters |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in results["models"].items():
        for variant, row in entry["variants"].items():
            generic = entry["generic_parameters"].get(variant)
            listed = "-" if generic is None else str(len(generic))
            lines.append(f"| {name} | {entry['shape']} | {variant} | {_ms(row)} | {row['overhead']:.2f}x | {listed} |")
    return "\n".join(lines) + "\n"


def _ms(row: dict[str, Any]) -> str:
    return f"{1000 * row['median_s']:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    args = round_robin_parser("capture_families", __doc__, "capture_families.json").parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"layers": {}, "models": {}}
    for part, cases in (("layers", layer_cases(args.size)), ("models", model_cases(args.size))):
        for case in cases:
            print(f"[capture-families] {case.name}", file=sys.stderr, flush=True)
            results[part][case.name] = measure(case, args.repeats, args.warmup)
    meta = round_robin_meta(args, torch.get_num_threads(), "transformers")
    return publish(args.out, {"meta": meta, "results": results}, markdown(results, meta), args.doc, (START, END))


if __name__ == "__main__":
    raise SystemExit(main())
