"""Lesson 09, task9_2: SLURM's environment becomes the torchrun arguments every node of a job
agrees on: compressed node lists expanded as SLURM does, bad ones refused, a broken environment
refused naming the variable.

    pytest lessons/09_survive_and_scale_out -m task9_2
"""

from __future__ import annotations

import pytest

from harness.sweep import st, sweep
from lesson09.common import (
    BAD_ENVIRONMENTS,
    BAD_NODELISTS,
    BOTH_NAMES,
    ENVIRONMENTS,
    JOB,
    NODELISTS,
    UNPAIRED_BRACKETS,
    expected_args,
)

# The tables of cases (node lists good and bad, environments) are in common.py: the check of
# slurm_args.py, the batch script's own copy of the mapping, reads them too.

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task9_2": {
        "expand_nodelist: the host names, in order": [
            "test_node_lists_expand_as_slurm_does",
            "test_any_compressed_node_list_expands_to_its_hosts"],
        "commas separate hosts, except inside brackets": [
            "test_node_lists_expand_as_slurm_does",
            "test_any_compressed_node_list_expands_to_its_hosts"],
        "a bracket holds numbers and ranges a-b (a range of one number too)": [
            "test_node_lists_expand_as_slurm_does",
            "test_any_compressed_node_list_expands_to_its_hosts"],
        "a range keeps the width of its first number": [
            "test_node_lists_expand_as_slurm_does",
            "test_any_compressed_node_list_expands_to_its_hosts"],
        "several brackets expand to every combination": [
            "test_node_lists_expand_as_slurm_does",
            "test_any_compressed_node_list_expands_to_its_hosts"],
        "an empty list or a backwards range raises ValueError": [
            "test_bad_node_lists_are_refused"],
        "an empty host (a,,b; a trailing comma) raises ValueError": [
            "test_bad_node_lists_are_refused"],
        "brackets that do not pair up (unclosed, nested, ']' first) raise ValueError": [
            "test_bad_node_lists_are_refused",
            "test_brackets_that_do_not_pair_up_are_reported_as_such"],
        "the message of unpaired brackets says 'bracket'": [
            "test_brackets_that_do_not_pair_up_are_reported_as_such"],
        "a number in a bracket that is not plain digits raises ValueError": [
            "test_bad_node_lists_are_refused"],
        "slurm_to_torchrun: the five arguments, in this order": [
            "test_slurm_environments_become_torchrun_arguments"],
        "the node list's first host is the endpoint on every node": [
            "test_slurm_environments_become_torchrun_arguments",
            "test_every_node_of_a_job_gets_the_same_arguments"],
        "the port is MASTER_PORT when set": ["test_slurm_environments_become_torchrun_arguments"],
        "else 20000 + SLURM_JOB_ID % 10000": [
            "test_slurm_environments_become_torchrun_arguments",
            "test_two_jobs_do_not_share_a_port"],
        "the GPUs: nproc_per_node when given": ["test_every_node_of_a_job_gets_the_same_arguments"],
        "else SLURM_GPUS_ON_NODE": ["test_slurm_environments_become_torchrun_arguments"],
        "else the number at the end of SLURM_GPUS_PER_NODE: 'h100:4'": [
            "test_slurm_environments_become_torchrun_arguments"],
        "else the number at the end of SLURM_GPUS_PER_NODE: '4'": [
            "test_a_bare_gpus_per_node_count_is_the_gpu_count"],
        "SLURM_NNODES and SLURM_NODELIST are older names of the same two": [
            "test_slurm_environments_become_torchrun_arguments"],
        "the older name is read when the new one is not set or empty; both set: the new wins": [
            "test_the_new_name_of_a_variable_wins_over_the_old"],
        "a variable missing: ValueError naming it": [
            "test_a_broken_slurm_environment_names_the_variable"],
        "a node count that is not the node list's length: ValueError naming it": [
            "test_a_broken_slurm_environment_names_the_variable"],
        "more than one task on a node: ValueError naming the variable": [
            "test_a_broken_slurm_environment_names_the_variable"],
        "no GPU count at all: ValueError naming the variable": [
            "test_a_broken_slurm_environment_names_the_variable"],
        "SLURM_TASKS_PER_NODE's compressed counts read and checked": [
            "test_a_broken_slurm_environment_names_the_variable",
            "test_slurm_environments_become_torchrun_arguments"],
        "SLURM_NTASKS_PER_NODE checked too": [
            "test_a_broken_slurm_environment_names_the_variable"],
        "a tasks-per-node value not in that form: ValueError naming it": [
            "test_a_broken_slurm_environment_names_the_variable"],
    },
}


@pytest.mark.task9_2
@pytest.mark.parametrize("nodelist", NODELISTS)
def test_node_lists_expand_as_slurm_does(ex, nodelist):
    """`expand_nodelist` gives the hosts of each of 8 compressed node lists written out by hand:
    numbers and ranges in a bracket, a range keeping its width (`098`), several brackets in one
    host, hosts after a bracket, a range of one number."""
    got = ex.expand_nodelist(nodelist)
    assert got == NODELISTS[nodelist], (
        f"expand_nodelist({nodelist!r}) gave {got}, expected {NODELISTS[nodelist]} (commas "
        "inside brackets do not separate hosts; a range keeps its first number's width)")


