"""Lesson 09, task9_4: first_mismatch reads every rank's flight-recorder entries and names the
first collective the ranks disagree on. Swept over generated records with one planted
divergence, then each clause alone; and once on a real recording of gloo ranks.

    pytest lessons/09_survive_and_scale_out -m task9_4
"""

from __future__ import annotations

import datetime
import pickle

import pytest
import torch
import torch.distributed as dist

from harness.exercises import raise_if_untouched
from harness.ranks import run_on_ranks
from harness.sweep import st, sweep

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task9_4": {
        "within a group, every member records the same collective under each sequence id": [
            "test_first_mismatch_finds_the_planted_divergence",
            "test_first_mismatch_compares_sequence_ids_not_positions"],
        "the same profiling_name and input_sizes": [
            "test_first_mismatch_finds_the_planted_divergence",
            "test_first_mismatch_compares_the_sizes_too"],
        "a member with no entry under an id another recorded has missed it": [
            "test_first_mismatch_finds_the_planted_divergence",
            "test_first_mismatch_names_a_stuck_rank"],
        "an id older than a member's oldest entry of the group is unknown, not missed": [
            "test_first_mismatch_finds_the_planted_divergence",
            "test_first_mismatch_treats_dropped_entries_as_unknown"],
        "sends and receives (operation send or recv) are not compared": [
            "test_first_mismatch_finds_the_planted_divergence",
            "test_first_mismatch_ignores_sends_and_receives"],
        "groups: each group's members; otherwise every rank of records": [
            "test_first_mismatch_finds_the_planted_divergence",
            "test_first_mismatch_counts_only_a_groups_members"],
        "None when every group agrees": ["test_first_mismatch_is_none_when_the_ranks_agree"],
        "a rank's first entry under an id counts": [
            "test_first_mismatch_takes_a_ranks_first_entry_under_an_id"],
        "a member with no entry of the group at all has missed all of them": [
            "test_first_mismatch_counts_a_member_without_records_as_missing_all"],
        "the smallest sequence id first; between groups, the name that sorts first (string)": [
            "test_first_mismatch_takes_the_smallest_sequence_id_then_the_group_name"],
        "the result: process_group, seq_id, calls; sizes as tuples; unknown members left out": [
            "test_first_mismatch_finds_the_planted_divergence",
            "test_first_mismatch_treats_dropped_entries_as_unknown"],
    },
}

OPS = ("gloo:all_reduce", "gloo:broadcast", "gloo:all_gather", "gloo:reduce_scatter")
SIZES = ([[4]], [[2, 3]], [[8], [8]])


def entry(group: str, seq: int, op: str = "gloo:all_reduce", sizes=([4],), p2p: int = 0) -> dict:
    """One flight-recorder entry, with the keys a real dump has. ``p2p``: the rank's count of
    sends and receives so far, which the recorder stores on every entry, collectives too."""
    return {"record_id": 0, "process_group": (group, "default_pg" if group == "0" else "undefined"),
            "collective_seq_id": seq, "p2p_seq_id": p2p, "op_id": seq, "profiling_name": op,
            "input_sizes": [list(size) for size in sizes], "state": "scheduled"}


def send(seq: int, op: str, p2p: int = 1) -> dict:
    """A send or a receive as NCCL records it: a name with the peers, its p2p_seq_id (``p2p``),
    and as collective_seq_id the rank's count of collectives so far (any number here)."""
    name = {"send": "nccl:send 0->1", "recv": "nccl:recv 1<-0"}[op.split(":")[-1]]
    return entry("0", seq, name, p2p=p2p)


def is_send(item: dict) -> bool:
    """A send or a receive: what send() makes (nccl:send, nccl:recv); entry() makes gloo:..."""
    return item["profiling_name"].startswith("nccl:")


def number_sends(records: dict) -> None:
    """Set every entry's p2p_seq_id to its rank's count of sends and receives up to it."""
    for entries in records.values():
        count = 0
        for item in entries:
            count += is_send(item)
            item["p2p_seq_id"] = count


def call(op: str = "gloo:all_reduce", sizes=([4],)) -> tuple:
    return (op, tuple(tuple(size) for size in sizes))


