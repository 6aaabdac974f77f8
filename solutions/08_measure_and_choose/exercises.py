"""Lesson 08 exercises: what communication costs, and which method to choose.

Grade with ``pytest lessons/08_measure_and_choose`` (one task: ``-m task8_1``). Each function's
docstring is its contract: what it takes, what it returns, and what the test checks.

Sizes are in bytes and times in seconds throughout. A collective's *payload* is the one tensor
it is about: an all-reduce's tensor, an all-gather's output (the gathered whole), a
reduce-scatter's input (the whole before scattering), a broadcast's tensor. On W ranks a ring
all-reduce is a reduce-scatter then an all-gather: 2 (W - 1) steps, in each of which every rank
sends 1/W of the payload to its neighbour.
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from torch import nn

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
MiB = 1024 * 1024  # DDP's "MB" in bucket_cap_mb is this many bytes
DEFAULT_BUCKET_CAP_MB = 25  # DDP's bucket_cap_mb when it is left unset
FIRST_BUCKET_BYTES = MiB  # dist._DEFAULT_FIRST_BUCKET_BYTES: the first bucket's, by default
LINKS = ("nvlink", "pcie")  # between the GPUs of one node: fast, or slow
METHODS = ("one device", "ddp", "fsdp", "tp+fsdp", "pp+fsdp", "cp+tp+fsdp", "cp+fsdp")
METHODS += tuple("ep+" + method for method in METHODS[2:])  # a mixture of experts


# --8<-- [start:bus_bandwidth]
def bus_bandwidth(op: str, num_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """``(algorithm bandwidth, bus bandwidth)`` of one collective, in bytes per second.

    The algorithm bandwidth is the payload over the time. The bus bandwidth multiplies it by
    the least a rank must send per byte of payload, for a ring, a tree or any algorithm of sends
    and receives: 2 (W - 1) / W for ``"all_reduce"``, (W - 1) / W for ``"all_gather"`` and
    ``"reduce_scatter"``, 1 for ``"broadcast"``, so that it is comparable across ops and world
    sizes, and to the link's own speed (the convention of the standard NCCL benchmarks,
    nccl-tests' doc/PERFORMANCE.md; an implementation that sends more shows a lower one).

    An op not in ``OPS``, ``seconds <= 0``, ``num_bytes < 0`` or ``world_size < 1`` raise
    ``ValueError``. The test checks each op at several world sizes.
    """
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}: expected one of {OPS}")
    if seconds <= 0 or num_bytes < 0 or world_size < 1:
        raise ValueError(f"need seconds > 0, num_bytes >= 0 and world_size >= 1; got "
                         f"seconds={seconds}, num_bytes={num_bytes}, world_size={world_size}")
    factors = {"all_reduce": 2 * (world_size - 1) / world_size,
               "all_gather": (world_size - 1) / world_size,
               "reduce_scatter": (world_size - 1) / world_size, "broadcast": 1.0}
    algorithm = num_bytes / seconds
    return algorithm, algorithm * factors[op]
# --8<-- [end:bus_bandwidth]


# --8<-- [start:fit_alpha_beta]
def fit_alpha_beta(sizes: list[int], seconds: list[float], world_size: int) -> tuple[float, float]:
    """The link's ``(alpha, beta)`` from measured all-reduce times at one world size.

    The model: an all-reduce of n bytes on a ring of W ranks takes
    ``t = 2 (W - 1) alpha + 2 (W - 1) / W * n * beta``: ``alpha`` is the latency of one step
    (seconds), ``beta`` the time per byte on one link (seconds per byte; 1 / beta is the bus
    bandwidth of large messages). Fit the straight line ``t = a + b n`` to every point so that
    its *relative* errors are small: least squares on ``(a + b n - t) / t``, that is each point
    weighted by ``1 / t**2``. Sizes span five orders of magnitude: an ordinary least-squares
    line is held by the largest times, and 1 % of noise there is larger than the whole
    latency, which the small sizes measure. Then read ``alpha`` from ``a`` and ``beta`` from
    ``b``.

    Fewer than two distinct sizes, lists of different lengths, a time that is not positive, or
    ``world_size < 2`` raise ``ValueError``. The test fits points made from known alpha and
    beta (at W = 2, 3, 4, 8), noisy points against weighted least squares, and points with 1 %
    of noise, whose alpha an ordinary least-squares line would lose.
    """
    if len(sizes) != len(seconds):
        raise ValueError(f"{len(sizes)} sizes but {len(seconds)} times: one time per size")
    if len(set(sizes)) < 2:
        raise ValueError(f"a line needs at least two distinct sizes; got {sorted(set(sizes))}")
    if world_size < 2:
        raise ValueError(f"an all-reduce on {world_size} rank moves nothing: need world_size >= 2")
    if min(seconds) <= 0:
        raise ValueError(f"times must be positive; got {min(seconds)}")
    n = torch.tensor(sizes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    # Least squares on the relative errors: row i of t = a + b n divided by t_i.
    design = torch.stack([1 / t, n / t], dim=1)
    a, b = torch.linalg.lstsq(design, torch.ones_like(t)[:, None]).solution[:, 0]
    steps = 2 * (world_size - 1)
    return float(a) / steps, float(b) / (steps / world_size)
# --8<-- [end:fit_alpha_beta]


# --8<-- [start:predict_allreduce_seconds]
def predict_allreduce_seconds(num_bytes: int, world_size: int, alpha: float,
                              beta: float) -> float:
    """The time of a ring all-reduce of ``num_bytes`` on ``world_size`` ranks: 2 (W - 1)
    steps of latency ``alpha``, each sending ``num_bytes / W`` at ``beta`` seconds per byte.
    On one rank nothing moves: 0.0. Fewer than one rank (``world_size < 1``) or a negative
    ``num_bytes`` raises ``ValueError``, either alone. The test checks it against
    ``fit_alpha_beta``'s model."""
    if world_size < 1 or num_bytes < 0:
        raise ValueError(f"need world_size >= 1 and num_bytes >= 0; got {world_size}, "
                         f"{num_bytes}")
    steps = 2 * (world_size - 1)
    return steps * alpha + steps * (num_bytes / world_size) * beta
