"""What the test files of lesson 05 share: the test model and its batches, the one-process run
that every data parallel method must reproduce, the memory formula written once more, the
tensors the collectives are tested on, each sharded method trained beside DDP on the same
ranks, with the checks of its steps and of its collectives, and what the peak predictors
(task5_9, task5_10) are held to: torch's count of what a forward keeps, and a step's peak
measured under every stage, and FSDP2 offloaded.

The test model is the running example at a small size without biases: a key projection's bias
has no gradient at all in exact arithmetic, so AdamW would step on rounding noise there and two
correct methods would drift apart (lesson 03 measures this); without biases, fp32 tolerance holds.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed.fsdp  # noqa: F401 - imported here once, so that forked ranks have it
from gpt import GPT, GPTConfig, run
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.collectives import CollectiveLog
from harness.compare import assert_close, assert_parameters_close, full_fp32
from harness.exercises import SOLUTIONS_DIR, load_exercise, load_path
from harness.launch import QUICK_SAMPLE
from harness.memory import AllocationPeak, held_bytes
from harness.ranks import group_params, run_on_ranks

LESSON = "05_sharded_data_parallel"
SCRIPT = f"lessons/{LESSON}/train_fsdp.py"
TRAIN_ONE_EPOCH = ("--epochs", "1", "--train-windows", "320", *QUICK_SAMPLE)  # the script's checks
WORLDS = (2, 3, 4)
# gloo with CPU tensors at every size; CUDA: gloo ranks sharing cuda:0, nccl one rank per GPU.
GROUPS = group_params(world_sizes=WORLDS, cuda_world_sizes=(2,))
# FSDP2 on gloo with CUDA tensors is not a combination the course has run: nccl only on GPUs.
FSDP_GROUPS = group_params(world_sizes=WORLDS, cuda_world_sizes=())

# 29 tokens, 25 features (5 heads), 2 blocks: some row counts (29, 25) and element counts (725,
# 25, 625) divide by none of 2, 3 and 4, so the padding is exercised at every world size.
CONFIG = dict(vocab_size=29, block_size=8, n_layer=2, n_head=5, n_embd=25, bias=False)
GLOBAL_BATCH = 12  # sequences per step: divides by 2, 3 and 4
STEPS = 3
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
SGD = {"lr": 0.5}
ADAM_STATE_BYTES = 8  # exp_avg and exp_avg_sq, fp32


def make_gpt(**overrides) -> GPT:
    return GPT(GPTConfig(**{**CONFIG, **overrides}), seed=0)


class Stack(nn.Module):
    """Two tiny blocks whose last parameters have fewer elements than there are ranks: a weight
    of 3 elements and a bias of 1, so that on 4 ranks some pieces are empty. Called like the
    GPT, ``stack(inputs, targets) -> (outputs, loss)``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(5, 3), nn.Tanh()),
                                     nn.Sequential(nn.Linear(3, 1))])
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator))

    def forward(self, x, targets):
        for block in self.blocks:
            x = block(x)
        return x, nn.functional.mse_loss(x, targets)


