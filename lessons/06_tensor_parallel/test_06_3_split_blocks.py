"""Lesson 06, task6_3: the split blocks (TensorParallelAttention, TensorParallelMLP,
tensor_parallel_blocks). The running example split by hand trains as the unsplit one does, step
after step, with two all-reduces of one activation per block each way, within its group only.
On gloo/CPU ranks (and on CUDA where present).

    pytest lessons/06_tensor_parallel -m task6_3
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.collectives import CollectiveLog
from harness.compare import assert_close, full_fp32
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import run_on_ranks
from lesson06.common import (
    BATCH,
    CONFIG,
    GROUPS,
    LESSON,
    SGD,
    STEPS,
    WORLDS,
    activation_bytes,
    assert_copies,
    assert_refused,
    assert_slices_of,
    batch,
    forward_or_explain,
    local,
    make_gpt,
    one_process,
    rank_weights,
    refused,
)

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task6_3": {
        "TensorParallelMLP: up_proj a ColumnParallelLinear, down_proj a RowParallelLinear":
            ["test_split_attention_and_mlp_give_the_input_its_whole_gradient",
             "test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "self.drop = mlp.drop; it is an MLP, so MLP.forward runs as it is":
            ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "one all-reduce per forward and one per backward":
            ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "TensorParallelMLP(mlp, group): its layers split within group":
            ["test_split_blocks_use_their_group_only"],
        "TensorParallelAttention: the number of heads must divide by W (split_size)":
            ["test_split_attention_refuses_heads_that_do_not_divide"],
        "q_proj, k_proj and v_proj ColumnParallelLinears with copy_input=False":
            ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "out_proj a RowParallelLinear": [
            "test_split_attention_and_mlp_give_the_input_its_whole_gradient",
            "test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "head_dim, dropout and resid_drop are kept":
            ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "group as self.group for the forward": ["test_split_blocks_use_their_group_only"],
        "forward: copy_to_parallel(x, group) once, for all three projections":
            ["test_split_attention_and_mlp_give_the_input_its_whole_gradient",
             "test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "then CausalSelfAttention.forward as it is":
            ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "tensor_parallel_blocks: each block.attn a TensorParallelAttention, block.mlp a "
        "TensorParallelMLP": ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "tensor_parallel_blocks splits in place": [
            "test_tensor_parallel_blocks_splits_the_model_in_place"],
        "tensor_parallel_blocks(model, group) splits within group":
            ["test_split_blocks_use_their_group_only"],
        "everything else stays whole and replicated":
            ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "returns model": ["test_tensor_parallel_gpt_trains_like_the_unsplit_model",
                          "test_tensor_parallel_blocks_splits_the_model_in_place"],
    },
}


def block_parameters(world: int) -> int:
    """Parameters one rank keeps of one block: 1/W of every split weight and of the column
    layers' biases; the row layers' biases and the layer norms whole."""
    c = CONFIG["n_embd"]
    split = 4 * c * c + 8 * c * c + 3 * c + 4 * c  # q, k, v, out, up, down weights; col biases
    whole = 2 * c + 4 * c  # out_proj and down_proj biases; two layer norms
    return split // world + whole


def layer_input_grad_run(ctx, layer: str):
    """The input gradient of one split block part (attention or MLP) alone, on this rank."""
    ex = load_exercise(LESSON)
    with full_fp32():  # compared with a CPU run: no TF32
        block = make_gpt().blocks[0].to(ctx.device)
        part = (ex.TensorParallelAttention(block.attn) if layer == "attn"
                else ex.TensorParallelMLP(block.mlp))
        x = rank_weights(-4, (BATCH, CONFIG["block_size"], CONFIG["n_embd"])).to(ctx.device)
        x.requires_grad_(True)
        c = rank_weights(-5, x.shape).to(ctx.device)
        out = part(x)
        (out * c).sum().backward()
        return {"out": out.detach(), "grad": x.grad}


@pytest.mark.task6_3
@pytest.mark.parametrize("layer", ["attn", "mlp"])
@pytest.mark.parametrize("world", WORLDS)
def test_split_attention_and_mlp_give_the_input_its_whole_gradient(ex, layer, world):
    """TensorParallelAttention and TensorParallelMLP, each alone, give the unsplit part's output and
    its input's whole gradient on every rank, on 2 and 4 gloo ranks; a gradient that only sums to
    the right one over the ranks is named as a missing f, one W times too large as an all-reduce in
    g's backward.

    Before the training test: with -x, its message is the one a learner reads first."""
    raise_if_untouched(ex.TensorParallelAttention.__init__, ex.TensorParallelMLP.__init__)
    results = run_on_ranks(layer_input_grad_run, layer, world_size=world)
    block = make_gpt().blocks[0]
    part = block.attn if layer == "attn" else block.mlp
    x = rank_weights(-4, (BATCH, CONFIG["block_size"], CONFIG["n_embd"])).requires_grad_(True)
    out = part(x)
    (out * rank_weights(-5, x.shape)).sum().backward()
    name = {"attn": "TensorParallelAttention", "mlp": "TensorParallelMLP"}[layer]
    for rank, got in enumerate(results):
        assert_close(got["out"], out.detach(), f"{name}'s output", rank)
        try:
            assert_close(got["grad"], x.grad, f"{name}: the gradient of its input", rank)
        except AssertionError as error:
            summed = sum(r["grad"] for r in results)
            mean_ratio = float((got["grad"] * x.grad).sum() / (x.grad * x.grad).sum())
            if torch.allclose(summed, x.grad, atol=1e-4):
                why = (f"each rank's input gradient is only its own heads' or features' part "
                       f"(on average 1/{world} of the whole: {mean_ratio:.2f} here); summed "
                       f"over the {world} ranks it is right. The copy_to_parallel (f) at the "
                       f"input of the split layers is missing")
            elif torch.allclose(got["grad"], world * x.grad, rtol=1e-3, atol=1e-4):
                why = (f"it is {world}x the whole: the input's gradient is all-reduced once "
                       f"too often. ReduceFromParallel's (g's) backward must pass the gradient "
                       f"through unchanged")
            else:
                why = ""
            raise AssertionError(f"{error}" + (f": {why}" if why else "")) from None


def hand_tp_run(ctx, steps: int):
    """The running example split by tensor_parallel_blocks, trained with SGD on the whole
    batch; every rank's parameters after each step, and the collectives of the first step."""
    ex = load_exercise(LESSON)
    with full_fp32():  # compared with a CPU run: no TF32
        model = ex.tensor_parallel_blocks(make_gpt().to(ctx.device))
        optimizer = torch.optim.SGD(model.parameters(), **SGD)
        block = model.blocks[0]
        out = {"states": [], "block_parameters": sum(p.numel() for p in block.parameters()),
               "storage": {name: (p.untyped_storage().nbytes(), p.numel() * p.element_size())
                           for name, p in block.named_parameters()}}
        for step in range(steps):
            inputs, targets = (t.to(ctx.device) for t in batch(step))
            optimizer.zero_grad(set_to_none=True)
            with CollectiveLog(ex) as forward:
                loss = forward_or_explain(model, inputs, targets, "tensor_parallel_blocks")
            with CollectiveLog(ex) as backward:
                loss.backward()
            optimizer.step()
            if step == 0:
                out["forward"] = [(c.op, c.payload) for c in forward.calls]
                out["backward"] = [(c.op, c.payload) for c in backward.calls]
            out["states"].append({name: local(p) for name, p in model.named_parameters()})
        return out


