"""TransformersTask: LoRA adapters over a local causal LM, generated data, no hub."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fedtrain.errors import ConfigError
from fedtrain.finetune import GeneratedReportsTask, TransformersTask
from fedtrain.finetune.corpus import SPECIALTIES, WordTokenizer, generic_text, reports
from fedtrain.task import TaskContext, federated_names, model_for, task_fingerprint
from fedtrain.tensors import ModelState

TINY = {"n_embd": 32, "n_layer": 1, "n_head": 2, "steps": 20}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lm") / "base"


def tiny(base_dir: Path, **options) -> GeneratedReportsTask:
    return GeneratedReportsTask(
        str(base_dir), base_size=TINY, train_per_site=24, test_per_site=16, lora_rank=4,
        **options,
    )  # fmt: skip


def test_reports_are_seeded_and_each_site_speaks_its_own_vocabulary():
    assert reports("cardiology", 5, 1) == reports("cardiology", 5, 1)
    assert reports("cardiology", 5, 1) != reports("cardiology", 5, 2)
    words = {s: {w for r in reports(s, 50, 0) for w in r.split()} for s in SPECIALTIES}
    drugs = set(SPECIALTIES["neurology"]["drug"])
    assert drugs & words["neurology"] and not drugs & words["cardiology"]
    assert "patient" in words["cardiology"] & words["oncology"]  # the shared template
    tok = WordTokenizer.generated()
    text = reports("oncology", 1, 0)[0]
    assert tok.decode(tok.encode(text)) == text and 3 not in tok.encode(text)  # no <unk>
    assert all(3 not in tok.encode(line) for line in generic_text(20, 0))


def test_the_generated_base_is_built_once_and_every_task_loads_the_same_one(base_dir):
    first = tiny(base_dir)
    model = model_for(first, 0)
    stamp = (base_dir / "model.safetensors").stat().st_mtime_ns
    again = tiny(base_dir)
    assert task_fingerprint(again) == task_fingerprint(first, model)
    assert (base_dir / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt


def test_a_base_pretrained_otherwise_has_another_fingerprint_base_half(base_dir, tmp_path):
    ours = task_fingerprint(tiny(base_dir))
    other = GeneratedReportsTask(
        str(tmp_path / "base"), base_size={**TINY, "seed": 1}, train_per_site=24,
        test_per_site=16, lora_rank=4,
    )  # fmt: skip
    theirs = task_fingerprint(other)
    assert theirs.split("+base:")[0] == ours.split("+base:")[0]
    assert theirs.split("+base:")[1] != ours.split("+base:")[1]


def test_only_the_lora_adapters_are_federated(base_dir):
    task = tiny(base_dir)
    model = model_for(task, 0)
    names = federated_names(task, model)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    shared = sum(model.state_dict()[n].numel() for n in names)
    assert shared < 0.1 * sum(p.numel() for p in model.parameters())
    assert {n.rsplit(".lora_", 1)[0].rsplit(".", 1)[1] for n in names} == {
        "c_attn", "c_proj", "c_fc",
    }  # fmt: skip


def test_fine_tuning_lowers_held_out_perplexity_and_leaves_the_base_alone(base_dir):
    task = tiny(base_dir)
    model = model_for(task, 0)
    names = federated_names(task, model)
    frozen_before = {k: v.clone() for k, v in model.state_dict().items() if k not in names}
    data = task.site_data("cardiology")
    before = task.evaluate(model, data.test, {}, TaskContext())
    assert before.metrics["perplexity"] == pytest.approx(math.exp(before.loss))
    result = task.train(
        model, data.train, {"epochs": 3, "lr": 0.02, "batch_size": 8}, TaskContext()
    )
    after = task.evaluate(model, data.test, {}, TaskContext())
    assert result.num_examples == 24 and after.num_examples == 16
    assert after.loss < before.loss - 0.5, (before, after)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in frozen_before.items())


def test_bf16_compute_trains_and_keeps_the_adapters_in_float32(base_dir):
    task = tiny(base_dir, precision="bf16")
    model = model_for(task, 0)
    data = task.site_data("oncology", 2)
    before = ModelState.from_module(model, federated_names(task, model))
    task.train(model, data.train, {"lr": 0.02, "batch_size": 8}, TaskContext())
    after = ModelState.from_module(model, federated_names(task, model))
    assert all(t.dtype == torch.float32 for t in after.values())
    assert not after.equal(before)


def test_a_site_that_is_not_one_of_the_federation_is_told_which_exist(base_dir):
    with pytest.raises(ConfigError, match="neurology"):
        tiny(base_dir).site_data("pediatrics")


def test_a_real_local_checkpoint_with_its_own_tokenizer_loads_by_path(base_dir, tmp_path):
    """A checkpoint directory as a user has one: weights plus a tokenizer saved beside
    them (here a word-level `tokenizers` model built in code), and text files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tiny(base_dir).base_path()  # the generated base, saved as any checkpoint is
    checkpoint = tmp_path / "checkpoint"
    AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True).save_pretrained(
        checkpoint
    )
    words = WordTokenizer.generated().words
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(checkpoint)
    (tmp_path / "train.txt").write_text("\n".join(reports("neurology", 12, 0)) + "\n")
    (tmp_path / "eval.txt").write_text("\n".join(reports("neurology", 6, 1)) + "\n")

    task = TransformersTask(str(checkpoint), lora_rank=2, target_modules=["c_attn"], seq_len=32)
    data = task.site_data(
        "neurology", train_path=str(tmp_path / "train.txt"), eval_path=str(tmp_path / "eval.txt")
    )
    assert len(data.train) == 12 and data.test is not None and len(data.test) == 6
    model = model_for(task, 0)
    before = task.evaluate(model, data.test, {}, TaskContext())
    task.train(model, data.train, {"epochs": 2, "lr": 0.02, "batch_size": 4}, TaskContext())
    assert task.evaluate(model, data.test, {}, TaskContext()).loss < before.loss
    assert "+base:" in task_fingerprint(task, model)


