"""What the test files of lesson 07 share: the running example at its tiny size, the tests'
own even cut of it into stages, and the reference every pipeline is held to.

The reference is one process on the whole batch, with SGD: a gradient m times too large (or
1/m) moves the weights m times too far, where Adam would normalise the mistake away.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.distributed.pipelining  # noqa: F401 - imported here once, so that forked ranks have it
import torch.nn.functional as F
from gpt import GPT, GPTConfig, GPTStage
from torch import nn

from harness.compare import assert_close
from harness.launch import QUICK_SAMPLE
from harness.ranks import group_params

LESSON = "07_pipeline_parallel"
SCRIPT = f"lessons/{LESSON}/train_pp.py"
TRAIN = ("--epochs", "1", "--train-windows", "64", *QUICK_SAMPLE)  # 1 epoch, 64 windows
# balance_stages.py's smallest run: 4 blocks, 16 wide, a vocabulary of 256, 2 micro-batches
BALANCE = ("--blocks", "4", "--width", "16", "--vocab-size", "256", "--context", "16",
           "--micro-batch-size", "2", "--micro-batches", "2", "--steps", "1", "--repeats", "1")
# 4 blocks: 2 stages of 2 blocks, or 4 of 1. Biases on: SGD steps on them as on the rest.
CONFIG = dict(vocab_size=29, block_size=8, n_layer=4, n_head=2, n_embd=16, bias=True)
BATCH = 8  # sequences per step: 1, 2, 4 or 8 micro-batches
STEPS = 2
SGD = {"lr": 0.5}
# gloo with CPU tensors; on GPUs nccl, one rank per GPU (gloo's send and receive of CUDA tensors
# is not something the course has run).
GROUPS = group_params(world_sizes=(2, 4), cuda_world_sizes=(), nccl_world_sizes=(2, 4))


def make_gpt(**overrides) -> GPT:
    return GPT(GPTConfig(**{**CONFIG, **overrides}), seed=0)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"] + 1),
                           generator=generator)
    # Contiguous, as a DataLoader's batch is: torch 2.11's pipelining compares each input's
    # strides with the stage's example input, and a slice of the (B, S + 1) tokens has S + 1.
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@functools.cache
def one_process(steps: int = STEPS) -> dict:
    """The unsplit model on the whole batch, SGD: the parameters after each step, the first
    step's gradients, and its micro-batch losses for each micro-batch count."""
    model = make_gpt()
    optimizer = torch.optim.SGD(model.parameters(), **SGD)
    out = {"states": [], "losses": {}}
    inputs, targets = batch(0)
    with torch.no_grad():
        for m in (1, 2, 4, 8):
            out["losses"][m] = [model(x, y)[1].item()
                                for x, y in zip(inputs.chunk(m), targets.chunk(m), strict=True)]
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(*batch(step))[1].backward()
        if step == 0:
            out["grads"] = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        out["states"].append({name: p.detach().clone() for name, p in model.named_parameters()})
    return out


def my_stage(model: GPT, stage: int, num_stages: int) -> GPTStage:
    """The tests' own cut: equal runs of blocks (task7_3 asks for the balanced one)."""
    per = CONFIG["n_layer"] // num_stages
    return GPTStage(model, stage * per, (stage + 1) * per)


