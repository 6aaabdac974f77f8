"""Run a pipeline schedule on paper: when each stage computes what, the bubble, the memory.

    from simulator import simulate     # beside it; the tests: from lesson07.simulator import ...

    gpipe = [[("F", m) for m in range(4)] + [("B", m) for m in reversed(range(4))]] * 2
    timeline = simulate(gpipe, num_micro_batches=4)      # 2 stages, 4 micro-batches
    timeline.bubble_fraction()                           # (p - 1) / (m + p - 1) = 0.2
    timeline.peak_in_flight(0)                           # 4: GPipe holds every micro-batch
    open("gpipe.svg", "w").write(timeline.svg("GPipe"))

A *schedule* lists, for every stage, the actions it runs in order: ``("F", m)`` is the forward
of micro-batch ``m``, ``("B", m)`` its backward. A stage runs its list in order and starts an
action as soon as it is free and the action's input has arrived:

- ``("F", m)`` on stage s needs stage s - 1's ``("F", m)`` (its output activation);
- ``("B", m)`` on stage s needs stage s + 1's ``("B", m)`` (the gradient of its output), and
  its own ``("F", m)`` earlier in its list (the activations it saved).

An interleaved schedule gives each of the p ranks v *chunks* (virtual stages), and its actions
name the chunk: ``("F", m, c)``. Chunk c of rank r is stage c * p + r of the p * v (the looping
layout of Megatron-LM and torch's ``ScheduleInterleaved1F1B``: a micro-batch passes every rank
once per chunk), and one chunk's forward takes ``forward_time / v``, its backward
``backward_time / v`` (a rank's layers are cut into v equal chunks). ``schedule[r]`` is then
rank r's list; ``("F", m)`` is ``("F", m, 0)``.

A zero-bubble schedule splits each backward in two: ``("B", m)`` computes only the gradient of
the stage's input (what the stage before waits for), ``("W", m)`` the gradients of its weights
(which nobody waits for), after it on the same stage. Where a schedule has W actions, ``B``
takes ``backward_time - weight_time`` and ``W`` takes ``weight_time`` (half the backward unless
given), and a micro-batch's activations are held until its W.

This is how real stages behave when each blocks on a receive: a stage whose next action waits
for something that can never come is a deadlock, and ``simulate`` raises :class:`Deadlock`
naming what every stuck stage waits for; a schedule whose neighbouring stages run their forwards
(or backwards) in different orders raises :class:`OrderMismatch` (sends and receives of one tag
pair up in the order they are posted, whatever micro-batch they carry); and the sends and
receives each stage posts must be an order NCCL can run (:func:`check_links`: between two
ranks one post after another, a send complete only once its receive runs), else
:class:`UnsafeOrder`. Communication is otherwise taken as free; a forward takes
``forward_time`` and a backward ``backward_time`` on every stage (even stages: the bubble
formula's assumption), unless ``stage_cost`` makes some slower.

The lesson's graded ``schedule()`` is checked with this module; the walkthrough runs it. It also
draws the lesson's pictures of the schedules (GPipe, 1F1B, interleaved, zero bubble):

    python lessons/07_pipeline_parallel/simulator.py --write   # docs/assets/pipeline/*.svg
    python lessons/07_pipeline_parallel/simulator.py --check   # exit 1 when one is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from xml.sax.saxutils import escape

Action = tuple  # ("F", micro_batch) or ("B", micro_batch), or with a chunk: ("F", m, c)
KINDS = ("F", "B", "W")  # W: a backward's weight gradients, where a schedule splits them off
Key = tuple[int, str, int, int]  # (rank, kind, micro-batch, chunk)


class ScheduleError(ValueError):
    """The schedule is not a schedule: an unknown action, a missing or repeated one, a backward
    before its forward."""


class Deadlock(ScheduleError):
    """No stage can start its next action: each waits for another that never comes."""


class OrderMismatch(ScheduleError):
    """Two neighbouring stages pass micro-batches in different orders: a send and a receive
    pair up in the order they are posted, so a receive would get another micro-batch's data."""


