"""A mixture-of-experts layer, in one process and with its experts spread over ranks.

    torchrun --standalone --nproc-per-node=2 lessons/11_mixture_of_experts/moe.py

Every rank builds the same layer (E experts, each the running example's MLP, behind a router)
from a seed, and its own tokens. Rank r keeps experts r E/W to (r + 1) E/W - 1 and runs the
layer expert-parallel: route its tokens, send each to the rank that holds its expert with one
all-to-all (after an all-to-all of the counts), run the experts there, send the results back
with a second all-to-all and weigh them. The backward sends the gradients the same two ways.
Each rank then checks its output, and the gradients, against the same layer run in one process;
rank 0 prints the largest difference, the tokens each expert got, how many were dropped over
capacity, and the bytes each all-to-all sent against the count by hand.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
from gpt import GPTConfig, run  # noqa: E402 - the plumbing every script shares
from gpt.model import MLP  # noqa: E402 - each expert is the running example's MLP


def route(logits, k, capacity=None):
    """Top-k of softmax(logits), renormalised for k > 1; each expert keeps its first `capacity`
    (task11_1)."""
    num_tokens, num_experts = logits.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"k = {k}: choose 1 to {num_experts} of the {num_experts} experts")
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity = {capacity}: an expert takes 0 or more assignments")
    top, experts = logits.softmax(dim=-1).topk(k, dim=-1)
    # k > 1: renormalised after the top-k (a token's weights sum to 1); k = 1: p itself, as in
    # Switch, since p / p = 1 would leave the router no gradient from the loss
    weights = top / top.sum(dim=-1, keepdim=True) if k > 1 else top
    if capacity is None:
        return experts, weights, torch.ones_like(experts, dtype=torch.bool)
    choice_major = experts.t().reshape(-1)  # every first choice, then every second, ...
    onehot = torch.nn.functional.one_hot(choice_major, num_experts)
    place = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1  # its place in its expert's queue
    return experts, weights, (place < capacity).reshape(k, num_tokens).t()


def dispatch_plan(experts, kept, num_experts, world_size):
    """The kept assignments' flat indices grouped by expert, and the count per expert
    (task11_2)."""
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts do not split into equal blocks on "
                         f"{world_size} ranks")
    chosen = kept.flatten().nonzero().flatten()
    order = chosen[torch.argsort(experts.flatten()[chosen], stable=True)]
    return order, torch.bincount(experts.flatten()[chosen], minlength=num_experts)


def exchange_counts(per_expert, group=None):
    """Row s: what rank s sends each expert of this rank (task11_3)."""
    received = torch.empty_like(per_expert)
    dist.all_to_all_single(received, per_expert.contiguous(), group=group)
    return received.view(dist.get_world_size(group), -1)


class AllToAll(torch.autograd.Function):
    """Rows to ranks with uneven sizes; the backward sends the gradients back (task11_3)."""

    @staticmethod
    def forward(ctx, x, send_sizes, receive_sizes, group=None):
        send_sizes, receive_sizes = [int(n) for n in send_sizes], [int(n) for n in receive_sizes]
        if sum(send_sizes) != x.shape[0]:
            raise ValueError(f"send_sizes add up to {sum(send_sizes)} rows, x has {x.shape[0]}")
        ctx.sizes, ctx.group = (send_sizes, receive_sizes), group
        out = x.new_empty((sum(receive_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive_sizes,
                               input_split_sizes=send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_sizes, receive_sizes = ctx.sizes
        back = grad.new_empty((sum(send_sizes), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=send_sizes,
                               input_split_sizes=receive_sizes, group=ctx.group)
        return back, None, None, None


def load_balancing_loss(probs, experts, num_experts):
    """Switch Transformer's auxiliary loss, E * sum_e f_e P_e: f_e the share of the assignments
    routed to expert e (before the capacity drops any), P_e its mean probability. 1 when both
    are uniform; its gradient flows through P alone (f is a count)."""
    if probs.shape[0] == 0:  # no token on this rank: nothing to balance
        return probs.sum()
    share = torch.bincount(experts.flatten(), minlength=num_experts) / experts.numel()
    return num_experts * (share.to(probs.dtype) * probs.mean(dim=0)).sum()


class MoE(nn.Module):
    """E experts behind a router; each token goes to k of them. ``forward(x)`` returns the
    weighted sum of its experts' outputs (0 for an assignment dropped over capacity: the block's
    residual carries the token on) and the load-balancing loss."""

    def __init__(self, width: int, num_experts: int, k: int = 2,
                 capacity_factor: float | None = None, seed: int = 0):
        super().__init__()
        self.num_experts, self.k, self.capacity_factor = num_experts, k, capacity_factor
        with torch.random.fork_rng():
            torch.manual_seed(seed)  # the same layer on every rank
            self.router = nn.Linear(width, num_experts, bias=False)
            config = GPTConfig(n_embd=width, n_head=1, n_layer=1, block_size=1, vocab_size=1)
            self.experts = nn.ModuleList(MLP(config) for _ in range(num_experts))

    def capacity(self, num_tokens: int) -> int | None:
        """Assignments one expert takes from ``num_tokens`` tokens: its even share times the
        capacity factor, rounded up (None: no limit)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.k / self.num_experts)

    def gate(self, x):
        """(tokens, experts, weights, kept, aux) for x (..., width)."""
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens)
        experts, weights, kept = route(logits, self.k, self.capacity(tokens.shape[0]))
        aux = load_balancing_loss(logits.softmax(dim=-1), experts, self.num_experts)
        return tokens, experts, weights, kept, aux

    def forward(self, x):
        tokens, experts, weights, kept, aux = self.gate(x)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, choice = ((experts == e) & kept).nonzero(as_tuple=True)
            out = out.index_add(0, token, weights[token, choice, None] * expert(tokens[token]))
        return out.view_as(x), aux


