"""Lesson 08: measure and choose. What a collective costs, what DDP's communication costs, a
compression hook, and the decision between the methods.

What the lesson rests on, checked in the tasks' files (test_08_K_*.py, ``pytest
lessons/08_measure_and_choose -m task8_K``) and here:
- the bus bandwidth and the alpha-beta model are the formulas of the text (points made from
  known alpha and beta are fitted back, noisy ones by least squares);
- DDP's buckets are the ones torch itself assigns (asked of torch, not copied from it);
- a bf16 hook trains like fp32 DDP within bf16's precision and sends half the bytes, counted
  on the ranks as torch dispatches each all-reduce;
- the decision function follows the README's table, row by row (the test reads the table).

The benchmark scripts run at tiny sizes: their files have every column, op and setting; no
number is held against a clock here (the README quotes measured runs).

This file holds the lesson's own checks (the README's table and hints, the scripts), which run last.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import time
from pathlib import Path

import pytest
import torch
from gpt import GPT, GPTConfig

from harness.compare import assert_close
from harness.exercises import load_lesson_module
from harness.hardware import needs_gpus
from harness.launch import QUICK_SAMPLE_LENGTH, one_process_fit, run_script
from harness.ranks import run_on_ranks
from lesson08.common import (
    BENCH,
    LESSON,
    METHODS,
    OPS,
    README,
    SIZES,
    TINY,
    noisy_times,
    readme_cases,
    relative_least_squares,
    ring_factor,
    ring_seconds,
)

# ----------------------------------------------------------------------------- the README's table


def test_the_readme_table_covers_every_method_and_an_error():
    """The README's decision table, which task8_4 grades against, has a row for one device, ddp,
    fsdp, tp+fsdp and pp+fsdp, and one where nothing fits."""
    methods = {case["method"] for case in readme_cases()}
    assert methods >= {"one device", "ddp", "fsdp", "tp+fsdp", "pp+fsdp", "error"}, methods


# ----------------------------------------------------------------------------- the hints

# task8_1's hint, sentence by sentence, and the line of fit_as_the_hint_says that follows each.
FIT_HINT = (r"Weight each point by $w = 1/t^2$",
            r"$\bar n = \sum w n / \sum w$ and $\bar t = \sum w t / \sum w$",
            r"$b = \frac{\sum w (n - \bar n)(t - \bar t)}{\sum w (n - \bar n)^2}$",
            r"the intercept $a = \bar t - b \bar n$",
            r"The intercept is the $2(W-1)\alpha$ of the formula, and the slope is its "
            r"$\frac{2(W-1)}{W}\beta$")


def fit_as_the_hint_says(sizes, seconds, world: int) -> tuple[float, float]:
    n = torch.tensor(sizes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    w = 1 / t**2
    n_bar, t_bar = (w * n).sum() / w.sum(), (w * t).sum() / w.sum()
    b = (w * (n - n_bar) * (t - t_bar)).sum() / (w * (n - n_bar) ** 2).sum()
    a = t_bar - b * n_bar
    steps = 2 * (world - 1)
    return float(a) / steps, float(b) / (steps / world)


def test_a_learner_who_follows_the_fit_hint_gets_the_graders_line():
    """The hint of task8_1 says what the grader checks: the line fitted to the relative errors
    (the oracle of test_08_1), on the grader's own noisy points and on exact ones."""
    hint = " ".join(README.read_text().split("<summary>Hint (task8_1)</summary>", 1)[1]
                    .split("</details>", 1)[0].split())
    for sentence in FIT_HINT:
        assert sentence in hint, f"the task8_1 hint no longer says {sentence!r}: update FIT_HINT"
    cases = [(SIZES + SIZES, 4, noisy_times(SIZES + SIZES, 4, 30e-6, 1e-10, 0.1, seed=8)),
             *((SIZES, 2, noisy_times(SIZES, 2, 20e-6, 1e-9, 0.01, seed=s)) for s in range(4))]
    for sizes, world, seconds in cases:
        assert_close(torch.tensor(fit_as_the_hint_says(sizes, seconds, world)),
                     torch.tensor(relative_least_squares(sizes, seconds, world)),
                     "the task8_1 hint's fit against the grader's", rtol=1e-6, atol=0)
    exact = [ring_seconds(n, 3, 25e-6, 1 / 20e9) for n in SIZES]
    assert_close(torch.tensor(fit_as_the_hint_says(SIZES, exact, 3), dtype=torch.float64),
                 torch.tensor([25e-6, 1 / 20e9], dtype=torch.float64),
                 "the task8_1 hint's fit of exact points", rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- the scripts


@pytest.mark.slow
def test_collective_benchmark_writes_every_op_and_size(launches):
    """bench_collectives.py on 2 ranks at 1, 4 and 16 KiB writes a CSV row of every column for each
    op and size: positive times on 2 ranks, a prediction for the all-reduces only, a nonzero fitted
    beta; and an SVG plot where matplotlib is installed."""
    run = launches["bench"].result()
    with open(launches["folder"] / "c.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert rows and list(rows[0]) == ["op", "backend", "world_size", "bytes", "seconds",
                                      "algbw_GBps", "busbw_GBps", "predicted_seconds"], rows[:1]
    assert {(r["op"], int(r["bytes"])) for r in rows} == set(
        itertools.product(OPS, [1024, 4096, 16384])), rows
    for r in rows:
        assert float(r["seconds"]) > 0 and int(r["world_size"]) == 2, r
        assert (r["predicted_seconds"] != "") == (r["op"] == "all_reduce"), r
    assert run.data["fit"]["beta_s_per_byte"] != 0, run.data["fit"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return  # the GPU machines' image: no plot, and the script said so
    assert (launches["folder"] / "c.svg").read_text().lstrip().startswith("<?xml"), "no SVG"


@pytest.mark.slow
def test_ddp_costs_predicts_and_measures_every_setting(launches):
    """ddp_costs.py at a tiny size on 2 ranks predicts and measures the default buckets,
    gradient_as_bucket_view and the bf16 hook; with bucket views there is one gradient storage per
    bucket, without them more than 2; its profiler trace is written and holds an all-reduce.

    At this size the fit is mostly noise: a prediction must exist and be finite, its sign is not
    asserted."""
    data = launches["costs"].result().data
    settings = data["settings"]  # the default, gradient_as_bucket_view and the bf16 hook
    assert list(settings) == ["default buckets (25 MiB)", "gradient_as_bucket_view",
                              "bf16 compression hook"], list(settings)
    for name, numbers in settings.items():
        # At this size the fit is mostly noise: a prediction exists, its sign is not asserted.
        assert math.isfinite(numbers["predicted_s"]) and numbers["step_s"] > 0, (name, numbers)
        assert "exposed_s" in numbers and numbers["buckets_bytes"], (name, numbers)
    # The gradients are views into the buckets with gradient_as_bucket_view, and only then.
    assert settings["gradient_as_bucket_view"]["gradient_storages"] == len(
        settings["gradient_as_bucket_view"]["buckets_bytes"])
    assert settings["default buckets (25 MiB)"]["gradient_storages"] > 2
    assert settings["default buckets (25 MiB)"]["trace"]["all_reduces"] >= 1
    assert (launches["folder"] / "trace.json").stat().st_size > 0


def test_benchmark_refuses_one_rank(outside_launcher, capsys):
    """bench_collectives.py run without a launcher, on one rank, exits with 2 and says to start it
    with `torchrun --nproc-per-node=2`."""
    bench = load_lesson_module(LESSON, "bench_collectives")
    assert bench.main(["--max-bytes", "1024"]) == 2
    assert "torchrun --nproc-per-node=2" in capsys.readouterr().err


def test_read_trace_reads_a_trace_file_and_names_what_it_cannot_read(outside_launcher,
                                                                     tmp_path, capsys):
    """read_trace.py refuses one rank; `--read` of a 3-event trace prints its step (0.9 ms, no data,
    backward 0.3, communication 0.4 of which 0.3 exposed), and names a step the trace lacks and a
    file it cannot read, exiting with 2."""
    script = load_lesson_module(LESSON, "read_trace")
    assert script.main([]) == 2, "one rank: DDP sends nothing"
    assert "--nproc-per-node=2" in capsys.readouterr().err
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "ProfilerStep#2", "ts": 1000.0, "dur": 900.0},
        {"ph": "X", "name": "autograd::engine::evaluate_function: AddmmBackward0", "ts": 1100.0,
         "dur": 300.0},
        {"ph": "X", "name": "gloo:all_reduce", "ts": 1300.0, "dur": 400.0}]}))
    assert script.main(["--read", str(trace)]) == 0
    row = capsys.readouterr().out.splitlines()[-1].split()
    # step 0.9 ms, no data, backward 0.3, communication 0.4 of which 0.3 exposed
    assert row[:6] == ["trace", "0.9", "0.00", "0.3", "0.4", "0.3"], row
    assert script.main(["--read", str(trace), "--step", "3"]) == 2
    assert "no event ProfilerStep#3" in capsys.readouterr().err
    assert script.main(["--read", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_input_pipeline_loads_slowly_what_the_data_holds_and_refuses_one_rank(outside_launcher,
                                                                              capsys):
    """input_pipeline.py's SlowToLoad gives back the samples it wraps, each after its load time (3
    samples of 10 ms take at least 30 ms), and the script refuses one rank."""
    script = load_lesson_module(LESSON, "input_pipeline")
    data = [(torch.tensor([k]), torch.tensor([k + 1])) for k in range(3)]
    slow = script.SlowToLoad(data, 0.01)
    began = time.perf_counter()
    assert len(slow) == 3 and [slow[k] for k in range(3)] == data
    assert time.perf_counter() - began >= 0.03, "each sample waits its load time"
    assert script.main([]) == 2, "one rank"
    assert "--nproc-per-node=2" in capsys.readouterr().err


def test_the_scripts_prediction_is_the_lessons_formula():
    """bench_collectives.py's own fit and ring are the ones the tasks grade: its fit gives back the
    alpha and beta of exact points on 4 ranks and equals the relative least squares on noisy ones,
    and its all-reduce prediction is the ring's formula.

    The script carries its own copy of them, so that a reader can copy the file alone."""
    bench = load_lesson_module(LESSON, "bench_collectives")
    seconds = [ring_seconds(n, 4, 7e-6, 1e-9) for n in SIZES]
    got = bench.fit_alpha_beta(SIZES, seconds, 4)
    assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor([7e-6, 1e-9],
                 dtype=torch.float64), "bench_collectives.fit_alpha_beta", rtol=1e-6, atol=0)
    noisy = noisy_times(SIZES, 4, 7e-6, 1e-9, 0.1, seed=3)
    assert_close(torch.tensor(bench.fit_alpha_beta(SIZES, noisy, 4), dtype=torch.float64),
                 torch.tensor(relative_least_squares(SIZES, noisy, 4), dtype=torch.float64),
                 "bench_collectives.fit_alpha_beta on noisy points: the relative errors' "
                 "least squares", rtol=1e-6, atol=0)
    assert bench.predict_allreduce_seconds(4096, 4, 7e-6, 1e-9) == pytest.approx(
        ring_seconds(4096, 4, 7e-6, 1e-9), rel=1e-12)


def test_ring_factors_of_the_script_are_the_texts():
    """bench_collectives.py's ring factors are the text's, for each of the four ops on 2, 4 and 8
    ranks."""
    bench = load_lesson_module(LESSON, "bench_collectives")
    for op, world in itertools.product(OPS, (2, 4, 8)):
        assert bench.RING_FACTOR[op](world) == pytest.approx(ring_factor(op, world)), op


@pytest.mark.slow
def test_methods_side_by_side_ran_every_method_and_measured_what_they_send_and_keep(launches):
    """compare_methods.py at a tiny size runs every method on 2 ranks: its bytes per step equal the
    formulas worked out in the test, its state is within 2 % of 16 bytes per kept parameter, and a
    step's peak moves as the text says. No number is compared with a clock.

    The bytes: DDP 4P for P parameters, tensor parallel 4 L B T C x 4 (4 all-reduces of (B, T, C)
    per block, L blocks), 1F1B and zero bubble B T C x 4, interleaved 1F1B 3 B T C x 4 on either
    rank, FSDP between 8P and 12P and the same checkpointed, not resharded 8P within 2 %; the
    script's own predictions equal what it sent. FSDP keeps under 0.6 of DDP's state. The peak:
    lower checkpointed, higher not resharded by at most the blocks' parameters, higher on rank 0
    interleaved, zero bubble's rank 0 within 3 % of 1F1B's and its last stage higher."""
    rows = launches["methods"].result().data
    with open(launches["folder"] / "m.csv") as handle:
        columns = next(csv.reader(handle))
    assert columns == ["rank", "method", "ranks", "device", "samples_per_s", "step_ms",
                       "compute_ms", "exposed_comm_ms", "state_bytes", "predicted_state_bytes",
                       "step_peak_bytes", "peak_bytes", "comm_bytes",
                       "predicted_comm_bytes"], columns
    expected = {"one process", "ddp", "fsdp", "fsdp+ac", "fsdp no reshard", "tp", "pp",
                "pp interleaved", "pp zero bubble"} | (
        {"dataparallel"} if torch.cuda.device_count() >= 2 else set())
    first = {row["method"]: row for row in rows if row["rank"] == 0}
    second = {row["method"]: row for row in rows if row["rank"] == 1}
    assert set(first) == expected, sorted(first)
    for row in rows:
        for key in ("samples_per_s", "step_ms", "compute_ms", "exposed_comm_ms", "state_bytes",
                    "predicted_state_bytes", "step_peak_bytes", "comm_bytes",
                    "predicted_comm_bytes"):
            assert row[key] is not None and row[key] >= 0, (row["method"], key, row)
    # The payload each method moves per step, from the lessons' formulas, worked out here.
    config = GPTConfig(vocab_size=65, block_size=TINY["context"], n_layer=TINY["blocks"],
                       n_head=4, n_embd=TINY["width"])
    params = GPT(config).num_parameters()
    activation = TINY["batch_size"] * TINY["context"] * TINY["width"] * 4
    assert first["one process"]["comm_bytes"] == 0
    assert first["ddp"]["comm_bytes"] == 4 * params, "DDP: one all-reduce of every gradient"
    assert first["tp"]["comm_bytes"] == 4 * TINY["blocks"] * activation, (
        "tensor parallel: 2 all-reduces of (B, T, C) per block forward, 2 backward")
    assert first["pp"]["comm_bytes"] == activation, "pipeline: stage 0 sends the activations"
    assert first["pp zero bubble"]["comm_bytes"] == activation, (
        "zero bubble: the same messages as 1F1B, in another order")
    for rank in (first, second):  # either rank's 2 chunks: 2 sends forward, 1 back, or 1 and 2
        assert rank["pp interleaved"]["comm_bytes"] == 3 * activation, (
            "interleaved 1F1B on 2 ranks x 2 chunks: each rank sends 3 batches' activations "
            "or their gradients")
    for method in ("ddp", "tp", "pp", "pp interleaved", "pp zero bubble"):
        assert first[method]["predicted_comm_bytes"] == first[method]["comm_bytes"], (
            f"compare_methods.py's own prediction for {method} is not what it sent")
    assert 2 * 4 * params <= first["fsdp"]["comm_bytes"] <= 3 * 4 * params, (
        "FSDP: an all-gather forward, one backward (not the root's), a reduce-scatter")
    assert first["fsdp+ac"]["comm_bytes"] == first["fsdp"]["comm_bytes"], (
        "a checkpointed block recomputes its forward inside the backward's all-gather")
    assert first["fsdp no reshard"]["comm_bytes"] == pytest.approx(2 * 4 * params, rel=0.02), (
        "FSDP without resharding after the forward: one all-gather, one reduce-scatter")
    for row in rows:  # 16 bytes per parameter a rank keeps (lesson 05), within FSDP's padding
        assert row["state_bytes"] == pytest.approx(row["predicted_state_bytes"], rel=0.02), row
    assert first["fsdp"]["state_bytes"] < first["ddp"]["state_bytes"] * 0.6
    # What a step holds above the state: checkpointing lowers it, keeping the gathered blocks
    # raises it by at most their bytes; interleaving raises rank 0's, zero bubble leaves rank
    # 0's as 1F1B's (its first stage holds p micro-batches either way) and raises the last
    # stage's.
    peak = {method: (first[method]["step_peak_bytes"], second.get(method, {}).get(
        "step_peak_bytes")) for method in first}
    assert peak["fsdp+ac"][0] < peak["fsdp"][0], peak
    gathered_blocks = 4 * sum(p.numel() for p in GPT(config).blocks.parameters())
    assert 0 < peak["fsdp no reshard"][0] - peak["fsdp"][0] <= gathered_blocks, peak
    assert peak["pp interleaved"][0] > peak["pp"][0], peak
    assert peak["pp zero bubble"][0] == pytest.approx(peak["pp"][0], rel=0.03), peak
    assert peak["pp zero bubble"][1] > peak["pp"][1], peak


def test_compare_methods_refuses_to_run_under_torchrun(outside_launcher, monkeypatch, capsys):
    """compare_methods.py refuses to run under torchrun (it starts torchrun itself): with RANK set
    it exits with 2 and says to run it with plain python."""
    script = load_lesson_module(LESSON, "compare_methods")
    monkeypatch.setenv("RANK", "0")
    assert script.main([]) == 2
    assert "plain python" in capsys.readouterr().err


def test_compare_methods_refuses_blocks_its_pipelines_cannot_split(outside_launcher, capsys):
    """compare_methods.py refuses a --blocks its pipelines cannot split, before any process starts,
    naming the number to use: interleaved 1F1B on 2 ranks needs a multiple of 4 stages (6 refused),
    the other pipelines a multiple of 2 (3 refused)."""
    script = load_lesson_module(LESSON, "compare_methods")
    assert script.main(["--blocks", "6"]) == 2
    assert "--blocks by 4" in capsys.readouterr().err
    assert script.main(["--blocks", "3", "--methods", "ddp,pp"]) == 2
    assert "--blocks by 2" in capsys.readouterr().err


def test_scaling_refuses_anything_but_two_ranks(outside_launcher, capsys):
    """scaling.py run on one rank exits with 2 and says it needs exactly 2 ranks."""
    script = load_lesson_module(LESSON, "scaling")
    assert script.main(["--steps", "1"]) == 2
    assert "exactly 2 ranks" in capsys.readouterr().err


@pytest.mark.slow
@needs_gpus(2, "nccl, 2 ranks")
def test_collective_benchmark_on_two_gpus_uses_nccl(tmp_path):
    """bench_collectives.py on 2 GPUs runs on nccl and measures all four ops."""
    run = run_script(BENCH, "--max-bytes", "1048576", "--steps", "2", launcher="torchrun",
                     nproc=2)
    assert run.data["backend"] == "nccl", run.data["backend"]
    assert {r["op"] for r in run.data["rows"]} == set(OPS)


@pytest.mark.slow
@needs_gpus(2, "nccl, 2 ranks, and nn.DataParallel on 2 GPUs")
def test_methods_side_by_side_on_two_gpus_include_dataparallel_and_peak_memory():
    """compare_methods.py on 2 GPUs adds nn.DataParallel, runs DDP on cuda:0, and reports for every
    row an allocator peak at least its training state."""
    rows = run_script(METHODS, *[f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()],
                      "--steps", "1", "--warmup", "1", timeout=300).data
    first = {row["method"]: row for row in rows if row["rank"] == 0}
    assert "dataparallel" in first and first["ddp"]["device"] == "cuda:0", first
    assert all(row["peak_bytes"] and row["peak_bytes"] >= row["state_bytes"] for row in rows)


# fp16 computation and bf16 gradients move a loss by a few parts in a thousand over 4 steps;
# a step that was skipped, or gradients summed over the ranks, move it by far more.
AMP_STEPS = {"rtol": 1e-2, "atol": 1e-2}


def amp_fit(ctx, checkpoint: str) -> dict:
    """train_amp.py's fit() on pooled ranks, as its main() runs it under torchrun (the
    manifest's smallest run launches the script itself): 2 x 8, fp16, bf16 gradients."""
    script = load_lesson_module(LESSON, "train_amp")
    model, result = script.fit(ctx.device, epochs=1, batch_size=8, train_windows=64,
                               fp16=True, comm_hook="bf16", sample_length=QUICK_SAMPLE_LENGTH,
                               log=lambda *a, **k: None)
    if ctx.rank == 0:
        script.run.save_checkpoint({"model": model.state_dict(), "scaler": result["scaler"]},
                               Path(checkpoint), log=lambda *a, **k: None)
    return result


def test_fp16_with_a_grad_scaler_under_ddp_trains_like_fp32_and_checkpoints_the_scaler(
        tmp_path):
    """train_amp.py in fp16 with a GradScaler and bf16 gradients trains like fp32 and checkpoints
    the scaler: 2 gloo ranks x 8 against one fp32 process x 16 on the same batches (lesson 03's
    script), losses within 1e-2 (+ 1 %), no step skipped, the scaler's state beside the model's.

    64 windows, 16 a step: 4 steps, none skipped for an overflow, so the saved scale is still 2**16
    and its growth tracker 4."""
    data = run_on_ranks(amp_fit, str(tmp_path / "amp.pt"), timeout=120)[0]
    reference = run_on_ranks(one_process_fit, 64, world_size=1, timeout=120)[0]["result"]
    assert (data["world_size"], data["fp16"], data["comm_hook"]) == (2, True, "bf16")
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(data[key]), torch.tensor(reference[key]),
                     f"fp16 + bf16 gradients on 2 ranks x 8 vs fp32, one process x 16: {key}",
                     **AMP_STEPS)
    # 64 windows, 16 a step: 4 steps, none skipped for an overflow (the scale stays 2**16).
    assert data["scaler"]["_growth_tracker"] == 4, data["scaler"]
    saved = torch.load(tmp_path / "amp.pt", weights_only=True)
    assert set(saved) == {"model", "scaler"}, list(saved)
    assert saved["scaler"]["scale"] == 2.0**16 and saved["scaler"]["_growth_tracker"] == 4