def assert_collectives(calls, phase: str, rank: int, hint: str) -> None:
    """One all-reduce of one activation per split layer pair: two per block."""
    __tracebackhide__ = True
    blocks = CONFIG["n_layer"]
    expected = [("all_reduce", activation_bytes())] * 2 * blocks
    if calls != expected:
        ops = [op for op, _ in calls]
        raise AssertionError(
            f"rank {rank}: the {phase} of {blocks} split blocks ran {len(calls)} collectives "
            f"({', '.join(sorted(set(ops))) or 'none'}), expected {2 * blocks} all-reduces of "
            f"{activation_bytes()} bytes (one activation, {BATCH} x {CONFIG['block_size']} x "
            f"{CONFIG['n_embd']} fp32): one for the attention and one for the MLP of each "
            f"block. {hint}")


@pytest.mark.task6_3
@pytest.mark.parametrize("group", GROUPS)
def test_tensor_parallel_gpt_trains_like_the_unsplit_model(ex, group):
    """The running example split by `tensor_parallel_blocks` trains as the unsplit one on the same
    batch: every rank's parameters against its slices of one process's after each of 3 SGD steps, on
    2 and 4 gloo ranks, with 2 all-reduces of one fp32 activation per block each way.

    The collectives are counted by wrapping them. Each rank keeps, of a block, 1/W of the split
    weights and of the column layers' biases and the rest whole (a parameter count), each slice a
    copy that owns its memory."""
    world, backend, device = group
    raise_if_untouched(ex.tensor_parallel_blocks, ex.TensorParallelAttention.__init__,
                       ex.TensorParallelMLP.__init__)
    results = run_on_ranks(hand_tp_run, STEPS, world_size=world, backend=backend, device=device)
    for rank, got in enumerate(results):
        assert got["block_parameters"] == block_parameters(world), (
            f"rank {rank}: keeps {got['block_parameters']} parameters of a block, expected "
            f"{block_parameters(world)}: 1/{world} of each split layer, the rest whole")
        assert_copies(got["storage"], rank, "block 0")
        assert_collectives(got["forward"], "forward", rank,
                           "In forward only the row-parallel layers (out_proj, down_proj) "
                           "all-reduce.")
        assert_collectives(got["backward"], "backward", rank,
                           "In backward only the copies into the split layers all-reduce: "
                           "the attention copies x once for q, k and v (copy_input=False on "
                           "each), the MLP's up_proj once.")
    for step, whole in enumerate(one_process()):
        assert_slices_of([r["states"][step] for r in results], whole,
                         f"after SGD step {step + 1}, the parameter")