class UnsafeOrder(ScheduleError):
    """Two neighbouring stages post their sends and receives in an order NCCL cannot run: each
    waits for a send to finish whose receive is queued on the other behind a send of its own."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One point-to-point operation a stage posts: ``kind`` "send" or "recv", to or from
    ``peer``; ``what`` names it in messages ("F1's activations")."""

    kind: str
    peer: int
    what: str = ""

    def __str__(self) -> str:
        thing = f" {self.what}" if self.what else ""
        return (f"send{thing} to stage {self.peer}" if self.kind == "send"
                else f"receive{thing} from stage {self.peer}")


Post = tuple[Op, ...]  # what a stage posts at once: one operation, or a batch of them


@dataclasses.dataclass(frozen=True)
class Slot:
    stage: int  # the rank: with chunks, several stages run on it
    kind: str  # "F", "B" or "W"
    micro_batch: int
    start: float
    end: float
    chunk: int = 0


@dataclasses.dataclass(frozen=True)
class Timeline:
    slots: tuple[Slot, ...]
    num_stages: int  # ranks
    num_micro_batches: int
    num_chunks: int = 1

    @property
    def makespan(self) -> float:
        """From the first forward's start to the last action's end (a backward, or a W)."""
        return max(slot.end for slot in self.slots)

    def of(self, stage: int) -> list[Slot]:
        return sorted((s for s in self.slots if s.stage == stage), key=lambda s: s.start)

    def busy(self, stage: int) -> float:
        return sum(slot.end - slot.start for slot in self.of(stage))

    def idle(self, stage: int) -> float:
        return self.makespan - self.busy(stage)

    def bubble_fraction(self) -> float:
        """The share of all stages' time spent idle: 1 - busy / (stages x makespan)."""
        total = self.num_stages * self.makespan
        return 1 - sum(self.busy(s) for s in range(self.num_stages)) / total

    def peak_in_flight(self, stage: int) -> int:
        """The most micro-batches whose activations ``stage`` holds at once: forwards done
        whose backward (or, where the backward is split, whose W) has not run yet; with
        chunks, each chunk's forward counts one."""
        frees = "W" if self.splits_backward else "B"
        held = peak = 0
        for slot in self.of(stage):
            held += 1 if slot.kind == "F" else -1 if slot.kind == frees else 0
            peak = max(peak, held)
        return peak

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule ran W's: its backwards split into B and W."""
        return any(slot.kind == "W" for slot in self.slots)

    def peak_activations(self, stage: int) -> float:
        """The most activations ``stage`` holds at once, in micro-batches through all its
        layers: ``peak_in_flight / num_chunks`` (a chunk holds 1/v of the rank's layers)."""
        return self.peak_in_flight(stage) / self.num_chunks

    def svg(self, title: str = "", unit: float = 24.0, row: float = 28.0) -> str:
        """The timeline as an SVG picture: one row per stage (per rank, with chunks), forwards
        blue, backwards (or B) green, W's red, every other chunk lighter, each labelled with its
        micro-batch; idle time left grey."""
        left, top = 70.0, 30.0 if title else 8.0
        width = left + self.makespan * unit + 10
        height = top + self.num_stages * row + 26
        parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
                 f'height="{height:.0f}" font-family="sans-serif" font-size="12">']
        if title:
            parts.append(f'<text x="{left}" y="18" font-weight="bold">{escape(title)}</text>')
        for stage in range(self.num_stages):
            y = top + stage * row
            name = "rank" if self.num_chunks > 1 else "stage"
            parts.append(f'<text x="4" y="{y + row / 2 + 4:.1f}">{name} {stage}</text>')
            parts.append(f'<rect x="{left}" y="{y + 2:.1f}" width="{self.makespan * unit:.1f}" '
                         f'height="{row - 4:.1f}" fill="#f2f2f2"/>')
        for slot in self.slots:
            x, y = left + slot.start * unit, top + slot.stage * row
            shade = slot.chunk % 2  # a chunk's colour, lighter every other chunk
            fill = {"F": ("#4c78a8", "#8fb3d9"), "B": ("#54a24b", "#98cf8f"),
                    "W": ("#e45756", "#f0a09f")}[slot.kind][shade]
            length = (slot.end - slot.start) * unit
            parts.append(f'<rect x="{x:.1f}" y="{y + 2:.1f}" width="{length:.1f}" '
                         f'height="{row - 4:.1f}" fill="{fill}" stroke="white"/>')
            label = f"{slot.kind}{slot.micro_batch}" if length >= 20 else f"{slot.micro_batch}"
            parts.append(f'<text x="{x + (4 if length >= 20 else 3):.1f}" '
                         f'y="{y + row / 2 + 4:.1f}" fill="white">{label}</text>')
        per = " of a chunk" if self.num_chunks > 1 else ""
        durations = (f"a forward{per} = {self._duration('F'):g}, "
                     + (f"B = {self._duration('B'):g}, W = {self._duration('W'):g}"
                        if self.splits_backward
                        else f"a backward{per} = {self._duration('B'):g}"))
        parts.append(f'<text x="{left}" y="{height - 8:.0f}">time ({durations}); '
                     f'idle {self.bubble_fraction():.0%}</text>')
        parts.append("</svg>")
        return "\n".join(parts) + "\n"

    def _duration(self, kind: str) -> float:
        return next(s.end - s.start for s in self.slots if s.kind == kind)


