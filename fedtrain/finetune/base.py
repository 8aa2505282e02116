"""A small GPT-2-style base model, built and "pretrained" here: no download, ever.

The fine-tuning example and its tests need a pretrained causal LM. They build one
from a config with random weights and train it briefly on generated generic text
(`corpus.generic_text`), seeded, then save it as an ordinary Hugging Face checkpoint
directory. The directory is the cache: every process of a run (server, sites,
baselines) loads the same files, so every site holds the identical base, which the
task fingerprint then confirms. Building is done once, under a file lock, into a
temporary directory renamed into place, so processes that start together neither
duplicate the work nor read a half-written checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock

from fedtrain.errors import ConfigError
from fedtrain.finetune.corpus import WordTokenizer, generic_text

log = logging.getLogger(__name__)

#: The file whose presence says a checkpoint directory is complete.
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class BaseSpec:
    """Size and pretraining of a generated base model (all of it is in the fingerprint,
    through the weights it produces)."""

    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    seq_len: int = 32
    steps: int = 150
    batch_size: int = 32
    lr: float = 3e-3
    seed: int = 0


def ensure_generated_base(directory: str | Path, spec: BaseSpec = BaseSpec()) -> Path:
    """The checkpoint directory, built and pretrained first if it holds none."""
    path = Path(directory)
    if (path / CONFIG_FILE).exists():
        return path
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(
            f"task_options.base = {str(path)!r} exists but holds no checkpoint "
            f"({CONFIG_FILE}): point base at an empty or new directory for the generated "
            "base model (fedtrain builds it there), or at a checkpoint directory"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if (path / CONFIG_FILE).exists():  # another process built it while we waited
            return path
        log.info("building the generated base model in %s", path)
        model = pretrain(spec)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
        try:
            model.save_pretrained(tmp)
            if path.exists():  # empty (checked above): os.replace takes its place
                path.rmdir()
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def pretrain(spec: BaseSpec) -> torch.nn.Module:
    """A GPT-2-style model with random weights, trained `spec.steps` steps on generic text."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = WordTokenizer.generated()
    config = GPT2Config(
        vocab_size=tokenizer.size,
        n_positions=spec.seq_len,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = GPT2LMHeadModel(config)
        ids = tokenizer.batch(generic_text(spec.steps * spec.batch_size, spec.seed), spec.seq_len)
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
        model.train()
        for step in range(spec.steps):
            batch = ids[step * spec.batch_size : (step + 1) * spec.batch_size]
            labels = batch.masked_fill(batch == 0, -100)
            loss = model(input_ids=batch, attention_mask=(batch != 0).long(), labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    log.info(
        "generated base pretrained: loss %.3f after %d steps", float(loss.detach()), spec.steps
    )
    return model.eval()