def expert_parallel_forward(tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                            kept: torch.Tensor, local_experts, num_experts: int, group=None):
    """Each token's kept experts, weighed, with this rank's block of experts (task11_4)."""
    world = dist.get_world_size(group)
    mine = num_experts // world
    if len(local_experts) != mine or num_experts % world:
        raise ValueError(f"{len(local_experts)} local experts given; {num_experts} experts on "
                         f"{world} ranks are {num_experts / world:g} a rank")
    k = experts.shape[1]
    order, per_expert = dispatch_plan(experts, kept, num_experts, world)
    from_each = exchange_counts(per_expert, group)  # (W, mine): rank s -> each of my experts
    send = per_expert.view(world, mine).sum(dim=1).tolist()
    receive = from_each.sum(dim=1).tolist()
    arrived = AllToAll.apply(tokens[order // k], send, receive, group)  # by source rank
    # Each source's rows are grouped by expert: regroup all of them by my expert, stably.
    local = torch.arange(mine, device=tokens.device).repeat(world)
    by_expert = torch.argsort(local.repeat_interleave(from_each.flatten()), stable=True)
    pieces = arrived[by_expert].split(from_each.sum(dim=0).tolist())
    done = torch.cat([expert(piece) for expert, piece in zip(local_experts, pieces, strict=True)])
    returned = AllToAll.apply(done[torch.argsort(by_expert)], receive, send, group)
    # returned's dtype: the experts' (under autocast, not the tokens'); a dropped slot stays 0
    slots = returned.new_zeros(experts.numel(), returned.shape[-1]).index_copy(0, order, returned)
    return (slots.view(*experts.shape, returned.shape[-1]) * weights.unsqueeze(-1)).sum(dim=1)


def expert_parallel(layer: MoE, x, group=None):
    """``layer(x)`` with this rank's block of experts only: the tokens travel to their experts'
    ranks and back. Returns (out, aux, per_expert): per_expert, what this rank sent each
    expert."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens, experts, weights, kept, aux = layer.gate(x)
    mine = layer.num_experts // world  # experts per rank
    block = layer.experts[rank * mine:(rank + 1) * mine]
    out = expert_parallel_forward(tokens, experts, weights, kept, block, layer.num_experts, group)
    _, per_expert = dispatch_plan(experts, kept, layer.num_experts, world)  # for the report
    return out.view_as(x), aux, per_expert


class ExpertParallelMLP(nn.Module):
    """A block's MLP as a mixture of experts, of which this process keeps its block: ``layer``'s
    router, and experts ``r E/ep`` to ``(r + 1) E/ep - 1`` for its place r in ``group``."""

    def __init__(self, layer: MoE, group):
        super().__init__()
        self.layer, self.group = layer, group
        mine = layer.num_experts // dist.get_world_size(group)
        first = dist.get_rank(group) * mine
        layer.experts = layer.experts[first:first + mine]  # the others are freed
        self.aux = self.load = None  # the last forward's balancing loss, and tokens per expert

    def forward(self, x):
        tokens, experts, weights, kept, self.aux = self.layer.gate(x)
        # what this process's tokens asked of each expert, dropped included (moe_costs.py)
        self.load = torch.bincount(experts.flatten(), minlength=self.layer.num_experts)
        return expert_parallel_forward(tokens, experts, weights, kept, self.layer.experts,
                                       self.layer.num_experts, self.group).view_as(x)


def expert_groups(world_size: int, ep: int):
    """This process's row of a dp x ep layout (ep consecutive ranks: every expert once, the
    all-to-alls) and its column (the ranks that hold copies of its experts): the groups of a
    (dp, ep) mesh, whose waits time out as the course's default group's do (a DeviceMesh's
    subgroups on gloo would wait 30 minutes)."""
    column, row = run.mesh_groups((world_size // ep, ep))
    return row, column


def fully_shard_ep(model, copies, device_type: str = "cpu"):
    """FSDP2 over a dp x ep layout, as torchtitan composes them: each block's experts sharded
    over ``copies`` (its column: the ranks holding the same experts), everything else over every
    rank. Every reduction is then a sum: each process must backpropagate its loss divided by the
    world size, so that the sums give the gradient of the mean of every process's loss."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    everyone = DeviceMesh.from_group(dist.group.WORLD, device_type)
    column = DeviceMesh.from_group(copies, device_type)
    for block in model.blocks:
        fully_shard(list(block.mlp.layer.experts), mesh=column)  # first: the block skips them
        fully_shard(block, mesh=everyone)  # attention, layer norms, the router
    fully_shard(model, mesh=everyone)  # embeddings, the last norm, the head
    for module in model.modules():  # FSDP divides by its mesh's size unless told otherwise
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def split_parameters(model) -> tuple[list, list]:
    """(the parameters every rank holds, this rank's experts' parameters), told by name."""
    held, own = [], []
    for name, parameter in model.named_parameters():
        (own if ".experts." in name else held).append(parameter)
    return held, own


def renumber(name: str, first: int) -> str:
    """A name as one process holding every expert has it, from a rank whose experts are
    numbered from 0 but are the experts ``first``, ``first + 1``, ... of the whole layer."""
    found = re.search(r"\.experts\.(\d+)\.", name)
    return name.replace(found[0], f".experts.{first + int(found[1])}.") if found else name


def whole_state(model, group) -> dict:
    """The state dict of one process holding every expert, gathered over ``group`` (collective;
    a tensor sharded by FSDP is first gathered whole, over its own mesh)."""
    mine = [None] * dist.get_world_size(group)
    own = {k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu()
           for k, v in model.state_dict().items()}
    dist.all_gather_object(mine, own, group=group)
    per_rank = len(model.blocks[0].mlp.layer.experts)
    return {renumber(key, place * per_rank): value
            for place, state in enumerate(mine) for key, value in state.items()}


def check(args, rank: int, world: int, device: torch.device) -> dict:
    def batch(seed: int) -> torch.Tensor:  # rank r's tokens, from seed + 1 + r
        return torch.randn(args.tokens, args.width,
                           generator=torch.Generator().manual_seed(seed)).to(device)

    layer = MoE(args.width, args.experts, args.k, args.capacity_factor, seed=args.seed)
    layer = layer.to(device)
    x, c = batch(args.seed + 1 + rank).requires_grad_(True), batch(-1 - rank)
    out, aux, per_expert = expert_parallel(layer, x)
    ((out * c).sum() + aux).backward()
    # One process: the same layer, on every rank's tokens, one batch at a time (the capacity is
    # per batch), the loss summed over the ranks' batches.
    single = MoE(args.width, args.experts, args.k, args.capacity_factor, seed=args.seed)
    single = single.to(device)
    total, mine = 0.0, None
    for source in range(world):
        xs, cs = batch(args.seed + 1 + source).requires_grad_(True), batch(-1 - source)
        ys, aux_s = single(xs)
        total = total + (ys * cs).sum() + aux_s
        if source == rank:
            mine = (ys.detach(), xs)
    total.backward()
    errors = {"output": (out.detach() - mine[0]).abs().max().item(),
              "input gradient": (x.grad - mine[1].grad).abs().max().item()}
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router)  # the router is replicated: its gradient sums every rank's tokens
    errors["router gradient"] = (router - single.router.weight.grad).abs().max().item()
    held = range(rank * args.experts // world, (rank + 1) * args.experts // world)
    errors["expert gradients"] = 0.0
    for e in held:  # an expert's gradient is whole on the rank that holds it
        for p, q in zip(layer.experts[e].parameters(), single.experts[e].parameters(),
                        strict=True):
            want = torch.zeros_like(q) if q.grad is None else q.grad
            got = torch.zeros_like(p) if p.grad is None else p.grad
            errors["expert gradients"] = max(errors["expert gradients"],
                                             (got - want).abs().max().item())
    sent_rows = per_expert.view(world, -1).sum(dim=1).tolist()
    dist.all_reduce(per_expert)  # every rank's: the tokens each expert got
    return {"errors": errors, "tokens_per_expert": per_expert.tolist(),
            "dropped": world * args.tokens * args.k - per_expert.sum().item(),
            "sent_rows": sent_rows, "row_bytes": args.width * x.element_size()}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=run.positive_int, default=4)
    parser.add_argument("--k", type=run.positive_int, default=2, help="experts per token")
    parser.add_argument("--tokens", type=run.positive_int, default=64, help="tokens per rank")
    parser.add_argument("--width", type=run.positive_int, default=32)
    parser.add_argument("--capacity-factor", type=float, default=1.0,
                        help="an expert takes this times its even share (0: no limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--threads", type=run.positive_int, default=1)
    parser.add_argument("--result", type=Path, help="write the numbers here as JSON (rank 0)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.capacity_factor = args.capacity_factor or None
    try:
        rank, world, device = run.setup(args.backend, __file__)
    except ValueError as err:
        return run.refuse(__file__, err)
    if args.experts % world or args.k > args.experts:
        dist.destroy_process_group()
        return run.refuse(__file__, f"--experts {args.experts} must divide by the {world} ranks "
                                    f"and be at least --k {args.k}")
    torch.set_num_threads(args.threads)
    log = run.rank_zero_log(rank)
    found = check(args, rank, world, device)
    every = [None] * world
    dist.all_gather_object(every, found)
    log(f"{args.experts} experts, top-{args.k}, capacity factor {args.capacity_factor}, "
        f"{args.tokens} tokens of width {args.width} per rank, on {world} rank"
        f"{'s' * (world > 1)} ({args.experts // world} experts each), {dist.get_backend()}")
    for name in every[0]["errors"]:
        log(f"largest difference from one process, {name:<17} "
            f"{max(f['errors'][name] for f in every):.1e}")
    log(f"tokens per expert: {found['tokens_per_expert']}; dropped over capacity: "
        f"{found['dropped']} of {world * args.tokens * args.k} assignments")
    for r, f in enumerate(every):
        across = sum(f["sent_rows"]) - f["sent_rows"][r]  # a rank's rows for itself stay put
        log(f"rank {r} sends {f['sent_rows']} rows to ranks 0..{world - 1}, "
            f"{across} x {args.width} x {f['row_bytes'] // args.width} = "
            f"{across * f['row_bytes']} bytes to the others; the same rows come back")
    if args.result and rank == 0:
        run.write_result({"world_size": world, "ranks": every}, args.result, log)
    dist.barrier()  # no rank leaves the group while another still talks to it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