def grade(ex, records: dict, groups=None, *, expected, why: str) -> None:
    got = ex.first_mismatch(records, groups) if groups is not None else ex.first_mismatch(records)
    if got != expected:
        raise AssertionError(
            f"first_mismatch({'records, groups' if groups is not None else 'records'}) returned "
            f"{got!r}; expected {expected!r}: {why}.\nThe records, rank -> (group, seq id, "
            f"name, sizes):\n" + "\n".join(
                f"  rank {rank}: " + ", ".join(
                    f"({e['process_group'][0]}, {e['collective_seq_id']}, {e['profiling_name']},"
                    f" {e['input_sizes']})" for e in entries) for rank, entries in records.items()))


# ----------------------------------------------------------------------------- each clause alone


@pytest.mark.task9_4
def test_first_mismatch_is_none_when_the_ranks_agree(ex):
    """`first_mismatch` returns `None` for 3 ranks that recorded the same collectives in two
    groups, and for 2 ranks that recorded nothing."""
    agreeing = [entry("0", 1), entry("1", 1, "gloo:broadcast"), entry("0", 2, sizes=([2, 2],))]
    grade(ex, {0: agreeing, 1: list(agreeing), 2: list(agreeing)}, expected=None,
          why="every rank recorded the same collectives under the same sequence ids")
    grade(ex, {0: [], 1: []}, expected=None, why="nothing was recorded")


@pytest.mark.task9_4
def test_first_mismatch_compares_sequence_ids_not_positions(ex):
    """Two ranks that issued the same collectives of two groups, interleaved in another order,
    agree: `first_mismatch` matches sequence id with sequence id, not entry with entry."""
    records = {0: [entry("0", 1), entry("1", 1, "gloo:broadcast"), entry("0", 2)],
               1: [entry("1", 1, "gloo:broadcast"), entry("0", 1), entry("0", 2)]}
    grade(ex, records, expected=None,
          why="the two ranks issued the same collectives in each group, in another order "
              "between the groups: sequence ids count per group; compare id with id, not the "
              "n-th entry with the n-th")


@pytest.mark.task9_4
def test_first_mismatch_compares_the_sizes_too(ex):
    """An all-reduce of 4 elements on rank 0 and of 5 on rank 1 is a mismatch: `first_mismatch`
    names collective 2 and both calls, their sizes as tuples."""
    records = {0: [entry("0", 1), entry("0", 2, sizes=([4],))],
               1: [entry("0", 1), entry("0", 2, sizes=([5],))]}
    grade(ex, records,
          expected={"process_group": "0", "seq_id": 2,
                    "calls": {0: call(sizes=([4],)), 1: call(sizes=([5],))}},
          why="collective 2 is an all_reduce of 4 elements on rank 0 and of 5 on rank 1: the "
              "same operation with other sizes is a mismatch (input_sizes must agree too)")


@pytest.mark.task9_4
def test_first_mismatch_names_a_stuck_rank(ex):
    """Of 3 ranks, the one whose only entry is collective 1 missed collective 2: `first_mismatch`
    names id 2, with that rank's call `None`."""
    records = {0: [entry("0", 1), entry("0", 2), entry("0", 3)],
               1: [entry("0", 1), entry("0", 2), entry("0", 3)],
               2: [entry("0", 1)]}
    grade(ex, records,
          expected={"process_group": "0", "seq_id": 2,
                    "calls": {0: call(), 1: call(), 2: None}},
          why="rank 2 never issued collective 2 (it is stuck after its first): it missed it, "
              "its call is None")


@pytest.mark.task9_4
def test_first_mismatch_treats_dropped_entries_as_unknown(ex):
    """A rank whose buffer kept only collectives 4 and 5 agrees with two ranks holding 1 to 5; when
    those two differ at collective 3, it is left out of the calls, unknown, not missed."""
    full = [entry("0", seq, OPS[seq % 2]) for seq in range(1, 6)]
    records = {0: full, 1: full[3:], 2: list(full)}  # rank 1 kept only its 2 newest entries
    grade(ex, records, expected=None,
          why="rank 1's buffer dropped collectives 1 to 3 (its oldest entry is 4): they are "
              "unknown, not missed")
    records[2] = full[:2] + [entry("0", 3, "gloo:all_gather")] + full[3:]
    grade(ex, records,
          expected={"process_group": "0", "seq_id": 3,
                    "calls": {0: call(OPS[1]), 2: call("gloo:all_gather")}},
          why="rank 2 recorded an all_gather as collective 3, rank 0 a broadcast; rank 1 no "
              "longer holds collective 3 (its oldest is 4), so it is left out of calls")


