"""Lesson 11, task11_3: exchange_counts and AllToAll, the two exchanges of expert parallelism.
Every rank's counts and rows are built from seeds, so each rank knows what every other sent and
checks what it received, and the gradients that came back, against them. On gloo/CPU ranks, 1
to 4 of them and subgroups (and on nccl where GPUs are present).

    pytest lessons/11_mixture_of_experts -m task11_3
"""

from __future__ import annotations

import pytest
import torch

from harness.collectives import CollectiveLog
from harness.compare import assert_close
from harness.exercises import load_exercise
from harness.ranks import run_on_ranks
from harness.sweep import st, sweep
from lesson11.common import GROUPS, LESSON, TIGHT, everyone_agrees, my_group, seeded, seeded_counts

NOT_CONTIGUOUS = ("a tensor given to it need not be contiguous, and all_to_all_single takes "
                  "only contiguous tensors: send t.contiguous() (x, or the gradient)")

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task11_3": {
        "exchange_counts: row s is what rank s sends each of this rank's experts, (W, E // W)":
            ["test_exchange_counts_tells_each_rank_what_comes"],
        "exchange_counts: one all-to-all, nothing else":
            ["test_exchange_counts_tells_each_rank_what_comes"],
        "AllToAll forward: the rows each rank sent this one, in rank order":
            ["test_all_to_all_sends_rows_and_their_gradients_back",
             "test_all_to_all_over_generated_sizes"],
        "AllToAll backward: each row's gradient back to its rank and row, one all-to-all":
            ["test_all_to_all_sends_rows_and_their_gradients_back",
             "test_all_to_all_over_generated_sizes"],
        "AllToAll: x and the gradient in any memory layout (all_to_all_single needs them "
        "contiguous)": ["test_all_to_all_sends_rows_and_their_gradients_back",
                        "test_all_to_all_over_generated_sizes"],
        "AllToAll: one all_to_all each way":
            ["test_all_to_all_sends_rows_and_their_gradients_back"],
        "AllToAll: sizes as lists of ints or 1-D integer tensors":
            ["test_all_to_all_takes_sizes_as_tensors"],
        "AllToAll: send_sizes that do not add up to N raise ValueError naming both":
            ["test_all_to_all_refuses_sizes_that_do_not_add_up"],
        "within group only (None: every rank)": [
            "test_exchange_counts_tells_each_rank_what_comes",
            "test_all_to_all_sends_rows_and_their_gradients_back"],
    },
}

WIDTH = 3  # each row's size


def counts_run(ctx, per_rank: int, groups=None) -> dict:
    ex = load_exercise(LESSON)
    group, members = my_group(ctx, groups)
    counts = seeded_counts(10 + ctx.rank, per_rank * len(members)).to(ctx.device)
    with CollectiveLog(ex) as log:
        got = ex.exchange_counts(counts) if groups is None else ex.exchange_counts(counts, group)
    return {"got": got, "members": members, "calls": [(c.op, c.payload) for c in log.calls]}


@pytest.mark.task11_3
@pytest.mark.parametrize("per_rank", [1, 3])
@pytest.mark.parametrize("group_case", GROUPS + [pytest.param("subgroups", id="subgroups")])
def test_exchange_counts_tells_each_rank_what_comes(group_case, per_rank):
    """exchange_counts gives every rank, in one all-to-all, the counts each rank sends its experts,
    row s from rank s: against every rank's seeded counts, 1 and 3 experts a rank, on 1 to 4 gloo
    ranks and in groups [0, 2] and [1, 3] of 4."""
    if group_case == "subgroups":
        world, backend, device, groups = 4, "gloo", "cpu", [[0, 2], [1, 3]]
    else:
        (world, backend, device), groups = group_case, None
    results = run_on_ranks(counts_run, per_rank, groups, world_size=world, backend=backend,
                           device=device)
    for rank, found in enumerate(results):
        members = found["members"]
        place = members.index(rank)
        every = [seeded_counts(10 + r, per_rank * len(members)) for r in members]
        want = torch.stack([c[place * per_rank:(place + 1) * per_rank] for c in every])
        got = found["got"]
        where = f"rank {rank} (place {place} of group {members}), {per_rank} experts a rank"
        if tuple(got.shape) != tuple(want.shape) or not torch.equal(got.cpu(), want):
            hint = ""
            if got.numel() == want.numel() and torch.equal(got.cpu().flatten(),
                                                           want.t().flatten()):
                hint = ": the counts are right, the shape is transposed; row s is rank s's"
            elif groups and got.numel() == want.numel() * 2:
                hint = ": that exchanged over every rank, not the group"
            raise AssertionError(f"{where}: exchange_counts returned {got.tolist()}, expected "
                                 f"{want.tolist()} (every rank's counts: "
                                 f"{[c.tolist() for c in every]}){hint}")
        ops = [op for op, _ in found["calls"]]
        assert ops == ["all_to_all"], (
            f"{where}: exchange_counts called {ops}; one all-to-all sends each rank exactly the "
            f"counts it needs (an all-gather sends every rank everything)")