# --8<-- [end:predict_allreduce_seconds]


# --8<-- [start:ddp_buckets]
def ddp_buckets(param_bytes: list[int], bucket_cap_bytes: int,
                first_bucket_bytes: int) -> list[list[int]]:
    """How DDP groups gradients into buckets: lists of indices into ``param_bytes``.

    ``param_bytes`` is in the order the gradients become ready (for DDP's first buckets:
    the model's parameters reversed). Walk it in order, adding each parameter to the open
    bucket; as soon as the bucket holds at least its limit, close it and open the next. The
    first bucket's limit is ``first_bucket_bytes``, every later one's ``bucket_cap_bytes``. The
    last bucket takes what is left, however small.

    The test compares your buckets with torch's own assignment
    (``torch.distributed._compute_bucket_assignment_by_size``) on many size lists.
    """
    buckets, current, size = [], [], 0
    for index, nbytes in enumerate(param_bytes):
        current.append(index)
        size += nbytes
        if size >= (first_bucket_bytes if not buckets else bucket_cap_bytes):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
# --8<-- [end:ddp_buckets]


# --8<-- [start:predict_ddp_comm_seconds]
def predict_ddp_comm_seconds(model: nn.Module, world_size: int, alpha: float, beta: float,
                             bucket_cap_mb: float | None = None,
                             bytes_per_element: int | None = None) -> float:
    """The communication time of one DDP step of ``model``: one ring all-reduce per bucket.

    ``bucket_cap_mb`` as it would be passed to ``DDP(model, bucket_cap_mb=...)``, and the
    buckets DDP builds after its first step for it: ``ddp_buckets`` of the parameters that
    require a gradient, reversed (the order their gradients arrive in a model used in order).
    Left ``None`` (DDP's default), the first bucket's limit is 1 MiB
    (``FIRST_BUCKET_BYTES``) and every later one's 25 MiB (``DEFAULT_BUCKET_CAP_MB``);
    given, even as 25, every bucket's limit is ``bucket_cap_mb`` MiB, the first's too. A
    communication hook that compresses the gradients sends ``bytes_per_element`` per element
    (2 for bf16) instead of the parameter's own ``element_size()``; the buckets are formed
    from the uncompressed sizes, as DDP forms them.

    The test checks it against the buckets a real DDP builds for the same model and
    ``bucket_cap_mb``, for generated models and caps.
    """
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    sizes = [p.numel() * p.element_size() for p in params]
    if bucket_cap_mb is None:
        cap, first = DEFAULT_BUCKET_CAP_MB * MiB, FIRST_BUCKET_BYTES
    else:  # a cap given is every bucket's limit: DDP keeps the small first one for its default
        cap = first = int(bucket_cap_mb * MiB)
    buckets = ddp_buckets(sizes, int(cap), first)
    total = 0.0
    for bucket in buckets:
        nbytes = sum(params[i].numel() * (bytes_per_element or params[i].element_size())
                     for i in bucket)
        total += predict_allreduce_seconds(nbytes, world_size, alpha, beta)
    return total