@pytest.mark.task9_4
def test_first_mismatch_takes_a_ranks_first_entry_under_an_id(ex):
    """A rank with two entries under sequence id 2, an all-reduce then a broadcast, is compared by
    its first: it agrees with a rank that issued the all-reduce."""
    records = {0: [entry("0", 1), entry("0", 2), entry("0", 2, "gloo:broadcast")],
               1: [entry("0", 1), entry("0", 2)]}
    grade(ex, records, expected=None,
          why="rank 0 holds two entries under id 2: its first, an all_reduce, counts, and it "
              "is rank 1's too")


@pytest.mark.task9_4
def test_first_mismatch_counts_a_member_without_records_as_missing_all(ex):
    """A member of group `1` (named in `groups`) with no entry at all has missed the group's
    collective 1: its call is `None`."""
    records = {0: [entry("0", 1), entry("1", 1)], 1: [entry("0", 1), entry("1", 1)]}
    grade(ex, records, {"0": [0, 1], "1": [0, 1, 2]},
          expected={"process_group": "1", "seq_id": 1, "calls": {0: call(), 1: call(), 2: None}},
          why="rank 2 is a member of group '1' (groups says so) but has no entry at all: it "
              "missed the group's collective 1")


@pytest.mark.task9_4
def test_first_mismatch_ignores_sends_and_receives(ex):
    # A pipeline's first exchange: rank 0 sends, rank 1 receives, before any collective (the
    # recorder numbers them with the collectives so far: 0).
    """`first_mismatch` finds no mismatch between 2 ranks that differ only in a send and a receive
    (named `nccl:send`, `nccl:recv`), before the first collective or between two, whatever their
    `collective_seq_id`."""
    records = {0: [send(0, "send"), entry("0", 1), entry("0", 2)],
               1: [send(0, "recv"), entry("0", 1), entry("0", 2)]}
    number_sends(records)
    grade(ex, records, expected=None,
          why="the entries named nccl:send and nccl:recv are sends and receives, numbered "
              "apart (p2p_seq_id): they are not compared, whatever their collective_seq_id")
    records = {0: [entry("0", 1), send(1, "send"), entry("0", 2)],
               1: [entry("0", 1), entry("0", 2), send(2, "recv")]}
    number_sends(records)  # rank 0's collective 2 comes after a send: its p2p_seq_id is 1
    grade(ex, records, expected=None,
          why="sends and receives, numbered apart, are told by their name (send, recv): a "
              "collective after one carries a p2p_seq_id too, and is still compared")


@pytest.mark.task9_4
def test_first_mismatch_counts_only_a_groups_members(ex):
    """With `groups` giving group `1` ranks 0 and 1, a rank 2 without its collectives is no
    mismatch; with `groups` silent on group `1`, its members are every rank of the records, and
    rank 2 missed collective 1."""
    records = {0: [entry("0", 1), entry("1", 1), entry("1", 2)],
               1: [entry("0", 1), entry("1", 1), entry("1", 2)],
               2: [entry("0", 1)]}
    grade(ex, records, {"0": [0, 1, 2], "1": [0, 1]}, expected=None,
          why="group '1' has ranks 0 and 1 only (groups says so): rank 2 is not missing its "
              "collectives")
    grade(ex, records, {"0": [0, 1, 2]},
          expected={"process_group": "1", "seq_id": 1, "calls": {0: call(), 1: call(), 2: None}},
          why="groups does not name group '1': its members are every rank of records, and "
              "rank 2 recorded none of its collectives")


