"""Grades task5_8, build_sharded: a GPT built on the meta device, sharded, materialised and
initialised, against the oracle GPT(config, seed) built eagerly: every parameter gathered and
each rank's own rows, for generated sizes on 2 and 3 ranks and for a vocabulary of fewer rows
than ranks (always, not left to the sweep's draw); the fully_shard-ed modules; and the
most bytes a rank holds at once while building, measured with harness.memory.AllocationPeak.

    pytest lessons/05_sharded_data_parallel -m task5_8
"""

from __future__ import annotations

import pytest
import torch
from gpt import GPT, GPTConfig

from harness.exercises import load_exercise, raise_if_untouched
from harness.hardware import needs_gpus
from harness.memory import AllocationPeak
from harness.ranks import run_on_ranks
from harness.sweep import st, sweep
from lesson05.common import LESSON

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task5_8": {
        "the result is GPT(config, seed)": ["test_the_sharded_build_is_the_eager_one",
                                            "test_the_sharded_build_for_any_size",
                                            "test_a_parameter_with_fewer_rows_than_ranks"],
        "seed=0 by default": ["test_the_sharded_build_is_the_eager_one"],
        "sharded as lesson 05 shards it: fully_shard on each block, then on the model":
            ["test_the_sharded_build_is_the_eager_one"],
        "shard it there, then to_empty": ["test_the_sharded_build_is_the_eager_one"],
        "each rank allocates only its shards, never the whole model":
            ["test_a_rank_never_holds_the_whole_model"],
        "on a GPU device": "not testable on CPU: with device='cpu' an answer that ignores device "
                           "lands on the right device by chance; test_the_sharded_build_on_a_gpu "
                           "checks cuda where one is present",
    },
}

# Deep and narrow: the whole model (83 kB) is far more than a rank's shards plus a few of its
# largest parameter (4 kB each), so building it whole shows.
DEEP = dict(vocab_size=29, block_size=8, n_layer=6, n_head=2, n_embd=16, bias=True)
SLACK = 3  # whole parameters a rank may hold at once beyond its shards


