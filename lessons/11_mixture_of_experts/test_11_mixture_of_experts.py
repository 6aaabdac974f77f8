"""Lesson 11: mixture of experts. What the lesson rests on, checked on one process and on
gloo/CPU ranks (and on nccl where GPUs are present):

- the script's MoE layer is the loop over tokens and their k experts that its text describes:
  a token's output is the sum of its kept experts' outputs, each weighed by its renormalised
  gate weight, and 0 for an assignment dropped over capacity;
- the load-balancing loss is Switch Transformer's, E * sum_e f_e P_e, whose gradient flows
  through P alone; it is 1 when the router is uniform;
- the task loss alone trains the router at k = 1 (the weight is p itself, as in Switch) and
  at k = 2;
- expert parallelism (each rank holds E / W experts, the tokens travel to them and back by
  all-to-all) gives each rank the output and the input gradient that the layer in one process
  gives its tokens, the router the sum of every rank's gradient, and each expert, on the rank
  that holds it, the gradient of all the tokens routed to it; the experts a rank does not hold
  are never touched; for 1, 2 and 4 ranks, top-1 and top-2, with and without a capacity, and
  when some expert gets no token;
- a step sends exactly: the counts (E numbers), this rank's kept rows there and the rows it
  received back in the forward, and the same two the other way in the backward;
- train_ep.py, expert parallel x data parallel: after a step every gradient a rank holds is the
  one-process gradient of the mean of the ranks' losses (capacity and auxiliary loss included),
  and its fit trains what one process trains on the global batch;
- experts x FSDP (moe.py's fully_shard_ep): the experts sharded over their column, the rest over
  every rank, every reduction a sum and each loss divided by W, train what one process trains;
  experts sharded over every rank instead become a patchwork of two experts, silently.

Each task's tests are in its own file, test_11_1_route.py to test_11_5_sync_gradients.py
(what they share is in common.py and conftest.py); this file checks the lesson's claims and its
scripts, moe.py and train_ep.py:

    pytest lessons/11_mixture_of_experts/test_11_mixture_of_experts.py
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, CharDataset, GPTConfig, run

from harness.collectives import CollectiveLog
from harness.compare import assert_close, assert_parameters_close
from harness.exercises import load_lesson_module
from harness.launch import QUICK_SAMPLE_LENGTH
from harness.ranks import run_on_ranks
from lesson11.common import GROUPS, LESSON, TIGHT, loop_route, seeded

WIDTH, TOKENS = 8, 12
LOOSE = {"rtol": 1e-5, "atol": 1e-5}  # float32 where grouped_mm sums in its own order


def moe_module():
    return load_lesson_module(LESSON, "moe")


def layer_of(moe, num_experts: int, k: int, capacity_factor, shun_last: bool):
    """The script's layer in float64; ``shun_last``: the router never picks the last expert."""
    layer = moe.MoE(WIDTH, num_experts, k, capacity_factor, seed=3).double()
    if shun_last:  # a router with a bias, far below the others for the last expert
        router = torch.nn.Linear(WIDTH, num_experts, dtype=torch.float64)
        with torch.no_grad():
            router.weight.copy_(layer.router.weight)
            router.bias.zero_()
            router.bias[-1] = -1e3
        layer.router = router
    return layer


