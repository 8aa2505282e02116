"""Generated text for fine-tuning without a download: a generic corpus to "pretrain"
a small base model on, and clinical-style reports whose vocabulary depends on the site.

Every site of the example is a hospital department (`SPECIALTIES`). Its reports
follow templates that all sites share (ages, durations, the order of a report), but
name that department's own symptoms, findings, drugs and procedures, and within a
department a symptom goes with particular findings and drugs. So a site's text is
skewed (its words are its own) and some structure is common to all sites: what a
federation can learn from everyone that one small site learns slowly alone.

Everything is drawn from `numpy.random.default_rng(seed)`, so each process builds
identical text, and the word-level tokenizer is built from the word lists, not learnt,
so each process builds the identical vocabulary too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

#: Per department: symptoms, findings, exams, drugs, procedures (each word one token).
SPECIALTIES: dict[str, dict[str, tuple[str, ...]]] = {
    "cardiology": {
        "symptom": ("chest_pain", "palpitations", "dyspnea", "syncope", "edema", "fatigue"),
        "finding": ("st_elevation", "murmur", "arrhythmia", "tachycardia", "bradycardia"),
        "exam": ("ecg", "echocardiogram", "troponin", "angiography"),
        "drug": ("aspirin", "metoprolol", "atorvastatin", "heparin", "furosemide"),
        "procedure": ("stenting", "ablation", "bypass", "pacemaker"),
    },
    "neurology": {
        "symptom": ("headache", "seizure", "numbness", "vertigo", "tremor", "weakness"),
        "finding": ("lesion", "infarct", "hemorrhage", "demyelination", "atrophy"),
        "exam": ("mri", "eeg", "lumbar_puncture", "ct_head"),
        "drug": ("levetiracetam", "sumatriptan", "levodopa", "alteplase", "gabapentin"),
        "procedure": ("thrombectomy", "craniotomy", "stimulation", "shunt"),
    },
    "oncology": {
        "symptom": ("weight_loss", "night_sweats", "lump", "bleeding", "anemia", "cough"),
        "finding": ("mass", "metastasis", "lymphadenopathy", "nodule", "effusion"),
        "exam": ("biopsy", "pet_scan", "tumor_markers", "ct_chest"),
        "drug": ("cisplatin", "tamoxifen", "pembrolizumab", "doxorubicin", "ondansetron"),
        "procedure": ("resection", "radiotherapy", "chemotherapy", "port_placement"),
    },
    "pulmonology": {
        "symptom": ("wheezing", "hemoptysis", "sputum", "orthopnea", "hypoxia", "fever"),
        "finding": ("consolidation", "fibrosis", "emphysema", "pneumothorax", "infiltrate"),
        "exam": ("spirometry", "chest_xray", "bronchoscopy", "blood_gas"),
        "drug": ("salbutamol", "tiotropium", "prednisone", "azithromycin", "oxygen"),
        "procedure": ("intubation", "drainage", "lobectomy", "ventilation"),
    },
}

#: Shared by every department's reports.
COMMON: dict[str, tuple[str, ...]] = {
    "age": tuple(str(a) for a in range(20, 95, 5)),
    "sex": ("male", "female"),
    "duration": ("two", "three", "five", "seven", "ten"),
    "unit": ("days", "weeks", "months"),
    "dose": ("5", "10", "20", "40", "80", "100"),
    "frequency": ("daily", "twice_daily", "weekly", "as_needed"),
    "severity": ("mild", "moderate", "severe"),
    "outcome": ("improved", "stable", "worsened", "resolved"),
}

#: The sentences of a report, in order; {slot}s are filled from the word lists.
REPORT: tuple[str, ...] = (
    "patient is a {age} year old {sex} with {severity} {symptom} for {duration} {unit} .",
    "{exam} showed {finding} .",
    "started {drug} {dose} mg {frequency} .",
    "plan {procedure} if {outcome} .",
)

#: Sentences of the "pretraining" corpus: the words in general use, any department's,
#: with none of a report's order or of a department's associations.
GENERIC: tuple[str, ...] = (
    "{symptom} can be {severity} .",
    "{exam} may show {finding} .",
    "{drug} is given {frequency} at {dose} mg .",
    "{procedure} takes {duration} {unit} .",
    "a {age} year old {sex} .",
    "the outcome was {outcome} .",
    "{finding} and {symptom} .",
)
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD, BOS, EOS, UNK = range(4)


def _template_words() -> set[str]:
    words: set[str] = set()
    for template in REPORT + GENERIC:
        words.update(w for w in template.split() if not w.startswith("{"))
    return words


def vocabulary() -> list[str]:
    """Every word any generated text can hold, specials first, then sorted."""
    words = _template_words()
    for lists in (*SPECIALTIES.values(), COMMON):
        for values in lists.values():
            words.update(values)
    return [*SPECIALS, *sorted(words)]


@dataclass(frozen=True)
class WordTokenizer:
    """Whitespace word-level tokenizer over a fixed vocabulary (no download, no training)."""

    words: tuple[str, ...]

    @classmethod
    def generated(cls) -> WordTokenizer:
        return cls(tuple(vocabulary()))

    @property
    def size(self) -> int:
        return len(self.words)

    def encode(self, text: str) -> list[int]:
        index = {w: i for i, w in enumerate(self.words)}
        return [BOS, *(index.get(w, UNK) for w in text.split()), EOS]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(self.words[i] for i in ids if i not in (PAD, BOS, EOS))

    def batch(self, texts: Sequence[str], seq_len: int) -> torch.Tensor:
        """Token ids [len(texts), seq_len]: truncated, padded with <pad>."""
        out = torch.full((len(texts), seq_len), PAD, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = self.encode(text)[:seq_len]
            out[row, : len(ids)] = torch.tensor(ids)
        return out


def reports(specialty: str, count: int, seed: int) -> list[str]:
    """`count` reports of one department. Within a department, each symptom goes with
    one likely finding, exam and drug (80% of the time): structure to learn."""
    if specialty not in SPECIALTIES:
        raise ValueError(f"unknown specialty {specialty!r}; known: {', '.join(SPECIALTIES)}")
    rng = np.random.default_rng(seed)
    words = {**COMMON, **SPECIALTIES[specialty]}
    symptoms = words["symptom"]
    out = []
    for _ in range(count):
        i = int(rng.integers(len(symptoms)))
        slots = {slot: str(rng.choice(values)) for slot, values in words.items()}
        slots["symptom"] = symptoms[i]
        for slot in ("finding", "exam", "drug", "procedure"):
            if rng.random() < 0.8:  # the symptom's usual companion
                slots[slot] = words[slot][i % len(words[slot])]
        out.append(" ".join(s.format(**slots) for s in REPORT))
    return out


def generic_text(count: int, seed: int, words_per_line: int = 28) -> list[str]:
    """`count` lines of generic sentences (about `words_per_line` words each, so every
    position of the model's context is trained) drawn over all departments' words:
    the base model's "pretraining" text, which teaches it words, not reports."""
    rng = np.random.default_rng(seed)
    pool = {**COMMON}
    for slot in ("symptom", "finding", "exam", "drug", "procedure"):
        pool[slot] = tuple(w for lists in SPECIALTIES.values() for w in lists[slot])
    out = []
    for _ in range(count):
        line: list[str] = []
        while len(line) < words_per_line:
            template = GENERIC[int(rng.integers(len(GENERIC)))]
            line += template.format_map(_Draw(pool, rng)).split()
        out.append(" ".join(line))
    return out


class _Draw(dict[str, str]):
    """format_map's slots: a fresh draw per slot."""

    def __init__(self, pool: dict[str, tuple[str, ...]], rng: np.random.Generator) -> None:
        super().__init__()
        self.pool, self.rng = pool, rng

    def __missing__(self, slot: str) -> str:
        return str(self.rng.choice(self.pool[slot]))
