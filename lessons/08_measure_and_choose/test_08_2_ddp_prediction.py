"""Lesson 08, task8_2: ``predict_allreduce_seconds``, ``ddp_buckets`` and
``predict_ddp_comm_seconds``: the ring's time, the buckets torch itself assigns (asked of
torch, not copied from it), and DDP's communication predicted from the buckets a real DDP
builds, on a pooled rank.

    pytest lessons/08_measure_and_choose -m task8_2
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.compare import assert_close
from harness.ranks import run_on_ranks
from harness.sweep import st, sweep
from lesson08.common import MiB, ring_seconds

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task8_2": {
        "predict_allreduce_seconds: 2 (W - 1) steps of alpha, each sending n / W at beta": [
            "test_predicted_allreduce_is_the_ring"],
        "predict_allreduce_seconds: 0.0 on one rank": ["test_predicted_allreduce_is_the_ring"],
        "predict_allreduce_seconds: world_size < 1 or num_bytes < 0 raises ValueError": [
            "test_predicted_allreduce_refuses_impossible_sizes"],
        "ddp_buckets: lists of indices, each parameter added to the open bucket, in order": [
            "test_buckets_are_the_ones_torch_assigns",
            "test_buckets_are_the_ones_torch_assigns_for_any_sizes"],
        "ddp_buckets: a bucket closes as soon as it holds at least its limit": [
            "test_buckets_are_the_ones_torch_assigns",
            "test_buckets_are_the_ones_torch_assigns_for_any_sizes"],
        "ddp_buckets: the first bucket's limit is first_bucket_bytes, later ones' the cap": [
            "test_buckets_are_the_ones_torch_assigns",
            "test_buckets_are_the_ones_torch_assigns_for_any_sizes",
            "test_predicted_ddp_step_is_one_allreduce_per_bucket_ddp_builds",
            "test_predicted_ddp_step_matches_real_ddp_for_generated_models"],
        "ddp_buckets: the last bucket takes what is left, however small": [
            "test_buckets_are_the_ones_torch_assigns",
            "test_buckets_are_the_ones_torch_assigns_for_any_sizes",
            "test_predicted_ddp_step_is_one_allreduce_per_bucket_ddp_builds",
            "test_predicted_ddp_step_matches_real_ddp_for_generated_models",
            "test_predicted_ddp_step_counts_each_parameters_own_bytes"],
        "predict_ddp_comm_seconds: one ring all-reduce per bucket": [
            "test_predicted_ddp_step_is_one_allreduce_per_bucket_ddp_builds",
            "test_predicted_ddp_step_matches_real_ddp_for_generated_models"],
        "predict_ddp_comm_seconds: only the parameters that require a gradient": [
            "test_predicted_ddp_step_is_one_allreduce_per_bucket_ddp_builds",
            "test_predicted_ddp_step_matches_real_ddp_for_generated_models"],
        "predict_ddp_comm_seconds: the parameters reversed": [
            "test_predicted_ddp_step_matches_real_ddp_for_generated_models"],
        "bucket_cap_mb None: a 1 MiB first bucket, 25 MiB for the others": [
            "test_predicted_ddp_step_is_one_allreduce_per_bucket_ddp_builds",
            "test_predicted_ddp_step_matches_real_ddp_for_generated_models"],
        "bucket_cap_mb given, even 25: every bucket's limit, the first's too": [
            "test_predicted_ddp_step_is_one_allreduce_per_bucket_ddp_builds",
            "test_predicted_ddp_step_matches_real_ddp_for_generated_models"],
        "bytes_per_element, when given, is what each element sends": [
            "test_predicted_ddp_step_is_one_allreduce_per_bucket_ddp_builds",
            "test_predicted_ddp_step_matches_real_ddp_for_generated_models"],
        "otherwise each element sends its parameter's own element_size()": [
            "test_predicted_ddp_step_counts_each_parameters_own_bytes"],
        "the buckets are formed from the uncompressed sizes": [
            "test_predicted_ddp_step_is_one_allreduce_per_bucket_ddp_builds",
            "test_predicted_ddp_step_matches_real_ddp_for_generated_models"],
    },
}


@pytest.mark.task8_2
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_predicted_allreduce_is_the_ring(ex, world):
    """`predict_allreduce_seconds` is the ring's time, 2 (W - 1) steps of alpha each sending n / W
    bytes at beta, and 0 on one rank: 0 bytes, 4 KiB and 100 MiB on 1, 2, 4 and 8 ranks, within a
    relative 1e-9 of the text's formula."""
    for n in (0, 4096, 100 * MiB):
        got = ex.predict_allreduce_seconds(n, world, 20e-6, 1 / 50e9)
        assert_close(torch.tensor(got, dtype=torch.float64),
                     torch.tensor(ring_seconds(n, world, 20e-6, 1 / 50e9), dtype=torch.float64),
                     f"an all-reduce of {n} bytes on {world} ranks: 2 (W - 1) steps of alpha, "
                     f"each sending n / W bytes", rtol=1e-9, atol=0)


