"""The course manifest: every lesson, its graded tasks and its scripts, in one place.

The integrity tests (``tests/``) check each lesson against its entry: the stubs raise exactly these
task ids, the tests mark them, the README has a hint and a command for each, the docs page shows
every script and every reference answer, the nav lists the page, and every script runs (at the
size given here, unless a lesson test already ran it in the same CI run). Adding a lesson, a
task or a script starts with a line here (docs/contributing.md has the steps).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Script:
    """A runnable file of a lesson, and how to run it at its smallest size (for CI)."""

    path: str  # relative to the lesson folder, e.g. "train_ddp.py" or "labs/01_set_epoch.py"
    launcher: str = "python"  # "python", "torchrun" or "launch" (harness.launch)
    nproc: int = 1
    smallest: tuple[str, ...] = ()  # arguments of its quickest complete run
    # A step of the chain: "<lesson folder>/<script>" this script is a copy of, changed only by
    # what its lesson teaches. tests/course/chain.py shows the diff in the lesson's README.
    builds_on: str | None = None
    # A step may change chain.py's MAX_CHANGED_LINES lines of the one it builds on; one
    # whose lesson really needs more says how many here, and why in a comment beside it.
    max_changed: int | None = None
    # A step may be chain.py's MAX_SCRIPT_LINES long; one that carries more lessons than
    # that (the chain adds up: lesson 09's last step holds DDP, mixed precision, checkpoints and
    # restarts) says how long here, and why in a comment beside it.
    max_lines: int | None = None


@dataclasses.dataclass(frozen=True)
class Lesson:
    folder: str  # lessons/<folder>, solutions/<folder>, docs/lessons/<folder>.md
    title: str  # the nav entry reads "NN · <title>"
    # task id -> what it grades: the snippet sections (functions, classes) of its reference
    # answer in solutions/<folder>/exercises.py, comma-separated when there are several
    tasks: dict[str, str]
    scripts: tuple[Script, ...]
    # The lesson's other Python files, which are not scripts to run: the tools its tests or its
    # walkthrough use (imported as ``lessonNN.<name>``, see harness/__init__.py), or the code its
    # training scripts share (imported by name from beside them). A lesson's
    # test code (harness.exercises.grader_files: its test files, conftest.py and common.py)
    # needs no entry.
    modules: tuple[str, ...] = ()
    # The main path (tests/course/words.py counts it) may be words.MAX_WORDS long; a lesson that
    # needs more says how many here, and why in a comment beside it.
    max_words: int | None = None

    @property
    def number(self) -> int:
        return int(self.folder[:2])

    def snippets(self, task: str) -> list[str]:
        """The snippet sections that show ``task``'s reference answer."""
        return [name.strip() for name in self.tasks[task].split(",")]


def _labs(*names: str) -> tuple[Script, ...]:
    # Each lab runs on two ranks; its fixed version is the smallest complete run.
    return tuple(Script(f"labs/{name}.py", "torchrun", 2, ("--fix",)) for name in names)


# The chain's scripts, at their smallest (8 characters sampled: harness.launch.QUICK_SAMPLE).
QUICK = ("--epochs", "1", "--train-windows", "64", "--sample-length", "8")

