"""Lesson 10: long sequences. What the lesson rests on, checked on gloo/CPU ranks (and on CUDA
where present):

- a block of the running example split by tensor parallelism, with and without sequence
  parallelism, computes the unsplit block's output and gradients; both send the same bytes, and
  sequence parallelism keeps 2 B S (C + 2) (W - 1) / W fewer elements for the backward: the
  layer norms' inputs and statistics, on S / W tokens instead of S;
  DTensor's sequence-parallel plan is the same split: the same collectives, bytes and kept
  elements, and every gradient of the unsplit block;
- the script's ring attention, backward written by hand, gives the outputs and the gradients of
  q, k and v that attention over the whole sequence gives in one process, for 1 to 4 ranks,
  contiguous and zig-zag, causal and not, trimmed or not;
- a rank never holds more than one block of scores, and what it keeps for the backward is its
  own tokens': the first falls as 1/W², the second as 1/W;
- under a causal mask contiguous blocks give the last rank about 2W - 1 times the first rank's
  work, zig-zag gives every rank the same; the script's counts show it, and trimming each block
  to what its queries see removes the masked half of the zig-zag blocks;
- documents packed in one sequence unbalance the head-tail split unless each is split on its own;
- ring_attention.py --torch-cp refuses to start without CUDA, and on GPUs torch's
  context_parallel gives the whole sequence's output and gradients.

Each task's tests are in its own file, test_10_1_sequence_collectives.py to test_10_5_ring.py
(what they share is in common.py and conftest.py); this file checks the lesson's claims and
its script, ring_attention.py:

    pytest lessons/10_long_sequences/test_10_long_sequences.py
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, CharDataset, GPTConfig, run
from gpt.model import causal_attention

from harness.compare import assert_close, assert_parameters_close
from harness.exercises import load_lesson_module
from harness.hardware import gpu_marks
from harness.launch import one_process_fit, run_script
from harness.ranks import group_params, run_on_ranks
from lesson10.common import (
    LESSON,
    RING_GROUPS,
    SCRIPT,
    SCRIPT_ARGS,
    TIGHT,
    TRAIN,
    TRAIN_SCRIPT,
    LargestTensor,
    reference_attention,
    seeded,
    split_positions,
    visible_pairs,
)

# Each task's CLAUSES (its contract, clause by clause, and the tests that fail when only that
# clause is broken) are in the task's file; tests/test_course.py merges them and checks the names.

SP_BLOCK = dict(vocab_size=1, n_embd=16, n_head=4, block_size=8, bias=True, dropout=0.0)


def sp_run(ctx):
    """The three versions of sequence_parallel.py's block on this rank."""
    script = load_lesson_module(LESSON, "sequence_parallel")
    return {version: script.measure(SP_BLOCK, 2, 8, version) for version in script.VERSIONS}


@functools.cache
def sp_versions(world: int) -> list[dict]:
    """sp_run on ``world`` ranks, once for both tests that read it."""
    return run_on_ranks(sp_run, world_size=world)


