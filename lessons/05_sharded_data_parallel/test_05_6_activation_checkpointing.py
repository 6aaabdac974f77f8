"""Grades task5_6, checkpoint_blocks: activation checkpointing against the same model unwrapped,
the oracle. A step with dropout (loss, gradients, the generator after it), which blocks run
their forward twice, the bytes autograd keeps, frozen embeddings, the state dict's keys, and
fully_shard on top, for generated depths and spacings.

    pytest lessons/05_sharded_data_parallel -m task5_6
"""

from __future__ import annotations

import warnings

import pytest
import torch
from gpt import GPT, GPTConfig

from harness.exercises import load_exercise
from harness.ranks import run_on_ranks
from harness.sweep import st, sweep
from lesson05.common import LESSON

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task5_6": {
        "blocks every - 1, 2 every - 1, ... of model.blocks": [
            "test_checkpointed_blocks_run_twice_and_the_step_is_the_same",
            "test_the_checkpointed_blocks_for_any_depth_and_spacing"],
        "replace each of those blocks, in place": [
            "test_checkpointed_blocks_run_twice_and_the_step_is_the_same"],
        "its forward keeps only its input for the backward":
            ["test_autograd_keeps_only_the_inputs_of_checkpointed_blocks"],
        "the backward runs the block's forward again": [
            "test_checkpointed_blocks_run_twice_and_the_step_is_the_same",
            "test_the_checkpointed_blocks_for_any_depth_and_spacing"],
        "return model": ["test_checkpointed_blocks_run_twice_and_the_step_is_the_same"],
        "every=1 by default: all of them":
            ["test_checkpointed_blocks_run_twice_and_the_step_is_the_same"],
        "the non-reentrant variant (use_reentrant=False)": [
            "test_gradients_reach_every_block_when_the_embeddings_are_frozen",
            "test_torch_autograd_grad_reaches_through_the_checkpointed_blocks"],
        "the recomputation draws the forward's dropout masks": [
            "test_checkpointed_blocks_run_twice_and_the_step_is_the_same",
            "test_the_checkpointed_blocks_for_any_depth_and_spacing"],
        "the global generator ends where it would have without checkpointing":
            ["test_checkpointed_blocks_run_twice_and_the_step_is_the_same"],
        "model.state_dict() keeps its keys":
            ["test_a_state_saved_without_checkpointing_loads_with_it"],
        "every < 1 raises ValueError": ["test_checkpoint_blocks_refuses_every_below_1"],
        "an every past the last block wraps none": [
            "test_checkpointed_blocks_run_twice_and_the_step_is_the_same",
            "test_the_checkpointed_blocks_for_any_depth_and_spacing"],
        "shards the wrapped model with fully_shard on 2 ranks":
            ["test_a_checkpointed_model_shards_with_fully_shard"],
    },
}

# The running example, small, with dropout: a recomputation that draws other masks shows.
CONFIG = dict(vocab_size=29, block_size=8, n_layer=4, n_head=2, n_embd=16, dropout=0.2)
WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def make_gpt(**overrides) -> GPT:
    return GPT(GPTConfig(**{**CONFIG, **overrides}), seed=0)


def batch(size: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG["vocab_size"], (size, CONFIG["block_size"] + 1),
                           generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


class Forwards:
    """Counts the forwards each of the model's blocks starts, hooked on the block modules
    themselves, so that a wrapper's forward and its recomputation both count (as they start:
    the recomputation stops once it has what the backward needs, before a forward hook)."""

    def __init__(self, blocks):
        self.counts = [0] * len(blocks)
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda *_, index=index: self._count(index))

    def _count(self, index: int) -> None:
        self.counts[index] += 1


def names_of(model) -> dict[int, str]:
    """Each parameter's name in the unwrapped model, by the parameter itself: a wrapper keeps
    the parameters but may add to their names (named_parameters walks every module, wrappers
    included)."""
    return {id(parameter): name for name, parameter in model.named_parameters()}