@pytest.mark.task9_4
def test_first_mismatch_takes_the_smallest_sequence_id_then_the_group_name(ex):
    """Of two groups that disagree, `first_mismatch` reports the smaller sequence id, and at the
    same id the group whose name sorts first as a string (`10` before `9`)."""
    records = {0: [entry("1", 1), entry("1", 2, "gloo:broadcast"), entry("0", 1),
                   entry("0", 2, "gloo:broadcast"), entry("0", 3, "gloo:broadcast")],
               1: [entry("1", 1), entry("1", 2), entry("0", 1), entry("0", 2), entry("0", 3)]}
    grade(ex, records,
          expected={"process_group": "0", "seq_id": 2,
                    "calls": {0: call("gloo:broadcast"), 1: call()}},
          why="groups '0' and '1' both disagree first at sequence id 2: between groups, the "
              "name that sorts first ('0'), whatever the order of the entries")
    records[1][3] = entry("0", 2, "gloo:broadcast")  # group '0' now agrees at 2, not at 3
    grade(ex, records,
          expected={"process_group": "1", "seq_id": 2,
                    "calls": {0: call("gloo:broadcast"), 1: call()}},
          why="group '1' disagrees at sequence id 2 and group '0' only at 3: the smallest id "
              "first, whatever the group's name")
    records = {rank: [entry(name, 1, "gloo:broadcast" if rank else "gloo:all_reduce")
                      for name in ("9", "10")] for rank in (0, 1)}
    grade(ex, records,
          expected={"process_group": "10", "seq_id": 1,
                    "calls": {0: call(), 1: call("gloo:broadcast")}},
          why="groups '9' and '10' both disagree at id 1: as strings, '10' sorts first")


# ----------------------------------------------------------------------------- the sweep
# After the clause tests, which name the mistake; the sweep then catches the rest.


@st.composite
def planted(draw):
    """Records of W ranks with one planted divergence, and the answer (known by construction).

    The ranks first agree on a program of collectives in the default group "0" and, when
    drawn, a subgroup "1". Then, in one group, some members (not all) diverge: they miss the
    next collective (and record nothing more: stuck), or record another operation, or other
    sizes. After it the diverging group alone goes on; sends and receives (with any
    collective_seq_id, different on every rank) are sprinkled in; and some ranks' oldest
    entries are dropped, as a full buffer does, never so many that the divergence becomes
    unknown.
    """
    world = draw(st.integers(2, 5))
    ranks = list(range(world))
    groups = {"0": ranks}
    if draw(st.booleans()):
        groups["1"] = sorted(draw(st.sets(st.sampled_from(ranks), min_size=2, max_size=world)))
    program = draw(st.lists(st.tuples(st.sampled_from(sorted(groups)), st.sampled_from(OPS),
                                      st.sampled_from(SIZES)), max_size=6))
    records: dict[int, list[dict]] = {rank: [] for rank in ranks}
    seq = {name: 0 for name in groups}
    for group, op, sizes in program:
        seq[group] += 1
        for rank in groups[group]:
            records[rank].append(entry(group, seq[group], op, sizes))
    group = draw(st.sampled_from(sorted(groups)))
    members = groups[group]
    odd = draw(st.sets(st.sampled_from(members), min_size=1, max_size=len(members) - 1))
    kind = draw(st.sampled_from(("missed", "op", "sizes")))
    op, sizes = draw(st.sampled_from(OPS)), draw(st.sampled_from(SIZES))
    other_op = draw(st.sampled_from([o for o in OPS if o != op]))
    other_sizes = draw(st.sampled_from([s for s in SIZES if s != sizes]))
    seq[group] += 1
    at = seq[group]
    calls = {}
    for rank in members:
        if rank in odd and kind == "missed":
            calls[rank] = None
            continue
        mine = (other_op if kind == "op" else op, other_sizes if kind == "sizes" else sizes)
        if rank not in odd:
            mine = (op, sizes)
        records[rank].append(entry(group, at, *mine))
        calls[rank] = call(*mine)
    for rank in members:  # the group goes on, each rank its own way: seq ids above the first
        if calls[rank] is not None:
            for later in range(draw(st.integers(0, 2))):
                records[rank].append(entry(group, at + 1 + later, draw(st.sampled_from(OPS))))
    for rank in ranks:  # sends and receives, never compared
        for _ in range(draw(st.integers(0, 2))):
            where = draw(st.integers(0, len(records[rank])))
            records[rank].insert(where, send(draw(st.integers(0, 9)),
                                             draw(st.sampled_from(("send", "recv")))))
    number_sends(records)
    for rank in ranks:  # a full buffer: the oldest entries are gone
        entries = records[rank]
        same_group = [i for i, e in enumerate(entries)
                      if e["process_group"][0] == group and not is_send(e)]
        # Keep the divergent entry, or for a rank that missed it its last entry of the group.
        keep = [i for i in same_group if entries[i]["collective_seq_id"] >= at]
        limit = keep[0] if keep else (same_group[-1] if same_group else 0)
        for other in groups:  # and the last entry of every other group it is in: a member
            last = [i for i, e in enumerate(entries)  # with none at all would have missed all
                    if e["process_group"][0] == other and not is_send(e)]
            if other != group and last:
                limit = min(limit, last[-1])
        records[rank] = entries[draw(st.integers(0, limit)):]
    return records, groups, {"process_group": group, "seq_id": at, "calls": calls}, kind


