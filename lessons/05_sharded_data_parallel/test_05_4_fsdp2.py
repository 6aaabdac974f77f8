"""Grades task5_4, shard_model (FSDP2): trained beside DDP; the all-gathers and reduce-scatters of
a step and what a rank holds at the end of the forward, with reshard_after_forward True and False;
a rank given another model; the mp_policy passed to every fully_shard.

    pytest lessons/05_sharded_data_parallel -m task5_4
"""

from __future__ import annotations

import re

import pytest
import torch
from gpt import GPT
from torch import nn

from harness.collectives import CollectiveLog
from harness.exercises import load_exercise, raise_if_untouched
from harness.memory import held_bytes
from harness.ranks import run_on_ranks
from lesson05.common import (
    FSDP_GROUPS,
    LESSON,
    MEMORY_TOLERANCE,
    STEPS,
    assert_holds_the_formula,
    assert_same_as_ddp,
    kb,
    make_gpt,
    my_share,
    num_params,
    one_process,
    sharded_by,
    train_beside_ddp,
)

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task5_4": {
        "check that it is the same on every rank: names and shapes, all_gather_object":
            ["test_shard_model_refuses_a_rank_with_another_model"],
        "raise ValueError naming the first rank that differs from rank 0":
            ["test_shard_model_refuses_a_rank_with_another_model"],
        "and the first parameter where it differs":
            ["test_shard_model_names_the_first_parameter_that_differs"],
        "where one rank's parameters are the other's with more after them: both counts":
            ["test_shard_model_gives_both_counts_when_one_model_has_more_at_the_end"],
        "a mesh over all ranks: init_device_mesh(<the parameters' device type>, (world_size,))":
            ["test_shard_model_trains_like_ddp"],
        "fully_shard each block first, then the root": [
            "test_shard_model_trains_like_ddp",
            "test_reshard_after_forward_trades_memory_for_an_all_gather"],
        "each block's fully_shard gets reshard_after_forward":
            ["test_reshard_after_forward_trades_memory_for_an_all_gather"],
        "mp_policy given is passed to every fully_shard":
            ["test_shard_model_passes_the_mp_policy_to_every_fully_shard"],
        "MixedPrecisionPolicy() (no mixed precision) when mp_policy is None":
            ["test_shard_model_trains_like_ddp"],
        "leave the root's reshard_after_forward to FSDP":
            ["test_reshard_after_forward_trades_memory_for_an_all_gather"],
        "return it": ["test_shard_model_trains_like_ddp"],
    },
}


@pytest.mark.task5_4
@pytest.mark.parametrize("group", FSDP_GROUPS)
def test_shard_model_trains_like_ddp(ex, group):
    """`shard_model` takes DDP's steps: every parameter after each of 3 AdamW steps on 2, 3 and
    4 gloo ranks, against DDP and (the last step) one process on the whole batches; a rank holds
    the formula's ZeRO-3 bytes after the backward of step 2, within 10 %."""
    raise_if_untouched(ex.shard_model)  # a stub: not attempted, without starting ranks
    world, backend, device = group
    results = run_on_ranks(train_beside_ddp, "fsdp", "adamw", STEPS, world_size=world,
                           backend=backend, device=device)
    psi = num_params(make_gpt())
    for rank, result in enumerate(results):
        assert_same_as_ddp(result, rank, world, "FSDP2", one_process("gpt", STEPS))
        assert_holds_the_formula(result["held"], psi, world, 3,
                                 "the model and the optimizer hold after backward", rank)


def fsdp_forward_and_backward(ctx, reshard_after_forward: bool):
    """One step of the learner's shard_model: what a rank holds at the end of the forward, and
    the collectives of the step."""
    ex = load_exercise(LESSON)
    # True is the default: that case calls shard_model(model) without it, so both are graded.
    options = {} if reshard_after_forward else {"reshard_after_forward": False}
    model = sharded_by(ex, make_gpt(), **options)
    inputs, targets = my_share(ctx, 0)
    with CollectiveLog(ex) as log:
        _, loss = model(inputs, targets)
        after_forward = held_bytes(model)
        loss.backward()
    return {"after_forward": after_forward, "all_gathers": log.count("all_gather"),
            "reduce_scatters": log.count("reduce_scatter"), "summary": log.summary(),
            "gathered": log.payload("all_gather"), "reduced": log.payload("reduce_scatter")}


