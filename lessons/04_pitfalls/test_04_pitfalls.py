"""Lesson 04: every pitfall's symptom is real, every fix removes it, and the doctor never hangs.

Each lab script's ``demo(fix)`` runs here on pooled ranks: the buggy variant must show the
symptom the lesson claims (so the lesson cannot claim what does not happen), and the fix must
remove it. Demonstrated hangs run in a pool whose process group times out after HANG_TIMEOUT
seconds, so torch's own timeout error ends them within seconds.

The tasks' tests are in test_04_K_*.py, one file per task (``pytest lessons/04_pitfalls -m
task4_K``); this file holds the labs' checks and the real launches, which run last.
"""

from __future__ import annotations

import ast
import difflib
import os
import time
from pathlib import Path

import pytest
import torch

from harness.compare import assert_close
from harness.exercises import load_lesson_module
from harness.hardware import needs_gpus
from harness.launch import run_script
from harness.ranks import RankError, run_on_ranks
from lesson04.common import DOCTOR, LESSON, TRUE_ACCURACY, lab

HANG_TIMEOUT = 2  # s: the process-group timeout under which a demonstrated hang becomes an error


def lab_on_rank(ctx, name: str, *args, fix: bool, **kwargs):
    """Run a lab's demo on this rank, inside the pool's process group."""
    return lab(name).demo(fix, *args, **kwargs)


def run_lab(name: str, *args, fix: bool, **kwargs) -> list[dict]:
    return run_on_ranks(lab_on_rank, name, *args, fix=fix, **kwargs)


# ----------------------------------------------------------------------------- the labs' scaffold

LABS = sorted((Path(__file__).parent / "labs").glob("[0-9][0-9]_*.py"))
SCAFFOLD = ("setup", "demo", "summarize", "main")


def test_every_lab_carries_the_same_scaffold():
    """All 15 labs carry the same scaffold, copied, not imported: one `setup()`, identical in
    every lab; `demo(fix, ...)` and `summarize(facts, fix)` called from `main`; the `--fix` and
    `--result` options.

    A lab is one file a learner can copy and run alone, so the scaffold is copied into every lab
    rather than imported."""
    assert len(LABS) >= 15, f"expected the 15 labs, found {[p.name for p in LABS]}"
    first, reference = None, None
    for path in LABS:
        source = path.read_text()
        functions = {node.name: node for node in ast.parse(source).body
                     if isinstance(node, ast.FunctionDef)}
        missing = [name for name in SCAFFOLD if name not in functions]
        assert not missing, f"labs/{path.name} lacks {missing}: copy them from labs/{LABS[0].name}"
        start = ast.get_source_segment(source, functions["setup"])
        if reference is None:
            first, reference = path.name, start
        elif start != reference:
            diff = "\n".join(difflib.unified_diff(reference.splitlines(), start.splitlines(),
                                                  f"labs/{first}", f"labs/{path.name}",
                                                  lineterm=""))
            raise AssertionError(f"labs/{path.name}'s setup() differs from labs/{first}'s: every "
                                 f"lab carries the same copy, so change them all together\n{diff}")
        demo = [a.arg for a in functions["demo"].args.args]
        assert demo[:1] == ["fix"], f"labs/{path.name}: demo's first argument is fix, not {demo}"
        summarize = [a.arg for a in functions["summarize"].args.args]
        assert summarize == ["facts", "fix"], (
            f"labs/{path.name}: summarize(facts, fix) returns (symptom, verdict); got {summarize}")
        calls = [node for node in ast.walk(functions["main"]) if isinstance(node, ast.Call)]
        called = {node.func.id for node in calls if isinstance(node.func, ast.Name)}
        assert {"setup", "demo", "summarize"} <= called, (
            f"labs/{path.name}: main calls {sorted(called)}; it should call setup, demo and "
            f"summarize")
        options = {node.args[0].value for node in calls
                   if isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
                   and node.args and isinstance(node.args[0], ast.Constant)}
        assert {"--fix", "--result"} <= options, (
            f"labs/{path.name} accepts {sorted(options)}; every lab accepts --fix and --result")