def build_on_rank(ctx, config: dict, seed: int | None, device: str = "cpu") -> dict:
    """The learner's build, measured; each parameter's rows on this rank against the eager
    GPT's, and the gathered whole against it."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    ex = load_exercise(LESSON)
    whole = []  # the parameters that were not yet sharded when to_empty gave them memory
    real_to_empty = torch.nn.Module.to_empty

    def to_empty(module, *args, **kwargs):
        whole.extend(name for name, param in module.named_parameters()
                     if not hasattr(param, "to_local"))
        return real_to_empty(module, *args, **kwargs)

    torch.nn.Module.to_empty = to_empty
    try:
        with AllocationPeak() as peak:
            model = (ex.build_sharded(GPTConfig(**config), device=device) if seed is None
                     else ex.build_sharded(GPTConfig(**config), seed, device=device))
    finally:
        torch.nn.Module.to_empty = real_to_empty
    eager = GPT(GPTConfig(**config), seed=0 if seed is None else seed)
    names = [name for name, _ in eager.named_parameters()]
    mine = dict(model.named_parameters())
    if sorted(mine) != sorted(names):
        return {"names": sorted(mine), "want_names": sorted(names)}
    rows, wholes, shards = {}, {}, {}
    for name, want in eager.named_parameters():
        param = mine[name]
        if not hasattr(param, "to_local"):
            return {"unsharded": name}
        if param.to_local().device.type != torch.device(device).type:
            return {"device": f"{name} is on {param.to_local().device}, not {device}"}
        local = param.to_local().detach().cpu()
        expected = torch.chunk(want.detach(), ctx.world_size)
        expected = expected[ctx.rank] if ctx.rank < len(expected) else want[:0]
        rows[name] = torch.equal(local, expected)
        wholes[name] = (param.full_tensor().detach().cpu() - want.detach()).abs().max().item()
        storage = param.to_local().untyped_storage()
        shards[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    groups = [fully_shard.state(module) if isinstance(module, FSDPModule) else None
              for module in (model, *model.blocks)]
    return {"rows": rows, "wholes": wholes, "peak": peak.bytes, "shards": sum(shards.values()),
            "whole": whole, "own_groups": len({id(g) for g in groups}) == len(groups),
            "whole_model": sum(p.numel() * p.element_size() for p in eager.parameters()),
            "largest": max(p.numel() * p.element_size() for p in eager.parameters()),
            "fsdp": {name or "the model": isinstance(module, FSDPModule)
                     for name, module in [("", model), *((f"blocks.{i}", block)
                                                        for i, block in enumerate(model.blocks))]}}


def check_values(results: list[dict], call: str) -> None:
    first = results[0]
    if "names" in first:
        raise AssertionError(f"{call}: the parameters are named {first['names']}; expected "
                             f"GPT's names {first['want_names']}")
    if "unsharded" in first:
        raise AssertionError(f"{call}: {first['unsharded']} is a plain tensor, not a DTensor: "
                             f"fully_shard every block and the model")
    if "device" in first:
        raise AssertionError(f"{call}: {first['device']}: materialise with "
                             f"to_empty(device=device)")
    for name in first["rows"]:
        wrong = [rank for rank, got in enumerate(results) if not got["rows"][name]]
        if not wrong:
            continue
        if 0 not in wrong:
            raise AssertionError(
                f"{call}: rank 0's rows of {name} are GPT(config, seed)'s, but ranks {wrong}'s "
                f"are not: every rank must draw the same values, from a generator seeded with "
                f"seed alone, and keep its own rows")
        raise AssertionError(
            f"{call}: rank 0's rows of {name} differ from GPT(config, seed)'s (gathered, by "
            f"{first['wholes'][name]:.3g}): after to_empty the memory holds whatever was there; "
            f"initialise it with model.init_weights and a generator seeded with seed, the "
            f"eager build's values, not a module's own reset_parameters")


@pytest.mark.task5_8
@pytest.mark.parametrize(("world", "seed"), [(2, None), (3, 5)],
                         ids=["2-ranks-seed-default", "3-ranks-seed-5"])
def test_the_sharded_build_is_the_eager_one(ex, world, seed):
    """`build_sharded` of a 6-block GPT, on 2 ranks (the default seed) and 3 (seed 5), gives
    each rank the eager `GPT(config, seed)`'s rows of every parameter, every block and the model
    `fully_shard`-ed as groups of their own, and no parameter given memory before it was
    sharded."""
    raise_if_untouched(ex.build_sharded)  # "not attempted" here, not on the ranks
    seeded = "" if seed is None else f", seed={seed}"
    call = f"build_sharded(a 6-block GPT{seeded}) on {world} ranks"
    results = run_on_ranks(build_on_rank, DEEP, seed, world_size=world)
    check_values(results, call)
    unsharded = [name for name, sharded in results[0]["fsdp"].items() if not sharded]
    assert not unsharded, (
        f"{call}: {unsharded} are not fully_shard-ed: shard every block, then the model, each "
        f"block a group of its own as lesson 05 does")
    assert results[0]["own_groups"], (
        f"{call}: the blocks share one fully_shard group (fully_shard on a list of them?): "
        f"shard each block on its own, then the model, so that each is gathered alone")
    assert not results[0]["whole"], (
        f"{call}: to_empty gave memory to {results[0]['whole'][:4]} before they were sharded: "
        f"each rank held them whole; call to_empty once fully_shard has sharded every "
        f"parameter (the root last)")


@pytest.mark.task5_8
@sweep(max_examples=8, layers=st.integers(1, 3), heads=st.sampled_from([1, 2, 5]),
       vocab=st.integers(2, 40), bias=st.booleans(), world=st.sampled_from([2, 3]))
def test_the_sharded_build_for_any_size(ex, layers, heads, vocab, bias, world):
    """Each rank's rows of every parameter are the eager `GPT(config, 1)`'s for generated sizes
    (1 to 3 blocks, 1, 2 or 5 heads, vocabularies of 2 to 40, biases or not) on 2 and 3 gloo
    ranks."""
    config = dict(vocab_size=vocab, block_size=4, n_layer=layers, n_head=heads,
                  n_embd=5 * heads, bias=bias)
    raise_if_untouched(ex.build_sharded)
    check_values(run_on_ranks(build_on_rank, config, 1, world_size=world),
                 f"build_sharded(GPTConfig({config}), 1) on {world} ranks")


@pytest.mark.task5_8
def test_a_parameter_with_fewer_rows_than_ranks(ex):
    """A vocabulary of 2 on 3 gloo ranks, where the embedding and the head hold 1, 1 and 0 rows,
    builds with each rank's rows the eager build's; always tried, whatever the sweep draws.

    A whole tensor copied into such a DTensor under implicit_replication() raises (DTensor finds
    no sharding of 2 rows over 3 ranks)."""
    config = dict(vocab_size=2, block_size=4, n_layer=1, n_head=1, n_embd=5, bias=True)
    raise_if_untouched(ex.build_sharded)
    check_values(run_on_ranks(build_on_rank, config, 1, world_size=3),
                 f"build_sharded(GPTConfig({config}), 1) on 3 ranks, the vocabulary's 2 rows "
                 f"fewer than the ranks")


@pytest.mark.task5_8
@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_never_holds_the_whole_model(ex, world):
    """While `build_sharded` builds a 6-block GPT of 83 kB on 2 and 3 gloo ranks, no rank holds
    more at once (`AllocationPeak`) than its shards and three times the largest parameter."""
    raise_if_untouched(ex.build_sharded)
    for rank, got in enumerate(run_on_ranks(build_on_rank, DEEP, 0, world_size=world)):
        allowed = got["shards"] + SLACK * got["largest"]
        assert got["peak"] <= allowed, (
            f"rank {rank} of {world}: build_sharded(a 6-block GPT) held {got['peak']:,} bytes "
            f"at once while building, more than its shards ({got['shards']:,}) and {SLACK} of "
            f"the largest parameter ({got['largest']:,} each): the whole model is "
            f"{got['whole_model']:,} bytes. Build on the meta device and call to_empty only "
            f"after fully_shard, so that no rank ever materialises the whole model")


@needs_gpus(1, "build_sharded on a CUDA device")
@pytest.mark.task5_8
def test_the_sharded_build_on_a_gpu(ex):
    """`build_sharded(..., device='cuda')` on one nccl rank puts every shard on the GPU with the
    eager build's values."""
    raise_if_untouched(ex.build_sharded)
    results = run_on_ranks(build_on_rank, DEEP, 0, "cuda", world_size=1, backend="nccl",
                           device="cuda")
    check_values(results, "build_sharded(a 6-block GPT, device='cuda') on 1 nccl rank")
