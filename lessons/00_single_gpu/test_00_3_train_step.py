"""task0_3, train_step: two steps equal a reference loop's, parameter for parameter.

    pytest lessons/00_single_gpu -m task0_3
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from harness.compare import assert_close, assert_parameters_close

# The task's contract, clause by clause, and the tests that fail when only that clause is
# broken (tests/test_course.py checks the names).
CLAUSES = {
    "task0_3": {
        "clear the gradients left by earlier steps": [
            "test_train_step_matches_a_reference_loop_over_two_steps"],
        "compute loss_fn(model(inputs), targets), back-propagate, step the optimizer": [
            "test_train_step_matches_a_reference_loop_over_two_steps"],
        "return the loss (computed before the step) as a Python float": [
            "test_train_step_matches_a_reference_loop_over_two_steps"],
    },
}


def small_classifier(seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def classification_batches(n_batches: int, size: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g))
            for _ in range(n_batches)]


def parameters_match(model: nn.Module, other) -> bool:
    """Every parameter of ``model`` close to the same-named one in ``other`` (a model or dict)."""
    wanted = dict(other.named_parameters()) if isinstance(other, nn.Module) else other
    return all(torch.allclose(p, wanted[name], rtol=1e-5, atol=1e-6)
               for name, p in model.named_parameters())


@pytest.mark.task0_3
def test_train_step_matches_a_reference_loop_over_two_steps(ex):
    """Two `train_step` calls on a small classifier with SGD, starting from stale gradients of 3.0,
    return each loss before its update as a float and leave the parameters a reference loop
    (`zero_grad`, forward, backward, `step`) reaches."""
    model = small_classifier()
    reference = copy.deepcopy(model)
    # Gradients left over from an earlier step: train_step must clear them before backward.
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    # The same loop without zero_grad, to recognise that mistake by its result.
    stale = copy.deepcopy(model)
    for p in stale.parameters():
        p.grad = torch.full_like(p, 3.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    stale_optimizer = torch.optim.SGD(stale.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()

    for step, (inputs, targets) in enumerate(classification_batches(2, 6), start=1):
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        got = ex.train_step(model, (inputs, targets), loss_fn, optimizer)

        reference_optimizer.zero_grad()
        expected = loss_fn(reference(inputs), targets)
        expected.backward()
        reference_optimizer.step()
        loss_fn(stale(inputs), targets).backward()  # no zero_grad: the gradients pile up
        stale_optimizer.step()

        assert isinstance(got, float), (
            f"step {step}: train_step returned a {type(got).__name__}, expected a Python float "
            "(loss.item(): a tensor would also keep the step's whole autograd graph alive)"
        )
        if parameters_match(model, before):
            pytest.fail(
                f"step {step}: the parameters did not change: call optimizer.step() after "
                "loss.backward(), and optimizer.zero_grad() before the backward, not between "
                "the backward and the step (that wipes the gradients the step needs)"
            )
        if parameters_match(model, stale) and not parameters_match(model, reference):
            pytest.fail(
                f"step {step}: the parameters moved by this batch's gradient plus the gradient "
                "already in .grad before train_step (3.0 everywhere): gradients accumulate, so "
                "call optimizer.zero_grad() before loss.backward()"
            )
        assert_close(got, expected.item(), f"step {step}: loss returned by train_step "
                                           "(the loss of the batch before the update)")
        assert_parameters_close(model, reference, f"step {step}: parameter")
