"""Dense-view evaluation: greedy accuracy and avg@k at a temperature (DESIGN.md section 5).

:func:`evaluate` takes an *already built* rollout engine (anything with the
:class:`~megatron_cegrpo.rollout.base.RolloutEngine` ``generate`` signature)
and its tokenizer, so the trainer can call it on its dense sampler between
iterations, and ``tools/evaluate.py`` can call it on a freshly loaded model.

Modes, per data set:

* ``"greedy"``: one greedy response per problem; ``acc`` = fraction correct.
* ``("avg@k", T)`` (or ``"avg@k"``, T = :data:`DEFAULT_AVG_TEMPERATURE`): k
  samples per problem at temperature T; ``acc`` = mean over problems of the
  mean verifier score of its k samples (``pass@k`` = fraction of problems with
  at least one correct sample is reported beside it).

Every data set is scored with its own verifier (``PromptRecord.verifier``).
The suite used by the seeds' harness is :data:`DEFAULT_SUITE`.
"""

from __future__ import annotations

import math
import re
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from megatron_cegrpo.data import DEFAULT_TEMPLATE, DatasetError, PromptRecord, encode_prompt, load_dataset
from megatron_cegrpo.rewards import get_verifier

__all__ = [
    "DEFAULT_AVG_TEMPERATURE",
    "DEFAULT_SUITE",
    "EvalMode",
    "DatasetResult",
    "EvalReport",
    "parse_dataset_specs",
    "parse_mode",
    "resolve_modes",
    "load_eval_datasets",
    "validate_records",
    "evaluate",
    "evaluate_detailed",
]

#: Temperature of an ``"avg@k"`` mode given without one (the seeds' harness: 0.7).
DEFAULT_AVG_TEMPERATURE = 0.7


@dataclass(frozen=True)
class EvalMode:
    """How one data set is decoded: ``k`` samples per problem, greedy or at ``temperature``."""

    greedy: bool = True
    k: int = 1
    temperature: Optional[float] = None

    def __post_init__(self):
        if self.greedy:
            if self.k != 1:
                raise ValueError(f"greedy evaluation draws one response per problem, got k={self.k}")
        else:
            if not isinstance(self.k, int) or self.k < 1:
                raise ValueError(f"avg@k needs an integer k >= 1, got {self.k!r}")
            if self.temperature is None or not (float(self.temperature) > 0 and math.isfinite(self.temperature)):
                raise ValueError(f"avg@k needs a finite temperature > 0, got {self.temperature!r}")

    @property
    def name(self) -> str:
        return "greedy" if self.greedy else f"avg@{self.k}"

    def describe(self) -> str:
        return "greedy" if self.greedy else f"avg@{self.k} T={self.temperature:g}"

    def to_dict(self) -> Dict[str, Any]:
        return {"mode": self.name, "k": self.k, "temperature": None if self.greedy else float(self.temperature)}


GREEDY = EvalMode()

#: The seeds' harness: greedy for the large sets, avg@8 at T=0.7 for the small competition sets.
DEFAULT_SUITE: Dict[str, EvalMode] = {
    "gsm8k/test": GREEDY,
    "mawps": GREEDY,
    "minerva_math": GREEDY,
    "amc23": EvalMode(greedy=False, k=8, temperature=DEFAULT_AVG_TEMPERATURE),
    "aime24": EvalMode(greedy=False, k=8, temperature=DEFAULT_AVG_TEMPERATURE),
    "olympiadbench": GREEDY,
}

_AVG_RE = re.compile(r"^avg@(\d+)(?:[:@,/ ]\s*(?:t=|T=)?([0-9.eE+-]+))?$")

ModeLike = Union[EvalMode, str, Tuple[str, float], Tuple[str], None]