# ----------------------------------------------------------------------------- 1 · set_epoch


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_set_epoch_decides_whether_epochs_reshuffle(fix):
    """Lab 1 on 2 gloo ranks, 12 samples, 3 epochs: without `set_epoch` every epoch repeats epoch
    0's order, with it every epoch's order is new; either way the ranks' shards cover the 12 samples
    once per epoch."""
    facts = run_lab("01_set_epoch", fix=fix)
    for f in facts:
        orders = f["orders"]
        if fix:
            assert len({tuple(o) for o in orders}) == len(orders), (
                f"rank {f['rank']}: with set_epoch every epoch should read a new order: {orders}")
        else:
            assert all(o == orders[0] for o in orders), (
                f"rank {f['rank']}: without set_epoch every epoch repeats epoch 0: {orders}")
    for epoch in range(len(facts[0]["orders"])):  # still one permutation shared by the ranks
        everything = sorted(i for f in facts for i in f["orders"][epoch])
        assert everything == list(range(12)), f"epoch {epoch}: the ranks' shards {everything}"
    assert lab("01_set_epoch").summarize(facts, fix=fix)[0] is not fix


# ----------------------------------------------------------------------------- 2 · no sampler


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_without_a_sampler_every_rank_reads_everything(fix):
    """Lab 2 on 2 gloo ranks, 12 samples in batches of 3: without a sampler each rank reads all 12
    in 4 steps, with `DistributedSampler` disjoint halves in 2 steps; `shuffle=True` next to a
    sampler raises "mutually exclusive"."""
    facts = run_lab("02_no_sampler", fix=fix)
    seen = [sorted(f["seen"]) for f in facts]
    if fix:
        assert sorted(i for s in seen for i in s) == list(range(12)), f"shards overlap: {seen}"
        assert all(f["steps"] == 2 for f in facts), "12 samples, 2 ranks, batch 3: 2 steps each"
    else:
        assert all(s == list(range(12)) for s in seen), f"each rank should read all 12: {seen}"
        assert all(f["steps"] == 4 for f in facts), "as many steps per epoch as one GPU"
    assert "mutually exclusive" in facts[0]["shuffle_and_sampler"]
    assert lab("02_no_sampler").summarize(facts, fix=fix)[0] is not fix


# ----------------------------------------------------------------------------- 3 · padded eval


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_padding_skews_an_evaluation_metric(fix):
    """Lab 3 on 2 gloo ranks, 11 samples, 8 classified right: the padded sampler evaluates sample 0
    twice and reports 8/12, and averaging the ranks' accuracies gives the mean of 5/6 and 3/5; the
    fix evaluates every sample once and reports 8/11, as one process does."""
    facts = run_lab("03_padded_eval", fix=fix)
    evaluated = [i for f in facts for i in f["shard"]]
    for f in facts:
        assert f["truth"] == pytest.approx(TRUE_ACCURACY)
    if fix:
        assert sorted(evaluated) == list(range(11)), "each sample evaluated exactly once"
        assert all(f["reported"] == pytest.approx(TRUE_ACCURACY) for f in facts)
    else:
        assert len(evaluated) == 12 and evaluated.count(0) == 2, f"sample 0 padded: {evaluated}"
        assert facts[0]["reported"] == pytest.approx(8 / 12), "the padded duplicate is counted"
        assert facts[0]["mean_of_ranks"] == pytest.approx((5 / 6 + 3 / 5) / 2), (
            "averaging the accuracies of shards of 6 and 5 samples weighs them alike")
    assert lab("03_padded_eval").summarize(facts, fix=fix)[0] is not fix


# ----------------------------------------------------------------------------- 4 · device


