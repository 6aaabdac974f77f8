"""Lesson 07 exercises: pipeline parallelism. One process per stage, schedules by hand, then
torch.distributed.pipelining.

Grade with ``pytest lessons/07_pipeline_parallel`` (one task: ``-m task7_1``). Each function's
docstring is its contract: what it takes, what it returns, and what the test checks.

A pipeline of p stages runs on p ranks: rank s holds stage s. A batch is cut into m equal
micro-batches; an *action* is ``("F", i)``, the forward of micro-batch i, or ``("B", i)``, its
backward. Stage s receives each forward's input from stage s - 1 and each backward's gradient
from stage s + 1, and sends the other way.
"""

from __future__ import annotations

import datetime
import itertools
import time

import torch
import torch.distributed as dist
from gpt import GPTStage
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

KINDS = ("gpipe", "1f1b")


def micro_batches(batch: torch.Tensor, num_micro_batches: int) -> list[torch.Tensor]:
    """``batch`` cut along its first dimension into ``num_micro_batches`` equal pieces.

    The rule of this lesson: the pieces must be equal, so that the mean of their mean losses is
    the batch's mean loss; a batch that does not divide is a ``ValueError`` naming both numbers.
    """
    if num_micro_batches < 1 or len(batch) % num_micro_batches:
        raise ValueError(f"a batch of {len(batch)} does not cut into {num_micro_batches} equal "
                         f"micro-batches: choose a micro-batch count that divides it")
    return list(batch.chunk(num_micro_batches))


# --8<-- [start:schedule]
def schedule(kind: str, num_stages: int, num_micro_batches: int) -> list[list[tuple[str, int]]]:
    """Every stage's actions, in the order it runs them: ``result[s]`` is stage s's list.

    - ``"gpipe"``: every forward (micro-batches 0, 1, ..., m - 1), then every backward, last
      micro-batch first (m - 1, ..., 0), a convention (torch's ScheduleGPipe runs them oldest
      first, with the same bubble and memory);
    - ``"1f1b"``: stage s first runs ``min(p - s - 1, m)`` forwards (the warm-up: enough to keep
      the stages after it busy), then alternates one forward and one backward, oldest
      micro-batch first, until the forwards run out, then runs the remaining backwards.

    Each stage runs each micro-batch's forward and backward exactly once. An unknown ``kind``,
    fewer than 1 stage or fewer than 1 micro-batch raise ``ValueError``.

    The test runs your schedules in the lesson's simulator (``simulator.py``): no
    deadlock, the bubble (p - 1) / (m + p - 1), and at most m activations in flight per stage
    for GPipe, p - s for 1F1B.
    """
    raise NotImplementedError("task7_1: every stage's actions: GPipe, or 1F1B with a warm-up")
# --8<-- [end:schedule]


