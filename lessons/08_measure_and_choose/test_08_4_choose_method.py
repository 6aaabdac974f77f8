"""Lesson 08, task8_4: ``choose_method``: the decision follows the README's table row by row (the
test reads the table), exactly full counts as fitting, nonsense is refused, and the error
says the bytes the smallest option needs. Plain calls.

    pytest lessons/08_measure_and_choose -m task8_4
"""

from __future__ import annotations

import re

import pytest

from harness.exercises import raise_if_untouched
from harness.sweep import st, sweep
from lesson08.common import GB, assert_refuses, readme_cases

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task8_4": {
        "'one device' when num_gpus is 1 and 4 x model + activations fit": [
            "test_choose_method_follows_the_table_of_the_text",
            "test_choose_method_counts_exactly_full_as_fitting"],
        "'ddp': the same, on every GPU": [
            "test_choose_method_follows_the_table_of_the_text",
            "test_choose_method_counts_exactly_full_as_fitting"],
        "'fsdp': 4 x model / num_gpus + activations": [
            "test_choose_method_follows_the_table_of_the_text",
            "test_choose_method_counts_exactly_full_as_fitting"],
        "activations split gpus_per_node ways: 'tp+fsdp' over NVLink": [
            "test_choose_method_follows_the_table_of_the_text"],
        "activations split gpus_per_node ways: 'pp+fsdp' over PCIe": [
            "test_choose_method_follows_the_table_of_the_text",
            "test_choose_method_counts_exactly_full_as_fitting"],
        "activations split num_gpus ways: 'cp+tp+fsdp' over NVLink": [
            "test_choose_method_follows_the_table_of_the_text",
            "test_choose_method_counts_exactly_full_as_fitting",
            "test_choose_method_is_the_tables_first_fit_on_generated_clusters"],
        "activations split num_gpus ways: 'cp+fsdp' over PCIe": [
            "test_choose_method_follows_the_table_of_the_text",
            "test_choose_method_counts_exactly_full_as_fitting",
            "test_choose_method_is_the_tables_first_fit_on_generated_clusters"],
        "moe=True: 1 and 2 stay, 3 to 5 split the experts, 'ep+' in front of the name": [
            "test_choose_method_follows_the_table_of_the_text",
            "test_choose_method_counts_exactly_full_as_fitting",
            "test_choose_method_is_the_tables_first_fit_on_generated_clusters"],
        "in order, the first that fits in gpu_memory (exactly full fits)": [
            "test_choose_method_follows_the_table_of_the_text",
            "test_choose_method_counts_exactly_full_as_fitting"],
        "nothing fits, or one GPU too small: ValueError": [
            "test_choose_method_follows_the_table_of_the_text"],
        "the ValueError says how many bytes the smallest option needs": [
            "test_choose_method_errors_say_the_bytes_the_smallest_option_needs"],
        "arguments that are not positive raise ValueError": ["test_choose_method_refuses_nonsense"],
        "gpus_per_node that does not divide num_gpus raises ValueError": [
            "test_choose_method_refuses_nonsense"],
        "an unknown link raises ValueError": ["test_choose_method_refuses_nonsense"],
    },
}


@pytest.mark.task8_4
@pytest.mark.parametrize("case", readme_cases(), ids=lambda case: case["case"])
def test_choose_method_follows_the_table_of_the_text(ex, case):
    """`choose_method` gives the method of every row of the README's decision table, read from the
    README by the test: dense models and mixtures of experts, NVLink and PCIe, one GPU to 8 nodes;
    where the row says error, a ValueError whose message holds a number."""
    arguments = {k: v for k, v in case.items() if k not in ("case", "method")}
    shown = ", ".join(f"{k}={v}" for k, v in arguments.items())
    if case["method"] == "error":
        error = assert_refuses(ex.choose_method, list(arguments.values()),
                               f"{case['case']}: in the table nothing fits (each GPU holds "
                               f"4 x the weights, AdamW's training state, plus activations)")
        assert re.search(r"\d", str(error)), (
            f"{case['case']}: the error {str(error)!r} should say how many bytes are needed")
        return
    try:
        got = ex.choose_method(**arguments)
    except ValueError as err:
        got = f"ValueError ({err})"
    assert got == case["method"], (
        f"{case['case']}: choose_method({shown}) returned {got!r}; the table says "
        f"{case['method']!r}. Each GPU holds 4 x the weights (AdamW: weights, gradients, two "
        f"moments), divided by the GPUs when sharded, plus its activations (divided by the GPUs "
        f"of a node with tensor or pipeline parallelism, by all the GPUs only with context "
        f"parallelism across the nodes as well); for a mixture of experts (moe=True), the rows "
        f"past DDP split the experts by expert parallelism: 'ep+' in front of their names")


