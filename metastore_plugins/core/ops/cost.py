"""The cost model: per record (pair), compute on the factors or rebuild dense gradients?

Both ways are exact; they differ in arithmetic. Counting multiply-adds as 2 flops,
with ``P = G d_out d_in`` weight entries, ``R`` kept rows and ``T`` the largest rows
per sample (``P_e = V d`` for an embedding, ``d`` its row width):

- outer x outer: factored ``2 G R_a R_b (d_in + d_out) + c R_a R_b``;
  dense ``(2 T_a + w) P B_a + (2 T_b + w) P B_b + 2 B_a B_b P``;
- outer x dense: factored ``2 R_a B_b P + c R_a B_b``; dense ``(2 T_a + w) P B_a + 2 B_a B_b P``;
- embedding x embedding: factored ``2 R_a R_b d + c R_a R_b``; dense ``w (B_a + B_b) P_e + 2 B_a B_b P_e``;
- embedding x dense: factored ``2 R_a B_b d + c R_a B_b``; dense ``w B_a P_e + 2 B_a B_b P_e``;
- dense x dense: dense ``2 B_a B_b P`` only;
- norms of an outer record: factored ``2 B G T^2 (d_in + d_out) + c B G T^2``;
  dense ``(2 T + w) P B + 2 B P``;
- norms of an embedding record: factored ``c R d`` (rows grouped by (sample, id));
  dense ``w B P_e + 2 B P_e``.

``c`` (:data:`ELEMENTWISE_COST`) weighs an element touched by a memory-bound step
(a Hadamard product, a scatter) against one flop of a matrix multiply; ``w``
(:data:`REBUILD_ELEMENT_COST`) is the cost of one rebuilt gradient entry (allocating,
writing and reading back memory dominate rebuilding on CPUs). Rebuilding
uses padded blocks of ``T`` rows per sample, hence ``B T`` rather than ``R``. The
cheaper plan wins; ties go to the factored form. A pair of kinds the factored
form does not cover (an embedding sharing its weight with a Linear head) is always
rebuilt. :attr:`Plan.flops` is the chosen method's plain arithmetic (no ``c``, ``w``):
the figure an arithmetic rate (flops per second) divides.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.ops._common import (
    common_params,
    max_rows_per_sample,
    num_rows,
    outer_dims,
    param_numel,
    record_pairs,
    roles_of,
    selected_roles,
)
from metastore_plugins.core.records import LayerRecord

Method = Literal["auto", "factored", "dense"]

#: Flop-equivalents of one element touched by an elementwise or scatter step.
ELEMENTWISE_COST = 8.0

#: Flop-equivalents of one rebuilt gradient entry: allocating, writing and re-reading it.
#: Calibrated on 2 CPU threads (d = 64..768, T = 1..128): rebuilding is memory-bound.
REBUILD_ELEMENT_COST = 256.0


@dataclass(frozen=True)
class Plan:
    """What the cost model decided for one record or pair.

    Attributes:
        method: ``"factored"`` or ``"dense"``.
        factored_cost: estimated flops of the factored form (``inf`` if not available).
        dense_cost: estimated flops of rebuilding the gradients.
        flops: arithmetic of the chosen method: matrix-multiply flops plus one per element
            of an elementwise or scatter step (no weights ``c``, ``w``; what a rate divides).
    """

    method: Literal["factored", "dense"]
    factored_cost: float
    dense_cost: float
    flops: float


@dataclass(frozen=True)
class Work:
    """The arithmetic of one way: matrix-multiply ``flops``, elements ``touched`` by
    memory-bound steps, gradient entries ``rebuilt``."""

    flops: float
    touched: float = 0.0
    rebuilt: float = 0.0

    @property
    def cost(self) -> float:
        """``flops + c touched + w rebuilt`` in flop-equivalents."""
        return self.flops + ELEMENTWISE_COST * self.touched + REBUILD_ELEMENT_COST * self.rebuilt

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.touched + other.touched, self.rebuilt + other.rebuilt)


UNAVAILABLE = Work(float("inf"))
#: Which record of a pair holds the factors the factored form runs on (the first in this order).
_ORDER = {"outer": 0, "embedding": 0, "dense": 1}


def _rebuild(record: LayerRecord, names: Collection[str], numel: int | None = None, exact: bool = True) -> Work:
    """Rebuilding a record's per-sample gradients of ``names`` (``numel`` entries; ``exact=False``: a lower
    bound, with the mean rows per sample for the largest count)."""
    numel = param_numel(record, names) if numel is None else numel
    if record.kind == "dense":
        return Work(0.0)
    written = record.batch_size * numel
    if record.kind == "embedding":
        return Work(0.0, rebuilt=written)
    rows = max_rows_per_sample(record) if exact else -(-num_rows(record) // max(1, record.batch_size))
    return Work(2.0 * numel * record.batch_size * rows, rebuilt=written)


def _factored(a: LayerRecord, b: LayerRecord, names: Collection[str]) -> Work:
    """The factored dot products of ``a`` (factored) with ``b``; :data:`UNAVAILABLE` if unsupported."""
    r_a, r_b = num_rows(a), num_rows(b)
    if a.kind == "outer" and b.kind == "outer":
        groups, d_in, d_out = outer_dims(a)
        width = (d_in if "weight" in roles_of(a, names) else 0) + d_out
        return Work(2.0 * groups * r_a * r_b * width, touched=groups * r_a * r_b)
    if a.kind == "outer" and b.kind == "dense":
        return Work(2.0 * r_a * b.batch_size * param_numel(a, names), touched=r_a * b.batch_size)
    if a.kind == "embedding" and b.kind == "embedding":
        return Work(2.0 * r_a * r_b * a.tensors["suffix"].shape[1], touched=r_a * r_b)
    if a.kind == "embedding" and b.kind == "dense":
        return Work(2.0 * r_a * b.batch_size * a.tensors["suffix"].shape[1], touched=r_a * b.batch_size)
    return UNAVAILABLE


def _factored_pair(a: LayerRecord, b: LayerRecord, names: Collection[str]) -> Work:
    """The factored form's work for a pair, its factors taken from the record :data:`_ORDER` puts first."""
    first, second = (a, b) if _ORDER[a.kind] <= _ORDER[b.kind] else (b, a)
    return UNAVAILABLE if first.kind == "dense" else _factored(first, second, names)