@pytest.mark.task8_2
@pytest.mark.parametrize(("num_bytes", "world"), [(4096, 0), (4096, -2), (-1, 4), (-1, 1),
                                                  (-1, 0)],
                         ids=["no rank", "negative ranks", "negative bytes on 4",
                              "negative bytes on 1", "both"])
def test_predicted_allreduce_refuses_impossible_sizes(ex, num_bytes, world):
    """`predict_allreduce_seconds` raises ValueError when world_size < 1 or num_bytes < 0, either
    alone or both: 0 and -2 ranks, -1 bytes on 4, 1 and 0 ranks."""
    what = f"predict_allreduce_seconds({num_bytes}, {world}, 20e-6, 1 / 50e9)"
    why = ("world_size must be at least 1" if world < 1 else "") + (
        " and " if world < 1 and num_bytes < 0 else "") + (
        "num_bytes cannot be negative" if num_bytes < 0 else "")
    try:
        got = ex.predict_allreduce_seconds(num_bytes, world, 20e-6, 1 / 50e9)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as error:
        pytest.fail(f"{what} raised {type(error).__name__}: {error}; expected ValueError "
                    f"({why}). Check the sizes first: either one impossible is enough")
    pytest.fail(f"{what} returned {got!r}; expected ValueError ({why}). Check world_size < 1 "
                f"or num_bytes < 0: either one alone is impossible")


def torch_buckets(sizes: list[int], cap: int, first: int) -> list[list[int]]:
    """torch's own assignment of tensors of these byte sizes to buckets."""
    tensors = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    return [list(b) for b in dist._compute_bucket_assignment_by_size(tensors, [first, cap])[0]]


def assert_buckets_are_torchs(ex, sizes: list[int], cap: int, first: int) -> None:
    __tracebackhide__ = True
    got = ex.ddp_buckets(sizes, cap, first)
    expected = torch_buckets(sizes, cap, first)
    assert [list(b) for b in got] == expected, (
        f"ddp_buckets({sizes}, bucket_cap_bytes={cap}, first_bucket_bytes={first}) returned "
        f"{got}; torch assigns {expected}: add each parameter to the open bucket, and close "
        f"it as soon as it holds at least its limit (the first bucket's is "
        f"first_bucket_bytes)")


@pytest.mark.task8_2
@pytest.mark.parametrize("sizes,cap,first", [
    ([1000] * 10, 2500, 1000), ([5000], 2500, 1000), ([10, 3000, 10, 10], 2000, 3000),
    ([999, 1, 1000, 1000], 1000, 1000), ([1], 1, 1), ([7, 7, 7], 100, 100), ([4, 3, 3], 4, 4)],
    ids=["tens", "one-big", "first-larger", "exactly-full", "one-byte", "all-in-one",
         "next-starts-empty"])
def test_buckets_are_the_ones_torch_assigns(ex, sizes, cap, first):
    """`ddp_buckets` assigns the buckets torch does: 7 hand-picked size lists (a parameter larger
    than the cap, a first limit larger than the cap, a bucket exactly full, one byte), against
    `torch.distributed._compute_bucket_assignment_by_size`, asked in the test, not copied from it.
    """
    assert_buckets_are_torchs(ex, sizes, cap, first)


