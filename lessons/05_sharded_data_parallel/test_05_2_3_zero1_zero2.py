"""Grades task5_2 and task5_3, ZeRO-1 and ZeRO-2 by hand: reduce_scatter_mean and all_gather_pieces
against the mean of every rank's tensor; Zero1Optimizer and Zero2Optimizer trained beside DDP
(their steps, the bytes a rank holds, the collectives of a step); and what both must get right
besides: the gradient's scale, a step with no backward before it, an inner AdamW on views of this
rank's pieces, no gradient left after a step, zero_grad and remove. The checks of every sharded
method on accumulated backwards, uneven shares and tiny parameters are in
test_05_2_to_4_edge_cases.py.

    pytest lessons/05_sharded_data_parallel -m task5_2
    pytest lessons/05_sharded_data_parallel -m task5_3
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from harness.collectives import CollectiveLog
from harness.compare import assert_close
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import run_on_ranks
from lesson05.common import (
    ADAM_STATE_BYTES,
    GROUPS,
    LESSON,
    SGD,
    SHAPES,
    STEPS,
    WORLDS,
    accumulate_beside_ddp,
    assert_collectives,
    assert_holds_the_formula,
    assert_same_as_ddp,
    build_hand_zero,
    kb,
    make_gpt,
    mean_piece,
    my_share,
    num_params,
    one_process,
    padded_numel,
    piece_bounds,
    train_beside_ddp,
    upstream_gradient,
    with_diagnosis,
)

# These tasks' contracts, clause by clause, and the tests that fail when only that
# clause is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task5_2": {
        "reduce_scatter_mean: tensor is flattened and zero-padded":
            ["test_reduce_scatter_mean_and_all_gather_pieces"],
        "reduce_scatter_mean: reduce_scatter_single gives this rank the sum of its piece":
            ["test_reduce_scatter_mean_and_all_gather_pieces"],
        "reduce_scatter_mean: dividing by the world size makes it the mean":
            ["test_reduce_scatter_mean_and_all_gather_pieces",
             "test_hand_zero_keeps_the_gradient_scale_of_ddp"],
        "reduce_scatter_mean: returns a 1-D tensor of shard_size elements, padding included":
            ["test_reduce_scatter_mean_and_all_gather_pieces"],
        "all_gather_pieces: piece is its real elements or the whole padded piece; zero-pad it":
            ["test_reduce_scatter_mean_and_all_gather_pieces"],
        "all_gather_pieces: all_gather_single every rank's piece, in rank order":
            ["test_reduce_scatter_mean_and_all_gather_pieces"],
        "all_gather_pieces: return its first numel":
            ["test_reduce_scatter_mean_and_all_gather_pieces"],
        "Zero1Optimizer: this rank's piece as a view of the parameter's own memory":
            ["test_zero1_trains_like_ddp_and_shards_the_optimizer_state",
             "test_hand_zero_builds_adamw_on_views_of_this_ranks_pieces"],
        "Zero1Optimizer: self.optimizer = optimizer_class(those views, **defaults)":
            ["test_zero1_trains_like_ddp_and_shards_the_optimizer_state",
             "test_hand_zero_builds_adamw_on_views_of_this_ranks_pieces"],
        "Zero1Optimizer: optimizer_class=torch.optim.AdamW by default":
            ["test_hand_zero_builds_adamw_on_views_of_this_ranks_pieces"],
        "Zero1Optimizer: parameters and their gradients stay whole, as in DDP":
            ["test_zero1_trains_like_ddp_and_shards_the_optimizer_state"],
        "Zero1Optimizer.step: reduce_scatter_mean each gradient, real elements to the view's .grad":
            ["test_zero1_trains_like_ddp_and_shards_the_optimizer_state",
             "test_hand_zero_keeps_the_gradient_scale_of_ddp"],
        "Zero1Optimizer.step: the whole gradient is not needed again: param.grad = None":
            ["test_hand_zero_step_needs_a_backward_since_the_last_step",
             "test_hand_zero_step_lets_go_of_every_gradient"],
        "Zero1Optimizer.step: self.optimizer.step(), then the views' .grad to None":
            ["test_zero1_trains_like_ddp_and_shards_the_optimizer_state",
             "test_hand_zero_step_lets_go_of_every_gradient"],
        "Zero1Optimizer.step: all_gather_pieces the updated views into every parameter":
            ["test_zero1_trains_like_ddp_and_shards_the_optimizer_state"],
        "Zero1Optimizer.step: a parameter without a gradient raises RuntimeError":
            ["test_hand_zero_step_before_backward_is_a_clear_error",
             "test_hand_zero_names_the_first_parameter_without_a_gradient"],
        "Zero1Optimizer.step: the RuntimeError names it (its index and shape)":
            ["test_hand_zero_names_the_first_parameter_without_a_gradient"],
        "Zero1Optimizer.step: it raises before any collective":
            ["test_hand_zero_step_before_backward_is_a_clear_error"],
        "Zero1Optimizer.zero_grad(set_to_none=True) clears the parameters' gradients":
            ["test_hand_zero_zero_grad_forgets_an_earlier_backward",
             "test_zero1_zero_grad_sets_to_none_by_default_and_zeros_when_asked"],
    },
    "task5_3": {
        "pieces as views and an inner self.optimizer over them, exactly as Zero1Optimizer":
            ["test_zero2_trains_like_ddp_and_shards_the_gradients",
             "test_hand_zero_builds_adamw_on_views_of_this_ranks_pieces"],
        "a post-accumulate-grad hook on each parameter reduce_scatter_means its gradient":
            ["test_zero2_trains_like_ddp_and_shards_the_gradients"],
        "the hook adds the real elements of this rank's piece to the view's .grad":
            ["test_accumulated_backwards_then_one_step_equal_ddp_with_no_sync"],
        "the hook frees the whole gradient at once: param.grad = None":
            ["test_zero2_trains_like_ddp_and_shards_the_gradients"],
        "step(): every parameter must have been reduced since the last step, else RuntimeError":
            ["test_hand_zero_step_before_backward_is_a_clear_error",
             "test_hand_zero_step_needs_a_backward_since_the_last_step",
             "test_hand_zero_names_the_first_parameter_without_a_gradient"],
        "the RuntimeError names the first that was not (its index and shape)":
            ["test_hand_zero_names_the_first_parameter_without_a_gradient"],
        "raised before any collective": ["test_hand_zero_step_before_backward_is_a_clear_error"],
        "step(): step the inner optimizer, set the views' .grad to None":
            ["test_zero2_trains_like_ddp_and_shards_the_gradients",
             "test_hand_zero_step_needs_a_backward_since_the_last_step",
             "test_hand_zero_step_lets_go_of_every_gradient"],
        "step(): all-gather the pieces back into the whole parameters":
            ["test_zero2_trains_like_ddp_and_shards_the_gradients"],
        "zero_grad() clears the pieces' .grad as well as the parameters'":
            ["test_hand_zero_zero_grad_forgets_an_earlier_backward"],
        "remove() removes the hooks": ["test_zero2_remove_takes_its_hooks_off"],
    },
}


# ----------------------------------------------------------------------------- the collectives


def both_collectives(ctx):
    """reduce_scatter_mean of a tensor that differs on every rank, then all_gather_pieces of
    the result, given short (its real elements only) and padded; with the collectives called."""
    ex = load_exercise(LESSON)
    out = []
    for shape in SHAPES:
        mine = upstream_gradient(shape, ctx.rank).to(ctx.device)
        numel = mine.numel()
        start, end = piece_bounds(numel, ctx.world_size, ctx.rank)
        with CollectiveLog(ex) as reduced:
            piece = ex.reduce_scatter_mean(mine)
        with CollectiveLog(ex) as gathered:
            try:
                short = ex.all_gather_pieces(piece[: end - start].clone(), numel)
                padded = ex.all_gather_pieces(piece, numel)
            except NotImplementedError:
                raise
            except RuntimeError as error:  # gloo's own words name no cause a learner knows
                raise AssertionError(
                    f"all_gather_pieces(piece of {end - start} real elements, {numel}) raised "
                    f"{type(error).__name__}: {str(error).splitlines()[0][:200]}. Every rank "
                    f"must give the all-gather the same number of elements: pad the piece "
                    f"with zeros to shard_size({numel}, {ctx.world_size}) first") from error
        out.append({"mine": mine, "piece": piece, "short": short, "padded": padded,
                    "reduce_calls": [(c.op, c.payload) for c in reduced.calls],
                    "gather_calls": [(c.op, c.payload) for c in gathered.calls]})
    return out


@pytest.mark.task5_2
@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_mean_and_all_gather_pieces(ex, world):
    """On 2, 3 and 4 gloo ranks, `reduce_scatter_mean` gives each rank its padded piece of the
    mean of every rank's tensor and `all_gather_pieces` rebuilds the whole from a short or a
    padded piece, each in one collective of the padded size, for tensors of 15, 7, 8 and 1
    elements."""
    for part in (ex.reduce_scatter_mean, ex.all_gather_pieces):
        raise_if_untouched(part)  # a stub: not attempted, without starting ranks
    results = run_on_ranks(both_collectives, world_size=world)
    for index, shape in enumerate(SHAPES):
        numel = torch.Size(shape).numel()
        padded_bytes = 4 * world * -(-numel // world)
        for rank, result in enumerate(results):
            got = result[index]
            mean, want = mean_piece(shape, world, rank)
            what = f"reduce_scatter_mean of a {shape} tensor: rank {rank}'s piece of the mean"
            try:
                assert_close(got["piece"], want, what, rank)
            except AssertionError as error:
                own = torch.zeros_like(want)
                start, end = piece_bounds(numel, world, rank)
                own[: end - start] = got["mine"].reshape(-1)[start:end]
                if got["piece"].shape == want.shape and torch.allclose(got["piece"], own):
                    raise with_diagnosis(error, "those are this rank's own values: nothing was "
                                                "reduced across the ranks") from None
                if got["piece"].shape != want.shape:
                    raise with_diagnosis(error, f"return the whole piece, padding included: "
                                                f"shard_size({numel}, {world}) elements") from None
                raise
            assert got["reduce_calls"] == [("reduce_scatter", padded_bytes)], (
                f"rank {rank}: reduce_scatter_mean of {numel} elements called "
                f"{got['reduce_calls']}; expected one reduce-scatter of the padded "
                f"{padded_bytes} bytes")
            for form in ("short", "padded"):
                assert_close(got[form], mean,
                             f"all_gather_pieces(the {form} piece, {numel}): the whole", rank)
            assert got["gather_calls"] == [("all_gather", padded_bytes)] * 2, (
                f"rank {rank}: two all_gather_pieces of {numel} elements called "
                f"{got['gather_calls']}; expected one all-gather each, of {padded_bytes} bytes")


# ----------------------------------------------------------------------------- ZeRO-1 and 2

# Each is trained beside DDP on the same ranks (train_beside_ddp, in common.py), and what it
# returns is compared with DDP's in the parent process.


@pytest.mark.task5_2
@pytest.mark.parametrize("group", GROUPS)
def test_zero1_trains_like_ddp_and_shards_the_optimizer_state(ex, group):
    """ZeRO-1 takes DDP's steps: every parameter after each of 3 AdamW steps on 2, 3 and 4 gloo
    ranks, against DDP and (the last step) one process on the whole batches; its AdamW holds
    state for about 1/W of the elements, and a step reduce-scatters and all-gathers each padded
    parameter once.

    Also checked: the first step's update against DDP's, and the bytes a rank holds after the
    backward of step 2 (`harness/memory.py`) against the formula, within 10 %."""
    raise_if_untouched(ex.Zero1Optimizer.__init__)  # a stub: not attempted, without starting ranks
    world, backend, device = group
    results = run_on_ranks(train_beside_ddp, "zero1", "adamw", STEPS, world_size=world,
                           backend=backend, device=device)
    model = make_gpt()
    psi, padded = num_params(model), padded_numel(model, world)
    largest = max(p.numel() for p in model.parameters())
    for rank, result in enumerate(results):
        assert_same_as_ddp(result, rank, world, "ZeRO-1", one_process("gpt", STEPS))
        state = result["optimizer_held"]
        # AdamW's two moments for this rank's pieces, and a 4-byte step count per parameter.
        low = ADAM_STATE_BYTES * psi / world
        high = ADAM_STATE_BYTES * (psi / world + largest) + 4 * len(list(model.parameters()))
        if not low * 0.9 <= state <= high:
            why = ""
            if state >= ADAM_STATE_BYTES * psi:
                why = (": that is state for every element. Give the inner optimizer only this "
                       "rank's piece of each parameter, param.detach().view(-1)[start:end]")
            elif state > high:
                why = (": more than the state of this rank's pieces. The pieces' gradients "
                       "kept after the step? Set each view's .grad to None once stepped")
            raise AssertionError(
                f"rank {rank}: ZeRO-1's optimizer holds {kb(state)} beyond the model; AdamW's "
                f"state for 1/{world} of the {psi:_} parameters is {kb(low)} (up to "
                f"{kb(high)} with the padding){why}")
        assert_holds_the_formula(result["held"], psi, world, 1,
                                 "the model and the optimizer hold after backward", rank)
        assert_collectives(result, rank, world, "ZeRO-1",
                           {"reduce_scatter": 4 * padded, "all_gather": 4 * padded})


def step_before_backward(ctx, method: str):
    """What ``step()`` does before any backward: ("RuntimeError", message, collectives called
    before it raised), another exception's name and message, or None when it returned."""
    ex = load_exercise(LESSON)
    optimizer = build_hand_zero(ex, method, make_gpt(), "adamw")
    with CollectiveLog(ex) as log:
        try:
            optimizer.step()
        except NotImplementedError:  # a stub (a RuntimeError too): not attempted, not an answer
            raise
        except RuntimeError as error:
            return ("RuntimeError", str(error), log.summary() if log.calls else "")
        except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
            return (type(error).__name__, str(error), "")
    return None