def dim0_padded_bytes(module: nn.Module, world: int) -> int:
    """What FSDP2's collectives move for ``module``'s parameters: each cut along its first
    dimension into ``world`` pieces of ceil(rows / world) rows (the last padded), all of them."""
    return sum(4 * world * -(-p.shape[0] // world) * (p.numel() // p.shape[0])
               for p in module.parameters())


@pytest.mark.task5_4
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reshard", [True, False], ids=["default-reshard", "keep"])
def test_reshard_after_forward_trades_memory_for_an_all_gather(ex, world, reshard):
    """`reshard_after_forward=True`, the default, frees a block's gathered parameters after its
    forward and gathers them again for the backward; `False` keeps them: a step's collectives
    and their bytes, and what a rank holds after the forward (within 10 %), on 2 and 4 gloo
    ranks.

    The all-gathers are the root once and each block twice or once; the reduce-scatters one per
    group, every gradient once."""
    raise_if_untouched(ex.shard_model)  # a stub: not attempted, without starting ranks
    results = run_on_ranks(fsdp_forward_and_backward, reshard, world_size=world)
    called = ("shard_model(model), reshard_after_forward's default (True)" if reshard
              else "reshard_after_forward=False")
    model = make_gpt()
    blocks = len(model.blocks)
    psi = num_params(model)
    root = psi - num_params(model.blocks)
    shards = 4 * psi / world
    # At the end of the forward: every shard, plus what is still gathered whole.
    expected = shards + 4 * (root if reshard else psi)
    gathers = 1 + (2 if reshard else 1) * blocks
    block_bytes = dim0_padded_bytes(model.blocks, world)
    root_bytes = dim0_padded_bytes(model, world) - block_bytes
    for rank, result in enumerate(results):
        got = result["all_gathers"]
        one_group = ": one group for the whole model. fully_shard each block, then the root"
        why = {1: one_group, 2: one_group,
               1 + 2 * blocks: ": the blocks were gathered again for backward although "
                               "reshard_after_forward=False: pass it to each block's fully_shard",
               2 + 2 * blocks: ": the root was gathered again for backward: leave the root's "
                               "reshard_after_forward to FSDP, which keeps it gathered"}
        assert got == gathers, (
            f"rank {rank}, {called}: {got} all-gathers in a step "
            f"({result['summary']}), expected {gathers}: the root once and each block "
            f"{'twice (forward, then again for backward)' if reshard else 'once'}"
            + why.get(got, ""))
        assert result["reduce_scatters"] == 1 + blocks, (
            f"rank {rank}: {result['reduce_scatters']} reduce-scatters in a step "
            f"({result['summary']}); one per group: each of the {blocks} blocks and the root")
        # The communication table: the parameters gathered once or twice, the gradients
        # reduce-scattered once (with FSDP2's padding of each parameter's rows).
        expected_gathered = root_bytes + (2 if reshard else 1) * block_bytes
        assert result["gathered"] == expected_gathered, (
            f"rank {rank}: all-gathered {kb(result['gathered'])} in a step, expected the root's "
            f"parameters once and the blocks' {'twice' if reshard else 'once'}: "
            f"{kb(expected_gathered)} ({result['summary']})")
        assert result["reduced"] == root_bytes + block_bytes, (
            f"rank {rank}: reduce-scattered {kb(result['reduced'])} in a step, expected every "
            f"gradient once: {kb(root_bytes + block_bytes)} ({result['summary']})")
        held = result["after_forward"]
        assert abs(held - expected) <= MEMORY_TOLERANCE * expected, (
            f"rank {rank}, {called}: holds {kb(held)} at the end of the "
            f"forward, expected {kb(expected)}: the shards ({kb(shards)}) and the parameters "
            f"still gathered ({'the root' if reshard else 'all of them'}, "
            f"{kb(4 * (root if reshard else psi))})"
            + ("" if reshard or held > 0.9 * expected else
               ": reshard_after_forward=False should keep the blocks gathered: pass it to "
               "each block's fully_shard"))


OTHER_MODELS = {"one more block": {"n_layer": 3}, "wider": {"n_embd": 30}}


def shard_a_different_model(ctx, difference: str):
    ex = load_exercise(LESSON)
    model = make_gpt(**(OTHER_MODELS[difference] if ctx.rank == 1 else {}))
    try:
        ex.shard_model(model)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.task5_4
@pytest.mark.parametrize("difference", list(OTHER_MODELS))
def test_shard_model_refuses_a_rank_with_another_model(ex, difference):
    """`shard_model` raises a ValueError naming rank 1 when rank 1's model has one more block,
    or is wider, than rank 0's (2 gloo ranks)."""
    raise_if_untouched(ex.shard_model)  # a stub: not attempted, without starting ranks
    messages = run_on_ranks(shard_a_different_model, difference, world_size=2, timeout=20,
                            pg_timeout=5.0)
    for rank, message in enumerate(messages):
        assert message is not None, (
            f"rank {rank}: shard_model returned although rank 1's model differs from rank "
            f"0's ({difference}: {OTHER_MODELS[difference]}): their collectives would not "
            f"match and training would hang. Compare the parameters' names and shapes across "
            f"ranks first (dist.all_gather_object) and raise ValueError")
        assert re.search(r"\brank 1\b", message), (
            f"rank {rank}: the ValueError should name the rank that differs (rank 1): "
            f"{message!r}")


def first_differences(difference: str) -> set[str]:
    """The names a message may give as the first parameter where rank 1's model differs from
    rank 0's: at the first position where the (name, shape) lists differ, either rank's name;
    or the first name, in either rank's order, that the other lacks or holds in another shape."""
    mine = [(n, tuple(p.shape)) for n, p in make_gpt().named_parameters()]
    theirs = [(n, tuple(p.shape)) for n, p in make_gpt(**OTHER_MODELS[difference])
              .named_parameters()]
    names = set()
    position = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b)
    names.update({mine[position][0], theirs[position][0]})
    for one, other in ((mine, dict(theirs)), (theirs, dict(mine))):
        names.add(next((n for n, shape in one if other.get(n) != shape), None))
    return names - {None}


