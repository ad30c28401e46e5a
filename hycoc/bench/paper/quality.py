"""Text quality metrics of one answer: repetition, and agreement with a reference where the dataset has one
(docs/benchmarks.md: the quality proxy beside every Δg, and the guard of `hycoc tune-epsilon`).

The paper scores answers with an LLM judge and supplements it with reference metrics (§4.1, App. E: WMT14 BLEU,
CNN/DailyMail ROUGE-L, GSM8K exact match, reference containment for QA and RAG). No judge runs here; what this
module measures instead is what ε-threshold acceptance breaks first on a small verifier: it commits tokens the
verifier would not have sampled, and on flat distributions those walk into loops ("Suuuuuuuuuuggment ...").

Repetition (no reference needed; `answer_metrics`). Words are ``\\w+`` runs and single punctuation marks of the
lower-cased text (`words`), so the figures do not depend on a tokenizer:

* ``compression_ratio``: zlib (level 9) compressed bytes / raw UTF-8 bytes of the text. Lower = more repetitive.
  Short texts pay zlib's fixed overhead (a 1-byte text compresses to 9 bytes), so compare answers of similar
  length, as a bench's paired configurations are.
* ``repeated_4gram_share``: share of the words that lie inside a word 4-gram occurring at least twice in the
  answer. 0 = no 4-gram repeats; 1 = every word is part of a repeat. Higher = more repetitive.
* ``distinct_1`` / ``distinct_2``: distinct word unigrams (bigrams) / all unigrams (bigrams) of the answer
  (Li et al., 2016, "distinct-n", per answer). Lower = more repetitive.
* ``longest_run``: the longest run of one identical item in a row: model token ids when given (the loop
  "uuuuuuuu" is one token id repeated), else words. Higher = more repetitive.

Reference metrics (`reference_metrics`; None where the category has no usable reference). Spec-Bench rows carry
their own formats (`hycoc.bench.datasets.Question.reference`):

* summarization: ``rouge_l``, ROUGE-L F1 x 100 against reference[0] (``rouge-score``, Porter stemming; Lin, 2004);
* translation: ``chrf`` (chrF, β = 2) and ``bleu`` (sentence BLEU, exponential smoothing) x 100 against
  reference[0] (``sacrebleu``; Popović, 2015; Papineni et al., 2002). A corpus BLEU over a configuration's
  answers is `corpus_bleu`;
* math_reasoning (GSM8K "#### 1000") and math (MT-bench "Area is 3"): ``final_number_match``, the answer's last
  number (or fraction) equals the reference's final one;
* math, math_reasoning, qa, rag: ``reference_match``, the containment proxy (`reference_match`).

Pure functions, no torch; ``rouge-score`` and ``sacrebleu`` (the ``full`` extra) are imported when first used.
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

# ---- repetition ---------------------------------------------------------------------------------------------

_WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """The lower-cased words of ``text``: runs of ``\\w`` characters and single punctuation marks, in order."""
    return _WORD.findall((text or "").lower())


def compression_ratio(text: str) -> float | None:
    """zlib (level 9) compressed bytes / raw UTF-8 bytes of ``text``; None for an empty text."""
    raw = (text or "").encode("utf-8")
    return len(zlib.compress(raw, 9)) / len(raw) if raw else None


def _ngrams(items: Sequence[Any], n: int) -> list[tuple]:
    return [tuple(items[i : i + n]) for i in range(len(items) - n + 1)]


def repeated_ngram_share(items: Sequence[Any], n: int = 4) -> float | None:
    """Share of ``items`` covered by an n-gram that occurs at least twice in ``items`` (overlaps count).

    None for an empty sequence; 0.0 when it is shorter than ``n``. Example: ``a b c d a b c d`` -> 1.0 (both
    copies of ``a b c d`` repeat), ``a b c d e`` -> 0.0. Raises ValueError when n < 1."""
    if n < 1:
        raise ValueError(f"n = {n}: an n-gram needs n >= 1")
    if not items:
        return None
    grams = _ngrams(items, n)
    counts = Counter(grams)
    covered = [False] * len(items)
    for i, g in enumerate(grams):
        if counts[g] > 1:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(items)


def distinct_n(items: Sequence[Any], n: int) -> float | None:
    """Distinct n-grams / all n-grams of ``items`` (distinct-n); None when there is no n-gram. n >= 1."""
    if n < 1:
        raise ValueError(f"n = {n}: an n-gram needs n >= 1")
    grams = _ngrams(items, n)
    return len(set(grams)) / len(grams) if grams else None


def longest_run(items: Sequence[Any]) -> int:
    """Length of the longest run of one identical item in a row (0 for an empty sequence)."""
    best = run = 0
    prev = object()
    for x in items:
        run = run + 1 if x == prev else 1
        prev = x
        best = max(best, run)
    return best


def answer_metrics(text: str, token_ids: Sequence[int] | None = None) -> dict[str, float | int | None]:
    """The repetition metrics of one answer (module docstring): ``words`` (count), ``compression_ratio``,
    ``repeated_4gram_share``, ``distinct_1``, ``distinct_2``, ``longest_run`` (over ``token_ids`` when given and
    non-empty, else over the words). Values are None where undefined (an empty answer)."""
    w = words(text)
    return {
        "words": len(w),
        "compression_ratio": compression_ratio(text),
        "repeated_4gram_share": repeated_ngram_share(w, 4),
        "distinct_1": distinct_n(w, 1),
        "distinct_2": distinct_n(w, 2),
        "longest_run": longest_run(list(token_ids) if token_ids else w),
    }


# ---- reference metrics --------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(text: str, reference: str) -> float:
    """ROUGE-L F1 x 100 of ``text`` against ``reference`` (rouge-score's tokenizer: lower-cased ASCII
    alphanumerics, Porter stemming). 0 when either side has no token."""
    return 100.0 * _rouge_scorer().score(reference, text or "")["rougeL"].fmeasure


def chrf(text: str, reference: str) -> float:
    """Sentence chrF (character 6-grams, β = 2) of ``text`` against ``reference``, 0-100 (sacrebleu)."""
    import sacrebleu

    return float(sacrebleu.sentence_chrf(text or "", [reference]).score)


def sentence_bleu(text: str, reference: str) -> float:
    """Sentence BLEU (13a tokenizer, exponential smoothing) of ``text`` against ``reference``, 0-100 (sacrebleu)."""
    import sacrebleu

    return float(sacrebleu.sentence_bleu(text or "", [reference]).score)


def corpus_bleu(texts: Sequence[str], references: Sequence[str]) -> float | None:
    """Corpus BLEU (sacrebleu defaults) of ``texts`` against one reference each, 0-100; None for no pair.
    Raises ValueError when the two lengths differ."""
    if len(texts) != len(references):
        raise ValueError(f"{len(texts)} texts but {len(references)} references")
    if not texts:
        return None
    import sacrebleu

    return float(sacrebleu.corpus_bleu([t or "" for t in texts], [list(references)]).score)


def _first_reference(reference: Any) -> str | None:
    refs = _flatten(reference)
    return refs[0] if refs and refs[0].strip() else None


def reference_metrics(category: str, text: str, reference: Any) -> dict[str, float | bool | None]:
    """The reference metrics of one answer (module docstring) as ``{rouge_l, chrf, bleu, final_number_match,
    reference_match}``; each is None where ``category`` has no reference of that kind."""
    out: dict[str, float | bool | None] = {
        "rouge_l": None,
        "chrf": None,
        "bleu": None,
        "final_number_match": final_number_match(category, text, reference),
        "reference_match": reference_match(category, text, reference),
    }
    ref = _first_reference(reference)
    if ref is not None and category in ("summarization", "long-summary"):
        out["rouge_l"] = rouge_l(text, ref)
    if ref is not None and category == "translation":
        out["chrf"], out["bleu"] = chrf(text, ref), sentence_bleu(text, ref)
    return out


# ---- the metrics' directions (for pairing and flags) --------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """One per-answer metric: its record key, a short column label, which direction is better, a format spec."""

    key: str
    label: str
    better: Literal["higher", "lower"]
    fmt: str

    def worse(self, delta: float) -> float:
        """``delta`` (config - reference) turned so that positive means worse."""
        return -delta if self.better == "higher" else delta


#: Per-answer metrics in the order the tables show them.
METRICS = (
    Metric("compression_ratio", "zlib ratio", "higher", ".3f"),
    Metric("repeated_4gram_share", "rep. 4-gram", "lower", ".3f"),
    Metric("distinct_2", "distinct-2", "higher", ".3f"),
    Metric("distinct_1", "distinct-1", "higher", ".3f"),
    Metric("longest_run", "longest run", "lower", ".1f"),
    Metric("rouge_l", "ROUGE-L", "higher", ".1f"),
    Metric("chrf", "chrF", "higher", ".1f"),
    Metric("bleu", "BLEU", "higher", ".1f"),
    Metric("final_number_match", "final-number EM", "higher", ".2f"),
)
METRIC_BY_KEY = {m.key: m for m in METRICS}


def metric_value(quality: dict | None, key: str) -> float | None:
    """A record's ``quality[key]`` as a float (bools as 0/1), None when absent."""
    if not quality or quality.get(key) is None:
        return None
    return float(quality[key])