def assert_step_before_backward_refused(outcomes: list, name: str) -> None:
    __tracebackhide__ = True
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None, (
            f"rank {rank}: {name}.step() before any backward() returned: raise RuntimeError "
            f"naming the parameter without a gradient (its index and shape), before any "
            f"collective")
        kind, message, collectives = outcome
        assert kind == "RuntimeError", (
            f"rank {rank}: {name}.step() before any backward() raised {kind}: {message}. Check "
            f"for missing gradients first and raise RuntimeError saying to call backward()")
        assert "backward" in message, (
            f"rank {rank}: the RuntimeError should say that backward() must come first: "
            f"{message!r}")
        assert not collectives, (
            f"rank {rank}: {name}.step() called {collectives} before refusing: check every "
            f"gradient before the first collective, or a rank that refuses leaves the others "
            f"waiting in it")


@pytest.mark.task5_3
@pytest.mark.parametrize("group", GROUPS)
def test_zero2_trains_like_ddp_and_shards_the_gradients(ex, group):
    """ZeRO-2 takes DDP's steps (every parameter after each of 3 AdamW steps on 2, 3 and 4 gloo
    ranks, against DDP and one process), holds no more whole gradients at once in the backward
    than the largest parameter's, none after it; a step reduce-scatters and all-gathers each
    padded parameter once.

    Also checked: the first step's update against DDP's, and the bytes a rank holds after the
    backward of step 2 (`harness/memory.py`) against the formula, within 10 %. The whole
    gradients are measured after every parameter's hook has run."""
    raise_if_untouched(ex.Zero2Optimizer.__init__)  # a stub: not attempted, without starting ranks
    world, backend, device = group
    results = run_on_ranks(train_beside_ddp, "zero2", "adamw", STEPS, world_size=world,
                           backend=backend, device=device)
    model = make_gpt()
    psi, padded = num_params(model), padded_numel(model, world)
    largest = max(4 * p.numel() for p in model.parameters())
    for rank, result in enumerate(results):
        assert_same_as_ddp(result, rank, world, "ZeRO-2", one_process("gpt", STEPS))
        peak = result["whole_grads_peak"]
        assert peak <= largest, (
            f"rank {rank} held {kb(peak)} of whole gradients at once during backward; ZeRO-2 "
            f"keeps at most the one being reduced ({kb(largest)} for the largest parameter): "
            f"in the hook, once the gradient is reduce-scattered into this rank's piece, set "
            f"param.grad = None")
        left = result["whole_grads_after_backward"]
        assert left == 0, (
            f"rank {rank}: after backward the parameters still hold {kb(left)} of whole "
            f"gradients: free each one (param.grad = None) in its hook")
        assert_holds_the_formula(result["held"], psi, world, 2,
                                 "the model and the optimizer hold after backward", rank)
        assert_collectives(result, rank, world, "ZeRO-2",
                           {"reduce_scatter": 4 * padded, "all_gather": 4 * padded})