COURSE: tuple[Lesson, ...] = (
    Lesson("00_single_gpu", "One device, done right",
           {"task0_1": "choose_device", "task0_2": "to_device", "task0_3": "train_step",
            "task0_4": "evaluate"},
           # The chain starts here; --train-windows 64: an epoch of 4 steps.
           (Script("train.py", smallest=QUICK),
            Script("fast_one_device.py", smallest=(
                "--device", "cpu", "--width", "32", "--blocks", "1", "--batch-size", "16",
                "--steps", "2", "--warmup", "1", "--no-compile")))),
    Lesson("01_data_parallel", "nn.DataParallel",
           {"task1_1": "scatter_sizes", "task1_2": "scatter", "task1_3": "replicate",
            "task1_4": "gather", "task1_5": "reduce_gradients_into",
            "task1_6": "data_parallel_step"},
           (Script("train.py", smallest=QUICK, builds_on="00_single_gpu/train.py"),
            Script("where_the_batch_goes.py", smallest=("--batch-size", "6", "--replicas", "2")))),
    Lesson("02_model_parallel", "Model parallelism by hand",
           {"task2_1": "place_stages, staged_model", "task2_2": "pipelined_step",
            "task2_3": "bubble_fraction"},
           (Script("train.py", smallest=(*QUICK, "--micro-batches", "2"),
                   builds_on="00_single_gpu/train.py"),
            Script("pipeline_sweep.py", smallest=("--width", "16", "--batch-size", "8",
                                                  "--micro-batches", "1,2", "--steps", "1")))),
    Lesson("03_ddp", "DDP with torchrun",
           {"task3_1": "shard_indices", "task3_2": "setup", "task3_3": "average_gradients",
            "task3_4": "train_one_epoch", "task3_5": "GradientBuckets"},
           (Script("train_ddp.py", "torchrun", 2, QUICK, builds_on="00_single_gpu/train.py"),
            Script("train_spawn.py", smallest=("--nprocs", "2", *QUICK))),
           modules=("check_setup.py",)),  # its tests run setup() under torchrun
    Lesson("04_pitfalls", "Pitfalls and the doctor",
           {"task4_1": "exact_accuracy", "task4_2": "pick_device", "task4_3": "save_on_rank0",
            "task4_4": "train_with_join", "task4_5": "load_checkpoint",
            "task4_6": "accumulate_gradients", "task4_7": "broadcast_initial_state"},
           (Script("doctor.py", "torchrun", 2, ("--timeout", "30", "--sizes", "1")),
            *_labs("01_set_epoch", "02_no_sampler", "03_padded_eval", "04_device_from_rank",
                   "05_rank0_collective", "06_uneven_inputs", "07_unused_parameters",
                   "08_module_forward", "09_checkpoints", "10_no_sync", "11_sum_loss",
                   "12_random_state", "13_batchnorm", "14_notebooks", "15_print_once"))),
    Lesson("05_sharded_data_parallel", "Sharded data parallel: ZeRO and FSDP2",
           {"task5_1": "memory_per_rank",
            "task5_2": "reduce_scatter_mean, all_gather_pieces, Zero1Optimizer",
            "task5_3": "Zero2Optimizer",
            "task5_4": "shard_model", "task5_5": "AllGatherShard, Zero3Blocks",
            "task5_6": "checkpoint_blocks", "task5_7": "prefetch",
            "task5_8": "build_sharded", "task5_9": "activation_bytes, peak_bytes",
            "task5_10": "zero_peak_bytes"},
           (Script("train_fsdp.py", "torchrun", 2, QUICK, builds_on="03_ddp/train_ddp.py"),)),
    Lesson("06_tensor_parallel", "Tensor parallel: split layers, DTensor, 2-D",
           {"task6_1": "CopyToParallel, ReduceFromParallel",
            "task6_2": "ColumnParallelLinear, RowParallelLinear",
            "task6_3": "TensorParallelMLP, TensorParallelAttention, tensor_parallel_blocks",
            "task6_4": "block_plan, parallelize_gpt", "task6_5": "parallelize_2d"},
           # 65 changed: the plan (block_plan) and the check of the degree (check_tp) are both
           # this lesson's.
           (Script("train_tp.py", "torchrun", 2, QUICK,
                   builds_on="05_sharded_data_parallel/train_fsdp.py", max_changed=65),)),
    Lesson("07_pipeline_parallel", "Pipeline parallel: stages, schedules, torch.pipelining",
           {"task7_1": "schedule", "task7_2": "StageRunner", "task7_3": "split_gpt",
            "task7_4": "torch_schedule, torch_step", "task7_5": "interleaved",
            "task7_6": "zero_bubble", "task7_7": "average_over_copies",
            "task7_8": "balance_by_time"},
           # 76 changed: the stage cut, the schedule and its loss, the weights shared back for
           # evaluation and the stages' busy clock are all this lesson's, and none fits into
           # lesson 03's lines.
           (Script("train_pp.py", "torchrun", 2, (*QUICK, "--micro-batches", "2"),
                   builds_on="03_ddp/train_ddp.py", max_changed=76),
            # lesson07.common.BALANCE, which the lesson's test launches (this file imports no
            # torch)
            Script("balance_stages.py", "torchrun", 2,
                   ("--blocks", "4", "--width", "16", "--vocab-size", "256", "--context", "16",
                    "--micro-batch-size", "2", "--micro-batches", "2", "--steps", "1",
                    "--repeats", "1"))),
           modules=("simulator.py",)),  # schedules on paper, for the tests and the walkthrough
    Lesson("08_measure_and_choose", "Measure and choose",
           {"task8_1": "bus_bandwidth, fit_alpha_beta",
            "task8_2": "predict_allreduce_seconds, ddp_buckets, predict_ddp_comm_seconds",
            "task8_3": "bf16_compress", "task8_4": "choose_method", "task8_5": "read_step",
            "task8_6": "fsdp_step_collectives"},
           (Script("bench_collectives.py", "torchrun", 2,
                   ("--max-bytes", "4096", "--steps", "1", "--warmup", "1")),
            Script("ddp_costs.py", "torchrun", 2,
                   ("--width", "32", "--blocks", "2", "--context", "16", "--steps", "1",
                    "--settings", "0")),
            # It starts torchrun itself, once, for every method.
            Script("compare_methods.py", smallest=(
                "--width", "32", "--blocks", "2", "--context", "16", "--batch-size", "8",
                "--steps", "1", "--warmup", "1", "--methods", "one process,ddp")),
            Script("train_amp.py", "torchrun", 2, (*QUICK, "--fp16", "--comm-hook", "bf16"),
                   builds_on="03_ddp/train_ddp.py"),
            Script("scaling.py", "torchrun", 2,
                   ("--width", "32", "--blocks", "2", "--context", "16", "--batch-size", "4",
                    "--steps", "1")),
            Script("read_trace.py", "torchrun", 2,
                   ("--width", "32", "--blocks", "2", "--batch-size", "4")),
            Script("input_pipeline.py", "torchrun", 2,
                   ("--width", "32", "--blocks", "2", "--batch-size", "4", "--decode-ms", "1")),
            # It plays every rank itself, in one process.
            Script("dry_run.py", smallest=("--world", "4", "--size", "tiny")))),
    Lesson("09_survive_and_scale_out", "Survive and scale out",
           {"task9_1": "ResumableSampler, save_training_state, load_training_state",
            "task9_2": "expand_nodelist, slurm_to_torchrun", "task9_3": "resume_point",
            "task9_4": "first_mismatch", "task9_5": "Preemption"},
           (Script("train_checkpoint.py", "torchrun", 2, QUICK,
                   builds_on="08_measure_and_choose/train_amp.py"),
            Script("train_resilient.py", "torchrun", 2, (*QUICK, "--save-every", "1"),
                   builds_on="09_survive_and_scale_out/train_checkpoint.py"),
            # 185 lines: DDP, mixed precision, checkpoints, restarts and preemption, the most any
            # step carries
            Script("train_preemptible.py", "torchrun", 2, (*QUICK, "--save-every", "1"),
                   builds_on="09_survive_and_scale_out/train_resilient.py", max_lines=185),
            Script("sharded_checkpoint.py", "torchrun", 2, ("--steps", "1")),
            Script("bench_checkpoint.py", "torchrun", 2,
                   ("--steps", "2", "--save-every", "1", "--n-embd", "32")),
            Script("find_a_hang.py", "torchrun", 2, ("--bug", "none", "--dump-after", "60")),
            Script("slurm_args.py", smallest=(
                "--env", "SLURM_JOB_ID=1", "--env", "SLURM_JOB_NUM_NODES=2",
                "--env", "SLURM_JOB_NODELIST=node[1-2]", "--env", "SLURM_GPUS_ON_NODE=4"))),
           modules=("training_state.py",),  # the three training scripts' checkpoint code
           # Three steps, each a script of its own (save and resume, restart, preempt) and the
           # cluster they run on: 7,000 words, where one method's lesson has 6,000.
           max_words=7000),
    Lesson("10_long_sequences", "Long sequences: sequence and context parallel",
           {"task10_1": "AllGatherSequence, ReduceScatterSequence",
            "task10_2": "merge_partials", "task10_3": "attend_block",
            "task10_4": "zigzag_split, zigzag_merge", "task10_5": "ring_attention",
            "task10_6": "SeqAllToAll, ulysses_attention", "task10_7": "token_mean_loss"},
           (Script("sequence_parallel.py", "torchrun", 2, ("--length", "8", "--width", "16")),
            Script("ring_attention.py", "torchrun", 2, ("--length", "16")),
            Script("memory_by_length.py", "torchrun", 2,
                   ("--lengths", "16", "--width", "16", "--heads", "2")),
            # 80 changed: the dp x cp mesh and its sampler (as lesson 06's), each rank's share of
            # every sequence (the collate), the ring swapped into the blocks, the validation
            # averaged over a row's ranks, the check of the degree; bf16 taken out (the ring
            # computes in fp32).
            Script("train_cp.py", "torchrun", 2, QUICK, builds_on="03_ddp/train_ddp.py",
                   max_changed=80))),
    Lesson("11_mixture_of_experts", "Mixture of experts: expert parallel",
           {"task11_1": "route", "task11_2": "dispatch_plan",
            "task11_3": "exchange_counts, AllToAll", "task11_4": "expert_parallel_forward",
            "task11_5": "sync_gradients", "task11_6": "grouped_experts",
            "task11_7": "biased_route, update_bias"},
           (Script("moe.py", "torchrun", 2, ("--tokens", "16", "--width", "8")),
            Script("moe_costs.py", "torchrun", 2, ("--steps", "2", "--tokens", "64")),
            # 85 changed: the dp x ep mesh and the model whose blocks keep their share of the
            # experts, the gradient sync that replaces DDP (task11_5's copy), the auxiliary loss,
            # the checkpoint gathered over a row, the flags of the degree and the experts and
            # their check.
            Script("train_ep.py", "torchrun", 2, QUICK, builds_on="03_ddp/train_ddp.py",
                   max_changed=85))),
)


def lesson(folder: str) -> Lesson:
    """The manifest entry of ``lessons/<folder>``."""
    for entry in COURSE:
        if entry.folder == folder:
            return entry
    raise KeyError(f"lessons/{folder} is not in the course manifest (tests/course/manifest.py)")


def all_tasks() -> dict[str, str]:
    """Every task id of the course, in order, with what it grades."""
    return {task: target for entry in COURSE for task, target in entry.tasks.items()}