def _check_method(method: str) -> None:
    if method not in ("auto", "factored", "dense"):
        raise ConfigError(f"method must be 'auto', 'factored' or 'dense', got {method!r}")


def _decide(factored: Work, dense: Work, method: Method) -> Plan:
    _check_method(method)
    if factored.cost == float("inf"):  # dense records, or kinds without a factored form: only one way
        method = "dense"
    elif method == "auto":
        method = "factored" if factored.cost <= dense.cost else "dense"
    chosen = factored if method == "factored" else dense
    return Plan(method, factored.cost, dense.cost, chosen.flops + chosen.touched)


def plan_dots(a: LayerRecord, b: LayerRecord, params: Collection[str] | None = None, method: Method = "auto") -> Plan:
    """Choose how :func:`~metastore_plugins.core.ops.dots` computes ``<g_a_i, g_b_j>``.

    Args:
        a, b: records of the same layer (any kinds).
        params: parameter names to include (all shared ones when ``None``).
        method: ``"auto"`` asks the cost model; ``"factored"`` / ``"dense"`` force a form
            (``"factored"`` still rebuilds when no factored form exists, e.g. dense x dense).
    """
    names = common_params(a, b, params)
    factored = _factored_pair(a, b, names)
    dense = _rebuild(a, names) + _rebuild(b, names) + Work(2.0 * a.batch_size * b.batch_size * param_numel(a, names))
    return _decide(factored, dense, method)


def dots_method(
    a: LayerRecord, b: LayerRecord, names: list[str], method: Method = "auto"
) -> Literal["factored", "dense"]:
    """``plan_dots(a, b, names, method).method``, for ``names`` already checked by ``common_params``.

    The per-call form :func:`~metastore_plugins.core.ops.dots` uses: rebuilding costs at least what it costs
    with ``T = ceil(R / B)`` rows per sample (the largest count is at least the mean), so rows are counted
    per sample only when the factored cost exceeds that bound. Same decision as :func:`plan_dots`.
    """
    _check_method(method)
    factored = _factored_pair(a, b, names)
    if method == "dense" or factored.cost == float("inf"):
        return "dense"
    if method == "factored":
        return "factored"
    numel = param_numel(a, names)
    bound = _rebuild(a, names, numel, exact=False) + _rebuild(b, names, numel, exact=False)
    if factored.cost <= (bound + Work(2.0 * a.batch_size * b.batch_size * numel)).cost:
        return "factored"
    return plan_dots(a, b, names, method).method