# --8<-- [start:StageRunner]
class StageRunner:
    """Runs one stage's schedule, sending and receiving with point-to-point operations.

    ``StageRunner(module, stage, num_stages, activation_shape, loss_fn=None, timeout=60.0)``:
    ``module`` is this rank's stage, ``stage`` its index (this rank's rank), ``activation_shape``
    the shape of what one micro-batch's forward sends from one stage to the next (for the
    running example: (micro-batch size, tokens, features)), ``loss_fn(output, target)`` the
    loss, needed on the last stage only.

    ``step(actions, inputs=None, targets=None)`` runs ``actions`` (this stage's list from
    ``schedule``) in order. ``inputs`` (first stage) and ``targets`` (last stage) are lists of
    the m micro-batches, m the number of ``"F"`` actions in ``actions`` (a list of forwards
    only, an evaluation, runs them and returns their losses too). For each action:

    - ``("F", i)``: the input is ``inputs[i]`` on the first stage; any other stage receives it
      from stage - 1 into a new tensor of ``activation_shape`` and marks it ``requires_grad``.
      Run the module and keep the input and output for the backward. The last stage computes
      ``loss_fn(output, targets[i]) / m`` (the m equal micro-batches' mean losses, averaged,
      are the batch's mean); any other stage sends the output (detached) to stage + 1;
    - ``("B", i)``: the last stage runs backward from its loss; any other receives the gradient
      of its output from stage + 1 and runs ``output.backward(gradient)``. Any stage but the
      first then sends the gradient of its input to stage - 1. Free what was kept for i.

    Sends and receives are point-to-point operations, posted so that they are safe on NCCL,
    which runs the operations between two ranks one after another, in the order they are
    posted, and completes a send larger than its buffer only once the receive runs. In 1F1B's
    steady state stage s sends F(i)'s output to s + 1 and then waits for B(j)'s gradient from
    s + 1, while s + 1 sends B(j)'s gradient and then waits for F(i)'s input: posted one by
    one, each send would wait for a receive queued behind the other's send. So an action's
    send is held back until the next action: if that action receives from the same neighbour,
    post the send and the receive together, ``dist.batch_isend_irecv([send, receive])`` (one
    batch: the order inside it does not matter, as torch's ``Schedule1F1B`` does); otherwise
    post the send alone (``dist.isend``) before the next action. A receive with no send to fuse
    is ``dist.irecv``. Wait for each receive (with its batch) with
    ``work.wait(datetime.timedelta(seconds=self.timeout))``; a receive that times out raises
    ``TimeoutError`` naming this stage, the action, and the stage it waited for: a mismatched
    schedule then ends with a message, not a hang. Keep the works of the sends posted alone
    and wait for all of them before ``step`` returns (a send's tensor must stay alive until it
    is received), posting first a send still held back after the last action.

    Also records ``self.timeline``: one ``(kind, i, start, end)`` per action, ``time.perf_counter``
    seconds around its computation only (not its receives); ``[]`` from construction, and
    started anew by each ``step``, so that it holds the last step's actions only, in their
    order. Returns the last stage's m losses as floats (scaled back up: each micro-batch's own
    mean loss), an empty list on other stages. Gradients accumulate in the module's parameters;
    the caller steps the optimizer.

    The test trains 2 and 4 stages of the running example with both schedules and several
    micro-batch counts against the unsplit model, records the operations each stage posts and
    runs them through the simulator's model of NCCL's links, gives two stages mismatched
    schedules, and measures the bubble from every stage's timeline.
    """

    def __init__(self, module: nn.Module, stage: int, num_stages: int,
                 activation_shape: tuple[int, ...], loss_fn=None, timeout: float = 60.0):
        raise NotImplementedError("task7_2: keep the module, the stage and what step needs")

    def _receive(self, source: int, what: str, send: dist.P2POp | None = None) -> torch.Tensor:
        """Receive from ``source``, posted in one batch with ``send`` when there is one."""
        raise NotImplementedError("task7_2: irecv (batched with send), wait with a timeout")

    def step(self, actions, inputs=None, targets=None) -> list[float]:
        raise NotImplementedError("task7_2: run the actions, sending and receiving between stages")
# --8<-- [end:StageRunner]


# --8<-- [start:split_gpt]
def split_gpt(model: nn.Module, num_stages: int) -> list[GPTStage]:
    """The running example cut into ``num_stages`` stages of consecutive blocks, with the
    parameter counts as even as a cut between blocks allows: ``gpt.GPTStage(model, start, end)``
    for each (it adds the embeddings to the first stage, the final norm and the head to the
    last, and keeps the model's own modules).

    Count each block's parameters; the first stage's count also includes the embeddings, the
    last's the final norm and the head. Of every way to cut the blocks into ``num_stages``
    non-empty runs, take one whose largest stage is smallest: every stage then needs about the
    same memory for its parameters, gradients and optimizer state; where several tie, the one
    with the fewest blocks in the first stage, then in the second, and so on (the first cut in
    ``itertools.combinations`` order). (Balancing the *time* of the stages, which sets the
    pipeline's pace, would count compute instead: an embedding has many parameters and almost
    no compute. The README explains both; this task is the memory split.) More stages than
    blocks raise ``ValueError`` naming both numbers.

    The test checks the stages keep every parameter once, in order, and that no cut has a
    smaller largest stage; then trains the stages against the unsplit model.
    """
    raise NotImplementedError("task7_3: the cut between blocks whose largest stage is smallest")
