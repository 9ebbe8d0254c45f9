"""Dense-view evaluation (greedy accuracy, avg@k at a temperature), its JSON summary and its
per-row files (``rows.py``)."""

from megatron_cegrpo.evaluation.core import (
    DEFAULT_AVG_TEMPERATURE,
    DEFAULT_SUITE,
    DatasetResult,
    EvalMode,
    EvalReport,
    evaluate,
    evaluate_detailed,
    load_eval_datasets,
    parse_dataset_specs,
    parse_mode,
    resolve_modes,
    validate_records,
)
from megatron_cegrpo.evaluation.rows import (
    ROWS_DIR,
    EvalRows,
    EvalRowsError,
    find_eval_rows,
    read_eval_rows,
    rows_digest,
    rows_file_name,
    write_eval_rows,
)
from megatron_cegrpo.evaluation.summary import SCHEMA, format_table, load_summary, summary_dict, write_summary

__all__ = [
    "DEFAULT_AVG_TEMPERATURE",
    "DEFAULT_SUITE",
    "DatasetResult",
    "EvalMode",
    "EvalReport",
    "EvalRows",
    "EvalRowsError",
    "ROWS_DIR",
    "SCHEMA",
    "evaluate",
    "evaluate_detailed",
    "find_eval_rows",
    "format_table",
    "load_eval_datasets",
    "load_summary",
    "parse_dataset_specs",
    "parse_mode",
    "read_eval_rows",
    "resolve_modes",
    "rows_digest",
    "rows_file_name",
    "summary_dict",
    "validate_records",
    "write_eval_rows",
    "write_summary",
]
