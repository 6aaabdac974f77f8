"""Lesson 08, task8_1: ``bus_bandwidth`` and ``fit_alpha_beta``: the algorithm and bus bandwidths
of the text's table for every op, and the ring's alpha and beta fitted back from points made
with them (exact ones, and noisy ones by least squares on the relative errors). Plain calls.

    pytest lessons/08_measure_and_choose -m task8_1
"""

from __future__ import annotations

import math

import pytest
import torch

from harness.compare import assert_close
from harness.sweep import st, sweep
from lesson08.common import (
    OPS,
    SIZES,
    MiB,
    assert_refuses,
    noisy_times,
    relative_least_squares,
    ring_factor,
    ring_seconds,
)

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task8_1": {
        "bus_bandwidth returns (algorithm bandwidth, bus bandwidth), in bytes per second": [
            "test_bus_bandwidth_is_the_algorithm_bandwidth_times_the_ring_factor",
            "test_bus_bandwidth_for_any_measurement"],
        "the algorithm bandwidth is the payload over the time": [
            "test_bus_bandwidth_is_the_algorithm_bandwidth_times_the_ring_factor",
            "test_bus_bandwidth_for_any_measurement"],
        "bus bandwidth: x 2 (W - 1) / W for all_reduce": [
            "test_bus_bandwidth_is_the_algorithm_bandwidth_times_the_ring_factor",
            "test_bus_bandwidth_for_any_measurement"],
        "bus bandwidth: x (W - 1) / W for all_gather and reduce_scatter": [
            "test_bus_bandwidth_is_the_algorithm_bandwidth_times_the_ring_factor",
            "test_bus_bandwidth_for_any_measurement"],
        "bus bandwidth: x 1 for broadcast": [
            "test_bus_bandwidth_is_the_algorithm_bandwidth_times_the_ring_factor",
            "test_bus_bandwidth_for_any_measurement"],
        "an op not in OPS raises ValueError": [
            "test_bus_bandwidth_refuses_what_is_not_a_measurement"],
        "seconds <= 0 raises ValueError": ["test_bus_bandwidth_refuses_what_is_not_a_measurement"],
        "num_bytes < 0 raises ValueError": ["test_bus_bandwidth_refuses_what_is_not_a_measurement"],
        "world_size < 1 raises ValueError": [
            "test_bus_bandwidth_refuses_what_is_not_a_measurement"],
        "fit: alpha read from a = 2 (W - 1) alpha, beta from b = 2 (W - 1) / W beta": [
            "test_fit_recovers_the_alpha_and_beta_the_points_were_made_with",
            "test_fit_recovers_any_link_from_exact_points"],
        "fit: the line t = a + b n through every point": [
            "test_fit_is_least_squares_on_the_relative_errors"],
        "fit: least squares on the relative errors (each point weighted by 1 / t**2)": [
            "test_fit_is_least_squares_on_the_relative_errors",
            "test_fit_keeps_the_latency_under_one_percent_of_noise"],
        "fit: fewer than two distinct sizes raise ValueError": [
            "test_fit_refuses_what_cannot_be_fitted"],
        "fit: lists of different lengths raise ValueError": [
            "test_fit_refuses_what_cannot_be_fitted"],
        "fit: a time that is not positive raises ValueError": [
            "test_fit_refuses_what_cannot_be_fitted"],
        "fit: world_size < 2 raises ValueError": ["test_fit_refuses_what_cannot_be_fitted"],
    },
}


@pytest.mark.task8_1
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("op", OPS)
def test_bus_bandwidth_is_the_algorithm_bandwidth_times_the_ring_factor(ex, op, world):
    """`bus_bandwidth` gives the payload over the time, and that times the op's ring factor (2 (W -
    1) / W for all_reduce, (W - 1) / W for all_gather and reduce_scatter, 1 for broadcast): 64 MiB
    in 20 ms, each of the four ops on 1, 2, 3 and 8 ranks, against the text's factors."""
    algbw, busbw = ex.bus_bandwidth(op, 64 * MiB, 0.02, world)
    assert_close(torch.tensor(algbw), torch.tensor(64 * MiB / 0.02),
                 f"{op} on {world} ranks: the algorithm bandwidth (payload / seconds)")
    assert_close(torch.tensor(busbw), torch.tensor(64 * MiB / 0.02 * ring_factor(op, world)),
                 f"{op} on {world} ranks: the bus bandwidth; the factor should be "
                 f"{ring_factor(op, world):.4g} (what a rank of a ring sends per payload byte)")


