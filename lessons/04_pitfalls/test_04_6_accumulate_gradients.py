"""Lesson 04, task4_6: ``accumulate_gradients`` on pooled ranks (gloo; CUDA where present):
DDP all-reduces once, for the last micro-batch, and the gradient equals one process on the
full batch; the caller's earlier gradients are kept and the weights untouched.

    pytest lessons/04_pitfalls -m task4_6
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.compare import assert_close, assert_parameters_close
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import group_params, run_on_ranks
from lesson04.common import LESSON, lab, mse_of_output_and_target

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task4_6": {
        "(loss_fn(model(inputs), targets) / k).backward() for each micro-batch":
            ["test_accumulate_gradients_syncs_once_and_equals_the_full_batch"],
        "all but the last micro-batch, forward and backward, inside model.no_sync()":
            ["test_accumulate_gradients_syncs_once_and_equals_the_full_batch"],
        "the last one outside it: its backward all-reduces the sum once":
            ["test_accumulate_gradients_syncs_once_and_equals_the_full_batch"],
        "do not zero the gradients": ["test_accumulate_gradients_neither_zeroes_nor_steps"],
        "do not step": ["test_accumulate_gradients_neither_zeroes_nor_steps"],
    },
}


ACCUMULATION_GROUPS = group_params(world_sizes=(2,), cuda_world_sizes=(2,),
                                   nccl_world_sizes=(2,))


def accumulating_on_rank(ctx, k: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False  # compared with a CPU run
    lab10 = lab("10_no_sync")
    model = DDP(lab10.make_model().to(ctx.device),
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    counter = {"buckets": 0, "elements": 0}
    model.register_comm_hook(None, lab10.counting_hook(counter))
    # Whether no_sync() was on at each forward (where DDP decides whether the next backward
    # all-reduces) and at each backward (once the first parameter's gradient is in).
    synced = {"forward": [], "backward": []}
    model.register_forward_pre_hook(
        lambda module, args: synced["forward"].append(module.require_backward_grad_sync))
    next(model.module.parameters()).register_post_accumulate_grad_hook(
        lambda param: synced["backward"].append(model.require_backward_grad_sync))
    batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in lab10.micro_batches(ctx.rank, k)]
    load_exercise(LESSON).accumulate_gradients(model, batches, mse_of_output_and_target)
    parameters = sum(p.numel() for p in model.parameters())
    return {"gradients": {n: p.grad for n, p in model.module.named_parameters()},
            "rounds": counter["elements"] / parameters, **synced}


def accumulation_problem(r: dict, k: int) -> str:
    """Why DDP did not all-reduce every gradient exactly once over the k micro-batches."""
    rounds, forward, backward = r["rounds"], r["forward"], r["backward"]
    armed_early = [i for i, (armed, syncs) in enumerate(zip(forward, backward, strict=False))
                   if armed and not syncs]
    if rounds > 1 and armed_early:
        return (f"DDP all-reduced every gradient {rounds:g} times for {k} micro-batches: the "
                f"forward ran outside no_sync(): DDP armed the all-reduce in forward (it reads "
                f"require_backward_grad_sync there), so the backward inside no_sync() still "
                f"all-reduced (micro-batches {armed_early}). Run the forward and the backward "
                f"of all but the last micro-batch inside `with model.no_sync():`")
    if rounds > 1:
        return (f"DDP all-reduced every gradient {rounds:g} times for {k} micro-batches; "
                f"expected once: run the forward and the backward of all but the last "
                f"micro-batch inside `with model.no_sync():`")
    if rounds == 0 and forward and not forward[-1] and backward and backward[-1]:
        return ("no gradient was all-reduced: the last micro-batch's forward ran inside "
                "no_sync(), and DDP decides in forward whether the backward all-reduces. Run "
                "the last micro-batch's forward and backward outside no_sync()")
    if rounds == 0:
        return ("no gradient was all-reduced: the last micro-batch (forward and backward) must "
                "run outside no_sync(), so that its backward all-reduces the accumulated sum")
    if rounds != 1:
        return f"DDP all-reduced {rounds:g} of every gradient's elements; expected all, once"
    return ""


@pytest.mark.task4_6
@pytest.mark.parametrize("group", ACCUMULATION_GROUPS)
def test_accumulate_gradients_syncs_once_and_equals_the_full_batch(ex, group):
    """For 4 micro-batches, DDP all-reduces every gradient exactly once (a communication hook
    counts), and the gradient equals one process's on all ranks' micro-batches; 2 ranks, gloo on the
    CPU, and with GPUs gloo on `cuda:0` and nccl."""
    raise_if_untouched(ex.accumulate_gradients)  # not attempted: no ranks
    world, backend, device = group
    k = 4
    lab10 = lab("10_no_sync")
    results = run_on_ranks(accumulating_on_rank, k, world_size=world, backend=backend,
                           device=device)
    reference = lab10.make_model()
    everything = [b for r in range(world) for b in lab10.micro_batches(r, k)]
    inputs, targets = (torch.cat(parts) for parts in zip(*everything, strict=True))
    nn.functional.mse_loss(reference(inputs), targets).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for rank, r in enumerate(results):
        problem = accumulation_problem(r, k)
        assert not problem, f"rank {rank}: {problem}"
        assert_parameters_close(r["gradients"], expected, rank=rank,
                                what="accumulated gradient vs one process on the full batch "
                                     "(divide each micro-batch loss by k)")


EARLIER_GRADIENT = 0.25  # what the caller's earlier backwards left in every .grad, on every rank


def accumulating_onto_earlier_gradients(ctx, k: int) -> dict:
    lab10 = lab("10_no_sync")
    model = DDP(lab10.make_model())
    for p in model.parameters():
        p.grad = torch.full_like(p, EARLIER_GRADIENT)
    weights = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    load_exercise(LESSON).accumulate_gradients(model, lab10.micro_batches(ctx.rank, k),
                                               mse_of_output_and_target)
    return {"gradients": {n: p.grad for n, p in model.module.named_parameters()},
            "weights_before": weights,
            "weights_after": {n: p.detach().clone() for n, p in model.module.named_parameters()}}


@pytest.mark.task4_6
def test_accumulate_gradients_neither_zeroes_nor_steps(ex):
    """On 2 gloo ranks, gradients of 0.25 already in `.grad` are kept: after the call every gradient
    is 0.25 plus the full batch's, and no weight has changed."""
    raise_if_untouched(ex.accumulate_gradients)  # not attempted: no ranks
    k = 4
    results = run_on_ranks(accumulating_onto_earlier_gradients, k)
    lab10 = lab("10_no_sync")
    reference = lab10.make_model()
    everything = [b for r in range(len(results)) for b in lab10.micro_batches(r, k)]
    inputs, targets = (torch.cat(parts) for parts in zip(*everything, strict=True))
    nn.functional.mse_loss(reference(inputs), targets).backward()
    for rank, r in enumerate(results):
        for name, before in r["weights_before"].items():
            assert torch.equal(r["weights_after"][name], before), (
                f"rank {rank}: accumulate_gradients changed the weight {name!r}: do not step, "
                f"the caller steps once the gradients are accumulated")
        for name, p in reference.named_parameters():
            got = r["gradients"][name]
            assert got is not None, f"rank {rank}: {name!r} has no gradient after the call"
            if torch.allclose(got, p.grad, rtol=1e-4, atol=1e-6):
                raise AssertionError(
                    f"rank {rank}: the gradient of {name!r} holds only this call's micro-batches: "
                    f"what the caller had accumulated before ({EARLIER_GRADIENT} in every "
                    f"element) is gone. Do not zero the gradients: the caller does, before its "
                    f"first micro-batch")
            assert_close(got, p.grad + EARLIER_GRADIENT,
                         f"gradient of {name!r}: the caller's earlier gradient plus this call's",
                         rank=rank)