def owned(model: GPT, module: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters that ``module`` holds, by the model's names."""
    mine = {id(p) for p in module.parameters()}
    return {name: p for name, p in model.named_parameters() if id(p) in mine}


def train_stage(model: GPT, stage: nn.Module, step_fn, steps: int) -> dict:
    """SGD on this rank's ``stage`` for ``steps`` steps; ``step_fn(step)`` runs one step's
    forwards and backwards (through a pipeline) and returns the last stage's losses. The stage's
    parameters after each step (by the model's names), its gradients and losses of the first."""
    optimizer = torch.optim.SGD(stage.parameters(), **SGD)
    out = {"states": [], "grads": {}, "losses": None}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses = step_fn(step)
        if step == 0:
            out["grads"] = {n: None if p.grad is None else p.grad.clone()
                            for n, p in owned(model, stage).items()}
            out["losses"] = losses
        optimizer.step()
        out["states"].append({n: p.detach().clone() for n, p in owned(model, stage).items()})
    return out


def assert_trains_like_one_process(results: list[dict], what: str, m: int) -> None:
    """Every rank's parameters (each its own stage's) against the unsplit model's."""
    __tracebackhide__ = True
    reference = one_process()
    covered = set().union(*(r["states"][0] for r in results))
    missing = sorted(set(reference["grads"]) - covered)
    assert not missing, f"{what}: no stage holds {missing[:3]}"
    for rank, got in enumerate(results):
        for name, grad in got["grads"].items():
            if grad is None:
                raise AssertionError(f"rank {rank}: {what}: {name!r} has no gradient after the "
                                     f"first step: no backward reached stage {rank}")
            try:
                assert_close(grad, reference["grads"][name], f"{what}: the first step's gradient "
                             f"of {name!r}", rank)
            except AssertionError as error:
                ratio = float((grad * reference["grads"][name]).sum()
                              / (reference["grads"][name] ** 2).sum())
                hint = (f": it is {ratio:.3g}x the whole batch's. Each micro-batch's mean loss "
                        f"is divided by m = {m} before its backward, so that the m gradients "
                        f"add up to the batch's mean" if m > 1 and abs(ratio - m) < 1e-3 * m
                        else "")
                raise AssertionError(f"{error}{hint}") from None
        for step, state in enumerate(got["states"]):
            for name, tensor in state.items():
                assert_close(tensor, reference["states"][step][name], f"{what}: {name!r} after "
                             f"SGD step {step + 1}", rank)




def torch_orders(schedule: str, max_ranks: int, max_chunks: int,
                 max_micro_batches: int) -> dict:
    """The orders torch's own schedules build, the oracle of tasks 7_5 and 7_6: for every p, v
    and m up to the maxima, each rank's actions as ``("F", i, c)``, ``("B", i, c)`` (with
    ``"zero-bubble"``, the input's gradient only) and ``("W", i, c)`` (the weights'), read from
    ``pipeline_order`` (its idle slots left out), or ``None`` where torch refuses the shape.
    ``schedule`` is ``"interleaved"`` (``ScheduleInterleaved1F1B``, rank r's chunk c being
    stage c * p + r) or ``"zero-bubble"`` (``ScheduleInterleavedZeroBubble``, the same layout).
    It opens torch's fake process group of p ranks, so run it in a process of its own
    (``harness.ranks.in_a_child``)."""
    import re

    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.testing._internal.distributed.fake_pg import FakeStore  # the fake group's store

    cls = {"interleaved": pipelining.ScheduleInterleaved1F1B,
           "zero-bubble": pipelining.ScheduleInterleavedZeroBubble}[schedule]
    kinds = {"F": "F", "B": "B", "I": "B", "W": "W"}  # I: torch's BACKWARD_INPUT
    orders = {}
    for p in range(1, max_ranks + 1):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p)
        try:
            for v in range(1, max_chunks + 1):
                stages = [pipelining.PipelineStage(nn.Identity(), c * p, p * v,
                                                   torch.device("cpu")) for c in range(v)]
                for m in range(1, max_micro_batches + 1):
                    try:
                        built = cls(stages, m)
                    except ValueError:  # m not a multiple of its rounds
                        orders[p, v, m] = None
                        continue
                    ranks = []
                    for rank in range(p):
                        actions = []
                        for action in filter(None, built.pipeline_order[rank]):
                            stage, kind, micro_batch = re.fullmatch(  # "5F2": stage 5, F, mb 2
                                r"(\d+)([FBIW])(\d+)", str(action)).groups()
                            actions.append((kinds[kind], int(micro_batch), int(stage) // p))
                        ranks.append(actions)
                    orders[p, v, m] = ranks
        finally:
            dist.destroy_process_group()
    return orders


# Cuts of layers into stages, by brute force: task7_8's oracle and balance_stages.py's.
def stage_times(seconds: list[float], counts: list[int]) -> list[float]:
    starts = [0, *itertools.accumulate(counts)]
    return [sum(seconds[a:b]) for a, b in itertools.pairwise(starts)]


def every_cut(seconds: list[float], stages: int):
    """(slowest stage's time, counts) of every cut, in itertools.combinations order."""
    n = len(seconds)
    for cuts in itertools.combinations(range(1, n), stages - 1):
        counts = [b - a for a, b in itertools.pairwise((0, *cuts, n))]
        yield max(stage_times(seconds, counts)), counts