def step(model, names: dict[int, str] | None = None, seed: int = 5) -> dict:
    """One forward and backward in training mode, the generator seeded first: the loss, every
    gradient by the parameter's unwrapped name, and the generator's state after it."""
    names = names or names_of(model)
    model.train()
    inputs, targets = batch()
    torch.manual_seed(seed)
    _, loss = model(inputs, targets)
    loss.backward()
    return {"loss": loss.detach(), "rng": torch.get_rng_state(),
            "grads": {names.get(id(p), n): p.grad for n, p in model.named_parameters()}}


def checkpointed(ex, every: int | None, **overrides):
    """A fresh model, its parameters' names and its blocks' forwards noted, then
    ``checkpoint_blocks(model, every)`` (``checkpoint_blocks(model)`` for None)."""
    model = make_gpt(**overrides)
    names, blocks = names_of(model), list(model.blocks)
    forwards = Forwards(blocks)
    returned = ex.checkpoint_blocks(model) if every is None else ex.checkpoint_blocks(model, every)
    return model, returned, forwards, blocks, names


def compare_steps(got: dict, want: dict, call: str) -> None:
    assert torch.equal(got["loss"], want["loss"]), (
        f"{call}: the loss is {got['loss'].item():.6f}, without checkpointing "
        f"{want['loss'].item():.6f}; the forward must be the block's own")
    missing = sorted(set(want["grads"]) - set(got["grads"]))
    assert not missing, f"{call}: parameters gone from the model: {missing[:3]}"
    for name, grad in want["grads"].items():
        mine = got["grads"][name]
        assert mine is not None, (
            f"{call}: {name} got no gradient; the backward must reach every block")
        assert torch.equal(mine, grad), (
            f"{call}: the gradient of {name} differs from the unwrapped model's by "
            f"{(mine - grad).abs().max().item():.3g}: the recomputation drew other dropout masks "
            f"than the forward (keep checkpoint's preserve_rng_state=True)")
    assert torch.equal(got["rng"], want["rng"]), (
        f"{call}: the global generator ends elsewhere than without checkpointing: the "
        f"recomputation's draws must not move it (preserve_rng_state=True restores it)")


def wrapped_indices(model, blocks) -> list[int]:
    return [i for i, block in enumerate(model.blocks) if block is not blocks[i]]


@pytest.mark.task5_6
@pytest.mark.parametrize("every", [None, 2, 5], ids=["default", "every-2", "past-the-last"])
def test_checkpointed_blocks_run_twice_and_the_step_is_the_same(ex, every):
    """`checkpoint_blocks` of a 4-block GPT with `every` left to its default, 2 and 5 wraps
    blocks every - 1, 2 every - 1, ... in place: those run their forward twice in a step, the
    others once, and a step with dropout gives the unwrapped model's loss, gradients and
    generator state, bit for bit."""
    model, returned, forwards, blocks, names = checkpointed(ex, every)
    call = ("checkpoint_blocks(a 4-block GPT), every's default" if every is None
            else f"checkpoint_blocks(a 4-block GPT, every={every})")
    assert returned is model, f"{call} returned {type(returned).__name__}: return the model"
    want_wrapped = list(range((every or 1) - 1, 4, every or 1))
    got = step(model, names)
    want = step(make_gpt())
    twice = [i for i, count in enumerate(forwards.counts) if count == 2]
    assert twice == want_wrapped and all(c in (1, 2) for c in forwards.counts), (
        f"{call}: the blocks ran {forwards.counts} forwards in a step; blocks {want_wrapped} "
        f"should run theirs again in the backward (2), the others once: "
        f"{wrapped_indices(model, blocks)} were replaced")
    compare_steps(got, want, call)


@pytest.mark.task5_6
@sweep(max_examples=12, layers=st.integers(1, 4), every=st.integers(1, 5))
def test_the_checkpointed_blocks_for_any_depth_and_spacing(ex, layers, every):
    """For generated depths (1 to 4 blocks) and spacings (1 to 5), exactly blocks every - 1, 2
    every - 1, ... run their forward twice, and a step with dropout equals the unwrapped model's
    bit for bit."""
    model, _, forwards, _, names = checkpointed(ex, every, n_layer=layers)
    got = step(model, names)
    call = f"checkpoint_blocks(a {layers}-block GPT, every={every})"
    want_twice = list(range(every - 1, layers, every))
    twice = [i for i, count in enumerate(forwards.counts) if count == 2]
    assert twice == want_twice, (
        f"{call}: blocks {twice} ran their forward again in the backward; expected "
        f"{want_twice}: the every-th, the 2 every-th, ..., blocks every - 1, 2 every - 1, ... "
        f"counted from 0 (none when every passes the last)")
    compare_steps(got, step(make_gpt(n_layer=layers)), call)


