"""Lesson 07: pipeline parallelism. One process per stage, schedules by hand, then
torch.distributed.pipelining.

What the lesson rests on, checked on gloo/CPU ranks (and on CUDA where present):
- a schedule is right when the lesson's simulator (``simulator.py``) runs it without a
  deadlock, with the bubble and the activations in flight the text gives;
- every stage of a pipeline takes the steps the unsplit model takes on the whole batch;
- a mismatched pair of schedules ends with an error naming the stage, not a hang;
- what a stage posts (its sends and receives, alone or batched) is an order NCCL can run;
- the idle time measured on every stage matches the bubble formula when the stages are even.

The reference is one process on the whole batch, with SGD: a gradient m times too large (or
1/m) moves the weights m times too far, where Adam would normalise the mistake away.

Each task's tests are in its own file (``test_07_1_schedules.py`` ... ``test_07_8_*``), with
what they share in ``common.py`` and ``conftest.py``; this file holds the lesson's own checks:
the scripts under torchrun (train_pp.py trains, balance_stages.py times layers and cuts on them),
and their refusals.
"""

from __future__ import annotations

import pytest
import torch
from gpt import GPT, GPTConfig, GPTStage

from harness.compare import assert_close
from harness.exercises import load_lesson_module
from harness.hardware import needs_gpus
from harness.launch import one_process_fit, run_script
from harness.ranks import run_on_ranks
from harness.sweep import st, sweep
from lesson07.common import BALANCE, LESSON, SCRIPT, TRAIN, every_cut, stage_times


def test_micro_batches_must_be_equal(ex):
    """micro_batches cuts a batch of 6 into 3 equal pieces and refuses a batch of 10 in 4 with a
    ValueError naming both numbers.

    That is the lesson's rule; torch's own schedules cut such a batch unevenly instead
    (tests/test_torch_claims.py shows how)."""
    pieces = ex.micro_batches(torch.arange(12).view(6, 2), 3)
    assert [tuple(p.shape) for p in pieces] == [(2, 2)] * 3
    with pytest.raises(ValueError, match=r"batch of 10 does not cut into 4 equal"):
        ex.micro_batches(torch.zeros(10, 2), 4)


# train_pp.py is lesson 03's train_ddp.py with the model cut into one stage per process, trained
# with torch's 1F1B schedule. On 2 ranks it must take the steps of one process on the same
# batches (lesson 00's script; pipelining changes where the model runs, not what it learns).
SAME_STEPS = {"rtol": 1e-3, "atol": 2e-4}  # another summation order, AdamW (lesson 03's bound)


@pytest.fixture(scope="module")
def reference():
    """What the script must reproduce: lesson 03's script, one process x 16, 64 windows."""
    return run_on_ranks(one_process_fit, 64, world_size=1, timeout=120)[0]["result"]


@pytest.mark.slow
def test_script_on_two_stages_trains_what_one_process_trains(script_run, reference):
    """train_pp.py under torchrun on 2 gloo stages, 4 micro-batches, trains what lesson 03's script
    trains as one process: train and val loss after one epoch of 64 windows (4 whole batches)
    within lesson 03's bound; both stages' busy and idle times reach rank 0, which alone prints
    them."""
    run = script_run.result()
    assert (run.data["world_size"], run.data["micro_batches"]) == (2, 4), run.data
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(run.data[key]), torch.tensor(reference[key]),
                     f"2 stages vs one process x 16: {key}", **SAME_STEPS)
    stages = run.data["stages"]
    assert [s["stage"] for s in stages] == [0, 1], stages
    for s in stages:
        assert s["busy_s"] > 0 and s["idle_s"] >= 0, s
    printed = [line for line in run.rank_lines(0) if line.startswith("stage ")]
    assert len(printed) == 2, run.output
    assert not [line for line in run.rank_lines(1) if line.startswith("stage ")], run.output