def first_fit(model: int, activations: int, memory: int, gpus: int, per_node: int,
              link: str, moe: bool) -> str | None:
    """The README's table, read as its text says: the first row whose bytes per GPU fit."""
    nvlink = link == "nvlink"
    ep = "ep+" if moe else ""
    rows = [("one device" if gpus == 1 else "ddp", 4 * model + activations)]
    if gpus > 1:
        rows += [(ep + "fsdp", 4 * model / gpus + activations),
                 (ep + ("tp+fsdp" if nvlink else "pp+fsdp"),
                  4 * model / gpus + activations / per_node),
                 (ep + ("cp+tp+fsdp" if nvlink else "cp+fsdp"), (4 * model + activations) / gpus)]
    return next((method for method, need in rows if need <= memory), None)


@pytest.mark.task8_4
@sweep(max_examples=60, nodes=st.integers(1, 8), per_node=st.sampled_from([1, 2, 4, 8]),
       model=st.integers(1, 64), activations=st.integers(0, 512),
       memory=st.integers(1, 512), link=st.sampled_from(["nvlink", "pcie"]), moe=st.booleans())
def test_choose_method_is_the_tables_first_fit_on_generated_clusters(
        ex, nodes, per_node, model, activations, memory, link, moe):
    """`choose_method` is the table's first row that fits, or a ValueError where none does, on 60
    generated clusters: 1 to 8 nodes of 1, 2, 4 or 8 GPUs, NVLink or PCIe, dense or a mixture of
    experts, against the table's rows written in the test.

    The sizes are in units that every split divides exactly, so no rounding decides a boundary."""
    gpus = nodes * per_node
    unit = 64 * 8  # every count of GPUs here divides it
    arguments = (model * unit, activations * unit, memory * unit // 4, gpus, per_node, link, moe)
    want = first_fit(*arguments)
    if want is None:
        assert_refuses(ex.choose_method, arguments, f"choose_method{arguments}: no row of the "
                       "table fits")
        return
    try:
        got = ex.choose_method(*arguments)
    except ValueError as err:
        got = f"ValueError ({err})"
    assert got == want, (
        f"choose_method{arguments} returned {got!r}; the table's first row that fits is "
        f"{want!r} (each GPU: 4 x weights / GPUs when sharded; activations / GPUs of a node with "
        f"tp or pp, / all GPUs with cp across the nodes too; moe=True puts 'ep+' in front of "
        f"every row past DDP)")


@pytest.mark.task8_4
@pytest.mark.parametrize("arguments", [(GB, GB, 0, 8, 8, "nvlink"), (GB, GB, 80 * GB, 8, 8, "ib"),
                                       (GB, GB, 80 * GB, 12, 8, "nvlink"),
                                       (0, GB, 80 * GB, 8, 8, "nvlink"),
                                       (GB, GB, 80 * GB, 0, 8, "nvlink"),
                                       (GB, GB, 80 * GB, 8, 0, "nvlink"),
                                       (GB, -1, 80 * GB, 8, 8, "nvlink")],
                         ids=["no memory", "unknown link", "not whole nodes", "no model",
                              "no GPUs", "no GPUs per node", "negative activations"])
def test_choose_method_refuses_nonsense(ex, arguments):
    """`choose_method` raises ValueError for nonsense: no GPU memory, an unknown link, GPUs that are
    not whole nodes, no model, no GPUs, no GPUs per node, negative activations."""
    assert_refuses(ex.choose_method, arguments, "sizes and counts must be positive "
                   "(activation_bytes may be 0), the link known, the GPUs whole nodes")


# (model, activations, memory, GPUs, per node, link) -> method: each row exactly at its limit
BOUNDARIES = [
    ((GB, GB, 5 * GB, 1, 1, "nvlink"), "one device", "4 x 1 GB + 1 GB is exactly 5 GB"),
    ((GB, 0, 4 * GB, 1, 1, "nvlink"), "one device", "no activations at all fit (0 is allowed)"),
    ((GB, GB, 5 * GB, 2, 2, "nvlink"), "ddp", "4 x 1 GB + 1 GB is exactly 5 GB on each GPU"),
    ((2 * GB, GB, 2 * GB, 8, 8, "nvlink"), "fsdp", "8 GB / 8 + 1 GB is exactly 2 GB"),
    ((GB, GB, 3 * GB, 2, 2, "nvlink"), "fsdp", "on two GPUs, 4 GB / 2 + 1 GB is exactly 3 GB"),
    ((2 * GB, 8 * GB, 2 * GB, 8, 8, "pcie"), "pp+fsdp", "8 GB / 8 + 8 GB / 8 is exactly 2 GB"),
    ((GB, 12 * GB, GB, 16, 8, "nvlink"), "cp+tp+fsdp",
     "(4 GB + 12 GB) / 16 is exactly 1 GB, where 4 GB / 16 + 12 GB / 8 is 1.75 GB"),
    ((GB, 12 * GB, GB, 16, 8, "pcie"), "cp+fsdp", "(4 GB + 12 GB) / 16 is exactly 1 GB"),
    ((GB, GB, 5 * GB, 2, 2, "nvlink", True), "ddp",
     "a mixture of experts that fits whole on each GPU (4 x 1 GB + 1 GB is exactly 5 GB) is DDP"),
    ((GB, GB, 3 * GB, 2, 2, "nvlink", True), "ep+fsdp",
     "a mixture of experts: 4 GB / 2 + 1 GB is exactly 3 GB, its experts split, not gathered"),
    ((2 * GB, 8 * GB, 2 * GB, 8, 8, "pcie", True), "ep+pp+fsdp",
     "a mixture of experts: 8 GB / 8 + 8 GB / 8 is exactly 2 GB"),
    ((GB, 12 * GB, GB, 16, 8, "pcie", True), "ep+cp+fsdp",
     "a mixture of experts: (4 GB + 12 GB) / 16 is exactly 1 GB"),
]


@pytest.mark.task8_4
@pytest.mark.parametrize("arguments,method,why", BOUNDARIES,
                         ids=[f"{b[1]}-{i}" for i, b in enumerate(BOUNDARIES)])
def test_choose_method_counts_exactly_full_as_fitting(ex, arguments, method, why):
    """A method whose bytes equal the GPU's memory fits: 12 cases, each exactly at the limit of its
    row (one device, DDP, FSDP, pp+fsdp, cp+tp+fsdp, cp+fsdp, and the mixtures of experts' rows)."""
    got = ex.choose_method(*arguments)
    assert got == method, (
        f"choose_method{arguments} returned {got!r}, expected {method!r}: {why}, and bytes that "
        f"equal gpu_memory fit (<=, not <)")


@pytest.mark.task8_4
def test_choose_method_errors_say_the_bytes_the_smallest_option_needs(ex):
    """Where nothing fits, the ValueError says the bytes the smallest option needs: one GPU, one
    node over PCIe and two nodes over NVLink, each one byte short, name the 5e9, 2e9 and 1e9 bytes
    needed; two GPUs, one per node, that each hold the whole run are DDP."""
    raise_if_untouched(ex.choose_method)
    error = assert_refuses(ex.choose_method, (GB, GB, 5 * GB - 1, 1, 1, "nvlink"),
                           "one GPU of 5 GB - 1 byte cannot hold 4 x 1 GB + 1 GB")
    assert "5000000000" in str(error), (
        f"the error {str(error)!r} should say the 5000000000 bytes (4 x the weights plus the "
        f"activations) one GPU would need")
    error = assert_refuses(ex.choose_method, (2 * GB, 8 * GB, 2 * GB - 1, 8, 8, "pcie"),
                           "8 GB / 8 of state + 8 GB / 8 of activations is 1 byte too many: the "
                           "activations split across the node add to the state, not subtract")
    assert "2000000000" in str(error), (
        f"the error {str(error)!r} should say the 2000000000 bytes each GPU would need")
    error = assert_refuses(ex.choose_method, (GB, 12 * GB, GB - 1, 16, 8, "nvlink"),
                           "two nodes: (4 GB + 12 GB) / 16 is 1 byte more than each GPU has")
    assert "1000000000" in str(error), (
        f"the error {str(error)!r} should say the 1000000000 bytes each GPU would need with the "
        f"smallest option, the state and the activations split over all 16 GPUs (context "
        f"parallel across the nodes), not the split inside one node")
    got = ex.choose_method(GB, GB, 5 * GB, 2, 1, "nvlink")
    assert got == "ddp", f"two GPUs that each hold the whole run is 'ddp', not {got!r}"
