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
    raise NotImplementedError("task8_1: the payload over the time, times the op's ring factor")
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
    raise NotImplementedError("task8_1: a line t = a + b n fitted to the relative "
                              "errors (weights 1 / t**2); alpha, beta from a, b")
# --8<-- [end:fit_alpha_beta]


# --8<-- [start:predict_allreduce_seconds]
def predict_allreduce_seconds(num_bytes: int, world_size: int, alpha: float,
                              beta: float) -> float:
    """The time of a ring all-reduce of ``num_bytes`` on ``world_size`` ranks: 2 (W - 1)
    steps of latency ``alpha``, each sending ``num_bytes / W`` at ``beta`` seconds per byte.
    On one rank nothing moves: 0.0. Fewer than one rank (``world_size < 1``) or a negative
    ``num_bytes`` raises ``ValueError``, either alone. The test checks it against
    ``fit_alpha_beta``'s model."""
    raise NotImplementedError("task8_2: 2 (W - 1) steps of alpha, each sending n / W bytes")
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
    raise NotImplementedError("task8_2: close a bucket once it holds at least its limit")
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
    raise NotImplementedError("task8_2: one all-reduce per bucket of the reversed parameters")
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
    raise NotImplementedError("task8_3: bf16, divided by the world size, all-reduced, copied back")
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
    raise NotImplementedError("task8_4: the first option of the table whose bytes per GPU fit")
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
    raise NotImplementedError("task8_5: union the intervals of each kind, inside the step")
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
    raise NotImplementedError("task8_6: per group one all-gather or two, a reduce-scatter, padded")
# --8<-- [end:fsdp_step_collectives]