@pytest.mark.parametrize("k, capacity_factor", [(1, None), (2, None), (1, 1.0), (2, 0.5)])
def test_moe_layer_is_the_loop_over_tokens_and_experts(k, capacity_factor):
    """moe.py's MoE is the loop over tokens and their kept experts, each expert's output weighed by
    its gate weight and a dropped one 0: 12 tokens of width 8, 4 experts, top-1 and top-2, no
    capacity or a factor of 1 or 0.5, in float64.

    At a factor of 0.5 at least half the assignments are dropped, at the capacity the text's formula
    gives."""
    moe = moe_module()
    layer = layer_of(moe, 4, k, capacity_factor, shun_last=False)
    x = seeded(1, 2, TOKENS // 2, WIDTH)
    out, _ = layer(x)
    tokens = x.reshape(-1, WIDTH)
    capacity = layer.capacity(TOKENS)
    experts, weights, kept = loop_route(layer.router(tokens), k, capacity)
    want = torch.stack([sum((weights[t][j] * layer.experts[experts[t][j]](tokens[t])
                             for j in range(k) if kept[t][j]), torch.zeros(WIDTH).double())
                        for t in range(TOKENS)])
    assert_close(out.reshape(-1, WIDTH), want, f"MoE(top-{k}, capacity factor "
                 f"{capacity_factor}) against the loop over tokens", **TIGHT)
    dropped = sum(not flag for row in kept for flag in row)
    if capacity_factor == 0.5:  # half an even share: at least half the assignments go
        assert dropped >= TOKENS * k // 2, f"{dropped} dropped at capacity {capacity}"
        assert capacity == -(-TOKENS * k // 4 // 2), capacity


@pytest.mark.parametrize("k", [1, 2])
def test_the_task_loss_gives_the_router_a_gradient(k):
    """The task loss alone, without the load-balancing loss, moves MoE's router at k = 1 as at k = 2
    (a gradient above 1e-3): for k = 1 the weight is the probability p itself, since p / p = 1 would
    give the router no gradient."""
    layer = layer_of(moe_module(), 4, k, None, shun_last=False)
    out, _ = layer(seeded(6, TOKENS, WIDTH))
    (out * seeded(7, TOKENS, WIDTH)).sum().backward()
    largest = layer.router.weight.grad.abs().max().item()
    assert largest > 1e-3, (f"top-{k}: the router's gradient from the loss is at most "
                            f"{largest:.1e}: its weights do not depend on the router")


def test_load_balancing_loss_is_switchs_formula():
    """moe.py's load-balancing loss is Switch Transformer's `E * sum_e f_e * P_e`, worked out by
    counting (12 tokens, 4 experts, top-2); its gradient flows through P_e alone, and it is 1 for a
    uniform router."""
    moe = moe_module()
    logits = seeded(2, TOKENS, 4).requires_grad_(True)
    probs = logits.softmax(dim=-1)
    experts = probs.topk(2, dim=-1).indices
    aux = moe.load_balancing_loss(probs, experts, 4)
    share = [sum(int(e == i) for row in experts.tolist() for e in row) / (2 * TOKENS)
             for i in range(4)]
    want = 4 * sum(share[i] * probs[:, i].mean() for i in range(4))
    assert_close(aux, want.detach(), "the load-balancing loss", **TIGHT)
    (grad,) = torch.autograd.grad(aux, logits, retain_graph=True)  # probs is shared
    (want_grad,) = torch.autograd.grad(want, logits)  # the shares are constants
    assert_close(grad, want_grad, "its gradient (through the mean probabilities only)", **TIGHT)
    uniform = torch.full((TOKENS, 4), 0.25, dtype=torch.float64)
    assert moe.load_balancing_loss(uniform, experts, 4).item() == pytest.approx(1.0), (
        "with a uniform router the loss is E * sum_e f_e / E = 1, whatever the shares")


def ep_run(ctx, num_experts: int, k: int, capacity_factor, shun_last: bool) -> dict:
    """Expert parallel on this rank, its collectives counted; the one-process reference for
    every rank's batch; what each rank found."""
    moe = moe_module()
    world, rank = ctx.world_size, ctx.rank
    layer = layer_of(moe, num_experts, k, capacity_factor, shun_last).to(ctx.device)
    x = seeded(10 + rank, TOKENS, WIDTH).to(ctx.device).requires_grad_(True)
    c = seeded(20 + rank, TOKENS, WIDTH).to(ctx.device)
    with CollectiveLog(moe) as forward:
        out, aux, per_expert = moe.expert_parallel(layer, x)
    with CollectiveLog(moe) as backward:
        ((out * c).sum() + aux).backward()
    single = layer_of(moe, num_experts, k, capacity_factor, shun_last)
    total, mine = 0.0, None
    for source in range(world):
        xs = seeded(10 + source, TOKENS, WIDTH).requires_grad_(True)
        ys, aux_s = single(xs)
        total = total + (ys * seeded(20 + source, TOKENS, WIDTH)).sum() + aux_s
        if source == rank:
            mine = (ys.detach(), xs)
    total.backward()
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router)
    mine_experts = range(rank * num_experts // world, (rank + 1) * num_experts // world)
    return {
        "out": (out.detach(), mine[0]), "x_grad": (x.grad, mine[1].grad),
        "router": (router, single.router.weight.grad),
        "held": {e: ([p.grad for p in layer.experts[e].parameters()],
                     [p.grad for p in single.experts[e].parameters()]) for e in mine_experts},
        "others_touched": [e for e in range(num_experts) if e not in mine_experts
                           and any(p.grad is not None for p in layer.experts[e].parameters())],
        "per_expert": per_expert,
        "forward": [(call.op, call.payload) for call in forward.calls],
        "backward": [(call.op, call.payload) for call in backward.calls],
    }


@pytest.mark.parametrize("shun_last", [False, True], ids=["every expert", "one expert idle"])
@pytest.mark.parametrize("k, capacity_factor", [(1, None), (2, None), (2, 1.0)])
@pytest.mark.parametrize("group_case", [g for g in GROUPS if g.values[0][0] in (1, 2, 4)])
def test_expert_parallel_is_the_layer_in_one_process(group_case, k, capacity_factor, shun_last):
    """moe.py's expert_parallel gives each rank the layer's output and input gradient in one
    process, the router the sum of every rank's gradient, each held expert its gradient, and others'
    experts none: 1, 2 and 4 gloo ranks, top-1 and top-2, with and without a capacity, one expert
    idle or not.

    The forward sends the counts (E numbers), this rank's kept rows, and the rows it received back;
    the backward the same two the other way; each of exactly those bytes."""
    world, backend, device = group_case
    num_experts = 2 * world if world > 1 else 3
    results = run_on_ranks(ep_run, num_experts, k, capacity_factor, shun_last,
                           world_size=world, backend=backend, device=device)
    for rank, found in enumerate(results):
        where = f"rank {rank} of {world}, {num_experts} experts, top-{k}, capacity factor " \
                f"{capacity_factor}"
        for name in ("out", "x_grad", "router"):
            got, want = found[name]
            assert_close(got.cpu(), want, f"{where}: {name} against one process", **TIGHT)
        for e, (got, want) in found["held"].items():
            for g, w in zip(got, want, strict=True):
                w = torch.zeros(()) if w is None else w
                assert g is not None or not w.abs().sum(), f"{where}: expert {e} got no grad"
                if g is not None:
                    assert_close(g.cpu(), w, f"{where}: expert {e}'s gradient", **TIGHT)
        assert not found["others_touched"], (
            f"{where}: experts {found['others_touched']}, held by other ranks, got gradients")
        if shun_last:
            total = sum(f["per_expert"] for f in results)
            assert total[-1] == 0, f"the last expert got {total[-1]} tokens; expected none"
        row = WIDTH * 8
        mine = num_experts // world  # what rank r receives: every rank's rows for its block
        sent = int(found["per_expert"].sum())
        received = int(sum(f["per_expert"][rank * mine:(rank + 1) * mine].sum() for f in results))
        assert found["forward"] == [("all_to_all", num_experts * 8), ("all_to_all", sent * row),
                                    ("all_to_all", received * row)], found["forward"]
        assert found["backward"] == [("all_to_all", sent * row),
                                     ("all_to_all", received * row)], found["backward"]


@pytest.mark.slow  # a torchrun launch
def test_script_matches_one_process(script_run):
    """moe.py under torchrun on 2 ranks, 32 tokens of width 16, differs from one process by less
    than 1e-5 in everything it compares, and its tokens per expert and dropped assignments add up to
    every token's 2 choices, some dropped at a capacity factor of 1."""
    run = script_run.result()
    print(run.output)
    ranks = run.data["ranks"]
    for rank, found in enumerate(ranks):
        for name, error in found["errors"].items():
            assert error < 1e-5, f"rank {rank}: {name} is {error:.1e} from one process"
    counts = ranks[0]["tokens_per_expert"]
    assert sum(counts) + ranks[0]["dropped"] == 2 * 32 * 2, (counts, ranks[0]["dropped"])
    assert ranks[0]["dropped"] > 0, "at capacity factor 1 the script's routing drops some"


def test_renormalising_after_top_k_is_a_softmax_over_the_chosen_logits():
    """route's top-2 weights are a softmax over the 2 chosen logits, Mixtral's form: 12 tokens, 6
    experts, in float64."""
    moe = moe_module()
    logits = seeded(5, TOKENS, 6)
    experts, weights, _ = moe.route(logits, 2)
    assert_close(weights, logits.gather(-1, experts).softmax(dim=-1),
                 "the weights against a softmax over the chosen logits", **TIGHT)


@pytest.mark.parametrize("case", ["grouped_mm", "float64", "no grouped_mm", "6 columns"])
def test_grouped_matmul_is_the_loop_over_groups_either_way(ex, monkeypatch, capsys, case):
    """The exercise file's grouped_matmul equals a loop over 4 groups of 3, 0, 5 and 2 rows with
    torch's grouped_mm (float32, 8 columns) and without it (float64; a torch without grouped_mm;
    6 float32 columns), and says why it loops once, however often it is called."""
    generator = torch.Generator().manual_seed(0)
    dtype = torch.float64 if case == "float64" else torch.float32
    columns = 6 if case == "6 columns" else 8
    x = torch.randn(10, columns, generator=generator, dtype=dtype)
    w = torch.randn(4, columns, 8, generator=generator, dtype=dtype)
    offs = torch.tensor([3, 3, 8, 10], dtype=torch.int32)
    if case == "no grouped_mm":
        monkeypatch.delattr(torch.nn.functional, "grouped_mm", raising=False)
    monkeypatch.setattr(ex, "_said_fallback", [])
    want = torch.cat([x[0:3] @ w[0], x[3:3] @ w[1], x[3:8] @ w[2], x[8:10] @ w[3]])
    for _ in range(2):
        assert_close(ex.grouped_matmul(x, w, offs), want, f"grouped_matmul ({case})", **LOOSE)
    said = capsys.readouterr().out
    assert said.count("looping over the groups") == (0 if case == "grouped_mm" else 1), said


def at_least_2_14() -> bool:
    """Where torch changed before 2.14 (2.11 on the course's GPU machine) the claims hold from
    2.14 on, as the text says; an older torch is only asked what it has kept since."""
    return torch.torch_version.TorchVersion(torch.__version__) >= "2.14"


def torch_a2a_run(ctx, sizes) -> dict:
    import warnings

    import torch.distributed._functional_collectives as ft_c
    import torch.distributed.nn.functional as nn_functional

    moe = moe_module()
    send = sizes[ctx.rank]
    receive = [row[ctx.rank] for row in sizes]
    found = {"warned": []}
    for name in ("course", "all_to_all_single_autograd", "all_to_all_single", "nn.functional"):
        x = seeded(30 + ctx.rank, sum(send), 3).requires_grad_(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if name == "course":
                y = moe.AllToAll.apply(x, send, receive)
            elif name == "nn.functional":
                y = nn_functional.all_to_all_single(x.new_empty(sum(receive), 3), x, receive,
                                                    send)
            else:
                y = ft_c.wait_tensor(getattr(ft_c, name)(x, receive, send, dist.group.WORLD))
        found["warned"] += [name for w in caught if issubclass(w.category, FutureWarning)]
        if not y.requires_grad:  # not differentiable on this torch
            found[name] = None
            continue
        (y * seeded(40 + ctx.rank, sum(receive), 3)).sum().backward()
        found[name] = (y.detach(), x.grad)
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_torchs_differentiable_all_to_alls_agree(world):
    """torch's `_functional_collectives.all_to_all_single`, `all_to_all_single_autograd` and the
    deprecated `nn.functional.all_to_all_single` give AllToAll's outputs and gradients, on 2 and 4
    gloo ranks with uneven sizes and zeros; from torch 2.14 the first is differentiable and only the
    last warns.

    The warning is a FutureWarning. An older torch is only asked what it has kept since."""
    sizes = [[(s + 2 * d) % 3 for d in range(world)] for s in range(world)]
    for rank, found in enumerate(run_on_ranks(torch_a2a_run, sizes, world_size=world)):
        if at_least_2_14():
            assert found["warned"] == ["nn.functional"], (
                f"rank {rank}: FutureWarning from {found['warned']}, expected only from "
                f"torch.distributed.nn.functional.all_to_all_single")
            assert found["all_to_all_single"] is not None, (
                f"rank {rank}: _functional_collectives.all_to_all_single gave no gradient")
        for name in ("all_to_all_single_autograd", "all_to_all_single", "nn.functional"):
            if found[name] is None:  # only before 2.14: the text claims 2.14
                assert name == "all_to_all_single" and not at_least_2_14(), (rank, name)
                continue
            for got, want, what in zip(found[name], found["course"], ("output", "gradient"),
                                       strict=True):
                assert_close(got, want, f"rank {rank}: torch's {name}'s {what} against "
                             f"AllToAll's", **TIGHT)


def ddp_broadcast_run(ctx) -> dict:
    """Each rank's own "experts" (a Linear seeded by its rank), wrapped in plain DDP."""
    from torch.nn.parallel import DistributedDataParallel

    experts = torch.nn.Linear(3, 3, dtype=torch.float64)
    with torch.no_grad():
        experts.weight.copy_(seeded(90 + ctx.rank, 3, 3))
    before = [p.detach().clone() for p in experts.parameters()]
    DistributedDataParallel(experts)
    mine = [p.detach().clone() for p in experts.parameters()]
    theirs = [torch.zeros_like(p) for p in mine]
    for own, other in zip(mine, theirs, strict=True):  # rank 0's, as DDP left it
        dist.broadcast(other.copy_(own), src=0)
    return {"changed": any(not torch.equal(a, b) for a, b in zip(before, mine, strict=True)),
            "equal_to_rank_0": all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))}


def test_plain_ddp_would_overwrite_every_ranks_experts_with_rank_0s():
    """Wrapping a model in plain DDP overwrites rank 1's parameters with rank 0's and leaves rank
    0's as they were: 2 gloo ranks, each with its own seeded Linear (DDP's init_sync, on by
    default)."""
    found = run_on_ranks(ddp_broadcast_run, world_size=2)
    assert not found[0]["changed"], "DDP changed rank 0's own parameters"
    assert found[1]["changed"] and found[1]["equal_to_rank_0"], (
        f"rank 1 after wrapping in DDP: {found[1]}; the text says it holds rank 0's parameters")


# ------------------------------------------------------------ train_ep.py: the running example

# AdamW over a few steps, another summation order (as lessons 03 and 10).
SAME_STEPS = {"rtol": 1e-3, "atol": 2e-4}


def train_ep_module():
    """train_ep.py as torchrun runs it, beside moe.py, which it imports by name."""
    sys.modules.setdefault("moe", moe_module())
    return load_lesson_module(LESSON, "train_ep")


class OneProcess(torch.nn.Module):
    """The oracle's MLP: moe.py's MoE layer with every expert, its loop over experts."""

    def __init__(self, layer):
        super().__init__()
        self.layer, self.aux = layer, None

    def forward(self, x):
        out, self.aux = self.layer(x)
        return out


def one_process_gradients(world: int, batch: int = 4, aux_weight: float = 0.01) -> dict:
    """The oracle, in this process: the running example with moe.py's MoE layer (every expert,
    its loop over experts) as each block's MLP runs each rank's batch on its own (capacity
    factor 1.25 and the auxiliary loss are per batch) and averages the W losses."""
    dataset = CharDataset(16)
    config = GPTConfig.named("tiny", vocab_size=dataset.vocab_size, block_size=16)
    inputs, targets = (torch.stack(t) for t in zip(*(dataset[i] for i in range(batch * world)),
                                                   strict=True))
    alone = GPT(config, seed=0)
    for i, block in enumerate(alone.blocks):
        block.mlp = OneProcess(moe_module().MoE(config.n_embd, 4, 2, 1.25, seed=1 + i))
    total = 0.0
    for source in range(world):
        theirs = slice(source * batch, (source + 1) * batch)
        _, loss = run.next_char_loss(alone, inputs[theirs], targets[theirs])
        total = total + loss + aux_weight * sum(b.mlp.aux for b in alone.blocks)
    (total / world).backward()
    return {n: p.grad for n, p in alone.named_parameters()}


def ep_gradients_on_rank(ctx, ep: int, batch: int = 4, aux_weight: float = 0.01) -> dict:
    """One step of train_ep.py's model on this rank's own batch, as its loop takes it:
    backward of the loss and the auxiliary loss, then its sync_gradients over dp rows x ep
    columns. Returns the gradients, the experts named by their number in one process, the loads,
    and the names whole_state gathers."""
    script = train_ep_module()
    dataset = CharDataset(16)
    config = GPTConfig.named("tiny", vocab_size=dataset.vocab_size, block_size=16)
    mine = [dataset[i] for i in range(ctx.rank * batch, (ctx.rank + 1) * batch)]
    inputs, targets = (torch.stack(t) for t in zip(*mine, strict=True))
    row, column = moe_module().expert_groups(ctx.world_size, ep)
    model = script.moe_gpt(config, 0, 4, 2, 1.25, row)
    _, loss = run.next_char_loss(model, inputs, targets)
    (loss + aux_weight * sum(b.mlp.aux for b in model.blocks)).backward()
    copies = column if ctx.world_size > ep else None
    script.sync_gradients(*moe_module().split_parameters(model), copies)
    first = ctx.rank % ep * (4 // ep)  # this rank's experts, numbered as in one process
    grads = {"loads": [block.mlp.load.tolist() for block in model.blocks],
             "whole": sorted(script.whole_state(model, row))}
    for name, parameter in model.named_parameters():
        grads[moe_module().renumber(name, first)] = parameter.grad
    return grads


@pytest.mark.parametrize("world, ep", [(2, 2), (2, 1), (4, 2), (4, 4)],
                         ids=["ep2", "dp2", "dp2xep2", "ep4"])
def test_train_ep_steps_give_the_gradients_of_one_process(world, ep):
    """train_ep.py's model and sync_gradients, after one step with a capacity factor of 1.25 and the
    load-balancing loss, give every parameter a rank holds the gradient of the mean of the ranks'
    losses in one process: 2 and 4 gloo ranks, ep 2, dp 2, dp 2 × ep 2 and ep 4.

    Each rank holds 1/ep of the expert tensors; each block's loads add up to every token's k
    assignments, dropped ones included (what moe_costs.py counts); whole_state names every expert as
    one process does."""
    want = one_process_gradients(world)
    for rank, got in enumerate(run_on_ranks(ep_gradients_on_rank, ep, world_size=world)):
        for loads in got.pop("loads"):  # what moe_costs.py counts: every assignment, dropped too
            assert len(loads) == 4 and sum(loads) == 4 * 16 * 2, (rank, loads)
        whole = got.pop("whole")  # the checkpoint's names: every expert, numbered as in one
        assert whole == sorted(want), f"rank {rank}: whole_state's names {whole}"
        for name, gradient in got.items():
            assert_close(gradient, want[name], f"the gradient of {name}, dp {world // ep} x ep "
                         f"{ep} vs one process", rank, rtol=1e-4, atol=1e-6)
        held = sum(".experts." in name for name in got)
        # 4 blocks x 4 experts x 4 tensors (two layers' weights and biases), split ep ways
        assert held == 4 * 4 * 4 // ep, f"rank {rank} holds {held} expert tensors, not 1/{ep}"


def ep_fit_on_rank(ctx, batch_size: int) -> dict:
    """train_ep.py's fit, one epoch of 64 windows, every process in one expert-parallel row,
    nothing dropped and no auxiliary loss; on one rank, every expert in one process."""
    whole, result = train_ep_module().fit(ctx.device, epochs=1, batch_size=batch_size,
                                          train_windows=64, ep=ctx.world_size,
                                          capacity_factor=None, aux_weight=0.0,
                                          sample_length=QUICK_SAMPLE_LENGTH,
                                          log=lambda *args, **kwargs: None)
    return {"state": whole, "result": result}


def test_train_ep_trains_what_one_process_trains():
    """train_ep.py's fit on 2 gloo ranks, ep 2 with 8 windows a rank, nothing dropped and no
    auxiliary loss, trains what one process with every expert trains on batches of 16: losses,
    accuracy and every parameter (experts gathered) to lesson 03's bound, and the same samples."""
    reference = run_on_ranks(ep_fit_on_rank, 16, world_size=1, timeout=120)[0]
    split = run_on_ranks(ep_fit_on_rank, 8, world_size=2, timeout=120)[0]
    data = split["result"]
    assert (data["world_size"], data["dp"], data["ep"]) == (2, 1, 2), data
    for key in ("train_loss", "val_loss", "val_accuracy"):
        assert_close(torch.tensor(data[key]), torch.tensor(reference["result"][key]),
                     f"ep 2 vs one process x 16: {key} per epoch", **SAME_STEPS)
    assert sorted(split["state"]) == sorted(reference["state"]), "the gathered state's names"
    assert_parameters_close(split["state"], reference["state"], what="trained parameter, ep 2 "
                            "vs one process", **SAME_STEPS)
    for key in ("sample_before", "sample_after"):
        assert data[key] == reference["result"][key], (key, data[key])


@pytest.mark.parametrize("argv, env, said", [
    (["--ep", "2"], {}, "--ep 2: ep must divide the processes (1)"),
    (["--experts", "6"], {"WORLD_SIZE": "4"}, "--ep 4 (the default: every process): ep must "
     "divide the processes (4) and --experts (6)"),
    (["--k", "5"], {}, "--k 5: a token chooses 1 to --experts (4) experts"),
    (["--capacity-factor", "-1"], {}, "--capacity-factor -1: 0 (no limit) or more"),
])
def test_train_ep_refuses_a_degree_that_does_not_fit(outside_launcher, monkeypatch, capsys,
                                                     argv, env, said):
    """train_ep.py refuses, before any process group and with status 2, an `--ep` that does not
    divide the processes or the experts, a `--k` outside 1 to the experts, and a negative capacity
    factor, each in one error naming the script and the numbers."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert train_ep_module().main(argv) == 2
    err = capsys.readouterr().err
    assert f"train_ep.py: error: {said}" in err, err
    assert not dist.is_initialized()


# ------------------------------------------ experts x FSDP: moe.py's fully_shard_ep, as torchtitan

SGD_STEPS = {"rtol": 1e-4, "atol": 1e-6}  # plain SGD: a gradient off by a factor shows whole


def one_process_steps(world: int, steps: int, batch: int, lr: float, aux_weight: float) -> dict:
    """The oracle: the running example with every expert in one process, SGD on the mean of the
    W batches' losses (each batch routed, capped and balanced on its own), step after step."""
    dataset = CharDataset(16)
    config = GPTConfig.named("tiny", vocab_size=dataset.vocab_size, block_size=16, n_layer=2)
    alone = GPT(config, seed=0)
    for i, block in enumerate(alone.blocks):
        block.mlp = OneProcess(moe_module().MoE(config.n_embd, 4, 2, 1.25, seed=1 + i))
    optimizer = torch.optim.SGD(alone.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        total, seen = 0.0, 0.0
        for source in range(world):
            first = (step * world + source) * batch
            inputs, targets = (torch.stack(t) for t in zip(
                *(dataset[i] for i in range(first, first + batch)), strict=True))
            _, loss = run.next_char_loss(alone, inputs, targets)
            total = total + loss + aux_weight * sum(b.mlp.aux for b in alone.blocks)
            seen += loss.item()
        optimizer.zero_grad()
        (total / world).backward()
        optimizer.step()
        losses.append(seen / world)
    return {"losses": losses, "state": {n: p.detach() for n, p in alone.named_parameters()}}


def fsdp_ep_steps_on_rank(ctx, ep: int, steps: int, batch: int, lr: float,
                          aux_weight: float) -> dict:
    """train_ep.py's model sharded by moe.py's fully_shard_ep, SGD on this rank's batch of each
    step with the loss divided by the world size (FSDP only sums). Returns the mean loss of each
    step and every parameter gathered, the experts numbered as in one process."""
    script, moe = train_ep_module(), moe_module()
    dataset = CharDataset(16)
    config = GPTConfig.named("tiny", vocab_size=dataset.vocab_size, block_size=16, n_layer=2)
    row, column = moe.expert_groups(ctx.world_size, ep)
    model = moe.fully_shard_ep(script.moe_gpt(config, 0, 4, 2, 1.25, row), column)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        first = (step * ctx.world_size + ctx.rank) * batch
        inputs, targets = (torch.stack(t) for t in zip(
            *(dataset[i] for i in range(first, first + batch)), strict=True))
        _, loss = run.next_char_loss(model, inputs, targets)
        aux = sum(block.mlp.aux for block in model.blocks)
        optimizer.zero_grad()
        ((loss + aux_weight * aux) / ctx.world_size).backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / ctx.world_size)
    first = ctx.rank % ep * (4 // ep)  # this rank's experts, numbered as in one process
    held = {moe.renumber(name, first): (p.to_local().numel(), p.device_mesh.size())
            for name, p in model.named_parameters()}
    return {"losses": losses, "state": moe.whole_state(model, row), "held": held}


def test_experts_sharded_over_their_copies_train_what_one_process_trains():
    """moe.py's fully_shard_ep on 4 gloo ranks, dp 2 × ep 2 (dense parameters sharded over all 4,
    each rank's experts over the 2 that hold them, every reduction a sum, each loss divided by 4):
    3 SGD steps give one process's losses and parameters, capacity and balancing loss included.

    SGD, not AdamW: a gradient off by a constant factor (FSDP's default division left on, over 4
    for the dense parameters or 2 for the experts) moves the parameters by that factor, where AdamW
    would nearly hide it. Each rank holds about a quarter of the dense tensors and half of its own
    experts', so about a quarter of the whole model."""
    steps, batch, lr, aux_weight = 3, 4, 0.5, 0.01
    want = one_process_steps(4, steps, batch, lr, aux_weight)
    found = run_on_ranks(fsdp_ep_steps_on_rank, 2, steps, batch, lr, aux_weight, world_size=4)
    for rank, got in enumerate(found):
        assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                     f"the mean loss of each of {steps} steps, dp 2 x ep 2 under FSDP vs one "
                     "process", rank, **SGD_STEPS)
        assert sorted(got["state"]) == sorted(want["state"]), f"rank {rank}: gathered names"
        assert_parameters_close(got["state"], want["state"], what=f"parameter after {steps} SGD "
                                "steps, dp 2 x ep 2 under FSDP vs one process", rank=rank,
                                **SGD_STEPS)
        for name, (_, ranks) in got["held"].items():
            over = 2 if ".experts." in name else 4
            assert ranks == over, f"rank {rank}: {name} sharded over {ranks} ranks, not {over}"
        whole = sum(p.numel() for p in want["state"].values())
        mine = sum(numel for numel, _ in got["held"].values())
        assert abs(mine - whole / 4) < 0.01 * whole, (
            f"rank {rank} holds {mine} of {whole} numbers; expected about a quarter")


def experts_over_everyone_run(ctx) -> dict:
    """A dp 2 x ep 2 rank's first expert (expert 0 on ranks 0 and 2, expert 2 on 1 and 3),
    sharded over all 4 ranks as if every rank held the same one; and a Linear sharded with FSDP's
    default division over a column, backpropagating a loss of (rank + 1) times its sum."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    layer = moe_module().MoE(WIDTH, 4, 2, seed=3)
    mine = layer.experts[ctx.rank % 2 * 2]  # the expert this rank holds in place 0
    before = mine.up_proj.weight.detach().clone()
    fully_shard(mine, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    gathered = mine.up_proj.weight.full_tensor().detach()
    _, column = moe_module().expert_groups(4, 2)
    probe = torch.nn.Linear(3, 1, bias=False)
    fully_shard(probe, mesh=DeviceMesh.from_group(column, "cpu"))
    (probe(torch.ones(1, 3)).sum() * (ctx.rank + 1)).backward()
    summed = torch.nn.Linear(3, 1, bias=False)  # division off, the reduction left to FSDP
    fully_shard(summed, mesh=DeviceMesh.from_group(column, "cpu")).set_gradient_divide_factor(1.0)
    try:
        summed(torch.ones(1, 3)).sum().backward()
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    return {"before": before, "gathered": gathered, "probe": probe.weight.grad.full_tensor(),
            "refused": refused}


def test_experts_sharded_over_everyone_mix_two_experts():
    """fully_shard over all 4 gloo ranks of a dp 2 × ep 2 layout's own experts checks nothing:
    each rank keeps its quarter of its own tensor, so every rank gathers one patchwork of experts 0
    and 2. Over a column of 2, FSDP's gradient is the mean; with the division off, gloo refuses.

    The quarters come from ranks 0, 1, 2, 3 in order: expert 0's rows, expert 2's, expert 0's,
    expert 2's. The probe's gradient, loss (r + 1) x sum on rank r, is (1 + 3) / 2 on ranks 0 and 2
    and (2 + 4) / 2 on ranks 1 and 3. A divide factor of 1.0 makes FSDP reduce-scatter with
    PREMUL_SUM, which gloo does not have (so moe.py's fully_shard_ep forces a plain sum)."""
    found = run_on_ranks(experts_over_everyone_run, world_size=4)
    rows = found[0]["before"].shape[0] // 4
    for rank, got in enumerate(found):
        patchwork = torch.cat([found[r]["before"][r * rows:(r + 1) * rows] for r in range(4)])
        assert torch.equal(got["gathered"], patchwork), (
            f"rank {rank}: the gathered weight is not each rank's own quarter in rank order")
        assert not torch.equal(got["gathered"], got["before"]), f"rank {rank}: no mixture"
        want = torch.full((1, 3), (1 + 3) / 2 if rank % 2 == 0 else (2 + 4) / 2)
        assert_close(got["probe"], want, "FSDP's default gradient over a column of 2", rank)
        assert "PREMUL_SUM with Gloo" in got["refused"], f"rank {rank}: {got['refused']!r}"