def a2a_run(ctx, sizes: list[list[int]], groups=None, as_tensors: bool = False) -> dict:
    """sizes[s][d]: the rows member s sends member d; ``as_tensors``: given as int64 tensors."""
    ex = load_exercise(LESSON)
    group, members = my_group(ctx, groups)
    place = members.index(ctx.rank)
    send = sizes[place]
    receive = [row[place] for row in sizes]
    if as_tensors:
        send, receive = torch.tensor(send), torch.tensor(receive)
    # Both column-major, so x and y's gradient are not contiguous, as a model's tensors need not
    # be (all_to_all_single refuses such a tensor): the same values, laid out the other way.
    x = seeded(300 + ctx.rank, sum(send), WIDTH).t().contiguous().t().to(ctx.device)
    x.requires_grad_(True)
    c = seeded(400 + ctx.rank, sum(receive), WIDTH).t().contiguous().t().to(ctx.device)
    before = x.detach().clone()
    with CollectiveLog(ex) as forward:
        try:
            y = (ex.AllToAll.apply(x, send, receive) if groups is None
                 else ex.AllToAll.apply(x, send, receive, group))
        except NotImplementedError:  # a stub (a subclass of RuntimeError): not attempted
            raise
        except (RuntimeError, TypeError, ValueError) as error:  # gloo: ValueError, not contiguous
            advice = (NOT_CONTIGUOUS if "contiguous" in str(error) else
                      f"in a group of {len(members)} of {ctx.world_size} ranks the size lists "
                      f"have one entry per rank of the group: pass group= to "
                      f"all_to_all_single" if groups else
                      "sizes may come as int64 tensors: turn them into lists of ints"
                      if as_tensors else "")
            raise AssertionError(f"rank {ctx.rank}: AllToAll.apply raised "
                                 f"{type(error).__name__}: {str(error)[:200]}; {advice}") from None
    found = {"y": y.detach(), "members": members, "x_changed": not torch.equal(x.detach(), before),
             "forward": [(call.op, call.payload) for call in forward.calls], "backward": []}
    if not everyone_agrees(ctx, y.shape == c.shape):  # every rank, or none, goes backward
        return {**found, "grad": None}
    with CollectiveLog(ex) as backward:
        try:
            (y * c).sum().backward()
        except (RuntimeError, ValueError) as error:  # a gradient of the wrong shape or layout
            return {**found, "grad": None, "backward_error": str(error)[:300]}
    return {**found, "grad": x.grad, "backward": [(call.op, call.payload)
                                                  for call in backward.calls]}