# CUDA kernels add in another order than the CPU's (lesson 03 measured the same bound).
CUDA_VS_CPU = {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.slow
@needs_gpus(2, "nccl, 2 stages")
def test_script_on_two_gpus_trains_what_one_process_trains_on_the_cpu(reference):
    """train_pp.py on 2 GPUs (nccl, 2 stages, 4 micro-batches) trains what lesson 03's script
    trains as one CPU process: train and val loss after one epoch of 64 windows within 1e-4
    relative, 1e-5 absolute."""
    run = run_script(SCRIPT, *TRAIN, "--micro-batches", "4", launcher="torchrun", nproc=2)
    assert (run.data["backend"], run.data["device"]) == ("nccl", "cuda:0"), run.data
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(run.data[key]), torch.tensor(reference[key]),
                     f"2 stages on GPUs vs one CPU process: {key}", **CUDA_VS_CPU)


@pytest.fixture
def train_script(outside_launcher):
    """train_pp.py, imported, to call its main() as plain python would run it."""
    return load_lesson_module(LESSON, "train_pp")


def test_script_refuses_more_stages_than_blocks(train_script, monkeypatch, capsys):
    """train_pp.py with WORLD_SIZE 8 exits with status 2 and one line of error naming the 8 stages
    and the 4 blocks."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert train_script.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "8 stage(s)" in err[0] and "4 blocks" in err[0], err


def test_script_refuses_a_batch_that_does_not_cut_into_micro_batches(train_script, capsys):
    """train_pp.py --batch-size 10 --micro-batches 4 exits with status 2 and one line of error
    naming the batch of 10 and the 4 micro-batches."""
    assert train_script.main(["--batch-size", "10", "--micro-batches", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "10" in err[0] and "4 micro-batches" in err[0], err


def test_script_refuses_compile(train_script, capsys):
    """train_pp.py --compile exits with status 2 and one line of error about --compile.

    --compile is every script's flag, but dynamo would cut the graphs at the clock's hooks."""
    assert train_script.main(["--compile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train_pp.py: error: --compile"), err


# balance_stages.py times each layer, cuts the blocks by parameters and by time with a search
# that does not try every cut, and runs the pipeline on each cut. What it computes from its
# measurements is checked here; how fast each cut ran is the machine's, printed, not asserted.
@pytest.fixture
def balance_script():
    return load_lesson_module(LESSON, "balance_stages")


# Whole numbers (parameter counts, ties frequent, zeros included) and measured-looking seconds.
COSTS = st.one_of(st.lists(st.integers(0, 20), min_size=1, max_size=9),
                  st.lists(st.floats(1e-5, 1e-2), min_size=1, max_size=9))


@sweep(costs=COSTS, data=st.data(), max_examples=200)
def test_the_scripts_search_finds_the_cut_trying_every_cut_finds(balance_script, costs, data):
    """balance_stages.py's fastest_cut finds the cut that trying every cut finds (the first, in
    combinations order, whose costliest stage costs least): 200 generated lists of up to 9 whole
    parameter counts (zeros and ties included) or measured-looking seconds.

    It is task 7_3's and 7_8's rule without trying every cut."""
    stages = data.draw(st.integers(1, len(costs)), label="stages")
    best, counts = min(every_cut(costs, stages), key=lambda cut: cut[0])  # the first of the best
    got = balance_script.fastest_cut(list(costs), stages)
    assert got == counts, (
        f"fastest_cut({costs}, {stages}) = {got}, stages costing "
        f"{stage_times(costs, got)}; every cut tried finds {counts}, costing "
        f"{stage_times(costs, counts)}")


def test_the_scripts_search_refuses_what_cannot_be_cut(balance_script):
    """fastest_cut raises ValueError saying that 2 layers cannot be cut into 3 stages, and 1 layer
    into 0."""
    for costs, stages in (([1.0, 2.0], 3), ([1.0], 0)):
        with pytest.raises(ValueError, match=rf"{len(costs)} layers cannot be cut into {stages}"):
            balance_script.fastest_cut(costs, stages)


@pytest.mark.slow
def test_balance_stages_cuts_on_what_it_measured(balance_run, balance_script):
    """balance_stages.py on 2 gloo ranks (4 blocks, small sizes): each layer's count is torch's,
    its cuts by parameters and by time the best of every cut of what it measured, every cut runs
    with the unsplit model's losses and squared-gradient sums, the predicted step is the formula;
    the measured step is only printed.

    The measured step is the machine's: printed, not asserted."""
    run = balance_run.result()
    data = run.data
    arg = {name: int(value) for name, value in zip(BALANCE[::2], BALANCE[1::2], strict=True)}
    m = arg["--micro-batches"]
    assert (data["world_size"], data["micro_batches"]) == (2, m), data
    model = GPT(GPTConfig(vocab_size=arg["--vocab-size"], block_size=arg["--context"],
                          n_layer=arg["--blocks"], n_head=4, n_embd=arg["--width"]), seed=0)
    blocks = model.config.n_layer
    # torch's count of each layer: its block, the embeddings first, the final norm and head last
    def count(*modules):
        return sum(p.numel() for module in modules for p in module.parameters())

    expected = [count(block) for block in model.blocks]
    expected[0] += count(model.tok_emb, model.pos_emb)
    expected[-1] += count(model.ln_f, model.lm_head)
    assert data["layer_parameters"] == expected and sum(expected) == model.num_parameters()
    layer_s = data["layer_s"]
    assert len(layer_s) == blocks and all(s > 0 for s in layer_s), layer_s
    rows = {tuple(row["blocks"]): row for row in data["rows"]}
    assert set(rows) == {(k, blocks - k) for k in range(1, blocks)}, (
        f"on 2 ranks every cut runs: {sorted(rows)}")
    named = {name: cut for cut, row in rows.items() for name in row["names"]}
    assert named == {
        "equal blocks": (blocks // 2, blocks // 2),
        "by parameters": tuple(min(every_cut(data["layer_parameters"], 2),
                                   key=lambda cut: cut[0])[1]),
        "by time": tuple(min(every_cut(layer_s, 2), key=lambda cut: cut[0])[1])}, rows
    # Every cut ran the whole model: its first step is the unsplit model's on the same batch.
    inputs, targets = balance_script.make_batch(arg["--vocab-size"],
                                                m * arg["--micro-batch-size"], arg["--context"])
    losses = [model(x, y)[1].item()
              for x, y in zip(inputs.chunk(m), targets.chunk(m), strict=True)]
    model(inputs, targets)[1].backward()
    for cut, row in rows.items():
        assert row["losses"] == pytest.approx(losses, rel=1e-5), (
            f"the cut {cut}: its micro-batches' losses {row['losses']}, the unsplit model's "
            f"{losses}")
        squares = [sum(p.grad.square().sum().item() for p in GPTStage(model, a, b).parameters())
                   for a, b in ((0, cut[0]), (cut[0], blocks))]
        assert row["grad_square_sums"] == pytest.approx(squares, rel=1e-4), (
            f"the cut {cut}: each stage's gradients' squares sum to {row['grad_square_sums']}, "
            f"the unsplit model's on the whole batch, over the same parameters, to {squares}")
        stages = stage_times(layer_s, list(cut))
        assert row["stage_s"] == pytest.approx(stages), row
        assert row["predicted_step_s"] == pytest.approx(sum(stages) + (m - 1) * max(stages)), row
        assert row["step_s"] > 0, row
    printed = [line for line in run.rank_lines(0) if line.startswith(("1 3", "2 2", "3 1"))]
    assert len(printed) == 3 and "equal blocks" in printed[1], run.output


def test_balance_stages_refuses_more_stages_than_blocks(balance_script, outside_launcher,
                                                        monkeypatch, capsys):
    """balance_stages.py exits with status 2 and one line of error for 8 stages of 4 blocks, and
    for --width 30, which does not split into 4 heads."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert balance_script.main(["--blocks", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "8 stages cannot share 4 blocks" in err[0], err
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert balance_script.main(["--width", "30"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--width 30 must split into 4 heads" in err[0], err