@pytest.mark.task6_3
def test_split_attention_refuses_heads_that_do_not_divide(ex):
    """TensorParallelAttention raises a ValueError naming 6 and 4 for 6 heads of 4 features on 4
    gloo ranks, though the 24 features would split evenly (6 each, a head and a half)."""
    raise_if_untouched(ex.TensorParallelAttention.__init__)
    results = run_on_ranks(refused, "TensorParallelAttention", 0, 0, world_size=4,
                           n_head=6, n_embd=24)
    assert_refused(results, "TensorParallelAttention", 6, 4)


def pair_blocks_run(ctx) -> dict:
    """On 4 ranks in pairs [0, 1] and [2, 3], each pair on inputs of its own: the split
    attention and MLP with group= the pair (output and input gradient), and the running example
    split by tensor_parallel_blocks(model, group) (its loss)."""
    ex = load_exercise(LESSON)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    pair = ctx.rank // 2
    group = pairs[pair]
    block = make_gpt().blocks[0]
    out = {}
    for name, part in (("attn", ex.TensorParallelAttention(block.attn, group)),
                       ("mlp", ex.TensorParallelMLP(block.mlp, group))):
        x = rank_weights(-40 - pair, (BATCH, CONFIG["block_size"], CONFIG["n_embd"]))
        x.requires_grad_(True)
        y = part(x)
        (y * rank_weights(-5, x.shape)).sum().backward()
        out[name] = {"out": y.detach(), "grad": x.grad}
    model = ex.tensor_parallel_blocks(make_gpt(), group)
    out["loss"] = model(*batch(10 + pair))[1].detach()
    return out


@pytest.mark.task6_3
def test_split_blocks_use_their_group_only(ex):
    """The split attention and MLP with `group=`, and `tensor_parallel_blocks(model, group)`, split
    within the group: on 4 gloo ranks in two groups of 2, each on inputs of its own, outputs, input
    gradients and the model's loss equal the unsplit ones on that pair's input."""
    raise_if_untouched(ex.TensorParallelAttention.__init__, ex.TensorParallelMLP.__init__,
                       ex.tensor_parallel_blocks)
    results = run_on_ranks(pair_blocks_run, world_size=4)
    block, model = make_gpt().blocks[0], make_gpt()
    for rank, got in enumerate(results):
        pair = rank // 2
        mates = [2 * pair, 2 * pair + 1]
        for name, part in (("attn", block.attn), ("mlp", block.mlp)):
            what = {"attn": "TensorParallelAttention", "mlp": "TensorParallelMLP"}[name]
            x = rank_weights(-40 - pair, (BATCH, CONFIG["block_size"], CONFIG["n_embd"]))
            x.requires_grad_(True)
            y = part(x)
            (y * rank_weights(-5, x.shape)).sum().backward()
            hint = (f": with group={mates} every collective, and the slices each rank keeps, "
                    f"belong to that group of 2, not to all 4 ranks. Pass group to each split "
                    f"layer" + (" and keep it as self.group for the copy_to_parallel in forward"
                                if name == "attn" else ""))
            for key, want, kind in (("out", y.detach(), "output"), ("grad", x.grad,
                                                                    "input's gradient")):
                try:
                    assert_close(got[name][key], want, f"{what}(..., group={mates}): its {kind}",
                                 rank)
                except AssertionError as error:
                    raise AssertionError(f"{error}{hint}") from None
        with torch.no_grad():
            loss = model(*batch(10 + pair))[1]
        try:
            assert_close(got["loss"], loss, f"tensor_parallel_blocks(model, group={mates}): the "
                         f"loss", rank)
        except AssertionError as error:
            raise AssertionError(f"{error}: pass group on to every TensorParallelAttention and "
                                 f"TensorParallelMLP it builds") from None


def split_in_place(ctx) -> dict:
    ex = load_exercise(LESSON)
    model = make_gpt()
    returned = ex.tensor_parallel_blocks(model)
    return {"same": returned is model, "returned": type(returned).__name__,
            "parts": [(type(b.attn).__name__, type(b.mlp).__name__) for b in model.blocks]}


@pytest.mark.task6_3
def test_tensor_parallel_blocks_splits_the_model_in_place(ex):
    """`tensor_parallel_blocks(model)` splits the model's own blocks and returns the model itself:
    on 2 gloo ranks, every block's attn and mlp are then a TensorParallelAttention and a
    TensorParallelMLP."""
    raise_if_untouched(ex.tensor_parallel_blocks)
    for rank, got in enumerate(run_on_ranks(split_in_place, world_size=2)):
        assert got["parts"] == [("TensorParallelAttention", "TensorParallelMLP")] * len(
            got["parts"]), (
            f"rank {rank}: after tensor_parallel_blocks(model), the model's own blocks hold "
            f"{got['parts']}: split them in place (block.attn = TensorParallelAttention(...), "
            f"block.mlp = TensorParallelMLP(...)), not a copy of the model")
        assert got["same"], (
            f"rank {rank}: tensor_parallel_blocks(model) returned a {got['returned']} that is "
            f"not model itself: return model, split in place")