def test_global_rank_as_gpu_index_overflows_the_second_machine():
    """Lab 4 for an emulated job of 2 machines with 2 GPUs each: the global rank picks GPUs 0, 1, 2,
    3 (the second machine has no 2 or 3), the local rank 0, 1, 0, 1; the lab reports the first as
    the symptom and the second as fixed."""
    lab04 = lab("04_device_from_rank")
    buggy = [lab04.gpu_index(env, fix=False) for env in lab04.TWO_MACHINES]
    fixed = [lab04.gpu_index(env, fix=True) for env in lab04.TWO_MACHINES]
    assert buggy == [0, 1, 2, 3], "RANK as the GPU index: the second machine asks for 2 and 3"
    assert fixed == [0, 1, 0, 1], "LOCAL_RANK: every machine uses its own cuda:0 and cuda:1"
    assert lab04.summarize([{"emulated": buggy}], fix=False)[0]
    assert not lab04.summarize([{"emulated": fixed}], fix=True)[0]


def test_the_lab_names_the_process_that_asked_for_a_gpu_its_machine_lacks():
    """Lab 4's verdict names what went wrong from the facts ranks gather: rank 1 (local rank 0)
    asking for `cuda:1`, rank 1's tensors on `cuda:0`, LOCAL_RANK 1 on a machine with 1 GPU; and
    `cuda:0` on both ranks of two one-GPU nodes passes.

    The first is what lesson 09's two-node GPU run reports, given here as the facts its ranks
    gather."""
    lab04 = lab("04_device_from_rank")
    emulated = [lab04.gpu_index(env, fix=False) for env in lab04.TWO_MACHINES]
    two_nodes = [{"rank": 0, "local_rank": 0, "emulated": emulated, "bare_cuda_tensor": "cuda:0"},
                 {"rank": 1, "local_rank": 0, "emulated": emulated, "bare_cuda_tensor": "cuda:0",
                  "rank_as_gpu_error": "CUDA error: invalid device ordinal"}]
    symptom, verdict = lab04.summarize(two_nodes, fix=False)
    assert symptom and "rank 1 (local rank 0) asked for cuda:1: CUDA error" in verdict, verdict
    emulated = [lab04.gpu_index(env, fix=True) for env in lab04.TWO_MACHINES]
    fixed = [{"rank": r, "local_rank": 0, "emulated": emulated, "bare_cuda_tensor": "cuda:0"}
             for r in (0, 1)]
    assert not lab04.summarize(fixed, fix=True)[0], "one GPU per node: cuda:0 on both is right"
    one_machine = [{**fixed[0]}, {**fixed[1], "local_rank": 1}]
    symptom, verdict = lab04.summarize(one_machine, fix=True)
    assert symptom and "rank 1's tensors landed on cuda:0" in verdict, verdict
    one_gpu = [{**fixed[0]}, {"rank": 1, "local_rank": 1, "emulated": emulated, "gpus_here": 1}]
    symptom, verdict = lab04.summarize(one_gpu, fix=True)
    assert symptom and "rank 1 has LOCAL_RANK 1, but its machine has 1 GPU(s)" in verdict, verdict


@pytest.mark.slow
@needs_gpus(2, "two ranks on two GPUs, to see where a bare 'cuda' lands")
def test_without_set_device_every_rank_lands_on_gpu_0():
    """Lab 4 under torchrun with 2 ranks on 2 GPUs: without `set_device` both ranks' bare `"cuda"`
    tensors land on `cuda:0`; with `--fix`, on `cuda:0` and `cuda:1`."""
    script = f"lessons/{LESSON}/labs/04_device_from_rank.py"
    buggy = run_script(script, launcher="torchrun", nproc=2).data["ranks"]
    fixed = run_script(script, "--fix", launcher="torchrun", nproc=2).data["ranks"]
    assert [r["bare_cuda_tensor"] for r in buggy] == ["cuda:0", "cuda:0"]
    assert [r["bare_cuda_tensor"] for r in fixed] == ["cuda:0", "cuda:1"]


# ----------------------------------------------------------------------------- 5 · rank-0 barrier


def test_a_barrier_only_rank_0_calls_times_out(tmp_path):
    """Lab 5 on 2 gloo ranks with a 2 s process-group timeout: a barrier only rank 0 calls ends in
    torch's own "Timed out" error, within 20 s, instead of a hang."""
    began = time.monotonic()
    with pytest.raises(RankError, match="Timed out"):
        run_lab("05_rank0_collective", str(tmp_path), fix=False, pg_timeout=HANG_TIMEOUT,
                timeout=30)
    assert time.monotonic() - began < 20, "the short process-group timeout should end it"