@pytest.mark.task5_4
@pytest.mark.parametrize("difference", list(OTHER_MODELS))
def test_shard_model_names_the_first_parameter_that_differs(ex, difference):
    """That ValueError names the first parameter where rank 1's model differs from rank 0's, one
    more block or wider (2 gloo ranks)."""
    raise_if_untouched(ex.shard_model)  # a stub: not attempted, without starting ranks
    messages = run_on_ranks(shard_a_different_model, difference, world_size=2, timeout=20,
                            pg_timeout=5.0)
    names = first_differences(difference)
    for rank, message in enumerate(messages):
        assert message is not None, (
            f"rank {rank}: shard_model returned although rank 1's model differs from rank "
            f"0's ({difference}): raise ValueError")
        assert any(re.search(rf"\b{re.escape(name)}\b", message) for name in names), (
            f"rank {rank}: the ValueError should name the first parameter where rank 1's model "
            f"differs ({' or '.join(sorted(names))}), with its shapes: {message!r}")


def with_a_layer_after_the_head() -> GPT:
    """The test's GPT with one more module registered last: its parameters are rank 0's, then
    two more (``extra.weight``, ``extra.bias``), so no position of the two lists differs."""
    model = make_gpt()
    model.extra = nn.Linear(2, 2)
    return model


def shard_a_model_with_more_at_the_end(ctx):
    ex = load_exercise(LESSON)
    model = with_a_layer_after_the_head() if ctx.rank == 1 else make_gpt()
    try:
        ex.shard_model(model)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.task5_4
def test_shard_model_gives_both_counts_when_one_model_has_more_at_the_end(ex):
    """When rank 1's parameters are rank 0's followed by two more, the ValueError gives both
    ranks' numbers of parameters (2 gloo ranks)."""
    raise_if_untouched(ex.shard_model)  # a stub: not attempted, without starting ranks
    messages = run_on_ranks(shard_a_model_with_more_at_the_end, world_size=2, timeout=20,
                            pg_timeout=5.0)
    counts = {0: len(list(make_gpt().parameters())),
              1: len(list(with_a_layer_after_the_head().parameters()))}
    for rank, message in enumerate(messages):
        assert message is not None, (
            f"rank {rank}: shard_model returned although rank 1's model has two parameters "
            f"more than rank 0's, after all of rank 0's: raise ValueError")
        numbers = {int(n) for n in re.findall(r"\b\d+\b", message)}
        missing = [f"rank {r}'s {counts[r]}" for r in counts if counts[r] not in numbers]
        assert not missing, (
            f"rank {rank}: rank 1's parameters are rank 0's ({counts[0]}) followed by two more "
            f"({counts[1]} in all), so no parameter differs where both have one; the ValueError "
            f"should then give both ranks' numbers of parameters, rank 0's and rank 1's, but "
            f"lacks {' and '.join(missing)}: {message!r}")


def shard_with_a_policy(ctx) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    ex = load_exercise(LESSON)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = sharded_by(ex, make_gpt(), mp_policy=policy)
    seen = {}
    # Each group's own forward pre-hook (FSDP's, registered first) has gathered its parameters
    # in the policy's dtype when these run: the root's before anything, block 0's before it.
    model.register_forward_pre_hook(
        lambda module, args: seen.update(root=module.lm_head.weight.dtype))
    model.blocks[0].register_forward_pre_hook(
        lambda module, args: seen.update(block=module.mlp.up_proj.weight.dtype))
    try:
        model(*my_share(ctx, 0))
    except RuntimeError as error:  # one group in bf16 and another in fp32: a matmul refuses
        seen["error"] = str(error).splitlines()[0][:200]
    return seen


@pytest.mark.task5_4
def test_shard_model_passes_the_mp_policy_to_every_fully_shard(ex):
    """With `mp_policy` a bf16 `MixedPrecisionPolicy`, both block 0 and the root run their
    forward on bf16 parameters: the policy reached every `fully_shard` (2 gloo ranks)."""
    raise_if_untouched(ex.shard_model)  # a stub: not attempted, without starting ranks
    for rank, seen in enumerate(run_on_ranks(shard_with_a_policy, world_size=2)):
        for where, group in (("block", "each block's"), ("root", "the root's")):
            assert seen.get(where) == torch.bfloat16, (
                f"rank {rank}: under shard_model(model, mp_policy=MixedPrecisionPolicy("
                f"param_dtype=torch.bfloat16)) the {where} ran its forward on "
                f"{seen.get(where)} parameters, not bfloat16: pass the mp_policy given to "
                f"{group} fully_shard, and to every other"
                + (f" (the forward then failed: {seen['error']})" if "error" in seen else ""))
        assert "error" not in seen, f"rank {rank}: the forward failed: {seen['error']}"