# --8<-- [end:predict_ddp_comm_seconds]


# --8<-- [start:bf16_compress]
# Not named bf16_compress_hook: DDP refuses a hook of that name (torch's own) on torch builds
# without CUDA and NCCL. No annotations: DDP checks them against the real classes, and
# ``from __future__ import annotations`` (above) makes them strings.
def bf16_compress(state, bucket):
    """A DDP communication hook: the bucket's gradients averaged over the ranks, sent as bf16.

    ``bucket`` is a ``torch.distributed.GradBucket``; return a
    ``torch.futures.Future[torch.Tensor]``.

    Register it with ``ddp_model.register_comm_hook(state, bf16_compress)``; ``state`` is
    the process group to average over, or ``None`` for the default group. DDP hands the hook
    each bucket as soon as its gradients are ready (``bucket.buffer()``: one flat tensor),
    waits on the returned future, and copies its value, the averaged bucket, into the
    gradients. So: cast to bf16, divide by the world size, all-reduce asynchronously, and when
    that completes, copy the result into the bucket's own buffer and return the buffer. (DDP
    would take the bf16 tensor too, casting as it copies; copying it into the buffer keeps no
    second bucket-sized tensor alive, which is why torch's own bf16 hook does the same.)

    The test trains with your hook against the same run without it (SGD, several steps,
    within bf16's precision), counts the bytes each all-reduce moves (half of fp32's), and
    checks that each future's value is the bucket's own buffer.
    """
    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(decompress)
# --8<-- [end:bf16_compress]


# --8<-- [start:choose_method]
def choose_method(model_bytes: int, activation_bytes: int, gpu_memory: int, num_gpus: int,
                  gpus_per_node: int, link: str, moe: bool = False) -> str:
    """The method of the lesson's decision table, one of ``METHODS``.

    ``model_bytes``: the fp32 weights. Training them with AdamW holds 4 times that (weights,
    gradients, two moments). ``activation_bytes``: what one GPU's share of the batch saves for
    the backward. ``link``: how the GPUs of a node are connected, ``"nvlink"`` or ``"pcie"``.
    In order, the first that fits in ``gpu_memory``:

    1. ``"one device"``, when ``num_gpus`` is 1: 4 x model + activations;
    2. ``"ddp"``: the same, on every GPU;
    3. ``"fsdp"``: 4 x model / num_gpus + activations (every GPU keeps a shard);
    4. the state sharded as in 3 and the activations split ``gpus_per_node`` ways inside a
       node: ``"tp+fsdp"`` over NVLink, ``"pp+fsdp"`` over PCIe (tensor parallelism waits on
       an all-reduce in every block; a pipeline only sends activations between stages);
    5. the state sharded as in 3 and the activations split ``num_gpus`` ways, every sequence
       cut across the nodes by context parallelism (lesson 10): ``"cp+tp+fsdp"`` over NVLink
       (tensor parallel inside each node, context parallel across), ``"cp+fsdp"`` over PCIe
       (context parallel over every GPU: its ring's sends can overlap attention).

    ``moe=True``, a mixture of experts (lesson 11): 1 and 2 stay, but in 3 to 5 expert
    parallelism splits the experts across the GPUs instead of FSDP gathering every expert to
    every GPU, and the name gets ``"ep+"`` in front (``"ep+fsdp"``, ``"ep+pp+fsdp"``, ...).
    The bytes per GPU are the same; what moves is each token to its experts.

    Nothing fits (or one GPU that is too small): ``ValueError`` saying how many bytes the
    smallest option (5, or 1 on one GPU) needs. Arguments that are not positive,
    ``gpus_per_node`` that does not divide ``num_gpus``, or an unknown link: ``ValueError``.
    The test checks the table of cases in the lesson's README, and the table's first fit on
    generated clusters.
    """
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}: expected one of {LINKS}")
    if min(model_bytes, gpu_memory, num_gpus, gpus_per_node) <= 0 or activation_bytes < 0:
        raise ValueError("sizes and counts must be positive (activation_bytes may be 0)")
    if num_gpus % gpus_per_node:
        raise ValueError(f"{num_gpus} GPUs are not whole nodes of {gpus_per_node}")
    state = 4 * model_bytes
    if state + activation_bytes <= gpu_memory:
        return "one device" if num_gpus == 1 else "ddp"
    if num_gpus == 1:
        raise ValueError(f"one GPU of {gpu_memory} bytes cannot hold {state + activation_bytes}: "
                         f"use more GPUs, a smaller batch or activation checkpointing")
    experts = "ep+" if moe else ""  # the experts split across the GPUs, not gathered
    if state / num_gpus + activation_bytes <= gpu_memory:
        return experts + "fsdp"
    if state / num_gpus + activation_bytes / gpus_per_node <= gpu_memory:
        return experts + ("tp+fsdp" if link == "nvlink" else "pp+fsdp")
    smallest = (state + activation_bytes) / num_gpus
    if smallest <= gpu_memory:
        return experts + ("cp+tp+fsdp" if link == "nvlink" else "cp+fsdp")
    raise ValueError(f"even with the state and the activations split {num_gpus} ways, each GPU "
                     f"needs {smallest:.0f} bytes and has {gpu_memory}: use more GPUs, a smaller "
                     f"batch or activation checkpointing")