def test_a_barrier_every_rank_calls_lets_training_go_on(tmp_path):
    """Lab 5's fix on 2 gloo ranks: rank 0 writes the checkpoint, every rank passes the barrier, and
    after one more step both ranks hold the same weight."""
    facts = run_lab("05_rank0_collective", str(tmp_path), fix=True)
    assert_close(torch.tensor(facts[1]["weight"]), torch.tensor(facts[0]["weight"]),
                 "weight after the save and one more step", rank=1)
    assert (tmp_path / "checkpoint.pt").is_file()


# ----------------------------------------------------------------------------- 6 · uneven inputs


def test_uneven_inputs_hang_without_join():
    """Lab 6 on 2 gloo ranks with 3 and 4 batches and a 2 s process-group timeout: without `Join`
    the ranks end in torch's own "Timed out" error, within 20 s, instead of a hang."""
    began = time.monotonic()
    with pytest.raises(RankError, match="Timed out"):
        run_lab("06_uneven_inputs", fix=False, pg_timeout=HANG_TIMEOUT, timeout=30)
    assert time.monotonic() - began < 20, "the short process-group timeout should end it"


def test_join_lets_uneven_ranks_finish_with_equal_weights():
    """Lab 6's fix on 2 gloo ranks: under `Join`, rank 0 trains its 3 batches and rank 1 its 4, and
    both end with the same weight."""
    facts = run_lab("06_uneven_inputs", fix=True)
    assert [f["steps"] for f in facts] == [3, 4], "every rank trains on all its batches"
    assert_close(torch.tensor(facts[1]["weight"]), torch.tensor(facts[0]["weight"]),
                 "final weight after Join", rank=1)


# ----------------------------------------------------------------------------- 7 · unused params


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_unused_parameters_break_ddp_until_declared(fix):
    """Lab 7 on 2 gloo ranks, 3 steps: plain DDP with an unused `aux_head` raises "Expected to have
    finished reduction" on every rank; freezing it, `static_graph=True` and
    `find_unused_parameters=True` each train, all to the same weights on every rank."""
    facts = run_lab("07_unused_parameters", fix=fix, steps=3)
    if fix:
        weights = {tuple(f[option][1]) for f in facts for option in lab("07_unused_parameters")
                   .FIXES}
        assert len(weights) == 1, "every fix trains the same weights on every rank"
    else:
        for f in facts:
            assert f["error"] and "Expected to have finished reduction" in f["error"], (
                f"rank {f['rank']}: {f['error']}")


# ----------------------------------------------------------------------------- 8 · model.module


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_calling_model_module_skips_the_gradient_all_reduce(fix):
    """Lab 8 on 2 gloo ranks: through `model.module(x)` the ranks' first gradients and final weights
    differ (by more than 1e-3); through `model(x)` they are equal."""
    facts = run_lab("08_module_forward", fix=fix)
    gradients = [torch.tensor(f["first_gradient"]) for f in facts]
    weights = [torch.tensor(f["weight"]) for f in facts]
    if fix:
        assert_close(gradients[1], gradients[0], "first gradient", rank=1)
        assert_close(weights[1], weights[0], "weight after training", rank=1)
    else:
        assert (gradients[1] - gradients[0]).abs().max() > 1e-3, "each rank kept its own gradient"
        assert (weights[1] - weights[0]).abs().max() > 1e-3, "the copies drifted apart"


# ----------------------------------------------------------------------------- 9 · checkpoints


