"""Prompt data: JSONL loaders, chat templates and a resumable sampler."""

from megatron_cegrpo.data.datasets import (
    DATA_ROOT_ENV,
    DATASETS,
    DatasetError,
    DatasetFormat,
    PromptRecord,
    available_datasets,
    available_formats,
    dataset_path,
    default_data_root,
    detect_format,
    get_format,
    load_dataset,
    load_prompts,
    register_format,
    split_holdout,
)
from megatron_cegrpo.data.sampler import PromptSampler
from megatron_cegrpo.data.templates import (
    DEFAULT_TEMPLATE,
    available_templates,
    build_prompt,
    get_template,
    register_template,
)

__all__ = [
    "DATA_ROOT_ENV",
    "DATASETS",
    "DEFAULT_TEMPLATE",
    "DatasetError",
    "DatasetFormat",
    "PromptRecord",
    "PromptSampler",
    "available_datasets",
    "available_formats",
    "available_templates",
    "build_prompt",
    "dataset_path",
    "default_data_root",
    "detect_format",
    "get_format",
    "get_template",
    "load_dataset",
    "load_prompts",
    "register_format",
    "register_template",
    "split_holdout",
]