# --8<-- [end:choose_method]


# --8<-- [start:read_step]
def read_step(events: list[dict], step: int | None = None) -> dict:
    """Where one training step of a ``torch.profiler`` trace of a CPU run (gloo) went.

    ``events``: a Chrome trace's ``"traceEvents"`` list, as ``prof.export_chrome_trace`` writes
    it (``json.load(file)["traceEvents"]``); times in microseconds. Only complete events count:
    ``"ph": "X"``, each with a ``"ts"`` (its start) and a ``"dur"``; skip every other kind
    (metadata, instants, flows), which have no ``"dur"``.

    The step is the event named ``ProfilerStep#<step>``; with ``step=None``, the one with the
    smallest number (``ProfilerStep#9`` comes before ``ProfilerStep#10``). No such event:
    ``ValueError``. An event belongs to the step when it starts at or after the step's start and
    before its end; its interval is cut at the step's end.

    Three kinds of event, by the start of their name:

    - backward: ``"autograd::engine::evaluate_function: "``;
    - communication, one per DDP bucket: ``"gloo:"``, the all-reduce as it runs on gloo's
      threads (not ``c10d::allreduce_``, which only hands the bucket to gloo);
    - data: ``"enumerate(DataLoader)"``, the wait for the next batch.

    Events of one kind may overlap (nested calls, several threads): a kind's time is the length
    of the union of its intervals, never the sum of their durations.

    Returns a dict, every time in microseconds: ``"step_us"``, the step's duration;
    ``"data_us"``, ``"backward_us"`` and ``"comm_us"``, each kind's time; ``"exposed_comm_us"``,
    the communication time during which no backward event runs (the part the step waits for);
    ``"buckets"``, a list with one ``(start, duration, overlap)`` tuple per communication event,
    in order of start: its start from the step's start, its duration (cut at the step's end),
    and the part of it during which a backward event runs.

    The test checks each clause alone, sweeps generated traces against a count over every
    piece of time between two event boundaries, and reads real traces of DDP on gloo (every
    profiled step, small buckets and one bucket) the same way.
    """
    def merged(intervals):  # the union, as disjoint intervals in order
        union: list[list[float]] = []
        for start, stop in sorted(intervals):
            if union and start <= union[-1][1]:
                union[-1][1] = max(union[-1][1], stop)
            else:
                union.append([start, stop])
        return union

    def covered(start, stop, union):  # how much of [start, stop) the union covers
        return sum(max(0.0, min(stop, b) - max(start, a)) for a, b in union)

    complete = [event for event in events if event.get("ph") == "X"]
    steps = {}
    for event in complete:
        found = re.fullmatch(r"ProfilerStep#(\d+)", event["name"])
        if found:
            steps[int(found.group(1))] = event
    number = min(steps, default=None) if step is None else step
    if number not in steps:
        raise ValueError(f"no event ProfilerStep#{number} in the trace (it has "
                         f"{sorted(steps)}): profile with a schedule and call prof.step() "
                         f"after each step")
    begin = float(steps[number]["ts"])
    end = begin + float(steps[number]["dur"])
    prefixes = {"backward": "autograd::engine::evaluate_function: ", "comm": "gloo:",
                "data": "enumerate(DataLoader)"}
    kinds: dict[str, list] = {kind: [] for kind in prefixes}
    for event in complete:
        start = float(event["ts"])
        kind = next((k for k, prefix in prefixes.items() if event["name"].startswith(prefix)),
                    None)
        if kind is not None and begin <= start < end:
            kinds[kind].append((start, min(start + float(event["dur"]), end)))
    backward = merged(kinds["backward"])
    communication = merged(kinds["comm"])
    return {"step_us": end - begin,
            "data_us": sum(b - a for a, b in merged(kinds["data"])),
            "backward_us": sum(b - a for a, b in backward),
            "comm_us": sum(b - a for a, b in communication),
            "exposed_comm_us": sum(b - a - covered(a, b, backward) for a, b in communication),
            "buckets": [(a - begin, b - a, covered(a, b, backward))
                        for a, b in sorted(kinds["comm"])]}