def test_checkpoint_mistakes_show_their_symptoms(tmp_path):
    """Lab 9 on 2 gloo ranks shows every scene's symptom: both ranks write the file, rank 1 reads
    before rank 0 has written (`FileNotFoundError`), `module.` keys do not load, a `cuda:0` file
    loaded without `map_location` fails on a CPU (lands on `cuda:0` with a GPU), and a crash
    mid-save destroys the previous checkpoint."""
    facts = run_lab("09_checkpoints", str(tmp_path), fix=False)
    assert facts[0]["writers"] == 2, "every rank wrote the same file"
    assert facts[1]["early_read"].startswith("FileNotFoundError"), facts[1]["early_read"]
    for f in facts:
        assert "module.weight" in f["prefix"], f"rank {f['rank']}: {f['prefix']}"
        where = "cuda:0" if torch.cuda.is_available() else "on a CUDA device"
        assert where in f["map_location"], f"rank {f['rank']}: {f['map_location']}"
        assert f["crash_save"].startswith("SimulatedCrash")
        assert not f["crash"].startswith("ok"), "the crash destroyed the previous checkpoint"


def test_checkpoint_fixes_remove_them(tmp_path):
    """Lab 9's fixes on 2 gloo ranks: only rank 0 writes; the early read, the prefix and the crash
    scenes load (the crash still happens, the previous checkpoint survives it); `map_location` puts
    the tensors on the CPU."""
    facts = run_lab("09_checkpoints", str(tmp_path), fix=True)
    assert facts[0]["writers"] == 1, "only rank 0 wrote"
    for f in facts:
        for scene in ("early_read", "prefix", "crash"):
            assert f[scene] == "ok", f"rank {f['rank']}, {scene}: {f[scene]}"
        assert f["map_location"] == "ok (tensors on cpu)", f["map_location"]
        assert f["crash_save"].startswith("SimulatedCrash"), "the crash did happen"


# ----------------------------------------------------------------------------- 10 · no_sync


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_accumulation_all_reduces_every_micro_step_without_no_sync(fix):
    """Lab 10 on 2 gloo ranks, 4 micro-steps: DDP all-reduces every gradient 4 times without
    `no_sync()`, once with forward and backward inside it, and 4 times with only the backward
    inside; each time the gradient is the full batch's (to 1e-5)."""
    facts = run_lab("10_no_sync", fix=fix, k=4)
    for f in facts:
        assert f["sync_rounds"] == (1 if fix else 4), (
            f"rank {f['rank']}: every gradient was all-reduced {f['sync_rounds']:g} times")
        assert f["gap_to_full_batch"] < 1e-5, "either way the accumulated gradient is right"
        if fix:  # the half-fix: only backward() inside no_sync(), the forward outside
            half = f["backward_only"]
            assert half["sync_rounds"] == 4, (
                f"rank {f['rank']}: with the forward outside no_sync() every gradient was "
                f"all-reduced {half['sync_rounds']:g} times, the lesson says 4")
            assert half["gap_to_full_batch"] < 1e-5


# ----------------------------------------------------------------------------- 11 · sum loss


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_a_summed_loss_shrinks_the_gradient_by_the_world_size(fix):
    """Lab 11 on 2 gloo ranks: DDP's gradient is half of one process's on the global batch with
    `reduction="sum"`, and equal to it with the mean."""
    facts = run_lab("11_sum_loss", fix=fix)
    for f in facts:
        expected = 1.0 if fix else 1 / f["world_size"]
        assert f["ratio"] == pytest.approx(expected, rel=1e-5), (
            f"rank {f['rank']}: DDP gradient / one-GPU gradient = {f['ratio']}, "
            f"expected {expected} with reduction={f['reduction']!r}")


# ----------------------------------------------------------------------------- 12 · random state


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_equal_seeds_repeat_augmentation_and_unbroadcast_models_differ(fix):
    """Lab 12 on 2 gloo ranks: seeded alike, the ranks draw the same augmentation, and hand-averaged
    models built from different seeds end with different weights; the fix (a generator per rank, a
    broadcast from rank 0) reverses both."""
    facts = run_lab("12_random_state", fix=fix)
    same_augmentation = facts[0]["augmentation"] == facts[1]["augmentation"]
    same_weights = facts[0]["weights"] == facts[1]["weights"]
    assert same_augmentation is not fix, "equal seeds: the same crops on every rank"
    assert same_weights is fix, "without a broadcast the hand-written DDP copies never agree"


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_dataloader_workers_repeat_across_ranks_seeded_alike(fix):
    """Lab 12's `DataLoader` with 2 workers, for ranks 0 and 1 in one process: seeded alike, both
    ranks' workers produce the same numbers; with a generator seeded `seed + rank` they differ.
    Within a rank the two workers always differ."""
    lab12 = lab("12_random_state")
    with torch.random.fork_rng():  # the lab seeds the global generator
        draws = [lab12.worker_draws(rank, fix, workers=2) for rank in (0, 1)]
    assert (draws[0] == draws[1]) is not fix, f"worker draws of ranks 0 and 1: {draws}"
    assert len(set(draws[0])) == len(draws[0]), "within a rank, the workers differ"