@pytest.mark.task9_4
@sweep(case=planted(), max_examples=80)
def test_first_mismatch_finds_the_planted_divergence(ex, case):
    """`first_mismatch` finds the one divergence planted in generated records of 2 to 5 ranks
    (members that miss a collective, another operation, other sizes), with a subgroup, sends and
    receives and dropped oldest entries; the answer is known by construction."""
    records, groups, expected, kind = case
    planted_as = {"missed": "members that missed it", "op": "a different operation",
                  "sizes": "different sizes"}[kind]
    grade(ex, records, groups, expected=expected,
          why=f"the first disagreement is group {expected['process_group']!r}'s collective "
              f"{expected['seq_id']}: {planted_as} ({expected['calls']})")


# ----------------------------------------------------------------------------- a real recording


def recording_on_rank(ctx) -> dict:
    """Two collectives of a new subgroup on every rank, then a third that only rank 0 issues
    (it times out within a second); every rank's flight-recorder entries of that subgroup."""
    group = dist.new_group(list(range(ctx.world_size)),
                           timeout=datetime.timedelta(seconds=1))
    tensor = torch.ones(4)
    dist.all_reduce(tensor, group=group)
    dist.broadcast(tensor, 0, group=group)
    error = None
    if ctx.rank == 0:
        try:
            dist.all_reduce(tensor, group=group)  # nobody else comes: a timeout
        except RuntimeError as raised:
            error = str(raised).splitlines()[0]
    dist.barrier()
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    names = {e["process_group"][0] for e in dump["entries"]}
    dist.destroy_process_group(group)
    return {"entries": dump["entries"], "names": sorted(names), "error": error,
            "group": group.group_name}


@pytest.mark.task9_4
def test_first_mismatch_reads_a_real_recording_of_gloo_ranks(ex):
    """On a real recording of 2 gloo ranks, a subgroup's all-reduce and broadcast on both, then a
    third all-reduce on rank 0 alone (timed out after 1 s), `first_mismatch` names sequence id 3,
    rank 1's call `None`; skipped on a torch whose flight recorder records nothing by default."""
    raise_if_untouched(ex.first_mismatch)  # not attempted: no ranks
    results = run_on_ranks(recording_on_rank, timeout=30)
    group = results[0]["group"]
    records = {rank: [e for e in r["entries"] if e["process_group"][0] == group]
               for rank, r in enumerate(results)}
    if not all(records.values()):
        pytest.skip(f"this torch ({torch.__version__}) recorded no gloo collective: its flight "
                    f"recorder is off by default (set TORCH_FR_BUFFER_SIZE)")
    assert results[0]["error"], "rank 0's lone all_reduce should have timed out"
    grade(ex, records, expected={"process_group": group, "seq_id": 3,
                                 "calls": {0: call(), 1: None}},
          why=f"on real gloo ranks, both issued an all_reduce and a broadcast in group {group!r}, "
              f"then only rank 0 a third collective, an all_reduce")