# A host name as SLURM compresses it: literal text, then brackets of numbers and ranges, each a
# literal again after it; a range keeps the width of its first number.
LITERAL = st.text("abcdefghxyz-", min_size=1, max_size=4)
RANGE = st.tuples(st.integers(0, 120), st.integers(0, 12), st.integers(1, 3))  # low, span, width
BRACKET = st.lists(RANGE, min_size=1, max_size=3)
HOST = st.tuples(LITERAL, st.lists(st.tuples(BRACKET, st.text("abn-", max_size=2)), max_size=2))


def compressed(host) -> tuple[str, list[str]]:
    """A host spec as SLURM writes it, and the hosts it stands for (the oracle)."""
    head, brackets = host
    text, names = head, [head]
    for ranges, tail in brackets:
        inside, numbers = [], []
        for low, span, width in ranges:
            high = low + span
            first = str(low).zfill(width)
            inside.append(first if span == 0 else f"{first}-{str(high).zfill(width)}")
            numbers += [str(n).zfill(len(first)) for n in range(low, high + 1)]
        text += "[" + ",".join(inside) + "]" + tail
        names = [name + number + tail for name in names for number in numbers]
    return text, names


@pytest.mark.task9_2
@sweep(hosts=st.lists(HOST, min_size=1, max_size=4), max_examples=60)
def test_any_compressed_node_list_expands_to_its_hosts(ex, hosts):
    """`expand_nodelist` expands generated lists of 1 to 4 compressed hosts (text, then up to two
    brackets of up to three numbers or zero-padded ranges) to every combination, in order, against
    the hosts the generator built each list from."""
    parts = [compressed(host) for host in hosts]
    nodelist = ",".join(text for text, _ in parts)
    want = [name for _, names in parts for name in names]
    got = ex.expand_nodelist(nodelist)
    assert got == want, (
        f"expand_nodelist({nodelist!r}) gave {got[:12]}{' ...' if len(got) > 12 else ''}, "
        f"expected {want[:12]}{' ...' if len(want) > 12 else ''} (every combination of the "
        "brackets, in order; a range keeps its first number's width)")


@pytest.mark.task9_2
@pytest.mark.parametrize("nodelist", {**BAD_NODELISTS, **UNPAIRED_BRACKETS})
def test_bad_node_lists_are_refused(ex, nodelist):
    """`expand_nodelist` raises `ValueError` for every node list SLURM never writes in the lesson's
    table: empty or blank, a backwards range, an empty host, letters, a sign or a space in a
    bracket, an empty bracket, brackets that do not pair up."""
    what = {**BAD_NODELISTS, **UNPAIRED_BRACKETS}[nodelist]
    try:
        got = ex.expand_nodelist(nodelist)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
        raise AssertionError(
            f"expand_nodelist({nodelist!r}), {what}: raised {type(error).__name__}: {error}; "
            f"expected ValueError") from None
    raise AssertionError(f"expand_nodelist({nodelist!r}), {what}: returned {got}; it must "
                         f"raise ValueError")


@pytest.mark.task9_2
@pytest.mark.parametrize("nodelist", UNPAIRED_BRACKETS)
def test_brackets_that_do_not_pair_up_are_reported_as_such(ex, nodelist):
    """For brackets that do not pair up (unclosed, a `]` first or second, nested),
    `expand_nodelist`'s `ValueError` says "bracket"."""
    try:
        ex.expand_nodelist(nodelist)
    except ValueError as error:
        caught = error
    else:
        caught = None
    assert caught is not None, (
        f"expand_nodelist({nodelist!r}), {UNPAIRED_BRACKETS[nodelist]}: no ValueError")
    assert "bracket" in str(caught).lower(), (
        f"expand_nodelist({nodelist!r}), {UNPAIRED_BRACKETS[nodelist]}: the ValueError says "
        f"{str(caught)!r}. Say that the brackets do not pair up (the word 'bracket'): count "
        f"them as you go, a ']' with no '[' open or a '[' inside one is the fault, not a range "
        f"or a host it leaves behind")


@pytest.mark.task9_2
@pytest.mark.parametrize("case", ENVIRONMENTS)
def test_slurm_environments_become_torchrun_arguments(ex, case):
    """`slurm_to_torchrun` gives the five `torchrun` arguments, in order, for 5 emulated
    environments: two nodes of four GPUs, the older variable names, `SLURM_GPUS_PER_NODE=h100:8`, a
    `MASTER_PORT` set by the script, one task per node said only as `SLURM_TASKS_PER_NODE=1(x2)`.
    """
    env, want = ENVIRONMENTS[case]
    got = ex.slurm_to_torchrun(env)
    hint = ""
    if len(got) == len(want) and got[:-1] == want[:-1] and got[-1].split(":")[0] == \
            want[-1].split(":")[0]:
        hint = (" Only the port differs: MASTER_PORT when set, else 20000 + SLURM_JOB_ID % "
                "10000 (one fixed port collides when two jobs share a node).")
    assert got == want, f"{case}: slurm_to_torchrun gave {got}, expected {want}.{hint}"