# ----------------------------------------------------------------------------- 13 · BatchNorm


def test_batchnorm_statistics_are_per_rank():
    """Lab 13 on 2 gloo ranks, each with data of another mean: the ranks' BatchNorm running means
    differ (by more than 0.01), and each rank's gradient differs from one process's on the global
    batch."""
    facts = run_lab("13_batchnorm", fix=False)
    spread = (torch.tensor(facts[0]["running_mean"]) -
              torch.tensor(facts[1]["running_mean"])).abs().max()
    assert spread > 0.01, "each rank's running mean comes from its own data"
    assert all(f["gradient_gap"] > 1e-3 for f in facts), (
        "with BatchNorm, DDP's gradient is not one GPU's on the global batch")


def test_syncbatchnorm_fix_says_it_needs_gpus_on_the_cpu():
    """Lab 13's fix on 2 gloo CPU ranks stops with the message that `SyncBatchNorm` needs GPU
    tensors, because it raises on a CPU."""
    facts = run_lab("13_batchnorm", fix=True)
    assert "needs GPU tensors: on a CPU it raises" in facts[0].get("skipped", ""), facts[0]


@needs_gpus(2, "SyncBatchNorm on nccl")
def test_syncbatchnorm_shares_statistics_across_ranks():
    """Lab 13's fix on 2 nccl ranks, one GPU each: `SyncBatchNorm` gives both ranks the same running
    mean, within 1e-5 of one process's on the global batch, and that process's gradient (to 1e-4).
    """
    facts = run_lab("13_batchnorm", fix=True, world_size=2, backend="nccl", device="cuda")
    assert_close(torch.tensor(facts[1]["running_mean"]), torch.tensor(facts[0]["running_mean"]),
                 "SyncBatchNorm running mean", rank=1)
    for f in facts:
        assert f["running_mean_gap"] < 1e-5 and f["gradient_gap"] < 1e-4, (
            f"rank {f['rank']}: SyncBatchNorm should match one process on the global batch: {f}")


# ----------------------------------------------------------------------------- 15 · printing


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_progress_printed_by_rank_0_only(fix):
    """Lab 15 on 2 gloo ranks, 3 steps: every rank prints each of its 3 progress lines; with the
    fix rank 0 prints its 3 and rank 1 none, and the lab's verdict says which.

    Under torchrun each copy reaches the terminal, tagged with its rank
    (tests/test_torch_claims.py checks torchrun's --tee); CI runs the lab itself under torchrun
    (the course manifest)."""
    facts = run_lab("15_print_once", fix=fix)
    assert len(facts[0]["printed"]) == 3
    assert len(facts[1]["printed"]) == (0 if fix else 3), f"rank 1 printed {facts[1]['printed']}"
    symptom, verdict = lab("15_print_once").summarize(facts, fix)
    assert symptom is not fix and verdict.startswith("FIXED" if fix else "SYMPTOM"), verdict


# ----------------------------------------------------------------------------- launches
# Every real launch of this lesson, started together before the lesson's first test: the
# ``launches`` fixture, in conftest.py.


@pytest.mark.slow
def test_a_notebook_cell_cannot_spawn_or_init_alone(launches):
    """Lab 14 run the way a kernel runs a cell (`python -c`): the `mp.spawn` children fail with
    "Can't get attribute 'work'", and a lone 2-rank `init_process_group` times out with "1/2
    clients"."""
    data = launches["notebook"].result().data
    assert data["spawn"]["returncode"] != 0
    assert "Can't get attribute 'work'" in data["spawn"]["error"], data["spawn"]
    assert "Timed out" in data["init"] and "1/2 clients" in data["init"], data["init"]
    assert data["symptom"]