# What ZeRO-1 and ZeRO-2 must both get right beyond their trajectories.
HAND_ZERO = [pytest.param("zero1", "Zero1Optimizer", marks=pytest.mark.task5_2, id="zero1"),
             pytest.param("zero2", "Zero2Optimizer", marks=pytest.mark.task5_3, id="zero2")]


@pytest.mark.parametrize("method,graded", HAND_ZERO)
@pytest.mark.parametrize("world", [2, 3])
def test_hand_zero_keeps_the_gradient_scale_of_ddp(ex, method, graded, world):
    """ZeRO-1 and ZeRO-2 take DDP's first SGD step on 2 and 3 gloo ranks: SGD steps by the
    gradient itself, so an update W times DDP's would show a sum where the mean belongs."""
    raise_if_untouched(getattr(ex, graded).__init__)  # a stub: not attempted, without ranks
    results = run_on_ranks(train_beside_ddp, method, "sgd", 1, world_size=world)
    for rank, result in enumerate(results):
        assert_same_as_ddp(result, rank, world, f"{method} (SGD)")


@pytest.mark.parametrize("method,graded", HAND_ZERO)
def test_hand_zero_step_before_backward_is_a_clear_error(ex, method, graded):
    """`step()` before any backward raises a RuntimeError saying backward must come first,
    before any collective is called (ZeRO-1 and ZeRO-2, 2 gloo ranks)."""
    raise_if_untouched(getattr(ex, graded).step)  # a stub: not attempted, without ranks
    outcomes = run_on_ranks(step_before_backward, method, world_size=2, timeout=20,
                            pg_timeout=5.0)
    assert_step_before_backward_refused(outcomes, graded)