TP, SP, DTENSOR = "tensor parallel", "tensor + sequence parallel", "the same with DTensor"
NORMS = [f"ln_{i}.{kind}" for i in (1, 2) for kind in ("weight", "bias")]
ROW_BIASES = ["attn.out_proj.bias", "mlp.down_proj.bias"]
DP_, TP_, SP_, CP_ = ("data parallel", "tensor parallel", "tensor + sequence parallel",
                      "context parallel")


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_keeps_less_and_sends_the_same_bytes(world):
    """sequence_parallel.py's block split by tensor parallelism, with and without sequence
    parallelism, gives the unsplit block's output and gradients to 1e-12 in float64 on 2 and 4 gloo
    ranks; both send the same bytes, and sequence parallelism keeps 2 B S (C + 2) (W - 1) / W fewer
    elements.

    Tensor parallelism runs 4 all-reduces, sequence parallelism 4 all-gathers and 4 reduce-scatters.
    Under sequence parallelism the gradients of the layer norms and of the row layers' biases are
    partial sums; without it, none is."""
    B, S, C = 2, 8, SP_BLOCK["n_embd"]
    tp = [got[TP] for got in sp_versions(world)]
    sp = [got[SP] for got in sp_versions(world)]
    for rank in range(world):
        for name, got in (("tensor parallel", tp[rank]), ("sequence parallel", sp[rank])):
            assert got["max_error"] < 1e-12, (
                f"rank {rank}: the {name} block's output or gradients differ from the unsplit "
                f"block's by {got['max_error']:.3g}")
        assert sorted(tp[rank]["collectives"]) == ["allreduce_"] * 4, tp[rank]["collectives"]
        assert sorted(sp[rank]["collectives"]) == (["_allgather_base_"] * 4
                                                   + ["_reduce_scatter_base_"] * 4), (
            sp[rank]["collectives"])
        # 2 all-reduces each way of a B x S x C float64 activation, at 2 (W - 1) / W of it
        assert tp[rank]["sent_bytes"] == sp[rank]["sent_bytes"] == (
            4 * 2 * (world - 1) / world * B * S * C * 8), (tp[rank], sp[rank])
        fewer = tp[rank]["kept_elements"] - sp[rank]["kept_elements"]
        assert fewer == 2 * B * S * (C + 2) * (world - 1) // world, (
            f"rank {rank}: sequence parallelism kept {fewer} fewer elements; the layer norms' "
            f"inputs, means and reciprocal deviations on S / W tokens give "
            f"{2 * B * S * (C + 2) * (world - 1) // world}")
        assert tp[rank]["kept_elements"] < tp[rank]["whole_kept_elements"]
        # The README: "the layer norms and the row layers' biases (added after the
        # reduce-scatter) see only the rank's tokens, so their gradients are partial sums"
        assert tp[rank]["partial_sums"] == [], tp[rank]["partial_sums"]
        assert sorted(sp[rank]["partial_sums"]) == sorted(NORMS + ROW_BIASES), (
            sp[rank]["partial_sums"])


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_sequence_parallel_is_the_same_split(world):
    """sequence_parallel.py's DTensor plan (SequenceParallel on the norms, the stream Shard(1)) is
    the split by hand, on 2 and 4 gloo ranks: the unsplit block's output and every gradient, 4
    all-gathers and 4 reduce-scatters, the same bytes and the same kept elements.

    Each parameter's slices are gathered and the layer norms' Partial(sum) gradients added; the row
    layers' biases arrive whole."""
    by_hand = [got[SP] for got in sp_versions(world)]
    dtensor = [got[DTENSOR] for got in sp_versions(world)]
    for rank, (mine, theirs) in enumerate(zip(by_hand, dtensor, strict=True)):
        # The README: "the layer norms' Partial(sum) DTensors added ... (it adds the row layers'
        # biases before the reduce-scatter, so theirs arrive whole)"
        assert sorted(theirs["partial_sums"]) == sorted(NORMS), theirs["partial_sums"]
        assert theirs["max_error"] < 1e-12, (
            f"rank {rank}: DTensor's block differs from the unsplit block's output or some "
            f"gradient by {theirs['max_error']:.3g}")
        assert sorted(theirs["collectives"]) == (["all_gather_into_tensor"] * 4
                                                 + ["reduce_scatter_tensor"] * 4), (
            theirs["collectives"])
        for key in ("sent_bytes", "kept_elements"):
            assert theirs[key] == mine[key], (rank, key, theirs[key], mine[key])

BATCH, HEADS, HEAD_DIM = 2, 2, 4


def by_hand_run(ctx, layout: str, causal: bool, trim: bool, tokens: int):
    """The script's RingAttention on this rank, forward and backward, with the largest tensor
    any operation built and the elements autograd saved for the backward."""
    script = load_lesson_module(LESSON, "ring_attention")
    length = tokens * ctx.world_size
    mine = split_positions(layout, length, ctx.world_size)[ctx.rank]
    q, k, v = (seeded(i, BATCH, HEADS, length, HEAD_DIM).index_select(2, mine)
               .to(ctx.device).requires_grad_(True) for i in range(3))
    c = seeded(10, BATCH, HEADS, length, HEAD_DIM).index_select(2, mine).to(ctx.device)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with LargestTensor() as seen:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = script.RingAttention.apply(q, k, v, mine.to(ctx.device), None, causal, trim)
        (out * c).sum().backward()
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad, "positions": mine,
            "largest": seen.largest, "saved": sum(saved)}


