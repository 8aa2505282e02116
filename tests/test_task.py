"""TorchTask's default loop, task loading and fingerprints, devices (CUDA when present)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Subset, TensorDataset

from fedtrain.errors import ConfigError, TaskError, TensorStreamError
from fedtrain.examples import BreastCancerTask, DigitsTask, FrozenBaseTask
from fedtrain.task import (
    TaskContext,
    federated_names,
    fingerprint_mismatch,
    iterate_batches,
    load_task,
    model_for,
    resolve_device,
    task_fingerprint,
)
from fedtrain.tensors import ModelState


def test_fast_batches_match_dataloader_order():
    x = torch.arange(50).float().unsqueeze(1)
    data = Subset(TensorDataset(x, torch.arange(50)), list(range(10, 40)))
    seen = torch.cat(
        [
            y
            for _, y in iterate_batches(
                data, 7, shuffle=True, generator=torch.Generator().manual_seed(1)
            )
        ]
    )
    assert sorted(seen.tolist()) == list(range(10, 40))
    again = torch.cat(
        [
            y
            for _, y in iterate_batches(
                data, 7, shuffle=True, generator=torch.Generator().manual_seed(1)
            )
        ]
    )
    assert torch.equal(seen, again)

    class Plain(torch.utils.data.Dataset):  # not a TensorDataset: DataLoader path
        def __len__(self):
            return 30

        def __getitem__(self, i):
            return x[i + 10], torch.tensor(i + 10)

    slow = torch.cat(
        [
            y
            for _, y in iterate_batches(
                Plain(), 7, shuffle=True, generator=torch.Generator().manual_seed(1)
            )
        ]
    )
    assert torch.equal(slow, seen)


def test_training_is_deterministic_and_improves():
    task = BreastCancerTask()
    train, test = task.datasets()
    config = {"epochs": 2, "lr": 0.1, "batch_size": 16, "round": 1}
    states = []
    for _ in range(2):
        model = model_for(task, 0)
        before = task.evaluate(model, test, config, TaskContext())
        result = task.train(model, train, config, TaskContext(seed=3, client_id="a"))
        states.append(ModelState.from_module(model))
    after = task.evaluate(model, test, config, TaskContext())
    assert states[0].equal(states[1])
    assert result.num_examples == len(train)
    assert after.loss < before.loss and after.metrics["accuracy"] > 0.9


def test_bad_round_config_is_refused():
    task = BreastCancerTask()
    with pytest.raises(ConfigError, match="epochs and batch_size"):
        task.train(model_for(task, 0), task.datasets()[0], {"epochs": 0}, TaskContext())


def test_load_task_errors_say_what_is_wrong():
    assert isinstance(load_task("fedtrain.examples:DigitsTask"), DigitsTask)
    assert load_task("fedtrain.examples:DigitsTask", {"test_fraction": 0.5}).test_fraction == 0.5
    with pytest.raises(ConfigError, match="must look like"):
        load_task("fedtrain.examples.DigitsTask")
    with pytest.raises(ConfigError, match="cannot import 'no_such_pkg'"):
        load_task("no_such_pkg:Task")
    with pytest.raises(ConfigError, match="has no 'Nope'"):
        load_task("fedtrain.examples:Nope")
    with pytest.raises(ConfigError, match="bad task options"):
        load_task("fedtrain.examples:DigitsTask", {"colour": "red"})
    with pytest.raises(TaskError, match="not a fedtrain Task"):
        load_task("collections:OrderedDict")


def test_fingerprint_differs_between_tasks_and_is_stable():
    assert task_fingerprint(DigitsTask()) == task_fingerprint(DigitsTask())
    assert task_fingerprint(DigitsTask()) != task_fingerprint(BreastCancerTask())


def test_model_for_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = ModelState.from_module(model_for(DigitsTask(), 5))
    assert torch.equal(torch.rand(1), expected_next)
    assert a.equal(ModelState.from_module(model_for(DigitsTask(), 5)))
    assert not a.equal(ModelState.from_module(model_for(DigitsTask(), 6)))


def test_cuda_device_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the error path needs one without")
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="not a device name"):
        resolve_device("tpu:9x")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_on_cuda_matches_the_cpu_loop():
    task = BreastCancerTask()
    train, test = task.datasets()
    config = {"epochs": 1, "lr": 0.1, "batch_size": 16, "round": 1}
    cpu, gpu = model_for(task, 0), model_for(task, 0)
    task.train(cpu, train, config, TaskContext())
    task.train(gpu, train, config, TaskContext(device=resolve_device("cuda")))
    assert next(gpu.parameters()).is_cuda
    a, b = ModelState.from_module(cpu), ModelState.from_module(gpu)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
    assert (
        task.evaluate(gpu, test, config, TaskContext(device=torch.device("cuda"))).metrics[
            "accuracy"
        ]
        > 0.9
    )


def test_fedprox_term_keeps_the_model_near_the_global_one():
    task = BreastCancerTask()
    train, _ = task.datasets()
    start = ModelState.from_module(model_for(task, 0))
    drift = {}
    for mu in (0.0, 10.0):
        model = model_for(task, 0)
        task.train(model, train, {"epochs": 3, "lr": 0.1, "proximal_mu": mu}, TaskContext())
        after = ModelState.from_module(model)
        drift[mu] = sum(float((after[k] - start[k]).norm() ** 2) for k in start)
    assert drift[10.0] < 0.5 * drift[0.0]


# -- federated parameters -------------------------------------------------------------------
def test_a_trainable_task_federates_its_head_and_keeps_the_frozen_base_home():
    task = FrozenBaseTask(num_train=40, num_test=10)
    model = model_for(task, 0)
    assert federated_names(task, model) == ("2.weight", "2.bias")
    state = ModelState.from_module(model, federated_names(task, model))
    assert list(state) == ["2.weight", "2.bias"]
    assert federated_names(DigitsTask(), model_for(DigitsTask(), 0)) is None  # "all"


def test_glob_patterns_pick_the_federated_tensors_and_a_pattern_matching_none_is_refused():
    task = FrozenBaseTask(num_train=40, num_test=10)
    model = model_for(task, 0)
    task.federated = ("*.bias",)
    assert federated_names(task, model) == ("0.bias", "2.bias")
    task.federated = ("lora_*",)
    with pytest.raises(ConfigError, match="selects none"):
        federated_names(task, model)
    task.federated = "adapters"
    with pytest.raises(ConfigError, match="trainable"):
        federated_names(task, model)


def test_loading_a_federated_state_leaves_the_base_and_refuses_a_state_missing_a_tensor():
    task = FrozenBaseTask(num_train=40, num_test=10)
    model, names = model_for(task, 0), ("2.weight", "2.bias")
    base = model[0].weight.clone()
    head = ModelState({"2.weight": torch.ones(2, 32), "2.bias": torch.zeros(2)})
    head.load_into(model, names)
    assert torch.equal(model[2].weight, torch.ones(2, 32)) and torch.equal(model[0].weight, base)
    with pytest.raises(TensorStreamError, match=r"missing \['2.bias'\]"):
        ModelState({"2.weight": torch.ones(2, 32)}).load_into(model, names)
    with pytest.raises(TensorStreamError, match="unexpected"):
        head.load_into(model)  # everything expected: the head alone is not a model
    # a server cannot overwrite the frozen base through the federated state
    with pytest.raises(TensorStreamError, match=r"unexpected \['0.weight'\]"):
        ModelState({**head, "0.weight": torch.zeros(32, 20)}).load_into(model, names)
    assert torch.equal(model[0].weight, base)


def test_the_fingerprint_tells_a_different_frozen_base_from_a_different_task():
    ours = task_fingerprint(FrozenBaseTask(base_seed=0))
    assert ours == task_fingerprint(FrozenBaseTask(base_seed=0))
    other_base = task_fingerprint(FrozenBaseTask(base_seed=1))
    assert other_base != ours
    assert "frozen base model differs" in fingerprint_mismatch(other_base, ours)
    other_task = task_fingerprint(FrozenBaseTask(hidden=16))
    assert "install the same task code" in fingerprint_mismatch(other_task, ours)
    assert "+base:" not in task_fingerprint(DigitsTask())  # "all": the old 16 hex digits


def test_a_declared_base_revision_replaces_hashing_the_base():
    class Declared(FrozenBaseTask):
        def base_revision(self) -> str:
            return "base-v1"

    # the declared revision, not the bits, identifies the base
    assert task_fingerprint(Declared(base_seed=0)) == task_fingerprint(Declared(base_seed=1))