def two_layers() -> nn.Module:
    """Parameters 0 to 3 of shapes (6, 5), (6,), (7, 6) and (7,)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 7))


def refused_step(ctx, method: str, before: str):
    """What ``step()`` does after ``before``: "half", a backward through the first layer only
    (parameters 2 and 3 get no gradient), or "step", a full backward and a step. As in
    step_before_backward: ("RuntimeError", message, collectives before it), another error,
    or None."""
    ex = load_exercise(LESSON)
    model = two_layers()
    wrapper = ex.Zero1Optimizer if method == "zero1" else ex.Zero2Optimizer
    optimizer = wrapper(model.parameters(), torch.optim.SGD, **SGD)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(ctx.rank))
    try:
        if before == "half":
            model[0](x).square().mean().backward()
        else:
            model(x).square().mean().backward()
            optimizer.step()
        with CollectiveLog(ex) as log:
            try:
                optimizer.step()
            except NotImplementedError:
                raise
            except RuntimeError as error:
                return ("RuntimeError", str(error), log.summary() if log.calls else "")
            except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
                return (type(error).__name__, str(error), "")
        return None
    finally:
        if hasattr(optimizer, "remove"):
            optimizer.remove()


@pytest.mark.parametrize("method,graded", HAND_ZERO)
def test_hand_zero_names_the_first_parameter_without_a_gradient(ex, method, graded):
    """After a backward through the first layer only, `step()` raises a RuntimeError naming
    parameter 2 by index and shape (7, 6), before any collective (ZeRO-1 and ZeRO-2, 2 gloo
    ranks)."""
    raise_if_untouched(getattr(ex, graded).step)  # a stub: not attempted, without ranks
    outcomes = run_on_ranks(refused_step, method, "half", world_size=2, timeout=20,
                            pg_timeout=5.0)
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None, (
            f"rank {rank}: {graded}.step() returned although parameters 2 and 3 got no "
            f"gradient (the backward ran through the first layer only): check every "
            f"parameter, and raise RuntimeError naming the first without one")
        kind, message, collectives = outcome
        assert kind == "RuntimeError", (
            f"rank {rank}: {graded}.step() with parameter 2 lacking a gradient raised {kind}: "
            f"{message}; raise RuntimeError naming it")
        index = re.search(r"\b2\b", message)
        shape = re.search(r"\b7\D{1,4}6\b", message)
        assert index and shape, (
            f"rank {rank}: the first parameter without a gradient is parameter 2, of shape "
            f"(7, 6); the RuntimeError should name its "
            f"{'index and shape' if not (index or shape) else 'shape' if index else 'index'}:"
            f" {message!r}")
        assert not collectives, (
            f"rank {rank}: {graded}.step() called {collectives} before refusing: check every "
            f"gradient before the first collective")


@pytest.mark.parametrize("method,graded", HAND_ZERO)
def test_hand_zero_step_needs_a_backward_since_the_last_step(ex, method, graded):
    """A second `step()` with no backward since the first raises RuntimeError before any
    collective: the first step used the gradients up and let them go (ZeRO-1 and ZeRO-2, 2 gloo
    ranks)."""
    raise_if_untouched(getattr(ex, graded).step)  # a stub: not attempted, without ranks
    outcomes = run_on_ranks(refused_step, method, "step", world_size=2, timeout=20,
                            pg_timeout=5.0)
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None, (
            f"rank {rank}: a second {graded}.step() with no backward() since the first "
            f"returned: it stepped again on gradients the first step had already used. After "
            f"the step no gradient is left (param.grad = None once reduced, the pieces' .grad "
            f"= None after the inner step), so the check finds none and raises RuntimeError")
        kind, message, collectives = outcome
        assert kind == "RuntimeError", (
            f"rank {rank}: a second {graded}.step() with no backward() since the first raised "
            f"{kind}: {message}; raise RuntimeError saying to call backward() first")
        assert not collectives, (
            f"rank {rank}: the second {graded}.step() called {collectives} before refusing: "
            f"check every gradient before the first collective")


def hand_zero_built(ctx, method: str) -> dict:
    """A hand ZeRO optimizer built with the default optimizer_class, on this rank: its inner
    optimizer, and whether those are views of this rank's pieces; then what one backward and
    one step leave behind."""
    ex = load_exercise(LESSON)
    model = two_layers()
    wrapper = ex.Zero1Optimizer if method == "zero1" else ex.Zero2Optimizer
    optimizer = wrapper(model.parameters(), lr=0.01, weight_decay=0.5)
    try:
        inner = optimizer.optimizer
        views = [p for group in inner.param_groups for p in group["params"]]
        out = {"inner": type(inner).__name__,
               "settings": [(group["lr"], group["weight_decay"]) for group in inner.param_groups],
               "views": []}
        for param, view in zip(model.parameters(), views, strict=False):
            start, end = piece_bounds(param.numel(), ctx.world_size, ctx.rank)
            shares = view.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
            offset = view.storage_offset() - param.storage_offset()
            out["views"].append({"numel": view.numel(), "expected": end - start,
                                 "view_of_param": shares, "offset": offset, "start": start})
        out["view_count"] = len(views)
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(ctx.rank))
        model(x).square().mean().backward()
        optimizer.step()
        out["param_grads_left"] = [i for i, p in enumerate(model.parameters())
                                   if p.grad is not None]
        out["view_grads_left"] = [i for i, v in enumerate(views) if v.grad is not None]
        return out
    finally:
        if hasattr(optimizer, "remove"):
            optimizer.remove()


@pytest.mark.parametrize("method,graded", HAND_ZERO)
def test_hand_zero_builds_adamw_on_views_of_this_ranks_pieces(ex, method, graded):
    """Given only `lr` and `weight_decay`, the inner optimizer is an AdamW with those settings
    over one view per parameter, each this rank's piece (`shard_bounds`) of the parameter's own
    memory (ZeRO-1 and ZeRO-2, 2 gloo ranks)."""
    raise_if_untouched(getattr(ex, graded).__init__)  # a stub: not attempted, without ranks
    results = run_on_ranks(hand_zero_built, method, world_size=2)
    for rank, got in enumerate(results):
        assert got["inner"] == "AdamW", (
            f"rank {rank}: {graded}(params, lr=0.01, weight_decay=0.5) built a {got['inner']} "
            f"as self.optimizer: optimizer_class defaults to torch.optim.AdamW")
        assert all(s == (0.01, 0.5) for s in got["settings"]), (
            f"rank {rank}: the inner optimizer's (lr, weight_decay) are {got['settings']}, not "
            f"(0.01, 0.5): pass **defaults on to optimizer_class")
        assert got["view_count"] == 4, (
            f"rank {rank}: the inner optimizer holds {got['view_count']} tensors; expected one "
            f"piece of each of the 4 parameters")
        for index, view in enumerate(got["views"]):
            assert view["numel"] == view["expected"], (
                f"rank {rank}: the inner optimizer's piece of parameter {index} has "
                f"{view['numel']} elements; this rank's piece (shard_bounds) has "
                f"{view['expected']}")
            assert view["view_of_param"] and view["offset"] == view["start"], (
                f"rank {rank}: the inner optimizer's piece of parameter {index} is not a view "
                f"of the parameter's own memory at element {view['start']}: use "
                f"param.detach().view(-1)[start:end], so that stepping it updates the "
                f"parameter in place, with no second copy of the shard")


@pytest.mark.parametrize("method,graded", HAND_ZERO)
def test_hand_zero_step_lets_go_of_every_gradient(ex, method, graded):
    """After a backward and `step()`, no parameter keeps its whole gradient and no piece keeps
    its gradient (ZeRO-1 and ZeRO-2, 2 gloo ranks)."""
    raise_if_untouched(getattr(ex, graded).step)  # a stub: not attempted, without ranks
    results = run_on_ranks(hand_zero_built, method, world_size=2)
    for rank, got in enumerate(results):
        assert not got["param_grads_left"], (
            f"rank {rank}: after {graded}.step() parameters {got['param_grads_left']} still "
            f"hold their whole gradients: once reduce-scattered they are not needed again, "
            f"param.grad = None")
        assert not got["view_grads_left"], (
            f"rank {rank}: after {graded}.step() the pieces of parameters "
            f"{got['view_grads_left']} still hold their gradients: once stepped, set each "
            f"view's .grad to None")


def backward_after_remove(ctx) -> dict:
    ex = load_exercise(LESSON)
    model = two_layers()
    optimizer = ex.Zero2Optimizer(model.parameters(), torch.optim.SGD, **SGD)
    optimizer.remove()
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(ctx.rank))
    with CollectiveLog(ex) as log:
        model(x).square().mean().backward()
    return {"collectives": log.summary() if log.calls else "",
            "whole": [p.grad is not None and p.grad.shape == p.shape
                      for p in model.parameters()]}


@pytest.mark.task5_3
def test_zero2_remove_takes_its_hooks_off(ex):
    """After `remove()`, a backward calls no collective and leaves every parameter its whole
    gradient: the hooks are gone (2 gloo ranks)."""
    raise_if_untouched(ex.Zero2Optimizer.remove)  # a stub: not attempted, without ranks
    results = run_on_ranks(backward_after_remove, world_size=2, timeout=20, pg_timeout=5.0)
    for rank, got in enumerate(results):
        assert not got["collectives"] and all(got["whole"]), (
            f"rank {rank}: after remove(), a backward still ran the hooks "
            f"({got['collectives'] or 'no collective'}; whole gradients kept: {got['whole']}): "
            f"remove() must call .remove() on every handle register_post_accumulate_grad_hook "
            f"returned")


@pytest.mark.parametrize("method,graded", HAND_ZERO)
def test_hand_zero_zero_grad_forgets_an_earlier_backward(ex, method, graded):
    """A backward thrown away with `zero_grad()` before each step's own leaves DDP's trajectory:
    2 AdamW steps on 2 gloo ranks against DDP, for ZeRO-1 and ZeRO-2 (whose reduced pieces must
    be cleared too)."""
    raise_if_untouched(getattr(ex, graded).zero_grad)  # a stub: not attempted, without ranks
    results = run_on_ranks(accumulate_beside_ddp, method, 1, 2, discard_first=True,
                           world_size=2)
    for rank, result in enumerate(results):
        try:
            assert_same_as_ddp(result, rank, 2, f"{method}, a backward thrown away with "
                                                 f"zero_grad() before the step's own")
        except AssertionError as error:
            raise with_diagnosis(error, "zero_grad() must clear every gradient this optimizer "
                                        "keeps, the pieces' .grad as well as the "
                                        "parameters'") from None


def zero1_gradients_after_zero_grad(ctx) -> dict:
    """What ``zero_grad()`` and ``zero_grad(set_to_none=False)`` leave after a backward."""
    ex = load_exercise(LESSON)
    model = make_gpt()
    optimizer = build_hand_zero(ex, "zero1", model, "sgd")
    seen = {}
    for label, call in (("zero_grad()", lambda: optimizer.zero_grad()),
                        ("zero_grad(set_to_none=False)",
                         lambda: optimizer.zero_grad(set_to_none=False))):
        inputs, targets = my_share(ctx, 0)
        model(inputs, targets)[1].backward()
        call()
        seen[label] = {name: (None if p.grad is None else float(p.grad.abs().sum()))
                       for name, p in model.named_parameters()}
    return seen


@pytest.mark.task5_2
def test_zero1_zero_grad_sets_to_none_by_default_and_zeros_when_asked(ex):
    """After a backward, ZeRO-1's `zero_grad()` leaves every gradient None and
    `zero_grad(set_to_none=False)` leaves zeros, as torch's optimizers do (2 gloo ranks)."""
    raise_if_untouched(ex.Zero1Optimizer.zero_grad)
    results = run_on_ranks(zero1_gradients_after_zero_grad, world_size=2)
    for rank, seen in enumerate(results):
        kept = [name for name, grad in seen["zero_grad()"].items() if grad is not None]
        assert not kept, (f"rank {rank}: after zero_grad(), {kept[0]} still has a .grad: the "
                          f"default is set_to_none=True, as for any torch optimizer")
        left = {name: grad for name, grad in seen["zero_grad(set_to_none=False)"].items()
                if grad != 0.0}
        assert not left, (f"rank {rank}: after zero_grad(set_to_none=False), {left}: each "
                          f"gradient must be zeros (None only where there was none), as for any "
                          f"torch optimizer")