@pytest.mark.task8_1
@sweep(op=st.sampled_from(OPS), num_bytes=st.integers(0, 2**40), seconds=st.floats(1e-7, 1e3),
       world=st.integers(1, 4096), max_examples=60)
def test_bus_bandwidth_for_any_measurement(ex, op, num_bytes, seconds, world):
    """`bus_bandwidth` holds for any measurement: 60 generated ones (any of the four ops, 0 bytes to
    1 TiB, 0.1 us to 1000 s, 1 to 4096 ranks), within a relative 1e-9 of payload / seconds and of
    that times the ring factor."""
    algbw, busbw = ex.bus_bandwidth(op, num_bytes, seconds, world)
    assert math.isclose(algbw, num_bytes / seconds, rel_tol=1e-9, abs_tol=1e-12), (
        f"bus_bandwidth({op!r}, {num_bytes}, {seconds}, {world}): algorithm bandwidth {algbw}, "
        f"expected payload / seconds = {num_bytes / seconds}")
    assert math.isclose(busbw, num_bytes / seconds * ring_factor(op, world), rel_tol=1e-9,
                        abs_tol=1e-12), (
        f"bus_bandwidth({op!r}, {num_bytes}, {seconds}, {world}): bus bandwidth {busbw}, "
        f"expected {ring_factor(op, world):.6g} x the algorithm bandwidth")


@pytest.mark.task8_1
@pytest.mark.parametrize("arguments", [("all_to_all", 1024, 1.0, 2), ("all_reduce", 1024, 0.0, 2),
                                       ("all_reduce", 1024, 1.0, 0), ("all_reduce", -1, 1.0, 2),
                                       ("all_reduce", 1024, -1.0, 2)],
                         ids=["unknown op", "zero seconds", "no ranks", "negative bytes",
                              "negative seconds"])
def test_bus_bandwidth_refuses_what_is_not_a_measurement(ex, arguments):
    """`bus_bandwidth` raises ValueError for what is not a measurement: an op it does not know
    (all_to_all), zero or negative seconds, no ranks, negative bytes."""
    assert_refuses(ex.bus_bandwidth, arguments, "an unknown op, a time that is not positive or "
                   "no ranks is not a measurement")


def assert_fit_recovers(ex, sizes, world: int, alpha: float, beta: float) -> None:
    __tracebackhide__ = True
    seconds = [ring_seconds(n, world, alpha, beta) for n in sizes]
    got = ex.fit_alpha_beta(sizes, seconds, world)
    assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor([alpha, beta],
                 dtype=torch.float64), f"(alpha, beta) fitted to exact points on {world} ranks "
                 f"(a line t = a + b n: alpha = a / (2 (W - 1)), beta = b / (2 (W - 1) / W))",
                 rtol=1e-6, atol=0)


@pytest.mark.task8_1
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_fit_recovers_the_alpha_and_beta_the_points_were_made_with(ex, world):
    """`fit_alpha_beta` gives back the alpha and beta that exact points were made with: all-reduce
    times from the ring's formula for 1 KiB to 64 MiB (alpha 25 us, 20 GB/s) on 2, 3, 4 and 8 ranks,
    within a relative 1e-6."""
    assert_fit_recovers(ex, SIZES, world, 25e-6, 1 / 20e9)


@pytest.mark.task8_1
@sweep(world=st.integers(2, 64), alpha=st.floats(1e-7, 1e-2),
       bandwidth=st.floats(1e7, 1e12), sizes=st.lists(st.integers(1, 2**30), min_size=2,
                                                      max_size=12, unique=True))
def test_fit_recovers_any_link_from_exact_points(ex, world, alpha, bandwidth, sizes):
    """`fit_alpha_beta` recovers any link from exact points: 25 generated links (2 to 64 ranks,
    alpha from 0.1 us to 10 ms, 10 MB/s to 1 TB/s), each timed at 2 to 12 distinct sizes of up to 1
    GiB, within a relative 1e-6."""
    assert_fit_recovers(ex, sizes, world, alpha, 1 / bandwidth)