def parse_mode(mode: ModeLike) -> EvalMode:
    """An :class:`EvalMode` from ``"greedy"``, ``"avg@8"``, ``"avg@8:0.7"``, ``("avg@8", 0.7)``
    or an :class:`EvalMode` (returned as is). ``None`` means greedy. ValueError otherwise."""
    if isinstance(mode, EvalMode):
        return mode
    if mode is None:
        return GREEDY
    temperature = None
    if isinstance(mode, (tuple, list)):
        if len(mode) == 1:
            text = mode[0]
        elif len(mode) == 2:
            text, temperature = mode
        else:
            raise ValueError(f"eval mode {mode!r}: expected 'greedy' or ('avg@k', temperature)")
    else:
        text = mode
    if not isinstance(text, str):
        raise ValueError(f"eval mode {mode!r}: expected 'greedy' or ('avg@k', temperature)")
    text = text.strip()
    if text.lower() == "greedy":
        if temperature is not None:
            raise ValueError(f"eval mode {mode!r}: greedy decoding takes no temperature")
        return GREEDY
    m = _AVG_RE.match(text)
    if not m:
        raise ValueError(f"eval mode {mode!r}: expected 'greedy', 'avg@K', 'avg@K:T' or ('avg@K', T)")
    k = int(m.group(1))
    if m.group(2) is not None:
        if temperature is not None:
            raise ValueError(f"eval mode {mode!r}: temperature given twice")
        temperature = float(m.group(2))
    if temperature is None:
        temperature = DEFAULT_AVG_TEMPERATURE
    return EvalMode(greedy=False, k=k, temperature=float(temperature))


def resolve_modes(names: Sequence[str], modes: Union[ModeLike, Mapping[str, ModeLike]] = None) -> Dict[str, EvalMode]:
    """The mode of each data set: ``modes[name]`` if given (a mapping), the one ``modes``
    for all (a single mode), else the :data:`DEFAULT_SUITE` mode, else greedy."""
    out = {}
    for n in names:
        if isinstance(modes, Mapping):
            m = modes.get(n, DEFAULT_SUITE.get(n, GREEDY))
        elif modes is not None:
            m = modes
        else:
            m = DEFAULT_SUITE.get(n, GREEDY)
        out[n] = parse_mode(m)
    return out


def parse_dataset_specs(text: str, default_mode: ModeLike = None) -> Dict[str, EvalMode]:
    """Parse a ``--datasets``-style list into ``{name: EvalMode}`` (in the given order).

    ``text`` is comma-separated ``NAME[:MODE]`` items (``mawps``, ``amc23:avg@8``,
    ``aime24:avg@8:0.7``, ``gsm8k/test:greedy``); ``default`` expands to
    :data:`DEFAULT_SUITE`.  An item without a mode takes ``default_mode`` if given, else
    its suite mode, else greedy.  ValueError names an unknown data set or a bad mode.
    """
    from megatron_cegrpo.data import available_datasets

    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise ValueError("no data sets named")
    out: Dict[str, EvalMode] = {}
    for item in items:
        if item == "default":
            for n, m in DEFAULT_SUITE.items():
                out[n] = parse_mode(default_mode) if default_mode else m
            continue
        name, _, mode = item.partition(":")
        name = name.strip()
        if name not in available_datasets():
            raise ValueError(f"unknown data set {name!r}; valid: {', '.join(available_datasets())}")
        if mode:
            out[name] = parse_mode(mode)
        elif default_mode:
            out[name] = parse_mode(default_mode)
        else:
            out[name] = DEFAULT_SUITE.get(name, GREEDY)
    return out