@pytest.mark.task9_2
def test_every_node_of_a_job_gets_the_same_arguments(ex):
    """The 4 nodes of one job, each with its own host name, node id and task rank, get the same
    arguments (the endpoint is the node list's first host); `nproc_per_node=2`, when given, is the
    process count."""
    nodes = ex.expand_nodelist("node[01-04]")
    answers = {}
    for node_id, host in enumerate(nodes):
        env = {**JOB, "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "node[01-04]",
               "SLURMD_NODENAME": host, "SLURM_NODEID": str(node_id),
               "SLURM_PROCID": str(node_id), "HOSTNAME": host}
        answers[host] = ex.slurm_to_torchrun(env)
    assert len({tuple(a) for a in answers.values()}) == 1, (
        f"the nodes of one job got different arguments: {answers}. Every node must meet at "
        "the same endpoint: the node list's first host, not the node it runs on")
    assert ex.slurm_to_torchrun(JOB, nproc_per_node=2)[1] == "--nproc-per-node=2", (
        "nproc_per_node, when given, is the number of processes per node")


@pytest.mark.task9_2
def test_two_jobs_do_not_share_a_port(ex):
    """Jobs 4242 and 4243 get different rendezvous ports: the port comes from `SLURM_JOB_ID`."""
    ports = {job: ex.slurm_to_torchrun({**JOB, "SLURM_JOB_ID": str(job)})[-1].rsplit(":", 1)[1]
             for job in (4242, 4243)}
    assert ports[4242] != ports[4243], (
        f"jobs 4242 and 4243 both rendezvous on port {ports[4242]}: two jobs sharing a node "
        "would collide; derive the port from SLURM_JOB_ID (20000 + id % 10000)")


@pytest.mark.task9_2
def test_a_bare_gpus_per_node_count_is_the_gpu_count(ex):
    """`SLURM_GPUS_PER_NODE=4`, a bare count, without `SLURM_GPUS_ON_NODE`, gives
    `--nproc-per-node=4`, as `h100:4` would.

    --gpus-per-node=4 sets SLURM_GPUS_PER_NODE to "4", --gpus-per-node=h100:4 to "h100:4"."""
    env = {**{k: v for k, v in JOB.items() if k != "SLURM_GPUS_ON_NODE"},
           "SLURM_GPUS_PER_NODE": "4"}
    try:
        got = ex.slurm_to_torchrun(env)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
        raise AssertionError(
            f"SLURM_GPUS_PER_NODE='4' (no SLURM_GPUS_ON_NODE): slurm_to_torchrun raised "
            f"{type(error).__name__}: {error}. The GPU count is the number at the end of it, "
            f"'4' as much as 'h100:4'") from None
    assert got == expected_args(2, 4, 4242, "node01:24242"), (
        f"SLURM_GPUS_PER_NODE='4' (no SLURM_GPUS_ON_NODE): slurm_to_torchrun gave {got}; the "
        f"GPU count is the number at the end of it, 4")


@pytest.mark.task9_2
@pytest.mark.parametrize("case", BOTH_NAMES)
def test_the_new_name_of_a_variable_wins_over_the_old(ex, case):
    """With both `SLURM_JOB_NODELIST` and `SLURM_NODELIST` set, or both `SLURM_JOB_NUM_NODES` and
    `SLURM_NNODES`, the new name wins; with the new one empty, the old one is read."""
    env, want = BOTH_NAMES[case]
    try:
        got = ex.slurm_to_torchrun(env)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - reported to the learner
        got = f"{type(error).__name__}: {error}"
    assert got == want, (
        f"{case}: slurm_to_torchrun gave {got}, expected {want}. Read SLURM_JOB_NODELIST and "
        f"SLURM_JOB_NUM_NODES first; the older SLURM_NODELIST and SLURM_NNODES only when the "
        f"new name is not set or empty")


@pytest.mark.task9_2
@pytest.mark.parametrize("case", BAD_ENVIRONMENTS)
def test_a_broken_slurm_environment_names_the_variable(ex, case):
    """Each of 9 broken environments raises a `ValueError` naming the variable at fault: no node
    list, job id or GPU count, a node count other than the list's, more than one task on a node (as
    a count or compressed), a task count not in SLURM's form."""
    variable, env = BAD_ENVIRONMENTS[case]
    try:
        got = ex.slurm_to_torchrun(env)
    except ValueError as error:
        caught = error
    else:
        raise AssertionError(
            f"{case} ({variable}={env.get(variable, '<not set>')}): slurm_to_torchrun returned "
            f"{got}; raise ValueError naming {variable}")
    assert variable in str(caught), (
        f"the ValueError must name {variable}, which is what is wrong here; it said "
        f"{str(caught)!r}")
