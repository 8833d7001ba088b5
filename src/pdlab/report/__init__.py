"""What a run looked like (pdlab.report): plotly figures callable from notebooks, and one self-contained
HTML report per run directory."""

from pdlab.report.figures import (
    CLASS_COLOURS,
    counts_table,
    itl_cdf_figure,
    sweep_figure,
    timeline_figure,
    ttft_by_class_figure,
    validation_figure,
    validation_summary,
)
from pdlab.report.html import headline_table, write_report
from pdlab.report.verdict import verdict

__all__ = [
    "CLASS_COLOURS",
    "counts_table",
    "headline_table",
    "itl_cdf_figure",
    "sweep_figure",
    "timeline_figure",
    "ttft_by_class_figure",
    "validation_figure",
    "validation_summary",
    "verdict",
    "write_report",
]