def load_eval_datasets(names: Sequence[str], limit: Optional[int] = None,
                       root: Optional[str] = None) -> Dict[str, List[PromptRecord]]:
    """``{name: load_dataset(name, limit, root)}`` in the given order (the first ``limit`` rows of
    each; ``root``: ``--data-root``, default ``$CEGRPO_DATA_ROOT`` or ``../shared/data``).

    Raises DatasetError naming the file and line of a malformed row, ValueError for an
    unknown name, FileNotFoundError for a missing file.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    return {n: load_dataset(n, limit=limit, root=root) for n in names}


# ----------------------------------------------------------------------------- validation

# (verifier, ground truth) pairs already checked, so the trainer's periodic
# evaluation does not re-parse every ground truth with math-verify each time.
_VALIDATED: set = set()


def _row_error(name: str, rec: Any, index: int, problem: str, fix: str) -> DatasetError:
    row = getattr(rec, "row", None)
    where = f"row {row}" if row is not None else f"record #{index}"
    return DatasetError(f"eval data set {name!r}, {where}: {problem}; fix: {fix}")


def validate_records(name: str, records: Sequence[PromptRecord]) -> None:
    """Check every record before any generation: a question, a known verifier and a
    ground truth that verifier can read. Raises DatasetError naming the data set and row."""
    if not isinstance(records, (list, tuple)):
        raise DatasetError(f"eval data set {name!r}: expected a list of PromptRecord, got {type(records).__name__}")
    if not records:
        raise DatasetError(f"eval data set {name!r} has no rows; fix: pass at least one PromptRecord")
    for i, r in enumerate(records):
        for attr in ("question", "ground_truth", "verifier"):
            if not hasattr(r, attr):
                raise _row_error(name, r, i, f"has no {attr!r} (a {type(r).__name__}, not a PromptRecord)",
                                 "build the rows with megatron_cegrpo.data.load_dataset")
        if not isinstance(r.question, str) or not r.question.strip():
            raise _row_error(name, r, i, f"question is {r.question!r}", "put the problem text in the row")
        if not isinstance(r.ground_truth, str) or not r.ground_truth.strip():
            raise _row_error(name, r, i, f"ground truth is {r.ground_truth!r}", "put the answer in the row")
        try:
            verifier = get_verifier(r.verifier)
        except ValueError as e:
            raise _row_error(name, r, i, str(e), "set PromptRecord.verifier to a registered verifier") from None
        key = (r.verifier, r.ground_truth)
        if key in _VALIDATED:
            continue
        try:
            verifier("", r.ground_truth)
        except ValueError as e:
            raise _row_error(name, r, i, f"ground truth {r.ground_truth!r} is unusable: {e}",
                             f"write an answer the {r.verifier!r} verifier can read") from None
        _VALIDATED.add(key)


# ----------------------------------------------------------------------------- results


@dataclass
class DatasetResult:
    """Everything measured on one data set."""

    name: str
    mode: EvalMode
    records: List[PromptRecord]
    scores: List[List[float]]        # [num_rows][k] verifier scores
    texts: List[List[str]]           # [num_rows][k] responses
    response_lengths: List[List[int]]
    truncated: List[List[bool]]      # no EOS within max_new_tokens
    seconds: float

    @property
    def num_rows(self) -> int:
        return len(self.records)

    @property
    def per_problem(self) -> List[float]:
        return [sum(s) / len(s) for s in self.scores]

    @property
    def acc(self) -> float:
        pp = self.per_problem
        return sum(pp) / len(pp)

    @property
    def acc_stderr(self) -> float:
        """Standard error of ``acc`` over problems (sample std / sqrt(n); 0 for one row)."""
        pp, n = self.per_problem, len(self.scores)
        if n < 2:
            return 0.0
        mean = sum(pp) / n
        return math.sqrt(sum((x - mean) ** 2 for x in pp) / (n - 1) / n)

    @property
    def pass_at_k(self) -> float:
        return sum(1.0 for s in self.scores if max(s) > 0) / len(self.scores)

    def metrics(self, prefix: str = "val") -> Dict[str, float]:
        p = f"{prefix}/{self.name}"
        lens = [x for row in self.response_lengths for x in row]
        trunc = [x for row in self.truncated for x in row]
        out = {f"{p}/acc": self.acc, f"{p}/acc_stderr": self.acc_stderr, f"{p}/num_rows": self.num_rows}
        if not self.mode.greedy:
            out[f"{p}/pass@{self.mode.k}"] = self.pass_at_k
        out[f"{p}/response_length/mean"] = sum(lens) / len(lens) if lens else 0.0
        out[f"{p}/response_length/clip_ratio"] = sum(trunc) / len(trunc) if trunc else 0.0
        out[f"timing_s/eval/{self.name}"] = self.seconds
        return out


@dataclass
class EvalReport:
    """The result of :func:`evaluate_detailed`: flat ``metrics`` and per-data-set details."""

    metrics: Dict[str, float]
    datasets: Dict[str, DatasetResult] = field(default_factory=dict)
    settings: Dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- evaluation


def _seed_for(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 31)


def evaluate_detailed(
    engine,
    tokenizer,
    datasets: Mapping[str, Sequence[PromptRecord]],
    *,
    modes: Union[ModeLike, Mapping[str, ModeLike]] = None,
    max_new_tokens: int = 512,
    batch_size: Optional[int] = 16,
    template: str = DEFAULT_TEMPLATE,
    progress: bool = True,
    seed: int = 0,
    top_p: float = 1.0,
    prefix: str = "val",
) -> EvalReport:
    """Evaluate ``engine`` on every data set; see :func:`evaluate` for the arguments.

    Returns an :class:`EvalReport` whose ``metrics`` is what :func:`evaluate` returns and
    whose ``datasets`` hold per-problem scores and responses (for the JSON summary).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    if not datasets:
        raise ValueError("evaluate: no data sets given")
    mode_of = resolve_modes(list(datasets), modes)
    # fail before any generation: every row of every data set
    for name, recs in datasets.items():
        validate_records(name, recs)

    t_all = time.perf_counter()
    # Scoring needs only the text: the engine skips its per-token log-probs (whose
    # [batch, new tokens, vocab] logits dominate its memory; RolloutEngine.generate)
    # prompts, longest first (padding waste is lowest when lengths are grouped)
    plans = []
    for name, recs in datasets.items():
        ids = [encode_prompt(tokenizer, r.question, template) for r in recs]
        order = sorted(range(len(recs)), key=lambda i: -int(ids[i].numel()))
        plans.append((name, list(recs), ids, order, mode_of[name]))
    total = sum(len(recs) * m.k for _, recs, _, _, m in plans)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="eval", unit="seq", file=sys.stderr, dynamic_ncols=True, leave=False)
    report = EvalReport(metrics={}, settings={
        "max_new_tokens": int(max_new_tokens), "batch_size": batch_size, "template": template,
        "seed": int(seed), "top_p": float(top_p)})
    try:
        for name, recs, ids, order, mode in plans:
            if bar is not None:
                bar.set_description(f"eval {name} ({mode.describe()})")
            t0 = time.perf_counter()
            texts, lens, trunc = _generate_k(engine, name, recs, ids, order, mode, bar, max_new_tokens=max_new_tokens,
                                             batch_size=batch_size, base_seed=_seed_for(seed, name), top_p=top_p)
            scores = _score_k(name, recs, texts, mode.k)
            res = DatasetResult(name, mode, recs, scores, texts, lens, trunc, time.perf_counter() - t0)
            report.datasets[name] = res
            report.metrics.update(res.metrics(prefix))
    finally:
        if bar is not None:
            bar.close()
    report.metrics["timing_s/eval"] = time.perf_counter() - t_all
    return report