def kept_bytes(model, inside=None) -> int:
    """The bytes autograd keeps for the backward during one forward: what its saved-tensor hook
    is handed, less the parameters (a linear layer keeps its weight too, which costs nothing
    more). ``inside``: count only what block ``inside`` saves."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total, active = [0], [inside is None]
    hooks = []
    if inside is not None:
        block = model.blocks[inside]
        hooks = [block.register_forward_pre_hook(lambda *_: active.__setitem__(0, True)),
                 block.register_forward_hook(lambda *_: active.__setitem__(0, False))]

    def pack(tensor):
        if active[0] and tensor.untyped_storage().data_ptr() not in parameters:
            total[0] += tensor.numel() * tensor.element_size()
        return tensor

    inputs, targets = batch()
    model.train()
    torch.manual_seed(5)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(inputs, targets)
    for hook in hooks:
        hook.remove()
    return total[0]


@pytest.mark.task5_6
@pytest.mark.parametrize("every", [1, 2, 3])
def test_autograd_keeps_only_the_inputs_of_checkpointed_blocks(ex, every):
    """With every 1, 2 and 3, autograd keeps exactly the unwrapped model's bytes less what the
    wrapped blocks save inside, plus their inputs, as a saved-tensors hook counts them
    (parameters aside).

    Without checkpointing autograd keeps what every block saves; a checkpointed block keeps its
    input instead (one activation, batch x sequence x width floats)."""
    plain = make_gpt()
    whole = kept_bytes(plain)
    inside = [kept_bytes(make_gpt(), i) for i in range(CONFIG["n_layer"])]
    block_input = 3 * CONFIG["block_size"] * CONFIG["n_embd"] * 4
    wrapped = range(every - 1, CONFIG["n_layer"], every)
    want = whole - sum(inside[i] for i in wrapped) + block_input * len(wrapped)
    model, *_ = checkpointed(ex, every)
    got = kept_bytes(model)
    assert got == want, (
        f"checkpoint_blocks(every={every}): autograd keeps {got:,} bytes in a forward; without "
        f"checkpointing {whole:,}, each block keeps {inside[0]:,} inside, so wrapping blocks "
        f"{list(wrapped)} should leave {want:,} (their inputs, {block_input:,} bytes each, "
        f"and what lies outside them)")


@pytest.mark.task5_6
def test_gradients_reach_every_block_when_the_embeddings_are_frozen(ex):
    """With the embeddings frozen, every block's parameters still get a gradient, which the
    reentrant checkpoint would not give block 0's.

    Fine-tuning with frozen embeddings: block 0's input then needs no gradient, and the
    reentrant checkpoint gives block 0's parameters none (torch warns, and trains on)."""
    model, *_, names = checkpointed(ex, 1)
    for parameter in (model.tok_emb.weight, model.pos_emb.weight):
        parameter.requires_grad_(False)
    inputs, targets = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reentrant variant warns here, and trains on
        _, loss = model(inputs, targets)
        loss.backward()
    none = [names[id(p)] for p in model.parameters() if p.requires_grad and p.grad is None]
    assert not none, (
        f"with the embeddings frozen, {none[:2]} got no gradient: the reentrant checkpoint "
        f"(use_reentrant=True, or CheckpointImpl.REENTRANT) drops a block's parameters when its "
        f"input needs no gradient; use the non-reentrant one (use_reentrant=False)")