@pytest.mark.slow
def test_a_notebook_can_launch_a_guarded_script_with_torchrun(launches):
    """Lab 14's fix: a guarded script started with torchrun from a subprocess runs 2 ranks, whose
    all-reduce gives 3, and exits with code 0."""
    data = launches["notebook --fix"].result().data
    assert data["launch"]["returncode"] == 0, data["launch"]
    assert "2 ranks trained; all-reduce gave 3" in data["launch"]["output"]


@pytest.mark.slow
def test_doctor_passes_on_a_healthy_group(launches):
    """The doctor under torchrun with 2 ranks passes: ranks, barrier and value-checked all-reduce,
    bandwidth at 1 and 4 MB, the verdict from rank 0 only, and the
    `TORCH_NCCL_ASYNC_ERROR_HANDLING=1` torchrun sets (on nccl with 2 GPUs, else gloo)."""
    run = launches["doctor"].result()
    data = run.data
    assert data["ok"] and data["verdict"].startswith("OK"), data.get("verdict")
    assert data["backend"] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    for step in ("ranks and devices", "barrier", "all-reduce (value check)"):
        assert step in data["steps"], f"step {step!r} missing: {sorted(data['steps'])}"
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert [b["megabytes"] for b in data["bandwidth"]] == [1, 4]
    assert all(b["busbw_GBps"] > 0 for b in data["bandwidth"])
    assert not any("verdict" in line for line in run.rank_lines(1)), "rank 0 reports"
    # torchrun gives its workers TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless it is set (the table).
    settings = data["environment"]["settings"]
    expected = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    assert settings.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == expected, settings
    assert any("TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (default 3; torchrun sets 1)" in line
               for line in run.rank_lines(0)) or expected != "1", run.output[-3000:]


@pytest.mark.slow
def test_doctor_runs_as_one_process_without_a_launcher(launches):
    """The doctor under plain `python` runs as a group of one: it passes, measures no bandwidth, and
    reports the torch version and the numpy and pytest packages as present."""
    data = launches["doctor, python"].result().data
    assert data["ok"] and [r["rank"] for r in data["ranks"]] == [0]
    assert "bandwidth" not in data, "one rank has nobody to measure bandwidth with"
    assert data["environment"]["torch"] == torch.__version__
    packages = data["environment"]["packages"]
    assert packages["numpy"] != "missing" and packages["pytest"] != "missing", packages


def test_doctor_names_a_missing_package_and_the_fix(monkeypatch):
    """With numpy made to look missing, the doctor's package check marks it missing and reports one
    problem: numpy is missing, and what it is needed for."""
    doctor = load_lesson_module(LESSON, "doctor")
    real_version = doctor.importlib.metadata.version

    def version(name):
        if name == "numpy":
            raise doctor.importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(doctor.importlib.metadata, "version", version)
    found, problems = doctor.packages()
    assert found["numpy"] == "missing"
    assert problems == [f"numpy is missing ({doctor.NEEDED_PACKAGES['numpy']})"], problems