def _generate_k(engine, name, recs, ids, order, mode, bar, *, max_new_tokens, batch_size, base_seed, top_p):
    """Each problem ``mode.k`` times in a row, in length order, in batches of ``batch_size``:
    returns (texts, response lengths, truncated flags), each [problem][sample]."""
    flat = [(i, j) for i in order for j in range(mode.k)]
    n = len(flat)
    bs = batch_size or n
    texts: List[List[Optional[str]]] = [[None] * mode.k for _ in recs]
    lens = [[0] * mode.k for _ in recs]
    trunc = [[False] * mode.k for _ in recs]
    for c, start in enumerate(range(0, n, bs)):
        chunk = flat[start:start + bs]
        out = engine.generate(
            [ids[i] for i, _ in chunk], max_new_tokens=max_new_tokens,
            temperature=1.0 if mode.greedy else float(mode.temperature), top_p=top_p,
            greedy=mode.greedy, generator_seed=base_seed + c, return_logprobs=False)
        if len(out.texts) != len(chunk):
            raise RuntimeError(f"evaluate {name!r}: the engine returned {len(out.texts)} responses "
                               f"for {len(chunk)} prompts")
        for pos, (i, j) in enumerate(chunk):
            texts[i][j] = out.texts[pos]
            if len(out.response_ids) == len(chunk):
                lens[i][j] = int(len(out.response_ids[pos]))
            if len(out.finished) == len(chunk):
                trunc[i][j] = not bool(out.finished[pos])
        if bar is not None:
            bar.update(len(chunk))
    return texts, lens, trunc