def whole(length: int, causal: bool) -> dict:
    q, k, v = (seeded(i, BATCH, HEADS, length, HEAD_DIM).requires_grad_(True) for i in range(3))
    positions = torch.arange(length)
    out, _ = reference_attention(q, k, v, positions, positions, causal)
    (out * seeded(10, BATCH, HEADS, length, HEAD_DIM)).sum().backward()
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


@pytest.mark.parametrize("causal, trim", [(True, True), (True, False), (False, False)],
                         ids=["causal-trimmed", "causal-whole-blocks", "full"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("group", RING_GROUPS)
def test_ring_attention_by_hand_gives_the_gradients_of_one_process(group, layout, causal, trim):
    """ring_attention.py's RingAttention, its backward written by hand, gives the output and the
    gradients of q, k and v of attention over the whole sequence in one process: on 1 to 4 gloo
    ranks, contiguous and zig-zag, causal with whole or trimmed blocks, and unmasked, to 1e-9 in
    float64."""
    world, backend, device = group
    results = run_on_ranks(by_hand_run, layout, causal, trim, 6, world_size=world,
                           backend=backend, device=device)
    want = whole(6 * world, causal)
    for rank, got in enumerate(results):
        for name in ("out", "q", "k", "v"):
            what = "the output" if name == "out" else f"the gradient of {name}"
            assert_close(got[name], want[name].index_select(2, got["positions"]),
                         f"{what} of ring_attention.py's RingAttention ({layout}, "
                         f"{'causal' if causal else 'no mask'}, trim={trim})", rank, **TIGHT)


def test_a_rank_holds_one_block_of_scores_and_keeps_its_own_tokens():
    """RingAttention on the same 24-token causal sequence on 1, 2 and 4 gloo ranks builds no tensor
    larger than one block of scores (24/W queries by 24/W keys), and autograd keeps only the rank's
    own tokens' q, k, v, output, lse and positions."""
    length = 24
    found = {world: run_on_ranks(by_hand_run, "contiguous", True, True, length // world,
                                 world_size=world)
             for world in (1, 2, 4)}
    for world, results in found.items():
        tokens = length // world
        for rank, got in enumerate(results):
            assert got["largest"] == BATCH * HEADS * tokens * tokens, (
                f"rank {rank} of {world}: the largest tensor had {got['largest']} elements; one "
                f"block of scores is {BATCH} x {HEADS} x {tokens} x {tokens}")
            # q, k, v and out (tokens x head_dim each), lse (tokens) and the positions (tokens)
            kept = BATCH * HEADS * tokens * (4 * HEAD_DIM + 1) + tokens
            assert got["saved"] == kept, (
                f"rank {rank} of {world}: autograd kept {got['saved']} elements for the "
                f"backward, expected {kept}: this rank's tokens only")


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_contiguous_blocks_load_the_last_rank_and_zigzag_balances(world):
    """Counting the visible (query, key) pairs of 16 tokens a rank under a causal mask, for 2, 3, 4
    and 8 ranks: contiguous blocks give the last rank between 2W - 1 - 0.2W and 2W - 1 times the
    first rank's; zig-zag gives every rank S (S + 1) / (2W)."""
    tokens = 16
    length = tokens * world
    contiguous = [visible_pairs(p, length) for p in split_positions("contiguous", length, world)]
    zigzag = [visible_pairs(p, length) for p in split_positions("zigzag", length, world)]
    assert contiguous == sorted(contiguous) and len(set(contiguous)) == world, contiguous
    # rank W-1 sees (W-1) t^2 + t(t+1)/2 pairs, rank 0 t(t+1)/2: about 2W - 1 times as many
    ratio = contiguous[-1] / contiguous[0]
    assert 2 * world - 1 - 0.2 * world < ratio < 2 * world - 1, ratio
    assert len(set(zigzag)) == 1 and zigzag[0] == length * (length + 1) // 2 // world, zigzag


def test_packed_documents_unbalance_the_head_tail_split_unless_each_is_split():
    """Two documents of 4 and 12 tokens packed in one 16-token sequence, a causal mask within each
    document, 2 ranks: the head-tail split of the sequence gives rank 0 52 visible (query, key)
    pairs and rank 1 36; each document split head-tail on its own gives both 44."""
    lengths, world = [4, 12], 2
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.arange(sum(lengths))
    sees = (document[:, None] == document[None, :]) & (position[None, :] <= position[:, None])

    def pairs(held):
        return int(sees[held].sum())

    whole = [pairs(held) for held in split_positions("zigzag", sum(lengths), world)]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]
    per_document = [pairs(torch.cat([start + split_positions("zigzag", n, world)[rank]
                                     for start, n in zip(starts, lengths, strict=True)]))
                    for rank in range(world)]
    assert whole == [52, 36] and per_document == [44, 44], (whole, per_document)


@pytest.mark.slow
def test_script_matches_one_process_and_counts_each_ranks_work(script_run):
    """ring_attention.py under torchrun on 4 ranks, 32 tokens, differs from one process by less than
    1e-12 for each split, and counts the scores each rank computes, forward and backward: rank r's r
    + 1 blocks contiguous, all 4 zig-zag, its own and half of each of the 3 others trimmed."""
    run = script_run.result()
    data = run.data
    assert data["world_size"] == 4, data
    layouts = data["layouts"]
    assert list(layouts) == ["contiguous", "zigzag", "zigzag, trimmed"], list(layouts)
    for layout, found in layouts.items():
        assert max(found["max_error"].values()) < 1e-12, (layout, found["max_error"])
    contiguous = layouts["contiguous"]["scores_per_rank"]
    zigzag = layouts["zigzag"]["scores_per_rank"]
    trimmed = layouts["zigzag, trimmed"]["scores_per_rank"]
    tokens = data["length"] // 4
    # forward and backward: rank r of contiguous blocks computes r + 1 blocks twice
    assert contiguous == [2 * (r + 1) * tokens * tokens for r in range(4)], contiguous
    assert zigzag == [2 * 4 * tokens * tokens] * 4, zigzag  # every block seen by some query
    # its own block whole, and half of each of the 3 others
    assert trimmed == [2 * (tokens * tokens + 3 * tokens * tokens // 2)] * 4, trimmed
    assert max(trimmed) < max(contiguous), (trimmed, contiguous)
    lines = run.output
    assert "zigzag, trimmed" in lines and "largest error" in lines, lines[-2000:]


@pytest.fixture
def ring_script(outside_launcher):
    """ring_attention.py, imported, to call its main() as plain python would run it."""
    return load_lesson_module(LESSON, "ring_attention")


def test_script_refuses_a_length_that_does_not_split(ring_script, capsys):
    """ring_attention.py as one plain process with `--length 7` exits with status 2 and one line
    naming the script and `--length 7`, before any process group."""
    assert ring_script.main(["--length", "7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ring_attention.py" in err[0] and "--length 7" in err[0], err
    assert not dist.is_initialized()


@pytest.mark.parametrize("argv, cuda", [(["--torch-cp"], False),
                                        (["--torch-cp", "--backend", "gloo"], True)],
                         ids=["no-cuda", "gloo"])
def test_script_refuses_torch_cp_without_cuda(ring_script, capsys, monkeypatch, argv, cuda):
    """ring_attention.py `--torch-cp` as one plain process, without CUDA or with `--backend gloo`,
    exits with status 2 and one line saying that torch's ring runs only in SDPA's CUDA kernels
    (tests/test_torch_claims.py asks torch), before any process group."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)

    def setup(*args):
        raise AssertionError("--torch-cp without CUDA started a process group before refusing")

    monkeypatch.setattr(ring_script.run, "setup", setup)
    assert ring_script.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ring_attention.py: error: --torch-cp needs CUDA "
                                               "GPUs"), err
    assert "flash, memory-efficient and cuDNN CUDA kernels" in err[0], err
    assert not dist.is_initialized()


@pytest.mark.slow
@pytest.mark.parametrize("gpus", [pytest.param(n, marks=gpu_marks(n, f"nccl, cp {n}, a GPU per "
                                                                     "rank"),
                                               id=f"cp{n}") for n in (1, 2)])
def test_script_runs_torchs_context_parallel_on_gpus(gpus):
    """ring_attention.py `--torch-cp` under torchrun on 1 and 2 GPUs (nccl: one GPU per rank, so 2
    ranks need 2 GPUs), 128 tokens: torch's context_parallel around SDPA's memory-efficient kernel
    gives the output and gradients of that kernel on the whole sequence to 1e-4, each rank holding
    chunks r and 2W - 1 - r.

    Not yet run on a GPU."""
    launch = run_script(SCRIPT, *SCRIPT_ARGS, "--length", "128", "--torch-cp",
                        launcher="torchrun", nproc=gpus)
    found = launch.data["torch_context_parallel"]
    assert max(found["max_error"].values()) < 1e-4, found["max_error"]
    assert found["positions_per_rank"] == [p.tolist() for p in split_positions(
        "zigzag", launch.data["length"], gpus)], found["positions_per_rank"]
    assert "torch's context_parallel, SDPA's memory-efficient kernel" in launch.output, (
        launch.output[-2000:])


# ------------------------------------------------------- memory_by_length.py: memory against S

def memory_run(ctx, lengths, width, heads):
    script = script_module("memory_by_length")
    return {f"{method}, {length}": script.measure_block(method, length, width, heads)
            for length in lengths for method in script.METHODS}


def kept_per_token(method: str, C: int, H: int, W: int) -> float:
    """The README's count, elements kept per token of the sequence (float32, each tensor
    once): one process 16C + H + 4; TP splits 12C + H; TP + SP also 2C + 4; CP all, plus the
    ring's own output (C)."""
    return {"data parallel": 16 * C + H + 4, "tensor parallel": 4 * C + 4 + (12 * C + H) / W,
            "tensor + sequence parallel": 2 * C + (14 * C + H + 4) / W,
            "context parallel": (17 * C + H + 4) / W}[method]


@pytest.mark.parametrize("world", [2, 4])
def test_memory_per_rank_is_what_the_text_counts(world):
    """memory_by_length.py's measurements on 2 and 4 gloo ranks, 16 and 32 tokens, are the README's
    count for every method: the bytes kept for one block's backward, the keys and values among them,
    the parameters, the bytes sent; context parallelism keeps least, then TP + SP, TP, one process.

    The kept bytes are counted tensor by tensor, each once, the positions (int64) on top for context
    parallelism; the keys and values are 2C per token in one process and a W-th of it otherwise; the
    parameters are whole but for tensor parallelism's slices. The script's printed count column is
    held to the same numbers."""
    C, H = 16, 4
    lengths = (16, 32)
    whole = 12 * C * C + 13 * C
    sliced = 12 * C * C + 7 * C
    script = script_module("memory_by_length")
    for rank, got in enumerate(run_on_ranks(memory_run, lengths, C, H, world_size=world)):
        for length in lengths:
            for method in (TP_, SP_, DP_, CP_):
                found = got[f"{method}, {length}"]
                want = 4 * length * kept_per_token(method, C, H, world)
                want += 8 * length / world if method == CP_ else 0
                printed = script.predicted(method, length, C, H, world)  # the "count" column
                assert printed["activations"] == want, (method, length, printed, want)
                assert found["activations"] == want, (rank, method, length, found, want)
                kv = 4 * 2 * length * C / (1 if method == DP_ else world)  # its heads or tokens
                assert printed["kv"] == kv and found["kv"] == kv, (rank, method, found, kv)
                params = 4 * (sliced / world + whole - sliced if method.startswith("tensor")
                              else whole)
                assert found["parameters"] == params, (rank, method, found, params)
                stream = 4 * length * C  # bytes of one sequence's stream, keys or values
                sent = {DP_: 0, TP_: 8 * (world - 1) / world * stream,
                        SP_: 8 * (world - 1) / world * stream,
                        CP_: (6 * world - 4) / world * stream
                        + 2 * (world - 1) * 8 * length / world}[method]
                assert found["sent"] == pytest.approx(sent, rel=1e-12), (rank, method, found,
                                                                          sent)
                assert printed["parameters"] == params and printed["sent"] == pytest.approx(
                    sent, rel=1e-12), (method, printed, params, sent)
            kept = [got[f"{m}, {length}"]["activations"] for m in (CP_, SP_, TP_, DP_)]
            assert kept == sorted(kept), kept


def test_memory_script_refuses_lengths_that_do_not_split(outside_launcher, capsys):
    """memory_by_length.py as one process with `--lengths 16,7` exits with status 2 and one line
    naming the script and `--lengths 7`, before any process group: a length must cut into 2 zig-zag
    chunks."""
    assert script_module("memory_by_length").main(["--lengths", "16,7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "memory_by_length.py" in err[0] and "--lengths 7" in err[0], err
    assert not dist.is_initialized()


# ------------------------------------------------------------ train_cp.py: the running example

# Another summation order, with AdamW amplifying rounding where a gradient is rounding noise
# (lesson 03 measured this bound).
SAME_STEPS = {"rtol": 1e-3, "atol": 2e-4}


def script_module(name: str):
    """A script of this lesson as torchrun runs it, beside the lesson's scripts it imports by
    name (ring_attention.py, sequence_parallel.py)."""
    for sibling in ("ring_attention", "sequence_parallel"):
        sys.modules.setdefault(sibling, load_lesson_module(LESSON, sibling))
    return load_lesson_module(LESSON, name)


def train_cp_module():
    return script_module("train_cp")


def cp_gradients_on_rank(ctx, length: int):
    """One forward and backward of the running example on this rank's zig-zag share of a batch
    of sequences, the ring in every block; the gradients summed over the ranks (what DDP's
    average over the ranks of a cp group gives, times W). Also the same step in one process."""
    script = train_cp_module()
    dataset = CharDataset(length)
    config = GPTConfig.named("tiny", vocab_size=dataset.vocab_size, block_size=length)
    inputs, targets = (torch.stack(t) for t in zip(*(dataset[i] for i in range(4)), strict=True))
    alone = GPT(config)
    _, loss = run.next_char_loss(alone, inputs, targets)
    loss.backward()
    model = GPT(config)
    positions = script.zigzag_split(torch.arange(length), ctx.world_size, 0)[ctx.rank]
    with script.ring_in_blocks(model, positions, None):
        keep = script.keep(positions)
        _, loss = run.next_char_loss(model, *keep(list(zip(inputs, targets, strict=True))),
                                     positions=positions)
        loss.backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
    restored = all(block.attn.attend is causal_attention for block in model.blocks)
    return {"split": {n: p.grad / ctx.world_size for n, p in model.named_parameters()},
            "alone": {n: p.grad for n, p in alone.named_parameters()}, "restored": restored}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_train_cp_steps_give_the_gradients_of_one_process(world):
    """The running example with every 16-token sequence split zig-zag over 1, 2 and 4 gloo ranks and
    the ring in every block: the mean of the ranks' gradients is one process's on whole sequences,
    every parameter, the position embedding's too; afterwards the blocks attend in one process
    again."""
    for rank, got in enumerate(run_on_ranks(cp_gradients_on_rank, 16, world_size=world)):
        for name, gradient in got["split"].items():
            assert_close(gradient, got["alone"][name], f"the gradient of {name}, cp {world} "
                         "vs one process on whole sequences", rank, rtol=1e-4, atol=1e-6)
        assert got["restored"], "after ring_in_blocks(...) the blocks still attend across ranks"


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(one_process_fit, 64, world_size=1, timeout=120)[0]


@pytest.mark.slow
def test_train_cp_on_four_ranks_trains_what_one_process_trains(train_run, reference):
    """train_cp.py under torchrun, dp 2 x cp 2 with 8 windows per row, takes the steps of lesson
    03's script in one process on batches of 16: losses, validation accuracy and weights to lesson
    03's bound, and the same sample before training (whole sequences, attention in one process)."""
    launch, checkpoint = train_run
    data = launch.result().data
    assert (data["world_size"], data["dp"], data["cp"]) == (4, 2, 2), data
    for key in ("train_loss", "val_loss", "val_accuracy"):
        assert_close(torch.tensor(data[key]), torch.tensor(reference["result"][key]),
                     f"dp 2 x cp 2 vs one process x 16: {key} per epoch", **SAME_STEPS)
    weights = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert_parameters_close(weights, reference["state"], what="trained parameter, dp 2 x cp 2 "
                            "vs one process", **SAME_STEPS)
    assert data["sample_before"] == reference["result"]["sample_before"], data["sample_before"]


@pytest.mark.parametrize("argv, env, said", [
    (["--cp", "2"], {}, "--cp 2: cp must divide the processes (1)"),
    (["--cp", "3", "--size", "tiny"], {}, "--cp 3: cp must divide the processes (1) and 2 x cp "
     "the tiny model's 32 positions; try --cp 1"),
    ([], {"WORLD_SIZE": "3"}, "--cp 3 (the default: every process): cp must divide"),
])
def test_train_cp_refuses_a_degree_that_does_not_fit(outside_launcher, monkeypatch, capsys,
                                                     argv, env, said):
    """train_cp.py refuses, before any process group and with status 2, a `--cp` that does not
    divide the processes (`--cp 2` on 1) or whose double does not divide the model's 32 positions
    (`--cp 3`, and the default 3 of 3 processes), naming the script, and for `--cp 3` one that fits.
    """
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert train_cp_module().main(argv) == 2
    err = capsys.readouterr().err
    assert f"train_cp.py: error: {said}" in err, err
    assert not dist.is_initialized()


@pytest.mark.slow
@pytest.mark.parametrize("gpus", [pytest.param(n, marks=gpu_marks(n, f"nccl, cp {n}"),
                                               id=f"cp{n}") for n in (1, 2)])
def test_train_cp_on_gpus_trains_what_one_process_trains_on_the_cpu(reference, gpus):
    """train_cp.py on 1 and 2 GPUs (nccl, one GPU per rank, every rank in one cp group) gives the
    losses of lesson 03's one-process CPU run on batches of 16, to CUDA's rounding (rtol 1e-4, atol
    1e-5).

    Not yet run on a GPU."""
    run = run_script(TRAIN_SCRIPT, *TRAIN, "--batch-size", "16", launcher="torchrun", nproc=gpus)
    assert (run.data["backend"], run.data["device"], run.data["cp"]) == ("nccl", "cuda:0",
                                                                         gpus), run.data
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(run.data[key]), torch.tensor(reference["result"][key]),
                     f"cp {gpus} on GPUs vs one CPU process x 16: {key}", rtol=1e-4, atol=1e-5)


def torch_context_parallel_run(ctx):
    """torch's context_parallel around F.scaled_dot_product_attention (its memory-efficient
    CUDA kernel: context parallel handles only SDPA's CUDA kernels), against the same call on
    the whole sequence, forward and backward."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.matmul.allow_tf32 = False
    mesh = init_device_mesh("cuda", (ctx.world_size,), mesh_dim_names=("cp",))
    # 2W chunks of 32: the head-tail split applies, and each chunk is a multiple of the 32 rows
    # the memory-efficient kernel pads its log-sum-exp to (torch's ring merges it unpadded).
    length = 64 * ctx.world_size
    q, k, v = (seeded(i, 2, 4, length, 16, dtype=torch.float32).cuda() for i in range(3))
    c = seeded(10, 2, 4, length, 16, dtype=torch.float32).cuda()
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        whole = [t.clone().requires_grad_(True) for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*whole, is_causal=True)
        (want * c).sum().backward()
        buffers = [t.clone() for t in (q, k, v, c)]  # sharded in place inside the context
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
            mine = [t.detach().requires_grad_(True) for t in buffers[:3]]  # this rank's tokens
            out = F.scaled_dot_product_attention(*mine, is_causal=True)
            (out * buffers[3]).sum().backward()
            out, *grads = context_parallel_unshard(
                mesh, [out.detach(), *(t.grad for t in mine)], [2] * 4)
    return {"out": (out, want.detach()), **{name: (got, t.grad) for name, got, t in
                                             zip("qkv", grads, whole, strict=True)}}


@pytest.mark.parametrize("group", group_params(world_sizes=(), cuda_world_sizes=(),
                                               nccl_world_sizes=(1, 2)))
def test_torchs_context_parallel_equals_attention_on_the_whole_sequence(group):
    """torch's `context_parallel` around SDPA's memory-efficient CUDA kernel, causal, on 1 and 2
    nccl ranks, gives the output and the gradients of q, k and v of the same call on the whole
    sequence, to 1e-4 in float32.

    Not yet run on a GPU."""
    world, backend, device = group
    for rank, got in enumerate(run_on_ranks(torch_context_parallel_run, world_size=world,
                                            backend=backend, device=device)):
        for name, (mine, theirs) in got.items():
            what = "the output" if name == "out" else f"the gradient of {name}"
            assert_close(mine, theirs, f"{what} under torch's context_parallel", rank,
                         rtol=1e-4, atol=1e-4)