# --8<-- [end:split_gpt]


# --8<-- [start:torch_schedule]
def torch_schedule(module: nn.Module, stage: int, num_stages: int, num_micro_batches: int,
                   loss_fn, device: torch.device, kind: str = "1f1b"):
    """The same pipeline with ``torch.distributed.pipelining``: wrap ``module`` in a
    ``PipelineStage(module, stage, num_stages, device)`` and return ``Schedule1F1B`` (or
    ``ScheduleGPipe`` for ``kind="gpipe"``) over it with ``n_microbatches=num_micro_batches`` and
    ``loss_fn``. torch cuts the batch, sends and receives, and averages the micro-batches'
    gradients (``scale_grads=True``, its default).

    The test steps it with ``torch_step`` and compares every stage's parameters with the unsplit
    model's, the reference task7_2's test holds the hand-written runner to.
    """
    raise NotImplementedError("task7_4: a PipelineStage, and Schedule1F1B or ScheduleGPipe on it")
# --8<-- [end:torch_schedule]


# --8<-- [start:torch_step]
def torch_step(schedule, stage: int, num_stages: int, inputs: torch.Tensor,
               targets: torch.Tensor) -> list[float]:
    """One training step of ``schedule`` on this rank: the first stage passes the whole
    batch's ``inputs`` (``schedule.step(inputs)``), the last its ``targets`` and a list for the
    losses (``schedule.step(target=targets, losses=losses)``), a middle stage nothing
    (``schedule.step()``). With a single stage, both. Returns the last stage's micro-batch
    losses as floats, an empty list on other stages.
    """
    raise NotImplementedError("task7_4: schedule.step with what this stage has")
# --8<-- [end:torch_step]


# --8<-- [start:interleaved]
def interleaved(num_ranks: int, num_chunks: int, num_micro_batches: int
                ) -> list[list[tuple[str, int, int]]]:
    """Interleaved 1F1B: every rank's actions, in the order it runs them. ``result[r]`` is rank
    r's list; an action is ``("F", i, c)`` or ``("B", i, c)``, the forward or backward of
    micro-batch i through the rank's chunk c.

    The model is cut into p * v stages (p = ``num_ranks``, v = ``num_chunks``) and rank r holds
    v of them: its chunk c is stage c * p + r, so a micro-batch passes ranks 0, 1, ..., p - 1
    for chunk 0, then again for chunk 1, and so on. The order is torch's
    ``ScheduleInterleaved1F1B`` (Megatron-LM's, with torch's rounds), for m micro-batches:

    - the micro-batches go in rounds: ``max(1, m // p)`` rounds of n = m / rounds each; an m
      that is not a multiple of the number of rounds raises ``ValueError``;
    - rank r's i-th forward (counting from 0) runs chunk ``(i // n) % v``, and its j-th backward
      chunk ``v - 1 - (j // n) % v``; each runs the oldest micro-batch that its chunk has not
      run yet (a chunk's forwards, and its backwards, go 0, 1, ..., m - 1);
    - rank r first runs ``min((v - 1) * n + 2 * (p - 1 - r), v * m)`` forwards (the warm-up),
      then alternates one forward and one backward until its v * m forwards are done, then
      runs its remaining backwards.

    Fewer than 1 rank, 1 chunk or 1 micro-batch raise ``ValueError``.

    The test runs your schedules in the lesson's simulator (no deadlock; for m >= p the bubble
    (p - 1) / (v m + p - 1)) and compares them with the order torch's
    ``ScheduleInterleaved1F1B`` builds, for generated p, v and m.
    """
    raise NotImplementedError("task7_5: each rank's forwards and backwards over its chunks")