def reference_schedule(kind: str, num_stages: int, num_micro_batches: int,
                       num_chunks: int = 1) -> list[list[Action]]:
    """The tests' own GPipe, 1F1B and interleaved 1F1B, to drive the stage runners and check
    the graded schedules independently of them: GPipe runs every forward, then every backward
    (the last micro-batch first); 1F1B warms up with p - s - 1 forwards on stage s, then
    alternates one forward and one backward, then drains the backwards; ``"interleaved"`` is
    torch's ``ScheduleInterleaved1F1B`` over ``num_stages`` ranks of ``num_chunks`` chunks
    (:func:`interleaved_order` says how); ``"zero-bubble"`` is ZB-H1 as torch's
    ``ScheduleInterleavedZeroBubble`` runs it with one stage per rank: 1F1B's warm-up, then
    each forward followed by a backward of the input's gradient only (B), stage s running the
    weights' gradient (W) of its oldest micro-batch after each B from its (s + 1)-th on, and
    the W's left at the end."""
    if kind == "interleaved":
        return interleaved_order(num_stages, num_chunks, num_micro_batches)
    if kind == "zero-bubble":
        return [_zero_bubble_stage(num_stages, stage, num_micro_batches)
                for stage in range(num_stages)]
    stages = []
    for stage in range(num_stages):
        if kind == "gpipe":
            actions = [("F", m) for m in range(num_micro_batches)]
            actions += [("B", m) for m in reversed(range(num_micro_batches))]
        elif kind == "1f1b":
            warmup = min(num_stages - stage - 1, num_micro_batches)
            actions = [("F", m) for m in range(warmup)]
            for i in range(num_micro_batches - warmup):
                actions += [("F", warmup + i), ("B", i)]
            actions += [("B", m) for m in range(num_micro_batches - warmup, num_micro_batches)]
        else:
            raise ValueError(f"no reference schedule {kind!r}: 'gpipe', '1f1b', 'interleaved' "
                             f"or 'zero-bubble'")
        stages.append(actions)
    return stages


def _zero_bubble_stage(num_stages: int, stage: int, num_micro_batches: int) -> list[Action]:
    warmup = min(num_stages - stage - 1, num_micro_batches)
    actions = [("F", i) for i in range(warmup)]
    weights = 0  # the W's run so far, oldest first
    for j in range(num_micro_batches):
        if warmup + j < num_micro_batches:
            actions.append(("F", warmup + j))
        actions.append(("B", j))
        if j >= stage:
            actions.append(("W", weights))
            weights += 1
    return actions + [("W", i) for i in range(weights, num_micro_batches)]