def test_doctor_explains_each_setting_that_is_set_and_warns_where_it_costs():
    """The doctor lists only the NCCL, gloo and torch.distributed variables that are set, sorted,
    each with its default (one not in its table too), and warns for `DETAIL`, a flight-recorder size
    of 0 and blocking wait, not for a default or harmless value."""
    doctor = load_lesson_module(LESSON, "doctor")
    lines = doctor.explain_settings({
        "PATH": "/usr/bin", "TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_DISTRIBUTED_DEBUG": "detail",
        "NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5", "TORCH_FR_BUFFER_SIZE": "0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    text = "\n".join(lines)
    assert "PATH" not in text, "only NCCL, gloo and torch.distributed settings are reported"
    named = [line.split("=")[0].strip() for line in lines if not line.startswith("    ")]
    assert named == sorted(named) == ["NCCL_DEBUG", "NCCL_IB_HCA", "TORCH_DISTRIBUTED_DEBUG",
                                      "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                      "TORCH_NCCL_BLOCKING_WAIT"], lines
    assert "NCCL_IB_HCA=mlx5: not in the doctor's table" in text, "an unknown one is still shown"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (default 3; torchrun sets 1)" in text, lines
    warned = [lines[k - 1].split("=")[0].strip() for k, line in enumerate(lines)
              if line.startswith("    warning:")]
    # DETAIL in any case (torch reads it so); a default value or a harmless one warns of nothing.
    assert warned == ["TORCH_DISTRIBUTED_DEBUG", "TORCH_FR_BUFFER_SIZE",
                      "TORCH_NCCL_BLOCKING_WAIT"], lines
    assert doctor.explain_settings({"HOME": "/root"}) == []


@pytest.mark.slow
def test_doctor_names_a_stalled_rank_instead_of_hanging(launches):
    """The doctor under torchrun with rank 1 stalled and a 5 s timeout exits non-zero, rank 0 giving
    a HANG verdict in the barrier that names rank 1; rank 1 prints one line of its own."""
    run = launches["doctor, stall"].result()  # within its 90 s limit, or LaunchError
    assert run.returncode != 0
    assert run.data["failed_step"] == "barrier" and run.data["kind"] == "hang", run.data
    assert "rank(s) 1" in run.data["verdict"], run.data["verdict"]
    assert any("verdict: HANG" in line for line in run.rank_lines(0)), run.output[-2000:]
    # One line per rank: only rank 0 gives the verdict and the next steps.
    other = [line for line in run.rank_lines(1) if "[FAIL]" in line or "next steps" in line
             or "verdict" in line]
    assert len(other) == 1 and "[FAIL] barrier" in other[0], other


@pytest.mark.slow
def test_doctor_names_the_step_where_a_rank_crashed(launches):
    """The doctor under torchrun with rank 1 made to crash exits non-zero, and rank 0's verdict,
    CRASH or STOPPED, names the all-reduce."""
    run = launches["doctor, crash"].result()
    assert run.returncode != 0
    assert any("simulating a crash" in line for line in run.rank_lines(1))
    verdicts = [line for line in run.rank_lines(0) if "verdict:" in line]
    assert verdicts and "all-reduce" in verdicts[0], run.output[-2000:]
    assert any(kind in verdicts[0] for kind in ("CRASH", "STOPPED")), verdicts[0]


@pytest.mark.slow
def test_doctor_gives_up_on_a_step_past_its_deadline(launches):
    """The doctor as one process stuck in its barrier step with `--timeout 1`, where no torch
    timeout applies, gives up at its own deadline (no answer within 3 s) and prints every thread's
    stack, which shows the stuck step."""
    run = launches["doctor, stuck alone"].result()
    assert run.returncode != 0
    assert run.data["failed_step"] == "barrier" and run.data["kind"] == "hang", run.data
    assert "no answer within 3 s" in run.data["verdict"], run.data["verdict"]
    # Before it gives up, the stack of every thread: the stuck one is in the barrier step.
    stacks = run.output[run.output.index("most recent call first"):]
    assert "in simulate" in stacks and "in barrier" in stacks, run.output[-3000:]


@pytest.mark.slow
@needs_gpus(1, "the doctor's CUDA checks: NCCL, devices, peer-to-peer")
def test_doctor_checks_the_gpus():
    """The doctor under torchrun on up to 2 GPUs passes on nccl, reports NCCL's version and one GPU
    per rank, and with 2 GPUs or more a peer-to-peer row for every GPU."""
    nproc = min(2, torch.cuda.device_count())
    data = run_script(DOCTOR, "--timeout", "60", "--sizes", "8", launcher="torchrun",
                      nproc=nproc).data
    assert data["ok"] and data["backend"] == "nccl", data.get("verdict")
    assert data["environment"]["nccl"][0].isdigit(), data["environment"]["nccl"]
    assert [r["device"] for r in data["ranks"]] == [f"cuda:{i}" for i in range(nproc)]
    if torch.cuda.device_count() >= 2:
        assert len(data["p2p"]) == torch.cuda.device_count()
