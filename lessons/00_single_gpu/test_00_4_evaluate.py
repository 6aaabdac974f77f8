"""task0_4, evaluate: the exact mean over every sample, in eval mode without gradients,
the model's mode restored.

    pytest lessons/00_single_gpu -m task0_4
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness.compare import assert_close

# The task's contract, clause by clause, and the tests that fail when only that clause is
# broken (tests/test_course.py checks the names).
CLAUSES = {
    "task0_4": {
        "the exact mean loss per sample: weigh each batch by its number of samples": [
            "test_evaluate_is_the_exact_mean_over_all_samples"],
        "run the model in eval mode": [
            "test_evaluate_uses_eval_mode_no_grad_and_restores_the_mode"],
        "with gradients off (torch.no_grad())": [
            "test_evaluate_uses_eval_mode_no_grad_and_restores_the_mode"],
        "leave it in the training/eval mode it was in before": [
            "test_evaluate_uses_eval_mode_no_grad_and_restores_the_mode"],
        "return a Python float": ["test_evaluate_is_the_exact_mean_over_all_samples"],
    },
}


class RecordingClassifier(nn.Module):
    """A linear classifier that records, at each forward, grad mode and training flag."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[1.0, -1.0, 0.5], [-0.5, 1.0, -1.0]]))
            self.linear.bias.copy_(torch.tensor([0.1, -0.1]))
        self.seen = []

    def forward(self, x):
        self.seen.append({"grad enabled": torch.is_grad_enabled(), "training": self.training})
        return self.linear(x)


def ten_samples():
    """10 samples in batches of 4, 4 and 2; the short last batch has a much larger loss."""
    g = torch.Generator().manual_seed(2)
    inputs = torch.randn(10, 3, generator=g)
    with torch.no_grad():
        predicted = RecordingClassifier()(inputs).argmax(dim=1)
    targets = predicted.clone()
    targets[8:] = 1 - predicted[8:]  # the last two are confidently wrong
    return DataLoader(TensorDataset(inputs, targets), batch_size=4, shuffle=False)


@pytest.mark.task0_4
def test_evaluate_is_the_exact_mean_over_all_samples(ex):
    """`evaluate` returns, as a float, the mean loss over 10 samples in batches of 4, 4 and 2, equal
    to one pass over all 10, not the mean of the 3 batch means nor the loss sum divided by 12."""
    loader = ten_samples()
    model = RecordingClassifier()
    loss_fn = nn.CrossEntropyLoss()
    inputs, targets = loader.dataset.tensors
    with torch.no_grad():
        expected = loss_fn(model(inputs), targets).item()
        mean_of_batch_means = sum(loss_fn(model(x), y).item() for x, y in loader) / len(loader)
    assert abs(mean_of_batch_means - expected) > 0.1, "test data no longer tells the two apart"

    got = ex.evaluate(model, loader, loss_fn)

    assert isinstance(got, float), (
        f"evaluate returned a {type(got).__name__}, expected a Python float"
    )
    if math.isclose(got, mean_of_batch_means, rel_tol=1e-5):
        pytest.fail(
            f"evaluate returned {got:.6f}, the mean of the 3 per-batch means; expected "
            f"{expected:.6f}, the mean over all 10 samples: the last batch has 2 samples, not 4, "
            "so weigh each batch's mean loss by its number of samples"
        )
    if math.isclose(got, expected * 10 / 12, rel_tol=1e-5):
        pytest.fail(
            f"evaluate returned {got:.6f}, the sum of the per-sample losses divided by 12 "
            f"(3 batches x 4); expected {expected:.6f}: there are 10 samples, the last batch "
            "holds 2, so divide by the number of samples you actually saw"
        )
    assert_close(got, expected, "evaluate(): mean loss per sample over 10 samples in batches "
                                "of 4, 4, 2")


@pytest.mark.task0_4
@pytest.mark.parametrize("start_in_training_mode", [True, False])
def test_evaluate_uses_eval_mode_no_grad_and_restores_the_mode(ex, start_in_training_mode):
    """Each of the 3 forward passes runs in eval mode with gradients off, no parameter gets a
    gradient, and the model ends in the mode it started in (both tried: training and eval)."""
    model = RecordingClassifier()
    model.train(start_in_training_mode)
    ex.evaluate(model, ten_samples(), nn.CrossEntropyLoss())

    assert len(model.seen) == 3, (
        f"the model ran {len(model.seen)} forward passes, expected 3 (one per batch)"
    )
    for i, state in enumerate(model.seen):
        assert not state["grad enabled"], (
            f"batch {i}: gradients were enabled in the forward pass; wrap the loop in "
            "torch.no_grad() (no graph is needed to evaluate, and it costs memory)"
        )
        assert not state["training"], (
            f"batch {i}: the model was in training mode; call model.eval() first (dropout and "
            "batch norm behave differently in eval mode)"
        )
    mode = "training" if start_in_training_mode else "eval"
    assert model.training == start_in_training_mode, (
        f"the model was in {mode} mode before evaluate and in "
        f"{'training' if model.training else 'eval'} mode after; restore the mode it had"
    )
    assert all(p.grad is None for p in model.parameters()), "evaluate must not compute gradients"
