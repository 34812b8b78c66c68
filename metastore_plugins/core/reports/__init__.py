"""Reports built from store queries, written as plain files (JSON, CSV, markdown) and TensorBoard events.

The package re-exports what its modules build (:mod:`.build`: the outlier and influence tables and
their files; :mod:`.tables` and :mod:`.influence_table`: the rows; :mod:`.files`: markdown).
"""

from metastore_plugins.core.reports.build import (
    INFLUENCE_SAMPLES,
    RenderFn,
    ReportOptions,
    report_tables,
    write_reports,
    write_tables,
)
from metastore_plugins.core.reports.files import markdown_table
from metastore_plugins.core.reports.influence_table import influence_rows
from metastore_plugins.core.reports.tables import OUTLIER_COLUMNS, checkpoint_points, outlier_rows

__all__ = [
    "INFLUENCE_SAMPLES",
    "OUTLIER_COLUMNS",
    "RenderFn",
    "ReportOptions",
    "checkpoint_points",
    "influence_rows",
    "markdown_table",
    "outlier_rows",
    "report_tables",
    "write_reports",
    "write_tables",
]