@pytest.mark.task8_1
def test_fit_is_least_squares_on_the_relative_errors(ex):
    """On noisy points the fit is the line with the least squared relative errors: 18 all-reduce
    times on 4 ranks (1 KiB to 64 MiB, each size twice, up to 10 % of noise), against the normal
    equations of the sum of ((a + b n - t) / t)**2, within a relative 1e-6.

    When the answer is the ordinary least-squares line instead, the failure says so."""
    world, sizes = 4, SIZES + SIZES
    seconds = noisy_times(sizes, world, 30e-6, 1e-10, 0.1, seed=8)
    expected = torch.tensor(relative_least_squares(sizes, seconds, world), dtype=torch.float64)
    got = torch.tensor(ex.fit_alpha_beta(sizes, seconds, world), dtype=torch.float64)
    ordinary = torch.linalg.lstsq(torch.tensor([[1.0, n] for n in sizes], dtype=torch.float64),
                                  torch.tensor(seconds, dtype=torch.float64)[:, None]).solution
    steps = 2 * (world - 1)
    plain = torch.tensor([float(ordinary[0]) / steps, float(ordinary[1]) * world / steps],
                         dtype=torch.float64)
    why = (": that is the ordinary least-squares line, which the largest times hold; weight "
           "each point by 1 / t**2 (least squares on (a + b n - t) / t)"
           if torch.allclose(got, plain, rtol=1e-6, atol=0) else "")
    assert_close(got, expected, "(alpha, beta) from noisy points: the line with the smallest "
                 f"relative errors, through all of them{why}", rtol=1e-6, atol=0)


@pytest.mark.task8_1
@pytest.mark.parametrize("seed", range(4))
def test_fit_keeps_the_latency_under_one_percent_of_noise(ex, seed):
    """With 1 % of noise the fitted alpha stays within 5 % of the link's and beta within 2 %:
    all-reduce times of 1 KiB to 64 MiB on 2 ranks of a 1 GB/s link with 20 us steps, 4 draws of the
    noise.

    At 64 MiB 1 % of noise is 0.7 ms, 17 times the whole latency of a small all-reduce (2 steps, 40
    us): an ordinary least-squares line, which the largest times hold, misses alpha by far more."""
    world, alpha, beta = 2, 20e-6, 1e-9
    seconds = noisy_times(SIZES, world, alpha, beta, 0.01, seed=seed)
    got_alpha, got_beta = ex.fit_alpha_beta(SIZES, seconds, world)
    assert abs(got_alpha - alpha) <= 0.05 * alpha, (
        f"with 1 % of noise the fitted alpha is {got_alpha * 1e6:.2f} us, the link's is "
        f"{alpha * 1e6:.0f} us: the largest times decide an ordinary least-squares line; fit the "
        f"relative errors (weight each point by 1 / t**2)")
    assert abs(got_beta - beta) <= 0.02 * beta, (
        f"with 1 % of noise the fitted 1/beta is {1 / got_beta / 1e9:.3f} GB/s, the link's "
        f"{1 / beta / 1e9:.3f} GB/s")


@pytest.mark.task8_1
@pytest.mark.parametrize("arguments", [([1024, 1024], [1e-3, 2e-3], 2), ([1024, 2048], [1e-3], 2),
                                       ([1024, 2048], [1e-3, 2e-3], 1),
                                       ([1024, 2048], [1e-3, 0.0], 2),
                                       ([1024, 2048], [-1e-3, 2e-3], 2)],
                         ids=["one size", "lengths differ", "one rank", "a time of zero",
                              "a negative time"])
def test_fit_refuses_what_cannot_be_fitted(ex, arguments):
    """`fit_alpha_beta` raises ValueError for what no line fits: one distinct size, lists of
    different lengths, one rank, a time of zero, a negative time."""
    assert_refuses(ex.fit_alpha_beta, arguments, "a line needs two distinct sizes, one "
                   "positive time per size, and an all-reduce needs two ranks")