@pytest.mark.task8_2
@sweep(sizes=st.lists(st.integers(1, 4000), min_size=1, max_size=25),
       cap=st.integers(1, 6000), first=st.integers(1, 6000), max_examples=60)
def test_buckets_are_the_ones_torch_assigns_for_any_sizes(ex, sizes, cap, first):
    """`ddp_buckets` assigns torch's buckets on 60 generated cases: 1 to 25 parameters of 1 to 4000
    bytes, caps and first limits of 1 to 6000 bytes, against torch's own assignment."""
    assert_buckets_are_torchs(ex, sizes, cap, first)


def models() -> dict[str, torch.nn.Module]:
    gpt = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128), seed=0)
    # Sizes whose order decides the buckets: a big last layer alone in a bucket when reversed.
    uneven = chain([64, 64, 64, 2000])
    return {"gpt": gpt, "uneven": uneven, "frozen": chain([64, 64, 64, 2000], frozen=1)}


def chain(widths: list[int], frozen: int | None = None) -> torch.nn.Module:
    """Linear layers of these widths, used in order; layer ``frozen`` needs no gradient."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    if frozen is not None:
        layers[frozen].requires_grad_(False)
    return torch.nn.Sequential(*layers)


def real_ddp_buckets(ctx, model: torch.nn.Module, bucket_cap_mb) -> list[int]:
    """The elements in each bucket a real DDP builds for ``bucket_cap_mb`` (``None``: left
    unset), after its first step, when it rebuilds them in the order the gradients came."""
    keywords = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = DDP(copy.deepcopy(model), **keywords)
    for _ in range(2):
        if isinstance(model, GPT):
            tokens = torch.randint(0, 65, (2, 64), generator=torch.Generator().manual_seed(0))
            ddp(tokens, tokens)[1].backward()
        else:
            ddp(torch.ones(2, model[0].in_features, dtype=model[0].weight.dtype)).sum().backward()
    return [b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()]


def assert_predicts_real_ddp(ex, model, name: str, cap_mb, wire) -> None:
    __tracebackhide__ = True
    alpha, beta, world = 50e-6, 1 / 10e9, 4
    got = ex.predict_ddp_comm_seconds(model, world, alpha, beta, bucket_cap_mb=cap_mb,
                                      bytes_per_element=wire)
    buckets = run_on_ranks(real_ddp_buckets, model, cap_mb, world_size=1)[0]
    expected = sum(ring_seconds(n * (wire or 4), world, alpha, beta) for n in buckets)
    setting = "left unset" if cap_mb is None else f"{cap_mb} MiB"
    hint = next((f": that is what {why}" for why, seconds in mistakes(
        model, world, alpha, beta, cap_mb, wire).items()
        if not math.isclose(got, expected, rel_tol=1e-9)
        and math.isclose(got, seconds, rel_tol=1e-9)), "")
    assert_close(torch.tensor(got, dtype=torch.float64),
                 torch.tensor(expected, dtype=torch.float64),
                 f"the {name} model's DDP communication with bucket_cap_mb {setting}: a real "
                 f"DDP builds {len(buckets)} bucket(s) of {buckets} elements; "
                 f"{wire or 4} bytes per element on the wire{hint}", rtol=1e-9, atol=0)


def mistakes(model, world: int, alpha: float, beta: float, cap_mb, wire) -> dict[str, float]:
    """What a few known mistakes would predict, to name one when an answer equals it."""
    params = [p for p in model.parameters() if p.requires_grad]
    limits = [MiB, 25 * MiB] if cap_mb is None else [int(cap_mb * MiB)]

    def predicted(order, limits, wire_bytes=wire) -> float:
        buckets = dist._compute_bucket_assignment_by_size(order, limits)[0]
        return sum(ring_seconds(sum(order[i].numel() for i in b) * (wire_bytes or 4), world,
                                alpha, beta) for b in buckets)

    found = {"buckets the parameters in the model's order predicts; DDP takes them last "
             "first, the order in which the backward produces their gradients":
             predicted(params, limits)}
    if cap_mb is not None:
        found["a 1 MiB first bucket predicts; DDP keeps its small first bucket only when "
              "bucket_cap_mb is left unset: a cap given, even 25, is every bucket's limit"] = (
            predicted(params[::-1], [MiB, int(cap_mb * MiB)]))
    if wire is not None:
        found[f"sending 4 bytes per element predicts; the hook sends {wire}"] = predicted(
            params[::-1], limits, None)
    return found


@pytest.mark.task8_2
@pytest.mark.parametrize("name", ["gpt", "uneven", "frozen"])
@pytest.mark.parametrize("cap_mb,wire", [(None, None), (25, None), (1000, None), (0.25, None),
                                         (0.1, 2)],
                         ids=["unset", "25-given", "one-bucket", "small", "bf16"])
def test_predicted_ddp_step_is_one_allreduce_per_bucket_ddp_builds(ex, name, cap_mb, wire):
    """`predict_ddp_comm_seconds` is one ring all-reduce per bucket that a real DDP builds (read
    from its reducer after two steps on one gloo rank): a 4-block GPT and two chains of Linear
    layers, one with a frozen layer, with bucket_cap_mb unset, 25, 1000, 0.25, and 0.1 at 2 bytes an
    element; relative 1e-9.

    The buckets are those DDP rebuilds in the order the gradients came, last parameter first; a
    frozen layer's parameters are in none. A failure names the mistake an answer equals: the
    parameters in the model's order, a 1 MiB first bucket under a given cap, 4 bytes sent per
    element under a hook that sends 2."""
    assert_predicts_real_ddp(ex, models()[name], name, cap_mb, wire)


@pytest.mark.task8_2
@sweep(widths=st.lists(st.integers(1, 700), min_size=2, max_size=6),
       cap_mb=st.one_of(st.none(), st.floats(0.01, 3.0)), wire=st.sampled_from([None, 2]),
       frozen=st.one_of(st.none(), st.integers(0, 4)), max_examples=20)
def test_predicted_ddp_step_matches_real_ddp_for_generated_models(ex, widths, cap_mb, wire,
                                                                  frozen):
    """`predict_ddp_comm_seconds` matches the buckets a real DDP builds on 20 generated chains of 1
    to 5 Linear layers (widths 1 to 700), with bucket_cap_mb unset or 0.01 to 3 MiB, 4 or 2 bytes an
    element on the wire, and a frozen layer or none."""
    if frozen is not None and frozen >= len(widths) - 1:
        frozen = None
    model = chain(widths, frozen)
    if not any(p.requires_grad for p in model.parameters()):
        return
    assert_predicts_real_ddp(ex, model, f"chain {widths}", cap_mb, wire)


@pytest.mark.task8_2
def test_predicted_ddp_step_counts_each_parameters_own_bytes(ex):
    """Without a hook each element sends its parameter's own element_size(): a float64 chain of
    Linear layers, 8 bytes an element in the buckets and on the wire, against the buckets a real DDP
    builds with bucket_cap_mb 0.25.

    The other tests' models are all float32, 4 bytes an element."""
    model = chain([64, 64, 64, 2000]).double()
    alpha, beta, world, cap_mb = 50e-6, 1 / 10e9, 4, 0.25
    got = ex.predict_ddp_comm_seconds(model, world, alpha, beta, bucket_cap_mb=cap_mb)
    buckets = run_on_ranks(real_ddp_buckets, model, cap_mb, world_size=1)[0]
    expected = sum(ring_seconds(n * 8, world, alpha, beta) for n in buckets)
    as_fp32 = sum(ring_seconds(n * 4, world, alpha, beta) for n in buckets)
    hint = (": that is 4 bytes per element; count each parameter's own element_size()"
            if math.isclose(got, as_fp32, rel_tol=1e-9) else "")
    assert_close(torch.tensor(got, dtype=torch.float64),
                 torch.tensor(expected, dtype=torch.float64),
                 f"a float64 model's DDP communication with bucket_cap_mb {cap_mb}: a real DDP "
                 f"builds {len(buckets)} bucket(s) of {buckets} elements of 8 bytes{hint}",
                 rtol=1e-9, atol=0)
