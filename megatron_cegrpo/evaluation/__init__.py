"""Dense-view evaluation (greedy accuracy, avg@k at a temperature) and its JSON summary."""

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
from megatron_cegrpo.evaluation.summary import SCHEMA, format_table, load_summary, summary_dict, write_summary

__all__ = [
    "DEFAULT_AVG_TEMPERATURE",
    "DEFAULT_SUITE",
    "DatasetResult",
    "EvalMode",
    "EvalReport",
    "SCHEMA",
    "evaluate",
    "evaluate_detailed",
    "format_table",
    "load_eval_datasets",
    "load_summary",
    "parse_dataset_specs",
    "parse_mode",
    "resolve_modes",
    "summary_dict",
    "validate_records",
    "write_summary",
]