def interleaved_order(num_ranks: int, num_chunks: int, num_micro_batches: int
                      ) -> list[list[Action]]:
    """Interleaved 1F1B as torch builds it (``ScheduleInterleaved1F1B``, after Megatron-LM):
    micro-batches go in rounds, ``max(1, m // p)`` rounds of ``n = m / rounds``; rank r's i-th
    forward runs chunk ``(i // n) % v``, its j-th backward chunk ``v - 1 - (j // n) % v``, each
    on that chunk's oldest micro-batch not yet run; rank r warms up with
    ``min((v - 1) * n + 2 * (p - 1 - r), v * m)`` forwards, alternates one forward and one
    backward until the forwards run out, then runs the remaining backwards."""
    rounds = max(1, num_micro_batches // num_ranks)
    if num_micro_batches % rounds:
        raise ValueError(f"{num_micro_batches} micro-batches do not go in {rounds} equal rounds")
    per_round = num_micro_batches // rounds
    plan = []
    for rank in range(num_ranks):
        total = num_chunks * num_micro_batches
        warmup = min((num_chunks - 1) * per_round + 2 * (num_ranks - 1 - rank), total)
        forward_chunks = [(i // per_round) % num_chunks for i in range(total)]
        backward_chunks = [num_chunks - 1 - (j // per_round) % num_chunks for j in range(total)]
        forwards = _numbered("F", forward_chunks)
        backwards = _numbered("B", backward_chunks)
        actions = forwards[:warmup]
        for i in range(total - warmup):
            actions += [forwards[warmup + i], backwards[i]]
        plan.append(actions + backwards[total - warmup:])
    return plan


def _numbered(kind: str, chunks: list[int]) -> list[Action]:
    """Each chunk's actions numbered 0, 1, 2, ... in the order the chunks come."""
    count: dict[int, int] = {}
    numbered = []
    for chunk in chunks:
        numbered.append((kind, count.get(chunk, 0), chunk))
        count[chunk] = count.get(chunk, 0) + 1
    return numbered


def num_chunks_of(schedule: Sequence[Sequence[Action]]) -> int:
    """How many chunks the schedule's ranks run: one more than the largest chunk it names."""
    return 1 + max((action[2] for actions in schedule for action in actions
                    if isinstance(action, tuple) and len(action) == 3
                    and isinstance(action[2], int)), default=0)


def splits_backward(schedule: Sequence[Sequence[Action]]) -> bool:
    """Whether the schedule has W actions: its backwards split into B and W."""
    return any(isinstance(a, tuple) and a[:1] == ("W",) for actions in schedule for a in actions)


def _full(action: Action) -> tuple[str, int, int]:
    """``action`` with its chunk, 0 where it names none."""
    return (action[0], action[1], action[2] if len(action) == 3 else 0)


def _normalised(schedule: Sequence[Sequence[Action]]) -> list[list[tuple[str, int, int]]]:
    return [[_full(a) for a in actions] for actions in schedule]


def validate(schedule: Sequence[Sequence[Action]], num_micro_batches: int) -> None:
    """Raise :class:`ScheduleError` unless every stage (every rank's every chunk) runs each
    micro-batch's forward and backward exactly once, forward first."""
    if not schedule:
        raise ScheduleError("a schedule needs at least one stage")
    chunks = num_chunks_of(schedule)
    split = splits_backward(schedule)
    expected = {(kind, m, c) for kind in KINDS[:3 if split else 2]
                for m in range(num_micro_batches) for c in range(chunks)}

    def name(action: tuple) -> str:
        return repr(action if chunks > 1 else action[:2])

    for stage, actions in enumerate(schedule):
        seen: set[tuple] = set()
        for position, action in enumerate(actions):
            if (not isinstance(action, tuple) or len(action) not in (2, 3)
                    or action[0] not in KINDS[:3 if split else 2]
                    or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                               for i in action[1:])):
                raise ScheduleError(f"stage {stage}, action {position}: {action!r} is not "
                                    f"('F', m), ('B', m) or ('W', m), or ('F', m, chunk)")
            full = _full(action)
            if full not in expected:
                raise ScheduleError(f"stage {stage}, action {position}: {action!r}: there are "
                                    f"micro-batches 0 to {num_micro_batches - 1}")
            if full in seen:
                raise ScheduleError(f"stage {stage} runs {name(full)} twice")
            if full[0] == "B" and ("F", *full[1:]) not in seen:
                raise ScheduleError(f"stage {stage} runs {name(full)} before "
                                    f"{name(('F', *full[1:]))}: a backward needs the "
                                    f"activations its forward saved")
            if full[0] == "W" and ("B", *full[1:]) not in seen:
                raise ScheduleError(f"stage {stage} runs {name(full)} before "
                                    f"{name(('B', *full[1:]))}: the weights' gradients need "
                                    f"the gradient of the output that B receives")
            seen.add(full)
        missing = sorted(expected - seen, key=lambda a: (a[2], a[1], a[0]))
        if missing:
            shown = [name(a) for a in missing[:4]]
            raise ScheduleError(f"stage {stage} never runs [{', '.join(shown)}]"
                                + (" ..." if len(missing) > 4 else ""))


def simulate(schedule: Sequence[Sequence[Action]], num_micro_batches: int,
             forward_time: float = 1.0, backward_time: float = 2.0,
             posting: str | None = "fused", weight_time: float | None = None,
             stage_cost: Sequence[float] | None = None) -> Timeline:
    """When every action of ``schedule`` runs (see the module docstring for the rules).

    ``posting`` says how the stages post their sends and receives, which decides whether NCCL
    can run them (:func:`check_links`): ``"fused"``, as the lesson's ``StageRunner`` does (a
    send posted in one batch with the next action's receive from the same neighbour);
    ``"separate"``, every operation on its own (raises :class:`UnsafeOrder` for 1F1B); ``None``
    leaves communication out, as an interleaved schedule must (the model of the links covers
    one stage per rank).

    ``stage_cost`` makes the stages uneven: rank r's every action takes ``stage_cost[r]``
    times its duration (one number per rank; all 1 unless given)."""
    if posting not in ("fused", "separate", None):
        raise ValueError(f"posting must be 'fused', 'separate' or None, not {posting!r}")
    validate(schedule, num_micro_batches)
    chunks = num_chunks_of(schedule)
    if chunks > 1 and posting is not None:
        raise ValueError("an interleaved schedule is simulated with posting=None: the model "
                         "of NCCL's links covers one stage per rank")
    plan = _normalised(schedule)
    ranks = len(plan)
    last = ranks * chunks - 1
    if weight_time is None:
        weight_time = backward_time / 2
    if not 0 <= weight_time <= backward_time:
        raise ValueError(f"weight_time {weight_time} must lie between 0 and the backward's "
                         f"{backward_time}: W is a part of the backward")
    split = splits_backward(schedule)
    cost = [1.0] * ranks if stage_cost is None else [float(c) for c in stage_cost]
    if len(cost) != ranks or not all(0 < c < float("inf") for c in cost):  # NaN fails too
        raise ValueError(f"stage_cost needs one positive number per rank ({ranks}), got "
                         f"{stage_cost!r}")
    duration = ({"F": forward_time, "B": backward_time - weight_time, "W": weight_time} if split
                else {"F": forward_time, "B": backward_time})
    done: dict[Key, float] = {}  # (rank, kind, micro-batch, chunk) -> end time
    position = [0] * ranks
    free = [0.0] * ranks
    slots = []

    def needs(rank: int, action: tuple[str, int, int]) -> Key | None:
        kind, m, chunk = action
        stage = chunk * ranks + rank
        other = stage - 1 if kind == "F" else stage + 1
        if kind == "W" or other < 0 or other > last:  # W waits only for its own B, run before
            return None
        return (other % ranks, kind, m, other // ranks)

    while any(position[r] < len(plan[r]) for r in range(ranks)):
        progressed = False
        for rank in range(ranks):
            while position[rank] < len(plan[rank]):
                action = plan[rank][position[rank]]
                dependency = needs(rank, action)
                if dependency is not None and dependency not in done:
                    break
                start = max(free[rank], done[dependency] if dependency is not None else 0.0)
                end = start + duration[action[0]] * cost[rank] / chunks
                slots.append(Slot(rank, action[0], action[1], start, end, action[2]))
                done[(rank, *action)] = free[rank] = end
                position[rank] += 1
                progressed = True
        if not progressed:
            waits = []
            for rank in range(ranks):
                if position[rank] < len(plan[rank]):
                    action = plan[rank][position[rank]]
                    source, kind, m, chunk = needs(rank, action)
                    of = f" of chunk {chunk}" if chunks > 1 else ""
                    mine = f" of chunk {action[2]}" if chunks > 1 else ""
                    waits.append(f"stage {rank} waits to run {action[0]}{action[1]}{mine} for "
                                 f"{kind}{m}{of} from stage {source}")
            raise Deadlock("deadlock: " + "; ".join(waits))
    check_order(schedule)
    if posting is not None:
        check_links(posts(schedule, fused=posting == "fused"))
    return Timeline(tuple(slots), ranks, num_micro_batches, chunks)


def check_order(schedule: Sequence[Sequence[Action]]) -> None:
    """Raise :class:`OrderMismatch` unless each stage receives in the order its neighbour
    sends: forwards' activations from the stage before, backwards' gradients from the one
    after (a schedule can avoid deadlock and still fail this: the simulator matches by
    micro-batch, a send and a receive by the order they are posted). With chunks, each
    chunk's link to the next stage is its own."""
    plan = _normalised(schedule)
    ranks, chunks = len(plan), num_chunks_of(schedule)
    for stage in range(ranks * chunks - 1):
        here, there = (stage % ranks, stage // ranks), ((stage + 1) % ranks, (stage + 1) // ranks)
        for kind, (sender, s_chunk), (receiver, r_chunk), what in (
                ("F", here, there, "activations"), ("B", there, here, "gradients")):
            sent = [m for k, m, c in plan[sender] if k == kind and c == s_chunk]
            received = [m for k, m, c in plan[receiver] if k == kind and c == r_chunk]
            if sent != received:
                of = ((f" of chunk {s_chunk}", f" of chunk {r_chunk}") if chunks > 1
                      else ("", ""))
                raise OrderMismatch(
                    f"stage {sender}{of[0]} sends its {what} in the order {sent} but stage "
                    f"{receiver}{of[1]} receives them in the order {received}: a send and a "
                    f"receive pair up in the order they are posted, so both stages must run "
                    f"their {kind}s in the same order")


def posts(schedule: Sequence[Sequence[Action]], fused: bool = True) -> list[list[Post]]:
    """What each stage posts, in order, running its actions as the lesson's ``StageRunner``:
    an action's receive at its start (``("F", m)`` from the stage before, ``("B", m)`` from
    the stage after), its send at its end (the other way). ``fused``: a send is held back to
    the next action and posted in one batch with that action's receive when it comes from the
    same neighbour, else alone before it; otherwise every operation is posted alone."""
    last = len(schedule) - 1
    posted: list[list[Post]] = []
    for stage, actions in enumerate(_normalised(schedule)):
        mine: list[Post] = []
        held: Op | None = None
        for kind, m, _ in actions:
            receive = (Op("recv", stage - 1, f"F{m}'s activations") if kind == "F" and stage > 0
                       else Op("recv", stage + 1, f"B{m}'s gradient") if kind == "B"
                       and stage < last else None)
            if held is not None and (not fused or receive is None or receive.peer != held.peer):
                mine.append((held,))
                held = None
            if receive is not None:
                mine.append((held, receive) if held is not None else (receive,))
                held = None
            send = (Op("send", stage + 1, f"F{m}'s activations") if kind == "F" and stage < last
                    else Op("send", stage - 1, f"B{m}'s gradient") if kind == "B" and stage > 0
                    else None)
            held = send
        if held is not None:
            mine.append((held,))
        posted.append(mine)
    return posted


def check_links(posted: Sequence[Sequence[Post]]) -> None:
    """Raise :class:`UnsafeOrder` unless every pair of stages can complete what they post to
    each other, as NCCL runs point-to-point operations: those between two ranks one post after
    another, in the order they are posted (the operations of one post together), and a send
    complete only once its receive runs (a message larger than NCCL's buffer). The k-th send
    from a stage to another pairs with the other's k-th receive from it.

    ``posted[s]`` is stage s's posts in order (:func:`posts` derives them from a schedule; a
    test can record them from a real runner)."""
    pairs = {tuple(sorted((stage, op.peer))) for stage, mine in enumerate(posted)
             for post in mine for op in post}
    for a, b in sorted(pairs):
        queues = {}
        for me, peer in ((a, b), (b, a)):
            counts = {"send": 0, "recv": 0}
            queue = []
            for post in posted[me] if me < len(posted) else ():
                ops = []
                for op in post:
                    if op.peer != peer:
                        continue
                    sender, receiver = (me, peer) if op.kind == "send" else (peer, me)
                    ops.append(((sender, receiver, counts[op.kind]), op))
                    counts[op.kind] += 1
                if ops:
                    queue.append(ops)
            queues[me] = queue
        heads = {me: 0 for me in (a, b)}
        active = {me: dict(queues[me][0]) if queues[me] else {} for me in (a, b)}
        while active[a] or active[b]:
            common = active[a].keys() & active[b].keys()
            if not common:
                _refuse(a, b, active, queues, heads)
            for side in (a, b):
                for key in common:
                    del active[side][key]
                while not active[side] and heads[side] + 1 < len(queues[side]):
                    heads[side] += 1
                    active[side] = dict(queues[side][heads[side]])
                if not active[side]:
                    heads[side] = len(queues[side])


def _refuse(a: int, b: int, active: dict, queues: dict, heads: dict) -> None:
    def waiting(side: int) -> str:
        ops = " and ".join(str(op) for op in active[side].values())
        later = [str(op) for post in queues[side][heads[side] + 1:] for _, op in post]
        return f"stage {side} posts {ops}" + (f", and only after it {later[0]}" if later else "")

    if not active[a] or not active[b]:
        side = a if active[a] else b
        raise UnsafeOrder(f"{waiting(side)}, which stage {b if side == a else a} never posts "
                          f"the other half of")
    raise UnsafeOrder(
        f"{waiting(a)}; {waiting(b)}. On NCCL the operations between two ranks run one after "
        f"another and a send completes only once its receive runs: each stage's send waits for "
        f"a receive queued behind the other's send, a deadlock once the tensors outgrow NCCL's "
        f"buffer. Post a send in one batch with the next receive from the same neighbour "
        f"(dist.batch_isend_irecv), as torch's Schedule1F1B does")


PICTURES_DIR = Path(__file__).resolve().parents[2] / "docs" / "assets" / "pipeline"
# The lesson's pictures: 4 ranks, 8 micro-batches, a backward twice as long as a forward;
# interleaved 1F1B with 2 chunks per rank (each chunk's forward half a rank's).
PICTURES = {"gpipe.svg": ("gpipe", 4, 8, 1), "1f1b.svg": ("1f1b", 4, 8, 1),
            "interleaved.svg": ("interleaved", 4, 8, 2),
            "zero-bubble.svg": ("zero-bubble", 4, 8, 1)}
TITLES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved 1F1B",
          "zero-bubble": "Zero bubble (ZB-H1)"}


def pictures() -> dict[str, str]:
    """Each picture's file name and its SVG, drawn from the reference schedules."""
    drawn = {}
    for name, (kind, stages, micro_batches, chunks) in PICTURES.items():
        plan = reference_schedule(kind, stages, micro_batches, chunks)
        timeline = simulate(plan, micro_batches, posting="fused" if chunks == 1 else None)
        held = ", ".join(f"{timeline.peak_activations(s):g}" for s in range(stages))
        shape = (f"{stages} ranks x {chunks} chunks" if chunks > 1
                 else f"{stages} stages")
        drawn[name] = timeline.svg(f"{TITLES[kind]}: {shape}, {micro_batches} micro-batches; "
                                   f"activations held per {'rank' if chunks > 1 else 'stage'}: "
                                   f"{held}")
    return drawn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Draw the lesson's pipeline schedules.")
    parser.add_argument("--write", action="store_true", help="write docs/assets/pipeline/")
    parser.add_argument("--check", action="store_true", help="exit 1 if a picture is stale")
    args = parser.parse_args(argv)
    stale = []
    for name, svg in pictures().items():
        path = PICTURES_DIR / name
        if args.write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(svg, encoding="utf-8")
            print(f"wrote {path}")
        elif not path.is_file() or path.read_text(encoding="utf-8") != svg:
            stale.append(name)
    if args.check and stale:
        print(f"stale pictures {stale}: run "
              "`python lessons/07_pipeline_parallel/simulator.py --write`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