MODELS = {"gpt": make_gpt, "stack": Stack}


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def global_batch(step: int, model: str = "gpt") -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    if model == "stack":
        return (torch.randn(GLOBAL_BATCH, 5, generator=generator),
                torch.randn(GLOBAL_BATCH, 1, generator=generator))
    tokens = torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, CONFIG["block_size"] + 1),
                           generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def share_sizes(world: int, uneven: bool = False) -> list[int]:
    """How many of the global batch's sequences each rank reads: equal shares, or (uneven) one
    more on rank 0 and one fewer on the last rank, as when the world size does not divide it."""
    sizes = [GLOBAL_BATCH // world] * world
    if uneven:
        sizes[0], sizes[-1] = sizes[0] + 1, sizes[-1] - 1
    return sizes


def my_share(ctx, step: int, model: str = "gpt", uneven: bool = False):
    """This rank's contiguous share of step ``step``'s global batch."""
    inputs, targets = global_batch(step, model)
    sizes = share_sizes(ctx.world_size, uneven)
    start = sum(sizes[:ctx.rank])
    part = slice(start, start + sizes[ctx.rank])
    return inputs[part].to(ctx.device), targets[part].to(ctx.device)


@functools.cache
def one_process(model: str, steps: int) -> list[dict[str, torch.Tensor]]:
    """The parameters after each of ``steps`` AdamW steps of one process on the whole global
    batches: what data parallel training must reproduce (with equal shares)."""
    net = MODELS[model]()
    optimizer = torch.optim.AdamW(net.parameters(), **ADAMW)
    trajectory = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        net(*global_batch(step, model))[1].backward()
        optimizer.step()
        trajectory.append({name: p.detach().clone() for name, p in net.named_parameters()})
    return trajectory


def ddp_of(model: nn.Module, ctx) -> DDP:
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


def whole_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole: a DTensor (FSDP) is gathered, on every rank."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def expected_bytes(psi: int, world: int, stage: int, param=4, grad=4, state=8) -> int:
    """The lesson's formula, written here once more (the grader never trusts the answer's own
    memory_per_rank): DDP holds (param + grad + state) bytes for each of the psi parameters;
    ZeRO stage 1 shards the state, 2 the gradients too, 3 the parameters too."""
    shard = -(-psi // world)
    return ((shard if stage >= 3 else psi) * param + (shard if stage >= 2 else psi) * grad
            + (shard if stage >= 1 else psi) * state)


MEMORY_TOLERANCE = 0.1  # the bound: measured bytes per rank within 10 % of the formula
PER_PARAMETER = {0: "4 + 4 + 8", 1: "4 + 4 + 8/W", 2: "4 + (4 + 8)/W", 3: "(4 + 4 + 8)/W"}
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 (fully sharded)"}


def assert_holds_the_formula(measured: float, psi: int, world: int, stage: int, what: str,
                             rank: int) -> None:
    """``measured`` bytes (``what``: what was measured, and when) against stage ``stage``'s
    bytes per rank for ``psi`` fp32 parameters with AdamW on ``world`` ranks."""
    __tracebackhide__ = True
    formula = expected_bytes(psi, world, stage)
    assert abs(measured - formula) <= MEMORY_TOLERANCE * formula, (
        f"rank {rank}: {what}: {kb(measured)}; the formula for {STAGE_NAMES[stage]} on {world} "
        f"ranks gives {kb(formula)} ({PER_PARAMETER[stage].replace('W', str(world))} bytes per "
        f"parameter)")


def padded_numel(model: nn.Module, world: int) -> int:
    """Elements in every parameter's padded pieces, all ranks together: what the collectives of
    a per-parameter flat sharding move."""
    return sum(world * -(-p.numel() // world) for p in model.parameters())


def rows_padded_numel(module: nn.Module, world: int) -> int:
    """Elements FSDP2's collectives move for ``module``'s parameters on ``world`` ranks: each
    cut along its first dimension, the rows padded to a multiple of ``world``."""
    return sum(-(-p.shape[0] // world) * world * p[0].numel() for p in module.parameters())


def piece_bounds(numel: int, world: int, rank: int) -> tuple[int, int]:
    size = -(-numel // world)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


def kb(nbytes: float) -> str:
    return f"{nbytes / 1000:,.1f} kB"


def with_diagnosis(error: AssertionError, why: str) -> AssertionError:
    """``error`` with ``why`` appended to its first line (the line a summary shows)."""
    first, _, rest = str(error).partition("\n")
    return AssertionError(f"{first}: {why}" + (f"\n{rest}" if rest else ""))


# ----------------------------------------------------------------------------- the collectives

SHAPES = [(5, 3), (7,), (2, 2, 2), (1,)]  # 15, 7, 8 and 1 elements: most divide by no world


def upstream_gradient(shape, rank: int) -> torch.Tensor:
    """A tensor that differs on every rank: a gradient before averaging."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + rank))


def mean_piece(shape, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean over ranks of upstream_gradient, and rank ``rank``'s padded piece of it."""
    mean = (sum(upstream_gradient(shape, r) for r in range(world)) / world).reshape(-1)
    start, end = piece_bounds(mean.numel(), world, rank)
    piece = torch.zeros(-(-mean.numel() // world))
    piece[: end - start] = mean[start:end]
    return mean, piece


# ----------------------------------------------------------------------------- beside DDP

# Every sharded method below is trained beside DDP, on the same ranks, from the same model and
# on the same batches. What each returns is compared with DDP's in the parent process.


def build_hand_zero(ex, method: str, model: nn.Module, optimizer: str):
    optimizer_class, settings = ((torch.optim.AdamW, ADAMW) if optimizer == "adamw"
                                 else (torch.optim.SGD, SGD))
    wrapper = ex.Zero1Optimizer if method == "zero1" else ex.Zero2Optimizer
    return wrapper(model.parameters(), optimizer_class, **settings)


def hybrid_sharded(model: nn.Module, replicas: int) -> nn.Module:
    """HSDP with torch's own fully_shard (no exercise): a (replicate, shard) mesh of
    ``replicas`` rows, each block sharded over a row's ranks and replicated down the columns,
    then the root."""
    import torch.distributed as dist
    from gpt import run
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device.type
    mesh = run.device_mesh(device, (replicas, dist.get_world_size() // replicas),
                           ("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def sharded_by(ex, model: nn.Module, **options) -> nn.Module:
    """``ex.shard_model(model, **options)``, with a hint when FSDP refuses what it was given."""
    try:
        return ex.shard_model(model, **options)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - FSDP's own message rarely names the cause
        raise AssertionError(
            f"shard_model raised {type(error).__name__}: {error}. If fully_shard(model) came "
            f"before the blocks': FSDP2 is applied bottom-up, each call taking the parameters "
            f"that no earlier call took, so shard each block first and the root last") from error


def train_beside_ddp(ctx, method: str, optimizer: str, steps: int, model_name: str = "gpt", *,
                     uneven: bool = False):
    """``steps`` steps of ``method`` ("zero1", "zero2", "fsdp", or "hsdp": torch's own
    fully_shard on a 2 x W/2 mesh, no exercise) next to DDP, on the test
    model ``model_name`` (see MODELS), each rank reading its share (``uneven``: shares of
    different sizes). Returns every step's whole parameters of both, and of the method: what a
    rank holds after the backward of step 2 (when parameters, gradients and optimizer state all
    exist), the whole gradients it held at most while a backward ran, and the collectives of its
    first step."""
    with full_fp32():  # compared with a CPU run: no TF32
        ex = load_exercise(LESSON)
        optimizer_class, settings = ((torch.optim.AdamW, ADAMW) if optimizer == "adamw"
                                     else (torch.optim.SGD, SGD))
        reference = ddp_of(MODELS[model_name]().to(ctx.device), ctx)
        reference_optimizer = optimizer_class(reference.parameters(), **settings)
        model = MODELS[model_name]().to(ctx.device)
        if method in ("fsdp", "hsdp"):
            model = sharded_by(ex, model) if method == "fsdp" else hybrid_sharded(model, 2)
            sharded = optimizer_class(model.parameters(), **settings)
        else:
            sharded = build_hand_zero(ex, method, model, optimizer)
        whole_grads_peak = [0]

        def whole_gradient_bytes() -> int:  # FSDP's gradients are DTensor shards, not whole
            return sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                       if p.grad is not None and not hasattr(p.grad, "to_local"))

        def note_whole_gradients(_):  # runs after the method's own hook on the same parameter
            whole_grads_peak[0] = max(whole_grads_peak[0], whole_gradient_bytes())

        hooks = [p.register_post_accumulate_grad_hook(note_whole_gradients)
                 for p in model.parameters()] if method not in ("fsdp", "hsdp") else []
        result = {"start": whole_parameters(model), "method": [], "ddp": [], "held": None,
                  "optimizer_held": None, "log": None}
        try:
            for step in range(steps):
                inputs, targets = my_share(ctx, step, model_name, uneven)
                reference_optimizer.zero_grad(set_to_none=True)
                reference(inputs, targets)[1].backward()
                reference_optimizer.step()
                with CollectiveLog(ex) as log:
                    sharded.zero_grad(set_to_none=True)
                    model(inputs, targets)[1].backward()
                    if step == 1:
                        result["held"] = held_bytes(model, sharded)
                        result["optimizer_held"] = held_bytes(sharded, exclude=[model])
                        result["whole_grads_after_backward"] = whole_gradient_bytes()
                    sharded.step()
                if step == 0:
                    result["log"] = {"summary": log.summary(), "calls": [
                        (c.op, c.payload) for c in log.calls]}
                result["method"].append(whole_parameters(model))
                result["ddp"].append(whole_parameters(reference.module))
        finally:
            for hook in hooks:
                hook.remove()
            if hasattr(sharded, "remove"):
                sharded.remove()
        result["whole_grads_peak"] = whole_grads_peak[0]
        return result


def piece_diagnosis(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor, world: int,
                    rank: int) -> str:
    """Where, by pieces, a parameter differs from DDP's: the mistake, when the numbers leave no
    doubt (the elements that differ are exactly the ones the step left as they were), or ""."""
    flat, previous = got.double().reshape(-1), before.double().reshape(-1)
    differ = ~torch.isclose(flat, want.double().reshape(-1), rtol=1.3e-6, atol=1e-5)
    unchanged = flat == previous
    numel = differ.numel()
    if not bool(differ.any()):
        return ""
    floor_end = world * (numel // world)
    if (numel % world and bool(differ[floor_end:].all()) and not bool(differ[:floor_end].any())
            and bool(unchanged[floor_end:].all())):
        return (f"only the last {numel - floor_end} elements differ, and the step left them as "
                f"they were: with numel // world_size elements per piece, {numel} % {world} "
                f"elements belong to no rank. Use shard_bounds: ceil(numel / world_size) per "
                f"piece, the last pieces padded")
    start, end = piece_bounds(numel, world, rank)
    outside = torch.ones(numel, dtype=torch.bool)
    outside[start:end] = False
    if (not bool(differ[start:end].any()) and bool(differ[outside].any())
            and bool(unchanged[differ].all())):
        return (f"rank {rank}'s own piece (elements {start} to {end - 1}) was updated as DDP's "
                f"but the others kept their values from before the step: the updated pieces "
                f"were not all-gathered back into the whole parameter")
    return ""


def assert_same_as_ddp(result: dict, rank: int, world: int, method: str,
                       one_process_steps: list | None = None) -> None:
    """Every step's parameters equal DDP's; the first step's *updates* too, where a wrong
    gradient scale shows (an update W times DDP's) even under AdamW, which hides it later. With
    ``one_process_steps``, the last step's parameters also equal one process's on the whole
    global batches."""
    __tracebackhide__ = True
    first_method = {n: result["method"][0][n] - result["start"][n] for n in result["start"]}
    first_ddp = {n: result["ddp"][0][n] - result["start"][n] for n in result["start"]}
    befores = [result["start"], *result["method"][:-1]]
    for step, (got, want) in enumerate(zip(result["method"], result["ddp"], strict=True)):
        for name in want:
            try:
                if step == 0:
                    assert_close(first_method[name], first_ddp[name],
                                 f"{method}: update of {name!r} in step 1, vs DDP's", rank)
                assert_close(got[name], want[name],
                             f"{method}: {name!r} after step {step + 1}, vs DDP", rank)
            except AssertionError as error:
                why = piece_diagnosis(got[name], want[name], befores[step][name], world, rank)
                raise (with_diagnosis(error, why) if why else error) from None
    if one_process_steps is not None:
        assert_parameters_close(result["method"][-1], one_process_steps[len(result["method"]) - 1],
                                what=f"{method} after the last step, vs one process on the "
                                     f"whole batches", rank=rank)


def assert_collectives(result: dict, rank: int, world: int, method: str,
                       expected: dict[str, int], why: dict[str, str] | None = None) -> None:
    """The first step's collectives: the payload of each op equals ``expected`` (bytes);
    ``why`` says, per op, what that payload is (default: every parameter once)."""
    __tracebackhide__ = True
    calls = result["log"]["calls"]
    moved = {op: sum(payload for kind, payload in calls if kind == op)
             for op in {kind for kind, _ in calls} | set(expected)}
    summary = result["log"]["summary"]
    if moved.get("all_reduce", 0) and not expected.get("all_reduce"):
        raise AssertionError(
            f"rank {rank}: {method} all-reduced {kb(moved['all_reduce'])} in one step "
            f"({summary}). A rank needs only the mean of its own piece of each gradient: "
            f"reduce_scatter_single gives it exactly that, for half an all-reduce's traffic "
            f"(an all-reduce is a reduce-scatter followed by an all-gather)")
    for op, payload in expected.items():
        reason = (why or {}).get(op, "every parameter once")
        assert moved.get(op, 0) == payload, (
            f"rank {rank}: {method}'s {op} payload in one step is {kb(moved.get(op, 0))}, "
            f"expected {kb(payload)}: {reason}, padded to world_size pieces ({summary})")


def accumulate_beside_ddp(ctx, method: str, micro_batches: int, steps: int = 2, *,
                          discard_first: bool = False):
    """``steps`` optimizer steps of ``method`` beside DDP, each over ``micro_batches``
    accumulated backwards of this rank's share (each micro-batch's loss divided by their
    number): DDP skips its all-reduce under ``no_sync()`` for all but the last, FSDP2 under
    ``set_requires_gradient_sync(False)``, the hand ZeRO optimizers reduce as they were built
    to. ``discard_first``: before each step's micro-batches, one backward of another batch
    thrown away with ``zero_grad()``, which must forget it. Returns both trajectories."""
    with full_fp32():  # compared with a CPU run: no TF32
        ex = load_exercise(LESSON)
        reference = ddp_of(make_gpt().to(ctx.device), ctx)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
        model = make_gpt().to(ctx.device)
        if method == "fsdp":
            model = sharded_by(ex, model)
            sharded = torch.optim.AdamW(model.parameters(), **ADAMW)
        else:
            sharded = build_hand_zero(ex, method, model, "adamw")
        result = {"start": whole_parameters(model), "method": [], "ddp": []}
        try:
            for step in range(steps):
                inputs, targets = my_share(ctx, step)
                reference_optimizer.zero_grad(set_to_none=True)
                sharded.zero_grad(set_to_none=True)
                if discard_first:
                    thrown_inputs, thrown_targets = my_share(ctx, 50 + step)
                    model(thrown_inputs, thrown_targets)[1].backward()
                    sharded.zero_grad(set_to_none=True)
                parts = list(zip(inputs.chunk(micro_batches), targets.chunk(micro_batches),
                                 strict=True))
                for index, (x, y) in enumerate(parts):
                    last = index == len(parts) - 1
                    with reference.no_sync() if not last else contextlib.nullcontext():
                        (reference(x, y)[1] / len(parts)).backward()
                    if method == "fsdp":
                        model.set_requires_gradient_sync(last)
                    (model(x, y)[1] / len(parts)).backward()
                reference_optimizer.step()
                sharded.step()
                result["method"].append(whole_parameters(model))
                result["ddp"].append(whole_parameters(reference.module))
        finally:
            if hasattr(sharded, "remove"):
                sharded.remove()
        return result


# -- FSDP2's schedule: which all-gather starts when (the prefetching section, task5_7)

class Timeline:
    """What a step of a :class:`Tower` does, in order: each collective (``AG2``: block 2's
    all-gather, ``RS2``: its reduce-scatter, told apart by their sizes, which differ from block
    to block) and each moment a block's computation begins (``F2``: its forward, ``B2``: its
    backward), as :meth:`events` lists them."""

    def __init__(self):
        self.log = CollectiveLog()
        self.marks: list[tuple[int, str]] = []  # (collectives recorded before it, "F2")

    def mark(self, name: str) -> None:
        self.marks.append((len(self.log.calls), name))

    def events(self, tower: nn.Module, world: int) -> list[str]:
        block_of = {}
        for index, block in enumerate(tower.blocks):
            payload = 4 * rows_padded_numel(block, world)
            assert payload not in block_of, f"blocks {block_of[payload]} and {index}: same size"
            block_of[payload] = index
        names = {"all_gather": "AG", "reduce_scatter": "RS"}
        unknown = [call for call in self.log.calls if call.payload not in block_of]
        assert not unknown, f"collectives of no block's size (padded otherwise?): {unknown}"
        calls = [f"{names.get(call.op, call.op)}{block_of[call.payload]}"
                 for call in self.log.calls]
        events, done = [], 0
        for position, name in self.marks:
            events += calls[done:position] + [name]
            done = position
        return events + calls[done:]


class Marked(torch.autograd.Function):
    """The identity, which marks ``name`` on the timeline when its backward runs: placed last in
    a block's forward, that is the moment the block's backward begins, just after FSDP's own
    hook on the block's output has all-gathered what it needs."""

    @staticmethod
    def forward(ctx, x, timeline, name):
        ctx.timeline, ctx.name = timeline, name
        return x.clone()  # not a view: FSDP hooks the block's output

    @staticmethod
    def backward(ctx, grad):
        ctx.timeline.mark(ctx.name)
        return grad, None, None


class TowerBlock(nn.Module):
    """A residual MLP whose hidden width is ``2 + index``: every block a different size."""

    def __init__(self, index: int, width: int, timeline: Timeline):
        super().__init__()
        self.index, self.timeline = index, timeline
        self.up, self.down = nn.Linear(width, 2 + index), nn.Linear(2 + index, width)

    def forward(self, x):
        self.timeline.mark(f"F{self.index}")
        return Marked.apply(x + self.down(self.up(x).tanh()), self.timeline, f"B{self.index}")


class Tower(nn.Module):
    """``depth`` blocks of different sizes and nothing else, so that the root's own group is
    empty and every collective of a step is a block's: ``AG0 F0 AG1 F1 ...`` says when each
    block's all-gather starts, relative to the blocks' computation."""

    def __init__(self, depth: int, width: int = 4):
        super().__init__()
        self.timeline = Timeline()
        with torch.random.fork_rng(devices=[]):  # the caller's generator is left as it was
            torch.manual_seed(depth)
            self.blocks = nn.ModuleList(TowerBlock(i, width, self.timeline)
                                        for i in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def tower_step(ctx, depth: int, prefetching=None, reshard_after_forward=True) -> dict:
    """A forward and a backward of a :class:`Tower` sharded with ``fully_shard`` block by block,
    then the root; ``prefetching(blocks)`` (if given) sets the schedule before the step. The
    step's events, each collective's group size, the elements of each block this rank holds
    between the forward and the backward, and the whole gradients."""
    from torch.distributed.fsdp import fully_shard

    tower = Tower(depth)
    for block in tower.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(tower)
    if prefetching is not None:
        prefetching(list(tower.blocks))
    timeline = tower.timeline
    with timeline.log:
        out = tower(torch.randn(3, 4, generator=torch.Generator().manual_seed(ctx.rank)))
        held = [sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                    for p in block.parameters()) for block in tower.blocks]
        out.sum().backward()
    return {"events": timeline.events(tower, ctx.world_size), "held_after_forward": held,
            "ranks": [(call.op, call.ranks) for call in timeline.log.calls],
            "grads": [p.grad.full_tensor() for p in tower.parameters()]}


# The peak predictors (task5_9, task5_10): the oracle of what a forward keeps, the
# configurations, and the step whose peak they predict, measured on every stage.

def model_of(config: GPTConfig, checkpoint: bool) -> GPT:
    """``GPT(config)``, every block wrapped by ``checkpoint_wrapper`` when asked."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = GPT(config)
    if checkpoint:
        for index, block in enumerate(model.blocks):
            model.blocks[index] = checkpoint_wrapper(block)
    return model


def kept_by_autograd(config: GPTConfig, batch_size: int, checkpoint: bool) -> int:
    """The oracle: the bytes of every storage torch's saved-tensors hook is handed during one
    training forward (each storage once), less the parameters'."""
    torch.manual_seed(0)
    model = model_of(config, checkpoint).train()
    ids = torch.randint(config.vocab_size, (batch_size, config.block_size))
    targets = torch.randint(config.vocab_size, (batch_size, config.block_size))
    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in parameters:
            kept[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids, targets)
    return sum(kept.values())


# What each configuration's peak is made of: the activations (ACTIVATIONS), the state
# (STATE: wide and short) or the loss over a large vocabulary (LOSS); the last has no biases.
ACTIVATIONS = dict(vocab_size=65, block_size=32, n_layer=4, n_head=4, n_embd=32)
STATE = dict(vocab_size=65, block_size=8, n_layer=2, n_head=4, n_embd=128)
LOSS = dict(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_embd=32)
NO_BIAS = dict(vocab_size=40, block_size=12, n_layer=3, n_head=3, n_embd=48, bias=False)


def train_step(step_model, optimizer, ids, targets) -> None:
    """One step whose gradients are zeroed, not freed (the lesson's scripts free them with
    zero_grad's default), so that under DDP and FSDP2 the rank holds its whole state
    throughout, as peak_bytes assumes; the lesson's ZeRO-1 and ZeRO-2 free them in step()
    themselves. The logits stay alive through the backward, as a caller's do."""
    optimizer.zero_grad(set_to_none=False)
    _logits, loss = step_model(ids, targets)
    loss.backward()
    optimizer.step()


def peaks_on_rank(ctx, cases: list) -> list[int]:
    """Each case ``(config, batch_size, stage, checkpoint, offload)`` trained on these ranks:
    stage 0 DDP (its gradients views into its buckets: one copy), 1 and 2 the reference's
    ``Zero1Optimizer`` and ``Zero2Optimizer`` (one implementation for every learner's
    predictor), 3 FSDP2, all with AdamW; the most bytes this rank held during the last step:
    what it kept from the step before (parameters, gradients, AdamW's moments) and the most the
    step's new tensors held at once beyond it. With ``offload`` (stage 3 only), FSDP2 runs with
    ``CPUOffloadPolicy`` and the peak is a GPU's: what the step's new tensors held at once, the
    kept state aside, since offload keeps it in the CPU's memory. (Without a GPU the CPU's
    memory is the only memory and the policy copies nothing: the shards' copies to the GPU
    before each all-gather, 4 bytes a parameter of the group over W, freed once copied into the
    all-gather's buffer, are missing from this count.)"""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    peaks = []
    for config, batch_size, stage, checkpoint, offload in cases:
        config = GPTConfig(**config)
        model = model_of(config, checkpoint)
        step_model = model
        if stage in (1, 2):
            zero = load_path(reference_answers())
            optimizer = (zero.Zero1Optimizer if stage == 1 else zero.Zero2Optimizer)(
                model.parameters(), lr=1e-3)
        else:
            if stage == 3:
                policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
                for block in model.blocks:
                    fully_shard(block, **policy)
                step_model = fully_shard(model, **policy)
            else:
                step_model = DDP(model, gradient_as_bucket_view=True)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(ctx.rank)
        shape = (batch_size // ctx.world_size, config.block_size)
        ids = torch.randint(config.vocab_size, shape, generator=generator)
        targets = torch.randint(config.vocab_size, shape, generator=generator)

        for _ in range(2 if stage == 0 else 1):  # AdamW's moments exist; DDP's buckets rebuilt
            train_step(step_model, optimizer, ids, targets)
        inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO's AdamW over its pieces
        kept = [run.local_part(t) for p in model.parameters() for t in (p, p.grad)
                if t is not None]
        kept += [run.local_part(t) for s in inner.state.values() for t in s.values()
                 if torch.is_tensor(t)]
        state = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                     for t in kept}.values())
        with AllocationPeak(ignore=kept) as peak:
            train_step(step_model, optimizer, ids, targets)
        peaks.append(peak.bytes if offload else state + peak.bytes)
        if stage == 2:
            optimizer.remove()
        del step_model, model, optimizer, inner, kept, peak
    return peaks


PREDICTED_METHODS = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP2"}


def assert_near_the_measured_peaks(name: str, cases: list, predicted: list, world: int,
                                   tolerance: float, why: str) -> None:
    """Measure each case ``(config, batch_size, stage, checkpoint, offload)`` on ``world``
    gloo ranks (:func:`peaks_on_rank`; the rank that held the most) and hold the predictions
    ``name`` returned to within ``tolerance`` of it; ``why`` ends the message with what to look
    at."""
    measured = [max(by_rank) for by_rank in zip(*run_on_ranks(
        peaks_on_rank, cases, world_size=world, timeout=240), strict=True)]
    wrong = []
    for (config, batch, stage, checkpoint, offload), want, got in zip(cases, measured, predicted,
                                                                      strict=True):
        method = (PREDICTED_METHODS[stage] + (", checkpointed" if checkpoint else "")
                  + (", offloaded (the GPU's peak)" if offload else ""))
        if not isinstance(got, int):
            wrong.append(f"{method}: {name} returned {got!r}, not an int")
        elif abs(got / want - 1) > tolerance:
            wrong.append(f"{method}, {batch} sequences in all of GPTConfig({config}): "
                         f"predicted {got:,}, measured {want:,} ({got / want:.2f}x)")
    assert not wrong, (
        f"{name} on {world} rank(s), off by more than {tolerance:.0%} of the measured peak:\n  "
        + "\n  ".join(wrong) + f"\n({why})")


def assert_refuses(predictor, arguments: dict, stage: int, predicts: str) -> None:
    """``predictor(config, **arguments)`` must raise ``ValueError``: ``arguments`` override a
    valid call (2 ranks, ``stage``, 16 sequences of the ACTIVATIONS configuration, dropout 0);
    ``predicts`` names the stages it does predict, for the message."""
    arguments = {"world_size": 2, "stage": stage, "batch_size": 16, "dropout": 0.0, **arguments}
    config = GPTConfig(**ACTIVATIONS, dropout=arguments.pop("dropout"))
    with pytest.raises(ValueError):
        got = predictor(config, **arguments)
        raise AssertionError(
            f"{predictor.__name__}({arguments}, dropout={config.dropout}) returned {got!r}: "
            f"raise ValueError; it predicts {predicts}, over at least one rank that splits at "
            f"least one sequence evenly, with dropout 0")


def reference_answers():
    """The path of this lesson's reference answers, whose ZeRO-1 and ZeRO-2 the peak tests
    measure (one implementation for every learner's predictor); a clear error if it is gone."""
    path = SOLUTIONS_DIR / LESSON / "exercises.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path.relative_to(SOLUTIONS_DIR.parent)} is missing: the peak tests measure its "
            f"Zero1Optimizer and Zero2Optimizer. Restore it: git checkout -- solutions")
    return path