# ---- reference answers: numbers and phrases -----------------------------------------------------------------

_NUM = re.compile(r"(?:(?<![\w.])-)?(?<![\d.])\d+(?:,\d{3})*(?:\.\d+)?(?!\d|,\d{3}|\.\d)")
_FRAC = re.compile(r"(?<![\d./])(-?\d+)\s*/\s*(\d+)(?![\d/])")
_GSM = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def _to_float(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def _numbers(text: str) -> list[float]:
    return [v for v in (_to_float(m.group(0)) for m in _NUM.finditer(text)) if v is not None]


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def _has_number(text: str, value: float) -> bool:
    return any(_same(v, value) for v in _numbers(text))


def _norm(s: str) -> str:
    """Case/space normalization for phrase matching: NFKC, lower case, curly quotes straightened, whitespace
    collapsed, no space before , . ; : ! ? ' ) ] or after ( [ (references are often tokenized: "UNICEF 's")."""
    s = unicodedata.normalize("NFKC", s).lower().replace("\u2019", "'").replace("\u2018", "'")
    s = re.sub(r"\s+", " ", s)
    s = re.sub(r"\s+([,.;:!?')\]])", r"\1", s)
    s = re.sub(r"([(\[])\s+", r"\1", s)
    return s.strip()


def _contains_phrase(text: str, phrase: str) -> bool:
    """phrase (normalized, outer punctuation stripped) occurs in text (normalized) not inside a longer word."""
    p = _norm(phrase).strip(" ,.;:!?\"'")
    if not p:
        return False
    return re.search(rf"(?<!\w){re.escape(p)}(?!\w)", _norm(text)) is not None


def _flatten(ref: Any) -> list[str]:
    if ref is None:
        return []
    if isinstance(ref, str):
        return [ref]
    return [s for r in ref for s in _flatten(r)]


def math_answer(category: str, reference: Any) -> tuple[str, Any] | None:
    """The final answer of a math reference: ``("number", 1000.0)``, ``("fraction", ("35", "36"))`` or
    ``("phrase", "line")``; None where there is none.

    * math_reasoning (GSM8K: ``[solution ... "#### 1000"]``): the number after ``####``.
    * math (MT-bench: ``["Area is 3", "5pi"]``, one entry per turn; the bench passes the answered turn's entry
      alone, `hycoc.bench.datasets.Question.reference_for_turn`): the first line of
      reference[0] with parenthesized asides removed (``"19 integers (-14, ..., 4)"`` -> 19, ``"f(2) = 0"`` -> 0);
      its last fraction (``35/36``) or number (``19%`` -> 19); with no number, the line itself as a phrase.
    """
    refs = _flatten(reference)
    if category == "math_reasoning":
        m = _GSM.search(refs[0]) if refs else None
        value = _to_float(m.group(1)) if m else None
        return None if value is None else ("number", value)
    if category != "math" or not refs or not refs[0].strip():
        return None
    line = refs[0].strip().splitlines()[0]
    core = line
    while True:  # remove parenthesized asides, innermost first
        stripped = re.sub(r"\([^()]*\)", " ", core)
        if stripped == core:
            break
        core = stripped
    fracs = list(_FRAC.finditer(core))
    nums = list(_NUM.finditer(core))
    if fracs and (not nums or fracs[-1].end() >= nums[-1].end()):
        return "fraction", (fracs[-1].group(1), fracs[-1].group(2))
    if nums:
        value = _to_float(nums[-1].group(0))
        return None if value is None else ("number", value)
    return "phrase", line


def final_number_match(category: str, text: str, reference: Any) -> bool | None:
    """Exact match of the answer's final number against a math reference's final answer (`math_answer`): the
    last number in ``text`` (or, for a fraction answer, the last fraction) equals it. None where the category has
    no numeric answer. ``"... so 1,000 in total."`` matches ``#### 1000``; ``"1000 ... or 10"`` does not."""
    answer = math_answer(category, reference)
    if answer is None or answer[0] == "phrase":
        return None
    text = text or ""
    if answer[0] == "fraction":
        fracs = list(_FRAC.finditer(text))
        return bool(fracs) and (fracs[-1].group(1), fracs[-1].group(2)) == answer[1]
    nums = _numbers(text)
    return bool(nums) and _same(nums[-1], answer[1])


def reference_match(category: str, text: str, reference: Any) -> bool | None:
    """Containment proxy of an answer against the dataset's reference (Spec-Bench formats); None where the
    category has no usable reference.

    * math_reasoning, math: the final answer (`math_answer`) appears in the text as a standalone number
      (``1,000`` and ``1000.0`` count; ``10000``, ``21000`` and ``1000.5`` do not) or fraction; a phrase answer
      must appear as a phrase.
    * rag and qa (lists of acceptable strings, possibly nested: ``[["James Ray", "George Harrison"]]``): any of
      them, case/space-normalized, is a substring of the normalized text at word boundaries.
    * anything else (translation, summarization, coding, ...): None.
    """
    text = text or ""
    if category in ("math_reasoning", "math"):
        answer = math_answer(category, reference)
        if answer is None:
            return None
        kind, value = answer
        if kind == "fraction":
            return any((m.group(1), m.group(2)) == value for m in _FRAC.finditer(text))
        if kind == "number":
            return _has_number(text, value)
        return _contains_phrase(text, value)
    if category in ("rag", "qa"):
        refs = [r for r in _flatten(reference) if _norm(r).strip(" ,.;:!?\"'")]
        if not refs:
            return None
        return any(_contains_phrase(text, r) for r in refs)
    return None


__all__ = [
    "METRICS",
    "METRIC_BY_KEY",
    "Metric",
    "answer_metrics",
    "chrf",
    "compression_ratio",
    "corpus_bleu",
    "distinct_n",
    "final_number_match",
    "longest_run",
    "math_answer",
    "metric_value",
    "reference_match",
    "reference_metrics",
    "repeated_ngram_share",
    "rouge_l",
    "sentence_bleu",
    "words",
]