@pytest.mark.task5_6
def test_torch_autograd_grad_reaches_through_the_checkpointed_blocks(ex):
    """`torch.autograd.grad` of the loss reaches block 0's parameters through the checkpointed
    blocks, which the reentrant checkpoint refuses.

    torch.autograd.grad (and backward(inputs=...)) ask for some gradients only; the reentrant
    checkpoint supports backward() alone, even where its input was made to need a gradient so
    that the frozen-embeddings case passes."""
    model, *_, names = checkpointed(ex, 1)
    inputs, targets = batch()
    _, loss = model.train()(inputs, targets)
    parameters = list(model.blocks[0].parameters())
    try:
        grads = torch.autograd.grad(loss, parameters)
    except RuntimeError as error:
        raise AssertionError(
            f"torch.autograd.grad through the checkpointed blocks raised: {error}; the "
            f"reentrant checkpoint (use_reentrant=True, or CheckpointImpl.REENTRANT) supports "
            f".backward() alone: use the non-reentrant one (use_reentrant=False)") from None
    assert all(g is not None for g in grads)


@pytest.mark.task5_6
def test_a_state_saved_without_checkpointing_loads_with_it(ex):
    """After `checkpoint_blocks(model, 2)` the state dict's keys are unchanged, and a state
    saved without checkpointing loads strictly."""
    saved = make_gpt().state_dict()
    model, *_ = checkpointed(ex, 2)
    keys = list(model.state_dict())
    renamed = [key for key in keys if key not in saved]
    assert not renamed, (
        f"after checkpoint_blocks the state dict has {renamed[:2]} where the model had "
        f"{[k for k in saved if k not in keys][:2]}: a checkpoint saved without activation "
        f"checkpointing no longer loads. torch's checkpoint_wrapper takes its "
        f"'{WRAPPER_PREFIX}' out of the keys; a wrapper of your own must keep them too")
    model.load_state_dict(saved)  # strict: every key


@pytest.mark.task5_6
@pytest.mark.parametrize("every", [0, -1])
def test_checkpoint_blocks_refuses_every_below_1(ex, every):
    """`every` of 0 or -1 raises ValueError."""
    try:
        ex.checkpoint_blocks(make_gpt(), every)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
        raise AssertionError(f"checkpoint_blocks(model, every={every}) raised "
                             f"{type(error).__name__}: {error}; raise ValueError") from None
    raise AssertionError(f"checkpoint_blocks(model, every={every}) returned: raise ValueError, "
                         f"every is 1 (every block), 2 (every other), ...")


def sharded_steps_on_rank(ctx) -> dict:
    """The same GPT on every rank, fully_shard-ed block by block, with and without
    checkpoint_blocks first (as torchtitan orders them): this rank's loss and whole gradients,
    in the parameters' order (fully_shard makes new parameters, and a wrapper may rename them)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ex = load_exercise(LESSON)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    out = {"names": [name for name, _ in make_gpt().named_parameters()]}
    for name, wrap in (("plain", False), ("checkpointed", True)):
        model = make_gpt()
        if wrap:
            ex.checkpoint_blocks(model, 1)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.train()
        inputs, targets = batch()
        torch.manual_seed(5 + ctx.rank)
        _, loss = model(inputs, targets)
        loss.backward()
        out[name] = {"loss": loss.item(),
                     "grads": [p.grad.full_tensor() for p in model.parameters()]}
    return out


@pytest.mark.task5_6
def test_a_checkpointed_model_shards_with_fully_shard(ex):
    """Checkpointed by `checkpoint_blocks` and then `fully_shard`-ed block by block, the GPT
    gives the plain sharded model's loss and whole gradients bit for bit, with dropout, on 2
    gloo ranks."""
    ex.checkpoint_blocks(make_gpt(), 1)  # "not attempted" here, not on the ranks
    for rank, got in enumerate(run_on_ranks(sharded_steps_on_rank, world_size=2)):
        plain, mine = got["plain"], got["checkpointed"]
        assert mine["loss"] == plain["loss"], (
            f"rank {rank}: under fully_shard the checkpointed model's loss is {mine['loss']}, "
            f"the plain one's {plain['loss']}")
        for name, grad, my_grad in zip(got["names"], plain["grads"], mine["grads"], strict=True):
            assert torch.equal(my_grad, grad), (
                f"rank {rank}: under fully_shard the gradient of {name} differs from the "
                f"unwrapped model's by {(my_grad - grad).abs().max().item():.3g}")
