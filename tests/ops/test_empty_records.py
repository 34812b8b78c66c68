"""A batch kept as metadata only has no records: the ops say so with a MetastoreError, never a raw ValueError
about batch sizes (issue 43, item 1: "the records must describe one batch (one batch size), got sizes []")."""

from __future__ import annotations

import pytest

from metastore_plugins.core import ops
from metastore_plugins.core.errors import MetastoreError


@pytest.mark.parametrize("query", ["total_sq_norms", "total_dots"])
def test_an_empty_record_list_is_a_metastore_error(query: str) -> None:
    with pytest.raises(MetastoreError, match="metadata only"):
        ops.total_sq_norms([]) if query == "total_sq_norms" else ops.total_dots([], [])