# ------------------------------------------------------------------ dry_run.py: a fake world


def dry_run_printed(argv: list[str]) -> tuple[int, str]:
    """dry_run.py's exit code and what it printed: in a child (in_a_child), since the fake
    group must be its process's default group and FSDP2's backward leaves a process unfit to
    fork ranks from."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = load_lesson_module(LESSON, "dry_run").main(argv)
    return code, printed.getvalue()


def fake_gpt_step(world: int) -> list[tuple[str, int]]:
    script = load_lesson_module(LESSON, "dry_run")
    config = GPTConfig.named("tiny", vocab_size=script.VOCAB)
    with torch.device("meta"):
        base = GPT(config)
    return script.one_step(base, config, world, 2)[0]


def real_gpt_step(ctx) -> list[tuple[str, int]]:
    """One step of the tiny GPT under FSDP2 on real gloo ranks, counted in Python (the
    harness's CollectiveLog, not the script's dispatch counter)."""
    from torch.distributed.device_mesh import init_device_mesh

    from harness.collectives import CollectiveLog

    script = load_lesson_module(LESSON, "dry_run")
    config = GPTConfig.named("tiny", vocab_size=script.VOCAB)
    model = script.shard(GPT(config), init_device_mesh("cpu", (ctx.world_size,)))
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size + 1))
    with CollectiveLog() as log:
        model(tokens[:, :-1], tokens[:, 1:])[1].backward()
    return [(call.op, call.payload) for call in log.calls]


def test_dry_run_plays_every_rank_and_predicts_the_step(outside_launcher):
    """dry_run.py over 4 ranks of the tiny GPT prints every rank's shard as torch.chunk along the
    first dimension cuts it, the padded embedding, and fsdp_step_collectives agreeing with its step;
    its fake step issues what a real run on 2 gloo ranks does, counted in Python."""
    from collections import Counter

    import torch._dynamo  # noqa: F401  (imported once here, not in every child)

    from harness.ranks import in_a_child

    world = 4
    code, printed = in_a_child(dry_run_printed, ["--world", str(world), "--size", "tiny"])
    assert code == 0, printed
    assert "fsdp_step_collectives predicts 14 collectives" in printed and "the same ones" in (
        printed), printed
    # Every rank's shard, from torch.chunk along the first dimension (what the text says
    # FSDP2 does), against what the script read off each rank's sharded model.
    config = GPTConfig.named("tiny", vocab_size=65)
    with torch.device("meta"):
        model = GPT(config)
    held = Counter()
    for rank in range(world):
        held[sum((len(pieces[rank]) if rank < len(pieces) else 0) * math.prod(p.shape[1:])
                 for p in model.parameters()
                 for pieces in [torch.chunk(torch.empty(p.shape[0], device="meta"), world)])] += 1
    for count in held:
        assert f"{count:,} parameters each" in printed, (count, printed)
    assert "tok_emb.weight (65, 32): ranks 0-2 hold 17 rows, rank 3 holds 14 rows; it travels " \
           "as 68 rows" in printed, printed
    # The fake world's step is the real one: the same collectives on 2 gloo ranks.
    fake = in_a_child(fake_gpt_step, 2)
    for rank, real in enumerate(run_on_ranks(real_gpt_step)):
        assert Counter(real) == Counter(fake), (
            f"rank {rank} of a real 2-rank run issued {sorted(real)}, the fake world "
            f"{sorted(fake)}")


def test_dry_run_refuses_a_launcher_and_a_world_of_one(outside_launcher, monkeypatch, capsys):
    """dry_run.py refuses `--world 1` (FSDP shards over 2 or more ranks) and a launcher: with RANK
    set it exits with 2 and says to run it with python, not torchrun."""
    script = load_lesson_module(LESSON, "dry_run")
    with pytest.raises(SystemExit):
        script.main(["--world", "1"])
    assert "2 or more ranks" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    assert script.main([]) == 2
    assert "not torchrun" in capsys.readouterr().err