def check_a2a(results, sizes, count_calls: bool = True) -> None:
    for rank, found in enumerate(results):
        members = found["members"]
        place = members.index(rank)
        n = len(members)
        where = f"rank {rank} (place {place} of group {members}), sizes {sizes}"
        xs = [seeded(300 + r, sum(sizes[s]), WIDTH) for s, r in enumerate(members)]
        cs = [seeded(400 + r, sum(row[d] for row in sizes), WIDTH)
              for d, r in enumerate(members)]
        want_y = torch.cat([xs[s][sum(sizes[s][:place]):sum(sizes[s][:place + 1])]
                            for s in range(n)])
        got = found["y"]
        if tuple(got.shape) != tuple(want_y.shape):
            raise AssertionError(f"{where}: AllToAll returned {tuple(got.shape)}, expected "
                                 f"{tuple(want_y.shape)}: sum(receive_sizes) rows")
        assert_close(got.cpu(), want_y, f"{where}: AllToAll's output (the rows of rank 0, then "
                     f"rank 1, ... sent to this one)", rank=rank, **TIGHT)
        assert not found["x_changed"], f"{where}: AllToAll changed its input x"
        want_grad = torch.cat([cs[d][sum(sizes[s][d] for s in range(place)):
                                     sum(sizes[s][d] for s in range(place + 1))]
                               for d in range(n)])
        if found["grad"] is None:
            error = found.get("backward_error", "")
            raise AssertionError(
                f"{where}: no gradient reached x{': ' + error if error else ''}; " + (
                    f"the gradient autograd passes to backward: {NOT_CONTIGUOUS}"
                    if "contiguous" in error else "the backward sends each row's gradient "
                    "back: all_to_all_single with input_split_sizes=receive_sizes and "
                    "output_split_sizes=send_sizes"))
        assert_close(found["grad"].cpu(), want_grad, f"{where}: the gradient of x (each row's "
                     f"gradient, back from the rank it went to)", rank=rank, **TIGHT)
        if not count_calls:
            continue
        row = WIDTH * 8
        want_f = [("all_to_all", sum(sizes[place]) * row)]
        want_b = [("all_to_all", sum(r[place] for r in sizes) * row)]
        assert found["forward"] == want_f, (
            f"{where}: the forward called {found['forward']}, expected {want_f} (one "
            f"all_to_all of this rank's rows)")
        assert found["backward"] == want_b, (
            f"{where}: the backward called {found['backward']}, expected {want_b} (one "
            f"all_to_all of the received rows' gradients)")


@pytest.mark.task11_3
@pytest.mark.parametrize("group_case", GROUPS + [pytest.param("subgroups", id="subgroups")])
def test_all_to_all_sends_rows_and_their_gradients_back(group_case):
    """AllToAll delivers every row to its rank, in rank order, and every row's gradient back home,
    with one all-to-all each way of exactly those rows' bytes and x unchanged: uneven sizes with
    zeros, on 1 to 4 gloo ranks and in groups [0, 2] and [1, 3] of 4.

    The rows and their gradients are not contiguous, as a model's tensors need not be."""
    if group_case == "subgroups":
        world, backend, device, groups = 4, "gloo", "cpu", [[0, 2], [1, 3]]
        n = 2
    else:
        (world, backend, device), groups = group_case, None
        n = world
    sizes = seeded_counts(n, n, n).tolist()  # zeros among them: some pairs send nothing
    sizes[0][n - 1] = 3  # uneven: rank 0 sends the last rank more than the others
    results = run_on_ranks(a2a_run, sizes, groups, world_size=world, backend=backend,
                           device=device)
    check_a2a(results, sizes)  # with subgroups, each exchanged on its own


@pytest.mark.task11_3
@sweep(max_examples=12, shrink=False, world=st.integers(2, 4),
       matrix=st.lists(st.lists(st.integers(0, 4), min_size=4, max_size=4), min_size=4,
                       max_size=4))
def test_all_to_all_over_generated_sizes(world, matrix):
    """AllToAll delivers the rows and brings their gradients home for 12 generated size matrices, 0
    to 4 rows from each rank to each, on 2 to 4 gloo ranks."""
    sizes = [row[:world] for row in matrix[:world]]  # sizes[s][d]: rows rank s sends rank d
    check_a2a(run_on_ranks(a2a_run, sizes, world_size=world), sizes, count_calls=False)


@pytest.mark.task11_3
def test_all_to_all_takes_sizes_as_tensors():
    """AllToAll takes its size lists as int64 tensors too: rows, gradients and one all-to-all each
    way, on 2 gloo ranks."""
    sizes = [[1, 2], [0, 3]]
    check_a2a(run_on_ranks(a2a_run, sizes, None, True, world_size=2), sizes)


def refusal_run(ctx) -> str:
    ex = load_exercise(LESSON)
    x = torch.zeros(5, WIDTH, dtype=torch.float64)
    try:
        ex.AllToAll.apply(x, [1, 2], [1, 2])
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.task11_3
def test_all_to_all_refuses_sizes_that_do_not_add_up():
    """AllToAll raises a ValueError naming 3 and 5 when the send sizes [1, 2] do not add up to x's 5
    rows, on 2 gloo ranks."""
    for rank, message in enumerate(run_on_ranks(refusal_run, world_size=2, timeout=60)):
        assert message, (f"rank {rank}: AllToAll.apply(x of 5 rows, send_sizes [1, 2], ...) "
                         f"did not raise ValueError: check before sending")
        assert "3" in message and "5" in message, (
            f"rank {rank}: the message should name both numbers (3 rows in send_sizes, 5 in "
            f"x): {message}")