# --8<-- [end:read_step]


# --8<-- [start:fsdp_step_collectives]
def fsdp_step_collectives(root: list[tuple[int, ...]], units: list[list[tuple[int, ...]]],
                          world_size: int, param_bytes: int = 4, reduce_bytes: int | None = None,
                          reshard_after_forward: bool = True) -> list[tuple[str, int]]:
    """The collectives FSDP2 issues in one training step (a forward, then a backward) of a model
    sharded as lesson 05 shards it: ``fully_shard(unit, reshard_after_forward=...)`` on each
    unit (a block), then ``fully_shard(model)`` on the whole, with its default.

    ``units``: for each unit, the shapes of its parameters; ``root``: the shapes of the
    parameters no unit holds (the embeddings, the last norm, the head), which the root's
    ``fully_shard`` manages as one more group. ``world_size`` ranks, 2 or more.

    FSDP2 shards every parameter along its first dimension: ``torch.chunk`` into
    ``world_size`` pieces, each piece padded to ``ceil(rows / world_size)`` rows, so that a
    parameter of ``rows`` rows travels as ``ceil(rows / world_size) * world_size`` rows (a 65-row
    embedding on 128 ranks moves 128 rows). A group's collective carries all its parameters at
    once, each padded so.

    Each group with at least one parameter issues, per step:

    - an all-gather of its parameters before its forward (payload: the gathered, padded
      whole, in ``param_bytes`` per element);
    - another before its backward, if it freed them after its forward: a unit with
      ``reshard_after_forward=True``, never the root (torch keeps the root's parameters after
      the forward, since its backward, the first to run, needs them at once);
    - a reduce-scatter of its gradients after its backward (payload: the padded whole, in
      ``reduce_bytes`` per element; ``None``: ``param_bytes``, as gradients reduce in the
      parameters' dtype unless a ``MixedPrecisionPolicy`` gives a ``reduce_dtype``).

    A group without parameters issues nothing. Returns one ``(op, payload_bytes)`` per
    collective, ``op`` being ``"all_gather"`` or ``"reduce_scatter"``, in any order (the order
    depends on prefetching; the test compares them as a multiset). ``world_size < 2`` (one rank
    shards nothing), a shape with no dimension or a dimension below 1, or a byte size below 1:
    ``ValueError``.

    The test checks each clause alone, sweeps generated models (shapes, world sizes up to 128,
    mixed precision, both reshard settings) against FSDP2 itself run in torch's fake process
    group and counted as torch dispatches each collective, and a real 2-rank run on gloo.
    """
    reduce_bytes = param_bytes if reduce_bytes is None else reduce_bytes
    if world_size < 2:
        raise ValueError(f"world_size {world_size}: FSDP needs 2 or more ranks to shard over")
    if min(param_bytes, reduce_bytes) < 1:
        raise ValueError(f"bytes per element must be 1 or more, not {param_bytes}, {reduce_bytes}")
    for shape in [*root, *(shape for unit in units for shape in unit)]:
        if len(shape) == 0 or min(shape) < 1:
            raise ValueError(f"shape {tuple(shape)}: every parameter needs dimensions of 1 or more")

    def padded_numel(shape: tuple[int, ...]) -> int:
        rows = -(-shape[0] // world_size) * world_size
        return rows * math.prod(shape[1:])

    collectives = []
    for shapes, is_root in [(root, True), *((unit, False) for unit in units)]:
        if not shapes:
            continue
        numel = sum(padded_numel(shape) for shape in shapes)
        gathers = 2 if reshard_after_forward and not is_root else 1
        collectives += [("all_gather", numel * param_bytes)] * gathers
        collectives.append(("reduce_scatter", numel * reduce_bytes))
    return collectives
# --8<-- [end:fsdp_step_collectives]
