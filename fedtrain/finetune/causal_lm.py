"""Causal-LM fine-tuning with LoRA adapters: only the adapters are federated.

`TransformersTask` loads a Hugging Face causal LM from a local checkpoint directory
(never the hub: `local_files_only`), wraps it in PEFT LoRA adapters (rank, alpha,
dropout and target modules from the task options), and declares `federated =
"trainable"`: the adapters are downloaded, uploaded, masked and aggregated; the base
stays at every site, identical (the fingerprint hashes it, or takes `base_revision`).

A site's text is a file with one document per line (`site_data(train_path=...,
eval_path=...)`, i.e. `data.source = "task"` in site.toml), tokenized with the
checkpoint's own tokenizer. `GeneratedReportsTask` is the same task over a generated
base and generated, site-skewed reports: the example and the tests, with no download.

Training is AdamW over the adapters (`lr`, `epochs`, `batch_size`, `weight_decay` from
the round config); evaluation reports the token-weighted mean negative log-likelihood
as the loss and its exponential as `perplexity`. `precision = "auto"` computes in
bfloat16 where the device supports it (a CUDA GPU with bf16), float32 elsewhere;
`base_dtype = "bfloat16"` also stores the frozen base in bfloat16 (half the memory).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from fedtrain.errors import ConfigError
from fedtrain.finetune.base import BaseSpec, ensure_generated_base
from fedtrain.finetune.corpus import SPECIALTIES, WordTokenizer, reports
from fedtrain.strategy.base import RoundConfig
from fedtrain.task import (
    EvalResult,
    SiteData,
    Task,
    TaskContext,
    TrainResult,
    iterate_batches,
    local_loop,
    sum_over_ranks,
)

PRECISIONS = ("auto", "bf16", "fp32")
BASE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TransformersTask(Task):
    """LoRA fine-tuning of a local Hugging Face causal LM; the adapters travel."""

    federated = "trainable"

    def __init__(
        self,
        base: str,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_dropout: float = 0.0,
        target_modules: Sequence[str] = ("c_attn",),
        seq_len: int = 128,
        precision: str = "auto",
        base_dtype: str = "float32",
        base_revision: str = "",
        full_finetune: bool = False,
        site_rank: int = 0,
    ) -> None:
        if lora_rank < 1:
            raise ConfigError(f"task_options.lora_rank must be >= 1, got {lora_rank}")
        if not 0 <= site_rank <= lora_rank:
            raise ConfigError(
                f"task_options.site_rank = {site_rank}: a site's rank must be between 1 and "
                f"the federation's lora_rank ({lora_rank}); 0 means lora_rank"
            )
        if precision not in PRECISIONS:
            raise ConfigError(f"task_options.precision = {precision!r}: use one of {PRECISIONS}")
        if base_dtype not in BASE_DTYPES:
            raise ConfigError(
                f"task_options.base_dtype = {base_dtype!r}: use one of {list(BASE_DTYPES)}"
            )
        self.base = base
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha
        self.lora_dropout = lora_dropout
        self.target_modules = tuple(target_modules)
        self.seq_len = seq_len
        self.precision = precision
        self.base_dtype = base_dtype
        self.declared_revision = base_revision
        #: Train (and federate) every weight instead of adapters: the baseline whose
        #: bytes on the wire LoRA is measured against.
        self.full_finetune = full_finetune
        #: This site's own LoRA rank (<= lora_rank, the federation's): see `limit_rank`.
        self.site_rank = site_rank or lora_rank
        if full_finetune:
            self.federated = "all"

    # -- the model ----------------------------------------------------------------------
    def base_path(self) -> Path:
        """The local checkpoint directory (checked here, so a typo is not a hub lookup)."""
        path = Path(self.base).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"task_options.base = {self.base!r} is not a Hugging Face checkpoint "
                "directory (no config.json); fedtrain loads base models from local files "
                "only: download it once (e.g. `huggingface-cli download NAME --local-dir "
                "DIR`) and point base at DIR"
            )
        return path

    def model(self) -> nn.Module:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(
            self.base_path(), local_files_only=True, dtype=BASE_DTYPES[self.base_dtype]
        )
        if self.full_finetune:
            return base
        config = LoraConfig(
            r=self.lora_rank,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=list(self.target_modules),
            task_type="CAUSAL_LM",
            fan_in_fan_out=_transposed(base, self.target_modules),
        )
        model = get_peft_model(base, config)
        if self.site_rank < self.lora_rank:
            limit_rank(model, self.site_rank)
        return model

    def base_revision(self) -> str | None:
        return self.declared_revision or None

    # -- data ---------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> TensorDataset:
        """(input ids, attention mask, group 0) of `texts`, `seq_len` tokens each."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.base_path(), local_files_only=True)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        enc = tokenizer(
            list(texts),
            max_length=self.seq_len,
            truncation=True,
            padding="max_length",
            return_tensors="pt",
        )
        return TensorDataset(
            enc["input_ids"], enc["attention_mask"], torch.zeros(len(texts), dtype=torch.long)
        )

    def datasets(self) -> tuple[Dataset, Dataset | None]:
        raise ConfigError(
            f"{type(self).__name__} has no bundled data: give each site its text with "
            'data.source = "task" and data.options = {train_path = ..., eval_path = ...}'
        )

    def site_data(self, site_name: str, train_path: str = "", eval_path: str = "") -> SiteData:
        """A site's text files (one document per line), tokenized."""
        if not train_path:
            raise ConfigError(f"site {site_name!r}: data.options.train_path is required")
        test = self.tokenize(_lines(eval_path)) if eval_path else None
        return SiteData(self.tokenize(_lines(train_path)), test)

    # -- training -----------------------------------------------------------------------
    def autocast(self, device: torch.device) -> AbstractContextManager[Any]:
        """bfloat16 compute where asked for or (auto) where the device supports it."""
        bf16 = self.precision == "bf16" or (
            self.precision == "auto"
            and device.type == "cuda"
            and torch.cuda.is_available()
            and torch.cuda.is_bf16_supported()
        )
        if not bf16:
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    def token_losses(
        self, model: nn.Module, batch: tuple[torch.Tensor, ...], device: torch.device
    ) -> tuple[torch.Tensor, int]:
        """(summed next-token NLL, number of predicted tokens) of one batch."""
        ids, mask = batch[0].to(device), batch[1].to(device)
        with self.autocast(device):
            logits = model(input_ids=ids, attention_mask=mask).logits
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        loss = nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        return loss, int((targets != -100).sum())

    def train(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> TrainResult:
        epochs, batch_size, gen = local_loop(config, context, default_batch_size=16)
        model.to(context.device).train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(
            params,
            lr=float(config.get("lr", 1e-3)),
            weight_decay=float(config.get("weight_decay", 0.0)),
        )
        idle = idle_slots(model, self.site_rank) if self.site_rank < self.lora_rank else []
        total, tokens = 0.0, 0
        for _ in range(epochs):
            for batch in iterate_batches(
                data, batch_size, shuffle=True, generator=gen,
                rank=context.rank, world_size=context.world_size,
            ):  # fmt: skip
                loss_sum, n = self.token_losses(model, batch, context.device)
                opt.zero_grad(set_to_none=True)
                (loss_sum / max(n, 1)).backward()
                opt.step()
                total += float(loss_sum.detach())
                tokens += n
        restore_slots(idle)
        if context.world_size > 1:
            total, tokens = sum_over_ranks((total, tokens), context.device)
        return TrainResult(len(data), {"train_loss": total / max(tokens, 1)})  # type: ignore[arg-type]

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> EvalResult:
        model.to(context.device).eval()
        total, tokens = 0.0, 0
        for batch in iterate_batches(data, int(config.get("eval_batch_size", 64))):
            loss_sum, n = self.token_losses(model, batch, context.device)
            total += float(loss_sum)
            tokens += n
        nll = total / max(tokens, 1)
        return EvalResult(len(data), nll, {"perplexity": math.exp(nll)})  # type: ignore[arg-type]


class GeneratedReportsTask(TransformersTask):
    """`TransformersTask` over a generated base and generated, site-skewed reports.

    `base`: the cache directory of the generated base (built on first use, see
    `fedtrain.finetune.base`); `sites`: the departments of the federation, one per
    site (`data.options.site` names one: 0-based index or name); each holds
    `train_per_site` reports to train on and `test_per_site` held out.
    """

    def __init__(
        self,
        base: str,
        sites: Sequence[str] = ("cardiology", "neurology", "oncology"),
        train_per_site: int = 200,
        test_per_site: int = 100,
        data_seed: int = 0,
        base_size: dict[str, Any] | None = None,
        target_modules: Sequence[str] = ("c_attn", "c_proj", "c_fc"),
        seq_len: int = 32,
        **options: Any,
    ) -> None:
        super().__init__(base, target_modules=target_modules, seq_len=seq_len, **options)
        unknown = [s for s in sites if s not in SPECIALTIES]
        if unknown:
            raise ConfigError(
                f"task_options.sites: unknown {unknown}; choose from {list(SPECIALTIES)}"
            )
        self.sites = tuple(sites)
        self.train_per_site = train_per_site
        self.test_per_site = test_per_site
        self.data_seed = data_seed
        try:
            self.spec = BaseSpec(**{"seq_len": seq_len, **(base_size or {})})
        except TypeError as exc:
            raise ConfigError(f"task_options.base_size: {exc}") from None
        self.tokenizer = WordTokenizer.generated()

    def base_path(self) -> Path:
        return ensure_generated_base(self.base, self.spec)

    def tokenize(self, texts: Sequence[str], group: int = 0) -> TensorDataset:
        ids = self.tokenizer.batch(texts, self.seq_len)
        return TensorDataset(ids, (ids != 0).long(), torch.full((len(texts),), group))

    def site_texts(self, index: int) -> tuple[list[str], list[str]]:
        """(train, held-out) reports of site `index`: one draw, split."""
        seed = self.data_seed * 1_000 + index
        texts = reports(self.sites[index], self.train_per_site + self.test_per_site, seed)
        return texts[: self.train_per_site], texts[self.train_per_site :]

    def site_data(self, site_name: str, site: int | str | None = None) -> SiteData:  # type: ignore[override]
        index = self._site_index(site_name if site is None else site)
        train, test = self.site_texts(index)
        return SiteData(self.tokenize(train, index), self.tokenize(test, index))

    def datasets(self) -> tuple[Dataset, Dataset | None]:
        """Every site's reports pooled (simulation, the centralized baseline); the last
        tensor is the site index, so label partitioners split by site."""
        parts = [self.site_data(name) for name in self.sites]
        train = [p.train.tensors for p in parts]  # type: ignore[attr-defined]
        test = [p.test.tensors for p in parts]  # type: ignore[union-attr]
        return (
            TensorDataset(*(torch.cat(t) for t in zip(*train, strict=True))),
            TensorDataset(*(torch.cat(t) for t in zip(*test, strict=True))),
        )

    def _site_index(self, site: int | str) -> int:
        if isinstance(site, int) and 0 <= site < len(self.sites):
            return site
        if site in self.sites:
            return self.sites.index(site)  # type: ignore[arg-type]
        raise ConfigError(
            f"site {site!r} is none of this federation's sites {list(self.sites)}: set "
            "data.options.site to one of them (or its 0-based index)"
        )


# -- mixed ranks: zero-padding ---------------------------------------------------------------
# Sites of one federation may train adapters of different ranks (a small GPU takes a
# lower one). fedtrain zero-pads (as HetLoRA, Cho et al. 2024), not stacks (FLoRA, 2024):
# stacking makes the global adapter's rank grow with the sites and merges it into the
# base every round, so the base would change and travel; zero-padding keeps one shape
# (the federation's `lora_rank` R) on the wire, which secure aggregation's fixed-size
# masked vector, checkpoints and the fingerprint need. A site of rank r < R holds the
# rank-R adapters but uses and trains only their first r slots (rows of A, columns of B):
# its forward pass is exactly a rank-r LoRA with the same scaling, and its update is
# zero on slots r..R. The weighted mean then gives slot j the mean over all sites, the
# sites without it counting as no change: slots that fewer sites train move more slowly.
RANK_MASK = "fedtrain_rank_mask"


def limit_rank(model: nn.Module, rank: int) -> None:
    """Make every LoRA layer of `model` act through its first `rank` slots only."""
    for a in _lora_a(model):
        mask = torch.zeros(a.out_features)
        mask[:rank] = 1.0
        a.register_buffer(RANK_MASK, mask, persistent=False)  # not in the state dict
        a.register_forward_hook(_mask_slots)


def _mask_slots(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    return output * getattr(module, RANK_MASK).to(output.dtype)


def idle_slots(model: nn.Module, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The slots beyond `rank` (parameter view -> its values now), to put back after
    training: no gradient reaches them, but weight decay would still move them."""
    out = []
    for layer in _lora_layers(model):
        for adapter in layer.lora_A:
            a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            out += [(view, view.detach().clone()) for view in (a[rank:], b[:, rank:])]
    return out


@torch.no_grad()
def restore_slots(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for view, values in saved:
        view.copy_(values)


def _lora_layers(model: nn.Module) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _lora_a(model: nn.Module) -> list[nn.Linear]:
    return [layer.lora_A[k] for layer in _lora_layers(model) for k in layer.lora_A]


def _transposed(model: nn.Module, targets: Sequence[str]) -> bool:
    """Whether the target layers store (in, out) weights (GPT-2's Conv1D), which LoRA
    must be told rather than warn about."""
    from transformers.pytorch_utils import Conv1D

    return any(
        isinstance(module, Conv1D)
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in targets
    )


def _lines(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the text file {path!r}: {exc}") from None
    return [line for line in text.splitlines() if line.strip()]
