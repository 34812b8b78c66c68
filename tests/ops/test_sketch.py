"""Kronecker sketches: equal to P_out G P_in^T of the torch.func gradients, reproducible, unbiased.

Stated error (checked below with fixed seeds, Gaussian factors, d = 48): the error of a
sketched inner product relative to ``||g|| ||h||`` has RMS at most ``2 / sqrt(k)`` for
unrelated gradients, and the relative error of a sketched squared norm at most
``1.5 sqrt(2 / k_out + 2 / k_in)`` (the rank-one worst case); the mean error is within four
standard errors of zero (unbiased).
"""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys

import pytest
import torch
from opscases import Case, reference_sketch, rel_err

from metastore_plugins.core.capture.build import outer_record
from metastore_plugins.core.ops import kmeans, projection, sketch
from metastore_plugins.core.records import LayerRecord, to_dense

K_OUT, K_IN = 4, 3


def test_sketch_is_the_projection_of_the_reference_gradients(case: Case) -> None:
    for record in case.train_records:
        expected = reference_sketch(record, case.train_ref, seed=7, k_in=K_IN, k_out=K_OUT)
        assert rel_err(sketch(record, K_IN, K_OUT, seed=7), expected) <= 1e-5, record.layer
        assert rel_err(sketch(to_dense(record), K_IN, K_OUT, seed=7), expected) <= 1e-5, record.layer


def test_sketch_small_budget(case: Case) -> None:
    for record in case.train_records:
        full = sketch(record, K_IN, K_OUT, seed=1)
        assert torch.allclose(sketch(record, K_IN, K_OUT, seed=1, max_bytes=1), full, atol=1e-6 * full.abs().max())


def test_projections_depend_on_layer_seed_and_shape_only() -> None:
    cpu = torch.device("cpu")
    a = projection("out", "encoder.0.fc", 3, (8, 20), 8, cpu)
    assert torch.equal(a, projection("out", "encoder.0.fc", 3, (8, 20), 8, cpu))
    assert not torch.equal(a, projection("out", "encoder.0.fc", 4, (8, 20), 8, cpu))
    assert not torch.equal(a, projection("out", "encoder.1.fc", 3, (8, 20), 8, cpu))
    code = (
        "import torch; from metastore_plugins.core.ops import projection; "
        "print(repr(projection('out', 'encoder.0.fc', 3, (8, 20), 8, torch.device('cpu')).tolist()))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    # another process, another hash seed: the same matrix, every entry bit for bit (repr round-trips a float,
    # and drawing from a seeded generator involves no reduction whose order could vary)
    assert torch.equal(torch.tensor(ast.literal_eval(other.stdout.strip()), dtype=a.dtype), a)


def _random_record(batch: int, tokens: int, dim: int, seed: int) -> LayerRecord:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randn(batch, tokens, 1, dim, generator=g)
    suffix = torch.randn(batch, tokens, 1, dim, generator=g)
    params, shapes = {"weight": "w", "bias": "b"}, {"weight": (dim, dim), "bias": (dim,)}
    return outer_record("layer", prefix, suffix, params, shapes, choose_smaller=False)


@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("k", [8, 16])
def test_sketch_error_statistics(tokens: int, k: int) -> None:
    record = _random_record(8, tokens, 48, seed=tokens)
    grads = record.restore()  # exact dense gradients (capture's restore, independent of ops)
    flat = torch.cat([grads["w"].flatten(1), grads["b"]], 1).double()  # (B, P)
    exact = flat @ flat.T
    norms = exact.diagonal().sqrt()
    off = ~torch.eye(8, dtype=torch.bool)
    dot_errors, norm_errors = [], []
    for seed in range(12):
        s = sketch(record, k, k, seed=seed).double()  # (B, k*k)
        error = (s @ s.T - exact) / torch.outer(norms, norms)
        dot_errors.append(error[off])
        norm_errors.append(error.diagonal())
    dot_err, norm_err = torch.cat(dot_errors), torch.cat(norm_errors)
    assert float(dot_err.pow(2).mean().sqrt()) <= 2.0 / k  # 2 / sqrt(k_out k_in)
    assert float(norm_err.pow(2).mean().sqrt()) <= 1.5 * math.sqrt(4.0 / k)
    for err in (dot_err, norm_err):  # unbiased: the mean is within 4 standard errors (12 seeds x 8 samples)
        assert abs(float(err.mean())) <= 4.0 * float(err.pow(2).mean().sqrt()) / math.sqrt(12 * 8)


def test_kmeans_on_sketches_separates_two_kinds_of_samples() -> None:
    """Samples whose factors come from two distinct directions fall in two clusters."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(2, 1, 1, 24, generator=g) * 3
    prefix = centres[torch.arange(10) % 2] + 0.1 * torch.randn(10, 1, 1, 24, generator=g)  # (10, 1, 1, 24)
    suffix = torch.ones(10, 1, 1, 24)
    record = outer_record("l", prefix, suffix, {"weight": "w"}, {"weight": (24, 24)}, choose_smaller=False)
    result = kmeans(sketch(record, 8, 8, seed=0), 2, seed=0)
    labels = result.labels.tolist()
    assert labels[0::2] == [labels[0]] * 5 and labels[1::2] == [labels[1]] * 5 and labels[0] != labels[1]