def _score_k(name, recs, texts, k) -> List[List[float]]:
    """Each response scored by its row's verifier; an unusable ground truth names the row."""
    scores = []
    for i, r in enumerate(recs):
        verifier = get_verifier(r.verifier)
        row_scores = []
        for j in range(k):
            try:
                row_scores.append(float(verifier(texts[i][j] or "", r.ground_truth)))
            except ValueError as e:
                raise _row_error(name, r, i, f"ground truth {r.ground_truth!r} is unusable: {e}",
                                 f"write an answer the {r.verifier!r} verifier can read") from None
            except Exception as e:
                e.add_note(f"while scoring eval data set {name!r}, row {getattr(r, 'row', i)}")
                raise
        scores.append(row_scores)
    return scores


def evaluate(
    engine,
    tokenizer,
    datasets: Mapping[str, Sequence[PromptRecord]],
    *,
    modes: Union[ModeLike, Mapping[str, ModeLike]] = None,
    max_new_tokens: int = 512,
    batch_size: Optional[int] = 16,
    template: str = DEFAULT_TEMPLATE,
    progress: bool = True,
    seed: int = 0,
    top_p: float = 1.0,
    prefix: str = "val",
) -> Dict[str, float]:
    """Dense-view accuracy of ``engine`` on each data set.

    Args:
        engine: a built rollout engine: ``generate(prompt_ids, *, max_new_tokens, temperature,
            top_p, greedy, generator_seed)`` returning ``.texts`` (and ``.response_ids``,
            ``.finished`` when it has them), e.g. the trainer's ``HFRolloutEngine``.  If its
            ``generate`` has a ``return_logprobs`` parameter it is passed ``False``.
        tokenizer: the model's tokenizer (prompts go through its chat template).
        datasets: ``{name: [PromptRecord, ...]}`` (see :func:`load_eval_datasets`).
        modes: one mode for all data sets, or ``{name: mode}``; a mode is ``"greedy"``,
            ``"avg@k"``, ``("avg@k", temperature)`` or an :class:`EvalMode`. Data sets not
            named take their :data:`DEFAULT_SUITE` mode, else greedy.
        max_new_tokens: response length limit.
        batch_size: sequences per ``generate`` call (a problem's k samples count k);
            None = one call per data set.
        template: prompt template name (``megatron_cegrpo.data.templates``).
        progress: a tqdm bar (stderr) over all sequences.
        seed: sampling seed (each data set and chunk derives its own); same seed, same draws.
        prefix: metric name prefix.

    Returns:
        ``{"<prefix>/<name>/acc", ".../acc_stderr", ".../num_rows", ".../pass@k" (avg@k only),
        ".../response_length/mean", ".../response_length/clip_ratio", "timing_s/eval/<name>",
        "timing_s/eval"}``.

    Raises:
        DatasetError naming the data set and row when a record is malformed (before any
        generation).
    """
    return evaluate_detailed(engine, tokenizer, datasets, modes=modes, max_new_tokens=max_new_tokens,
                             batch_size=batch_size, template=template, progress=progress, seed=seed,
                             top_p=top_p, prefix=prefix).metrics