def plan_total_dots(
    records_a: Sequence[LayerRecord],
    records_b: Sequence[LayerRecord],
    params: Collection[str] | None = None,
    method: Method = "auto",
) -> list[Plan]:
    """The plans :func:`~metastore_plugins.core.ops.total_dots` follows, one per record pair it multiplies."""
    return [plan_dots(a, b, params, method) for a, b in record_pairs(records_a, records_b, params)]


def plan_norms(record: LayerRecord, params: Collection[str] | None = None, method: Method = "auto") -> Plan:
    """Choose how :func:`~metastore_plugins.core.ops.sq_norms` computes ``||g_i||^2``."""
    names = list(selected_roles(record, params).values())
    batch, numel = record.batch_size, param_numel(record, names)
    dense = _rebuild(record, names) + Work(2.0 * batch * numel)
    if record.kind == "outer":
        groups, d_in, d_out = outer_dims(record)
        pairs = batch * groups * max_rows_per_sample(record) ** 2
        width = (d_in if "weight" in roles_of(record, names) else 0) + d_out
        factored = Work(2.0 * pairs * width, touched=pairs)
    elif record.kind == "embedding":
        factored = Work(0.0, touched=num_rows(record) * record.tensors["suffix"].shape[1])
    else:
        factored = UNAVAILABLE
    return _decide(factored, dense, method)


# -- bytes: what each representation of a layer costs in the store ------------------------------

#: The most bytes of exact factors (float32, as captured) one checkpoint-pass batch holds before the plan keeps them:
#: a pass batch is cut to ``PASS_BATCH_BYTES / (factor bytes per sample)`` samples (the MiniLM example's batches of
#: 32 training and 64 validation reviews, about 2.4 MB each, become batches of 27). Per-sample gradients do not
#: depend on the batch; a smaller one costs only more, smaller products.
PASS_BATCH_BYTES = 64 * 2**20


def pass_batch_size(batch_size: int, sample_bytes: float, max_bytes: float = PASS_BATCH_BYTES) -> int:
    """A checkpoint-pass batch of ``batch_size`` cut to what ``max_bytes`` of exact factors hold, at
    ``sample_bytes`` per sample (as given while that is not measured: 0)."""
    if sample_bytes <= 0:
        return batch_size
    return min(batch_size, max(1, int(max_bytes // sample_bytes)))


#: Bytes a shard spends per stored tensor besides its data (safetensors header entry, index columns).
TENSOR_OVERHEAD_BYTES = 160
#: Bytes per stored sample of the metadata every batch keeps, twice: in its shard (id, label and prediction
#: int64, loss and margin float32: 32 bytes) and in the index journal (the same columns in base64: 43 bytes).
SAMPLE_METADATA_BYTES = 76
#: Bytes per stored batch besides its samples and records: the header entries of its metadata tensors and its
#: columns in the index journal (measured: 503 bytes per batch, 75 per sample, for batches of 8 and 32 samples).
BATCH_METADATA_BYTES = 512


def encoded_value_bytes(encoding: str) -> float:
    """Bytes of one encoded floating value (``fp32`` 4, ``fp16``/``bf16`` 2, ``int8`` 1)."""
    return {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0}[encoding]


def projected_sample_bytes(k_in: int, k_out: int, encoding: str) -> float:
    """Bytes per sample of a ``"projected"`` record: ``k_out k_in`` encoded values, a row scale, a float32 norm."""
    scale = 4.0 if encoding in ("fp16", "int8") else 0.0
    return k_in * k_out * encoded_value_bytes(encoding) + scale + 4.0


def exact_sample_bytes(records: Sequence[LayerRecord], encoding: str) -> float:
    """Bytes per sample the exact records of one layer and batch take, encoded (row scales and overheads included)."""
    batch = max(1, records[0].batch_size)
    total = 0.0
    for record in records:
        for tensor in record.tensors.values():
            rows = tensor.shape[0] if tensor.dim() else 1
            if tensor.is_floating_point():
                per_row = tensor[0].numel() if rows else 0
                scale = 4.0 if encoding in ("fp16", "int8") else 0.0
                total += rows * (per_row * encoded_value_bytes(encoding) + scale)
            else:
                total += 4.0 * tensor.numel()  # int32
            total += TENSOR_OVERHEAD_BYTES
    return total / batch