# --8<-- [end:interleaved]


# --8<-- [start:zero_bubble]
def zero_bubble(num_stages: int, num_micro_batches: int) -> list[list[tuple[str, int]]]:
    """Zero bubble (ZB-H1): every stage's actions, in order, with each backward split in two:
    ``("B", i)`` computes only the gradient of the stage's input (what the stage before waits
    for), ``("W", i)`` the gradients of the stage's weights (what nobody waits for). The order
    is torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank; on stage s of p, for
    m micro-batches:

    - first ``min(p - s - 1, m)`` forwards (1F1B's warm-up);
    - then, for j = 0, 1, ..., m - 1: the next forward while any are left, then ``("B", j)``,
      then, once j >= s, the W of the oldest micro-batch whose W has not run;
    - then the W's left, oldest first.

    Each stage runs each micro-batch's F, B and W exactly once, in that order. Fewer than 1
    stage or 1 micro-batch raise ``ValueError``.

    The test compares your lists with the order torch builds, for generated p and m, and runs
    them in the lesson's simulator with a forward, a B and a W of equal time: no deadlock, the
    bubble (p - 1) / (3 m + p - 1) for m >= p (a third of 1F1B's idle time), and every stage
    holding at most p micro-batches' activations (1F1B's most).
    """
    raise NotImplementedError("task7_6: 1F1B with each backward split, the W's delayed")
# --8<-- [end:zero_bubble]


# --8<-- [start:average_over_copies]
def average_over_copies(module: nn.Module, mesh) -> None:
    """After one step of a pipeline that is also data parallel, make the gradients of this
    rank's stage those of the whole batch: average each of ``module``'s gradients over the
    copies of this stage.

    ``mesh`` is a 2-D ``DeviceMesh`` with a dimension named ``"pp"`` and one named ``"dp"``, in
    either order: the ranks along ``"pp"`` are one copy of the pipeline, its stages in order;
    the ranks along ``"dp"`` hold the same stage, each copy fed its own share of the batch.
    All-reduce each gradient over ``mesh["dp"]``'s process group and divide it by that group's
    size. Not over the world: its other ranks hold other stages, whose gradients are of other
    parameters. A ``"dp"`` dimension of size 1 leaves the gradients as they are. Parameters
    without a gradient are skipped.

    The test sets known gradients on 4 ranks (meshes of 2 x 2, in both orders, and 4 x 1 and
    1 x 4) and compares each rank's with the average over its stage's copies; then trains the
    running example as 2 copies of a 2-stage 1F1B pipeline (torch's ``Schedule1F1B`` over
    ``mesh["pp"]``) against one process on the whole batch.
    """
    raise NotImplementedError("task7_7: all-reduce over the copies of this stage, mesh[\"dp\"]")
# --8<-- [end:average_over_copies]


# --8<-- [start:balance_by_time]
def balance_by_time(seconds: list[float], num_stages: int) -> list[int]:
    """How many consecutive layers each of ``num_stages`` stages gets so that the slowest stage
    is as fast as it can be: ``seconds[i]`` is layer i's measured forward and backward time
    (the embeddings counted in the first layer's, the head in the last's), a stage's time the
    sum of its layers'. Returns one count per stage, each at least 1, summing to
    ``len(seconds)``.

    Of every way to cut the layers into ``num_stages`` non-empty runs, take one whose slowest
    stage is fastest; where several tie, the one with the fewest layers in the first stage, then
    in the second, and so on (task 7_3's rule, on time instead of parameters). Every cut takes
    the same total time, so under GPipe, whose step is that total plus (m - 1) times the
    slowest stage (when each stage's backward is the same multiple of its forward), this cut
    gives the shortest step. More stages than layers, or fewer than 1,
    raise ``ValueError`` naming both numbers.

    The test compares your cut with every cut of generated times (ties included), and runs the
    simulator with the stages' times.
    """
    raise NotImplementedError("task7_8: the cut whose slowest stage is fastest")
# --8<-- [end:balance_by_time]