def test_a_directory_holding_something_else_is_never_overwritten_by_the_generated_base(
    tmp_path,
):
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        model_for(GeneratedReportsTask(str(tmp_path), base_size=TINY), 0)
    assert keep.read_text() == "mine"


def test_a_base_path_without_a_checkpoint_is_a_clear_error_not_a_hub_lookup(tmp_path):
    task = TransformersTask(str(tmp_path / "gpt2"))
    with pytest.raises(ConfigError, match="local files only"):
        task.model()


def test_a_site_daemon_whose_base_was_pretrained_otherwise_is_refused_at_join(
    base_dir, tmp_path, caplog
):
    """Real gRPC, in-process: the site's own log says what to fix."""
    import logging
    import threading

    from runtime_support import inprocess_server, wait_for

    from fedtrain.config import from_dict
    from fedtrain.runtime.config import SiteConfig
    from fedtrain.runtime.site.daemon import SiteDaemon

    server = inprocess_server(tmp_path, tiny(base_dir), 1, rounds=1, evaluate="off")
    options = {
        "base": str(tmp_path / "their-base"), "base_size": {**TINY, "seed": 1},
        "train_per_site": 24, "test_per_site": 16, "lora_rank": 4,
    }  # fmt: skip
    raw = {
        "task": "fedtrain.finetune:GeneratedReportsTask",
        "task_options": options,
        "name": "hospital-b",
        "server": f"127.0.0.1:{server.port}",
        "data": {"source": "task", "options": {"site": 1}},
        "reconnect": {"min_s": 5.0, "max_s": 5.0},
    }
    daemon = SiteDaemon(from_dict(SiteConfig, raw), insecure=True)
    thread = threading.Thread(target=daemon.run, daemon=True)
    try:
        with caplog.at_level(logging.ERROR, logger="fedtrain.runtime.site.daemon"):
            thread.start()
            wait_for(lambda: "refused this site" in caplog.text, 60, "the refusal")
        assert "frozen base model differs from the server's" in caplog.text
        assert len(server.registry) == 0
    finally:
        daemon.stop()
        thread.join(10)
        server.stop()


def test_the_simulation_federates_the_adapters_of_generated_reports(base_dir, tmp_path):
    from fedtrain.config import from_dict
    from fedtrain.simulation import SimConfig, run_simulation

    options = {"base": str(base_dir), "base_size": TINY, "train_per_site": 24,
               "test_per_site": 16, "lora_rank": 4}  # fmt: skip
    config = from_dict(
        SimConfig,
        {
            "task": "fedtrain.finetune:GeneratedReportsTask",
            "task_options": options,
            "rounds": 2,
            "num_clients": 3,
            "backend": "inline",
            "run_dir": str(tmp_path / "sim"),
            "partition": {"kind": "shards", "labels_per_client": 1},
            "strategy": {"min_fit_clients": 3, "min_available_clients": 3},
            "client": {"lr": 0.02, "batch_size": 8},
            "secagg": {"enabled": True, "clip": 1.0, "max_weight": 100.0},
        },
    )
    result = run_simulation(config)
    task = tiny(base_dir)
    model = model_for(task, 0)
    assert list(result.model) == list(federated_names(task, model))
    # the server-side record keeps the loss; perplexity is its exponential
    assert result.history[-1]["loss"] < result.history[0]["loss"]
