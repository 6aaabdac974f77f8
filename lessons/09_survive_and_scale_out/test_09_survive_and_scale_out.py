"""Lesson 09: survive and scale out. Exact resume, restarts, several nodes, cluster launchers.

What the lesson rests on, checked here on gloo/CPU ranks:
- a run stopped, saved and resumed (mid-epoch, on fresh objects) takes bitwise the same steps as
  one that never stopped: the model, optimizer, schedule, scaler, the sampler's place and every
  rank's generators all come back;
- a crash half-way through a save leaves the earlier checkpoint loadable and no half one;
- the newest complete checkpoint is found among planted partial and broken ones;
- SLURM's environment becomes the torchrun arguments every node agrees on;
- an FSDP2 checkpoint written by 4 ranks with torch.distributed.checkpoint loads on 2 and goes
  on as one process would;
- TORCH_DISTRIBUTED_DEBUG=DETAIL names mismatched collectives, monitored_barrier the rank that
  did not arrive, and faulthandler's stacks where each rank is (never waiting long);
- the lesson's scripts resume exactly in-process, and under torchrun: a rank SIGKILLed with a
  restart left is restarted and resumed; with none left, torchrun says which rank died and how;
  two torchrun agents form one group of two nodes and train what one node trains.
"""

from __future__ import annotations

import copy
import datetime
import faulthandler
import io
import os
import random
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401 - the first fully_shard() imports it: a second per rank
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401 - imported here once, so forked ranks have it
import torch.distributed.fsdp  # noqa: F401 - the same: seconds per rank otherwise
import torch.nn.functional as F
from gpt import GPT, CharDataset, GPTConfig, parameter_digest
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from harness.compare import assert_parameters_close
from harness.exercises import REPO_ROOT, load_exercise, load_lesson_module, raise_if_untouched
from harness.hardware import needs_gpus
from harness.launch import free_port, path_with, start_first, start_nodes, start_script
from harness.ranks import run_on_ranks
from harness.sweep import st, sweep

LESSON = "09_survive_and_scale_out"
RESILIENT = f"lessons/{LESSON}/train_resilient.py"
SBATCH = f"lessons/{LESSON}/slurm/train.sbatch"
CONFIG = dict(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1)

# Each task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task9_1": {
        "set_epoch(epoch, start=k): the next iteration yields this rank's indices from the k-th": [
            "test_the_sampler_resumes_an_epoch_where_it_stopped",
            "test_the_sampler_resumes_any_epoch_of_any_split_where_it_stopped",
            "test_a_resumed_run_is_bitwise_equal_to_one_that_never_stopped"],
        "__len__ is what is left": [
            "test_the_sampler_resumes_an_epoch_where_it_stopped",
            "test_the_sampler_resumes_any_epoch_of_any_split_where_it_stopped"],
        "set_epoch(epoch) starts the epoch at its beginning": [
            "test_the_sampler_resumes_an_epoch_where_it_stopped",
            "test_a_resumed_run_is_bitwise_equal_to_one_that_never_stopped"],
        "a sampler never given set_epoch: epoch 0, whole (the parent's)": [
            "test_a_sampler_never_given_set_epoch_is_the_parents_epoch_0"],
        "the order is the parent's (seed, epoch, rank, world size)": [
            "test_the_sampler_resumes_an_epoch_where_it_stopped",
            "test_the_sampler_resumes_any_epoch_of_any_split_where_it_stopped"],
        "start below 0 or above the rank's share raises ValueError": [
            "test_the_sampler_resumes_an_epoch_where_it_stopped"],
        "save: train.pt holds the layout of the text (four state dicts, position, generators)": [
            "test_the_file_holds_the_layout_of_the_text"],
        "save: the position is saved as given": [
            "test_the_file_holds_the_layout_of_the_text",
            "test_a_resumed_run_is_bitwise_equal_to_one_that_never_stopped"],
        "save: path is a str or a path object": [
            "test_a_save_takes_its_path_as_a_str_too"],
        "save: every rank's rng_state() gathered to rank 0, which writes the file": [
            "test_a_resumed_run_is_bitwise_equal_to_one_that_never_stopped",
            "test_the_file_holds_the_layout_of_the_text"],
        "save 1: train.pt written into <path>.partial/": [
            "test_a_crash_during_a_save_leaves_the_last_checkpoint_whole",
            "test_a_save_reaches_the_disk_before_and_after_its_rename"],
        "save 1: a .partial an earlier crash left is removed first": [
            "test_a_crash_during_a_save_leaves_the_last_checkpoint_whole"],
        "save 2: sync_to_disk the file, then the .partial directory, before the rename": [
            "test_a_save_reaches_the_disk_before_and_after_its_rename"],
        "save 3: the directory renamed to path": [
            "test_a_crash_during_a_save_leaves_the_last_checkpoint_whole",
            "test_a_save_reaches_the_disk_before_and_after_its_rename",
            "test_a_resumed_run_is_bitwise_equal_to_one_that_never_stopped"],
        "save 3: a path that exists already is replaced (renamed aside, removed after)": [
            "test_a_save_replaces_a_copy_of_its_step_left_by_an_earlier_attempt"],
        "save 3: aside to <path>.old, removed before if a crash left one": [
            "test_a_save_removes_the_old_copy_a_crash_left_aside"],
        "save 4: sync_to_disk the parent directory after the rename": [
            "test_a_save_reaches_the_disk_before_and_after_its_rename"],
        "save: no rank returns before then": [
            "test_no_rank_returns_from_a_save_before_the_checkpoint_is_there"],
        "save: a crash leaves the earlier checkpoints as they were, no half-written path": [
            "test_a_crash_during_a_save_leaves_the_last_checkpoint_whole"],
        "load: every rank loads train.pt with map_location": [
            "test_every_rank_loads_with_the_map_location_it_is_given"],
        "load: restores the model, the optimizer, the scheduler and the scaler": [
            "test_a_resumed_run_is_bitwise_equal_to_one_that_never_stopped"],
        "load: each rank restores its own generators (set_rng_state of its entry)": [
            "test_a_resumed_run_is_bitwise_equal_to_one_that_never_stopped",
            "test_the_generators_come_back_whatever_device_the_tensors_load_onto"],
        "load: a checkpoint of another number of ranks raises ValueError naming both": [
            "test_a_crash_during_a_save_leaves_the_last_checkpoint_whole"],
        "load: returns the position": [
            "test_a_resumed_run_is_bitwise_equal_to_one_that_never_stopped"],
    },
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
    "task9_3": {
        "the newest complete checkpoint, or None": [
            "test_resume_point_picks_the_newest_complete_checkpoint",
            "test_resume_point_finds_the_newest_complete_checkpoint_among_any"],
        "None when the folder does not exist": [
            "test_resume_point_picks_the_newest_complete_checkpoint"],
        "only directories named step-<digits> count": [
            "test_resume_point_picks_the_newest_complete_checkpoint",
            "test_resume_point_finds_the_newest_complete_checkpoint_among_any"],
        "newest by step number, not by name": [
            "test_resume_point_picks_the_newest_complete_checkpoint",
            "test_resume_point_finds_the_newest_complete_checkpoint_among_any"],
        "not by modification time": ["test_resume_point_picks_the_newest_complete_checkpoint"],
        "a .partial directory is skipped": [
            "test_resume_point_picks_the_newest_complete_checkpoint",
            "test_resume_point_finds_the_newest_complete_checkpoint_among_any"],
        "a directory without its train.pt is skipped": [
            "test_resume_point_picks_the_newest_complete_checkpoint",
            "test_resume_point_finds_the_newest_complete_checkpoint_among_any"],
        "a train.pt cut short (not a zip archive) is skipped": [
            "test_resume_point_picks_the_newest_complete_checkpoint",
            "test_resume_point_finds_the_newest_complete_checkpoint_among_any"],
    },
}
SEQUENCES, BATCH = 64, 4  # 64 sequences: 8 steps per epoch of 4 per rank on 2 ranks
STOP, MORE = 5, 7  # stop after step 5 (mid-epoch 1), resume, 7 more: into epoch 2


@pytest.fixture
def ex():
    return load_exercise(LESSON)


# ----------------------------------------------------------------------------- a training run


def dataset() -> TensorDataset:
    tokens = torch.randint(0, CONFIG["vocab_size"], (SEQUENCES, CONFIG["block_size"] + 1),
                           generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class Run:
    """Everything a run holds, built fresh (as a new process would after a crash)."""

    def __init__(self, ex, global_seed: int):
        self.model = GPT(GPTConfig(**CONFIG), seed=0)
        self.ddp = DDP(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        # A step schedule: a resumed run that restarts the schedule steps with another rate.
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.5)
        # growth_interval=1: the scale doubles every step, so a lost scaler state shows.
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1)
        data = dataset()
        self.sampler = ex.ResumableSampler(data, shuffle=True, seed=7)
        # The loader's own generator: a new iterator must not draw from the global one.
        self.loader = DataLoader(data, BATCH, sampler=self.sampler,
                                 generator=torch.Generator())
        torch.manual_seed(global_seed)  # dropout draws from here, differently on every rank
        random.seed(global_seed)
        self.position = {"epoch": 0, "start": 0, "step": 0}

    def train(self, steps: int) -> None:
        done = 0
        while done < steps:
            self.sampler.set_epoch(self.position["epoch"], self.position["start"])
            for inputs, targets in self.loader:
                logits, _ = self.ddp(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                loss = loss + 1e-3 * random.random()  # Python's generator is state too
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.scheduler.step()
                self.position["start"] += targets.shape[0]
                self.position["step"] += 1
                done += 1
                if done == steps:
                    break
            if self.position["start"] == self.sampler.num_samples:  # the epoch is done
                self.position.update(epoch=self.position["epoch"] + 1, start=0)

    def pieces(self) -> dict:
        # Copies: the state dicts share their tensors with the live objects, which train on.
        return copy.deepcopy({
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
            "rng": torch.get_rng_state(), "python_rng": random.getstate(),
            "position": self.position})

    def save(self, ex, path: Path) -> None:
        ex.save_training_state(path, self.model, self.optimizer, self.scheduler, self.scaler,
                               self.position)

    def load(self, ex, path: Path) -> None:
        self.position = dict(ex.load_training_state(path, self.model, self.optimizer,
                                                    self.scheduler, self.scaler, "cpu"))


def resume_on_rank(ctx, ex_path: str, folder: str) -> dict:
    from harness.exercises import load_path

    ex = load_path(ex_path)
    path = Path(folder) / "step-00000005"
    uninterrupted = Run(ex, global_seed=100 + ctx.rank)
    uninterrupted.train(STOP + MORE)
    first = Run(ex, global_seed=100 + ctx.rank)
    first.train(STOP)
    saved = first.pieces()
    first.save(ex, path)
    if ctx.rank == 0:  # what every rank saved, to tell "rank 0's" from "its own"
        torch.save({"rng": saved["rng"]}, Path(folder) / "rank0-rng.pt")
    dist.barrier()
    rank0_rng = torch.load(Path(folder) / "rank0-rng.pt")["rng"]
    resumed = Run(ex, global_seed=999)  # a new process: fresh objects, another generator
    resumed.load(ex, path)
    loaded = resumed.pieces()
    resumed.train(MORE)
    return {"saved": saved, "loaded": loaded, "rank0_rng": rank0_rng,
            "uninterrupted": uninterrupted.pieces()["model"], "resumed": resumed.pieces()["model"],
            "listing": sorted(p.name for p in Path(folder).iterdir())}


def first_difference(actual: dict, expected: dict) -> str | None:
    for name, want in expected.items():
        got = actual.get(name)
        if got is None or not torch.equal(got, want):
            return name
    return None


def tensors_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# ----------------------------------------------------------------------------- task 9_1


@pytest.mark.task9_1
def test_the_sampler_resumes_an_epoch_where_it_stopped(ex):
    data = list(range(22))  # 11 per rank: the parent pads, the resumed epoch keeps its order
    for rank in (0, 1):
        whole = list(DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=3))
        sampler = ex.ResumableSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=3)
        for start in (0, 4, 11):
            sampler.set_epoch(0, start)
            got = list(sampler)
            assert got == whole[start:], (
                f"rank {rank}, set_epoch(0, start={start}): yielded {got}, expected the rest "
                f"of the epoch {whole[start:]} (the parent's order, without its first {start})")
            assert len(sampler) == len(whole) - start, (
                f"rank {rank}, start={start}: len() is {len(sampler)}, expected "
                f"{len(whole) - start}, the samples left (a DataLoader sizes the epoch by it)")
        sampler.set_epoch(1)
        epoch1 = list(DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=3))
        whole1 = list(sampler)
        assert whole1 != whole, "epoch 1 must be shuffled differently from epoch 0 (set_epoch)"
        ref = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=3)
        ref.set_epoch(1)
        assert whole1 == list(ref), (
            f"set_epoch(1) with no start: yielded {whole1}, expected the whole epoch "
            f"{list(ref)}: a new epoch starts at its beginning")
        del epoch1
        for bad in (-1, 12):
            with pytest.raises(ValueError, match=str(bad)):
                sampler.set_epoch(2, bad)


@pytest.mark.task9_1
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_sampler_never_given_set_epoch_is_the_parents_epoch_0(ex, shuffle):
    """A loop that starts without set_epoch (a first run, an evaluation pass) gets the parent's
    epoch 0, whole."""
    data = list(range(22))
    for rank in (0, 1):
        options = dict(num_replicas=2, rank=rank, shuffle=shuffle, seed=3)
        whole = list(DistributedSampler(data, **options))
        sampler = ex.ResumableSampler(data, **options)
        try:
            got, size = list(sampler), len(sampler)
        except NotImplementedError:
            raise
        except Exception as error:  # noqa: BLE001 - reported to the learner
            raise AssertionError(
                f"rank {rank}: iterating a ResumableSampler on which set_epoch was never called "
                f"raised {type(error).__name__}: {error}. Give it a start of 0 when it is made "
                f"(in __init__), not only in set_epoch") from None
        assert got == whole, (
            f"rank {rank}, shuffle={shuffle}, no set_epoch: yielded {got}, expected the "
            f"parent's whole epoch 0 {whole}: a new sampler starts at the beginning")
        assert size == len(whole), (
            f"rank {rank}, no set_epoch: len() is {size}, expected the whole share {len(whole)}")


@pytest.mark.task9_1
@sweep(size=st.integers(1, 40), world=st.integers(1, 5), shuffle=st.booleans(),
       drop_last=st.booleans(), epoch=st.integers(0, 3), data=st.data(), max_examples=40)
def test_the_sampler_resumes_any_epoch_of_any_split_where_it_stopped(ex, size, world, shuffle,
                                                                    drop_last, epoch, data):
    """DistributedSampler is the oracle: any dataset size, world size, rank, shuffle and
    drop_last, any epoch, started from any place in the rank's share."""
    rank = data.draw(st.integers(0, world - 1), label="rank")
    options = dict(num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last)
    reference = DistributedSampler(list(range(size)), **options)
    reference.set_epoch(epoch)
    whole = list(reference)
    start = data.draw(st.integers(0, len(whole)), label="start")
    sampler = ex.ResumableSampler(list(range(size)), **options)
    sampler.set_epoch(epoch, start)
    got = list(sampler)
    assert got == whole[start:], (
        f"{size} samples, {world} ranks, rank {rank}, shuffle={shuffle}, drop_last={drop_last}, "
        f"set_epoch({epoch}, start={start}): yielded {got}, expected {whole[start:]}")
    assert len(sampler) == len(whole) - start, (
        f"len() is {len(sampler)} after set_epoch({epoch}, start={start}), expected "
        f"{len(whole) - start}: the samples left")


@pytest.mark.task9_1
def test_a_resumed_run_is_bitwise_equal_to_one_that_never_stopped(ex, tmp_path):
    raise_if_untouched(ex.ResumableSampler.set_epoch, ex.ResumableSampler.__iter__,
                       ex.save_training_state, ex.load_training_state)
    ranks = run_on_ranks(resume_on_rank, str(ex.__file__), str(tmp_path), world_size=2)
    listing = ranks[0]["listing"]
    assert "step-00000005" in listing, f"no checkpoint directory step-00000005: found {listing}"
    assert not any(name.endswith(".partial") for name in listing), (
        f"a .partial directory is left after a save that succeeded: {listing}; rename it")
    for rank, got in enumerate(ranks):
        saved, loaded = got["saved"], got["loaded"]
        assert loaded["position"] == saved["position"], (
            f"rank {rank}: load_training_state returned the position {loaded['position']}, "
            f"expected what was saved: {saved['position']}")
        name = first_difference(loaded["model"], saved["model"])
        assert name is None, f"rank {rank}: after loading, parameter {name!r} is not the saved one"
        assert tensors_equal(loaded["optimizer"], saved["optimizer"]), (
            f"rank {rank}: the optimizer's state after loading is not the saved one (AdamW's "
            "moments and step counts): save and load optimizer.state_dict()")
        assert loaded["scheduler"] == saved["scheduler"], (
            f"rank {rank}: the scheduler after loading is at step "
            f"{loaded['scheduler'].get('last_epoch')}, the run was at "
            f"{saved['scheduler'].get('last_epoch')}: save and load scheduler.state_dict(), or "
            "the learning rate starts its schedule again")
        assert loaded["scaler"] == saved["scaler"], (
            f"rank {rank}: the GradScaler's scale after loading is "
            f"{loaded['scaler'].get('scale')}, the run had {saved['scaler'].get('scale')}: save "
            "and load scaler.state_dict()")
        if not torch.equal(loaded["rng"], saved["rng"]):
            whose = (" it is rank 0's: every rank must save and restore its own generators"
                     if rank and torch.equal(loaded["rng"], got["rank0_rng"]) else
                     " restore each rank's own (rng_state / set_rng_state)")
            pytest.fail(f"rank {rank}: torch's generator after loading is not the one this rank "
                        f"had when it saved;{whose}. Dropout would draw other masks.")
        assert loaded["python_rng"] == saved["python_rng"], (
            f"rank {rank}: Python's random generator was not restored")
    for rank, got in enumerate(ranks):  # every piece of every rank first: they say what is wrong
        name = first_difference(got["resumed"], got["uninterrupted"])
        assert name is None, (
            f"rank {rank}: after resuming and {MORE} more steps, {name!r} is not bitwise equal "
            f"to the run that never stopped ({STOP + MORE} steps)")


def crash_on_rank(ctx, ex_path: str, folder: str) -> dict:
    from harness.exercises import load_path

    ex = load_path(ex_path)
    good, bad = Path(folder) / "step-00000002", Path(folder) / "step-00000003"
    run = Run(ex, global_seed=1)
    run.train(2)
    run.save(ex, good)
    run.train(1)
    real_save = torch.save

    def half_a_save(obj, f, *args, **kwargs):
        if isinstance(f, io.BytesIO):  # pickling a tensor (all_gather_object) uses torch.save
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()[: len(buffer.getvalue()) // 2]
        if isinstance(f, (str, os.PathLike)):
            Path(f).write_bytes(data)
        else:
            f.write(data)
        raise OSError("injected: the disk filled up half-way through torch.save")

    torch.save = half_a_save
    try:
        run.save(ex, bad)
        raised = None
    except OSError as err:
        raised = str(err)
    finally:
        torch.save = real_save
    after_crash = sorted(p.name for p in Path(folder).iterdir())
    left = {p.relative_to(folder).as_posix(): p.stat().st_size
            for p in Path(folder).rglob("*") if p.is_file()}
    fresh = Run(ex, global_seed=2)
    fresh.load(ex, good)
    loaded_step = fresh.position["step"]
    try:  # a save after the crash, over its leftovers, must work
        run.save(ex, bad)
        again = None
    except Exception as err:  # noqa: BLE001 - reported to the learner
        again = f"{type(err).__name__}: {err}"
    # A checkpoint of two ranks, in the layout of the text, cannot be loaded by one.
    two = torch.load(good / "train.pt", weights_only=False)
    two["generators"] = [two["generators"][0]] * 2
    two_dir = Path(folder) / "two-ranks"
    two_dir.mkdir()
    torch.save(two, two_dir / "train.pt")
    try:
        fresh.load(ex, two_dir)
        mismatch = None
    except ValueError as err:
        mismatch = str(err)
    return {"raised": raised, "after_crash": after_crash, "left": left,
            "loaded_step": loaded_step, "again": again, "mismatch": mismatch,
            "final": sorted(p.name for p in Path(folder).iterdir())}


@pytest.mark.task9_1
def test_a_crash_during_a_save_leaves_the_last_checkpoint_whole(ex, tmp_path):
    raise_if_untouched(ex.ResumableSampler.set_epoch, ex.ResumableSampler.__iter__,
                       ex.save_training_state, ex.load_training_state)
    got = run_on_ranks(crash_on_rank, str(ex.__file__), str(tmp_path), world_size=1)[0]
    assert got["raised"], "the save whose torch.save failed returned as if it had succeeded"
    assert "step-00000003" not in got["after_crash"], (
        f"the crash left step-00000003 behind, with a file cut short ({got['left']}): write "
        "into step-00000003.partial and rename it to step-00000003 only once it is whole")
    assert got["loaded_step"] == 2, "the checkpoint saved before the crash no longer loads"
    assert got["again"] is None, (
        f"saving again after a crashed save failed: {got['again']} (remove or reuse the "
        ".partial directory the crash left)")
    assert "step-00000003" in got["final"], f"the save after the crash wrote {got['final']}"
    assert got["mismatch"] and "2" in got["mismatch"] and "1" in got["mismatch"], (
        "loading a checkpoint of 2 ranks on 1 must raise ValueError naming both numbers; got "
        f"{got['mismatch']!r}")


def load_onto_meta_on_rank(ctx, ex_path: str, folder: str) -> dict:
    """Save, then load with ``map_location="meta"`` into a model and optimizer on the meta
    device: the tensors move, the generators must still come back (on a GPU the same load
    with ``map_location=cuda:k`` would hand ``set_rng_state`` tensors it cannot take)."""
    from harness.exercises import load_path

    ex = load_path(ex_path)
    path = Path(folder) / "step-00000002"
    run = Run(ex, global_seed=10 + ctx.rank)
    run.train(2)
    saved = run.pieces()
    run.save(ex, path)
    dist.barrier()  # whether the save waits for rank 0 is another test's (a file not there yet)
    model = GPT(GPTConfig(**CONFIG), seed=0).to("meta")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1)
    torch.manual_seed(12345)  # elsewhere: what a new process's generators would be
    random.seed(12345)
    try:
        ex.load_training_state(path, model, optimizer, scheduler, scaler, "meta")
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - reported to the learner
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    return {"error": None, "rng": torch.get_rng_state(), "python": random.getstate(),
            "saved_rng": saved["rng"], "saved_python": saved["python_rng"],
            "device": next(model.parameters()).device.type}


@pytest.mark.task9_1
def test_the_generators_come_back_whatever_device_the_tensors_load_onto(ex, tmp_path):
    raise_if_untouched(ex.save_training_state, ex.load_training_state)
    for rank, got in enumerate(run_on_ranks(load_onto_meta_on_rank, str(ex.__file__),
                                            str(tmp_path), world_size=2)):
        assert got["error"] is None, (
            f"rank {rank}: load_training_state(..., map_location='meta') raised "
            f"{got['error']}. map_location moves every tensor of the file; torch.set_rng_state "
            f"takes a CPU ByteTensor only, so on a GPU the same load fails: save the generators "
            f"with rng_state() (bytes, which map_location leaves alone) and restore them with "
            f"set_rng_state()")
        assert torch.equal(got["rng"], got["saved_rng"]), (
            f"rank {rank}: after loading onto another device, torch's generator is not the "
            f"one this rank saved")
        assert got["python"] == got["saved_python"], (
            f"rank {rank}: after loading onto another device, Python's generator is not the "
            f"one this rank saved")


def save_over_on_rank(ctx, ex_path: str, folder: str) -> dict:
    """Save step 3 where a broken copy of it lies, then where a whole older copy lies (a
    restart re-reaches a step it saved before), recording each fsync and rename."""
    from harness.exercises import load_path

    ex = load_path(ex_path)
    path = Path(folder) / "step-00000003"
    run = Run(ex, global_seed=3)
    run.train(1)
    outcomes = {}
    path.mkdir()
    (path / "train.pt").write_bytes(b"PK\x03\x04 cut short by a power loss")
    events: list[tuple] = []
    real = {name: getattr(os, name) for name in ("fsync", "replace", "rename")}

    def fsync(descriptor):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{descriptor}")))
        return real["fsync"](descriptor)

    def renamer(name):
        def rename(source, destination, *args, **kwargs):
            events.append(("rename", os.path.realpath(source), os.path.realpath(destination)))
            return real[name](source, destination, *args, **kwargs)
        return rename

    for copy_kind in ("broken", "whole"):
        run.train(1)
        os.fsync, os.replace, os.rename = fsync, renamer("replace"), renamer("rename")
        try:
            run.save(ex, path)
            outcomes[copy_kind] = None
        except NotImplementedError:
            raise
        except Exception as error:  # noqa: BLE001 - reported to the learner
            outcomes[copy_kind] = f"{type(error).__name__}: {error}"
        finally:
            os.fsync, os.replace, os.rename = real["fsync"], real["replace"], real["rename"]
        if copy_kind == "broken":
            first_events = list(events)
    fresh = Run(ex, global_seed=4)
    try:
        fresh.load(ex, path)
        loaded = fresh.position["step"]
    except Exception as error:  # noqa: BLE001 - reported to the learner
        loaded = f"{type(error).__name__}: {error}"
    return {"outcomes": outcomes, "loaded": loaded, "steps": run.position["step"],
            "events": first_events, "path": os.path.realpath(path),
            "left": sorted(p.name for p in Path(folder).iterdir())}


@pytest.mark.task9_1
def test_a_save_replaces_a_copy_of_its_step_left_by_an_earlier_attempt(ex, tmp_path):
    raise_if_untouched(ex.save_training_state, ex.load_training_state)
    got = run_on_ranks(save_over_on_rank, str(ex.__file__), str(tmp_path), world_size=1)[0]
    for kind, outcome in got["outcomes"].items():
        assert outcome is None, (
            f"saving step-00000003 where a {kind} copy of it already was failed: {outcome}. A "
            f"restart that reaches a step again saves it again; os.replace cannot rename a "
            f"directory onto one that is not empty: rename the old one aside first, then "
            f"remove it")
    assert got["loaded"] == got["steps"], (
        f"after saving over the old copies, step-00000003 loads as {got['loaded']!r}; the run "
        f"was at step {got['steps']}: the new checkpoint must replace the old one")
    assert got["left"] == ["step-00000003"], (
        f"after the saves, the folder holds {got['left']}: remove the old copy and the "
        f".partial directory once the new checkpoint is in place")


@pytest.mark.task9_1
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_a_save_reaches_the_disk_before_and_after_its_rename(ex, tmp_path):
    raise_if_untouched(ex.save_training_state, ex.load_training_state)
    got = run_on_ranks(save_over_on_rank, str(ex.__file__), str(tmp_path), world_size=1)[0]
    assert got["outcomes"]["broken"] is None, f"the save failed: {got['outcomes']['broken']}"
    events, path = got["events"], got["path"]
    into = [i for i, event in enumerate(events) if event[0] == "rename" and event[2] == path]
    assert into, (f"no rename onto {Path(path).name} was seen ({events}): write into "
                  f"<path>.partial/ and rename it with os.replace")
    rename = into[-1]
    partial = events[rename][1]
    synced = [(i, event[1]) for i, event in enumerate(events) if event[0] == "fsync"]
    file_before = [i for i, where in synced if i < rename
                   and where == os.path.join(partial, "train.pt")]
    assert file_before, (
        f"train.pt was not fsynced before the rename (fsyncs: {[w for _, w in synced]}): a "
        f"file system may put the rename on the disk before the file's data, so a power loss "
        f"can leave a short file under the final name. sync_to_disk(<partial>/train.pt) first")
    directory_before = [i for i, where in synced if i < rename and where == partial]
    assert directory_before and directory_before[-1] > file_before[-1], (
        f"the .partial directory was not fsynced after its file and before the rename "
        f"(fsyncs: {[w for _, w in synced]}): sync_to_disk(<partial>) records the file's name "
        f"in it")
    parent_after = [i for i, where in synced if i > rename and where == os.path.dirname(path)]
    assert parent_after, (
        f"the checkpoints folder was not fsynced after the rename (fsyncs: "
        f"{[w for _, w in synced]}): until it is, the rename itself may be lost with the "
        f"power. sync_to_disk(path.parent) last")


def save_leftover_on_rank(ctx, ex_path: str, folder: str, scenario: str) -> dict:
    """``scenario`` "str": save step 1 given its path as a str. "old": save step 2, leave
    ``step-00000002.old/`` beside it (a crash between renaming the old copy aside and removing
    it), then save step 2 again over both."""
    from harness.exercises import load_path

    ex = load_path(ex_path)
    run = Run(ex, global_seed=5)
    run.train(1)
    path = Path(folder) / ("step-00000001" if scenario == "str" else "step-00000002")
    if scenario == "old":
        run.save(ex, path)
        shutil.copytree(path, path.with_name(path.name + ".old"))
        run.train(1)
    try:
        ex.save_training_state(str(path) if scenario == "str" else path, run.model,
                               run.optimizer, run.scheduler, run.scaler, run.position)
        outcome = None
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - reported to the learner
        outcome = f"{type(error).__name__}: {error}"
    fresh = Run(ex, global_seed=6)
    try:
        fresh.load(ex, path)
        loaded = fresh.position["step"]
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - reported to the learner
        loaded = f"{type(error).__name__}: {error}"
    return {"outcome": outcome, "loaded": loaded, "steps": run.position["step"],
            "left": sorted(p.name for p in Path(folder).iterdir())}


@pytest.mark.task9_1
def test_a_save_takes_its_path_as_a_str_too(ex, tmp_path):
    raise_if_untouched(ex.save_training_state, ex.load_training_state)
    got = run_on_ranks(save_leftover_on_rank, str(ex.__file__), str(tmp_path), "str",
                       world_size=1)[0]
    assert got["outcome"] is None, (
        f"save_training_state given its path as a str failed: {got['outcome']}. The path may "
        f"be a str or a Path: make it a Path first (Path(path))")
    assert got["loaded"] == got["steps"] and got["left"] == ["step-00000001"], (
        f"after a save to a str path the folder holds {got['left']} and step-00000001 loads as "
        f"{got['loaded']!r}; expected step-00000001 alone, at step {got['steps']}")


@pytest.mark.task9_1
def test_a_save_removes_the_old_copy_a_crash_left_aside(ex, tmp_path):
    raise_if_untouched(ex.save_training_state, ex.load_training_state)
    got = run_on_ranks(save_leftover_on_rank, str(ex.__file__), str(tmp_path), "old",
                       world_size=1)[0]
    assert got["outcome"] is None, (
        f"saving step-00000002 again, where a crash had left step-00000002.old beside it "
        f"(between renaming the old copy aside and removing it), failed: {got['outcome']}. "
        f"os.replace cannot rename onto a directory that is not empty: remove a leftover "
        f"<path>.old before renaming the old copy aside to it")
    assert got["loaded"] == got["steps"], (
        f"after saving over step-00000002, it loads as {got['loaded']!r}; the run was at step "
        f"{got['steps']}: the new checkpoint must replace the old one")
    assert got["left"] == ["step-00000002"], (
        f"after the save, the folder holds {got['left']}: the old copy set aside (and the one "
        f"a crash left there) must be gone")


SAVED_AT = {"epoch": 1, "start": 8, "step": 3}  # a position the tests can tell from the default


def save_and_load_on_rank(ctx, ex_path: str, folder: str) -> dict:
    """Save with rank 0 held up in its torch.save (0.5 s), noting on each rank whether the
    checkpoint is there when save_training_state returns; rank 0 reads the file as written; then
    every rank loads it with map_location="meta", each torch.load's map_location recorded."""
    import inspect
    import time

    from harness.exercises import load_path

    ex = load_path(ex_path)
    path = Path(folder) / "step-00000003"
    run = Run(ex, global_seed=30 + ctx.rank)
    run.position = dict(SAVED_AT)
    real_save, real_load = torch.save, torch.load

    def late_save(obj, f, *args, **kwargs):
        if not isinstance(f, io.BytesIO):  # all_gather_object pickles through torch.save too
            time.sleep(0.5)
        return real_save(obj, f, *args, **kwargs)

    if ctx.rank == 0:
        torch.save = late_save
    try:
        run.save(ex, path)
    finally:
        torch.save = real_save
    there = zipfile.is_zipfile(path / "train.pt")
    dist.barrier()  # the rest only once rank 0 has written, whatever the answer did
    written = None
    if ctx.rank == 0:
        state = real_load(path / "train.pt", weights_only=False)
        written = {"keys": sorted(state), "position": state.get("position"),
                   "generators": (len(state["generators"])
                                  if isinstance(state.get("generators"), list) else
                                  type(state.get("generators")).__name__)}
    locations = []
    signature = inspect.signature(real_load)

    def watched_load(*args, **kwargs):
        locations.append(repr(signature.bind(*args, **kwargs).arguments.get("map_location")))
        return real_load(*args, **kwargs)

    model = GPT(GPTConfig(**CONFIG), seed=0).to("meta")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1)
    torch.load = watched_load
    try:
        ex.load_training_state(path, model, optimizer, scheduler, scaler, "meta")
        error = None
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - reported to the learner
        error = f"{type(err).__name__}: {str(err)[:300]}"
    finally:
        torch.load = real_load
    return {"there": there, "written": written, "locations": locations, "error": error}


@pytest.mark.task9_1
def test_no_rank_returns_from_a_save_before_the_checkpoint_is_there(ex, tmp_path):
    raise_if_untouched(ex.save_training_state, ex.load_training_state)
    ranks = run_on_ranks(save_and_load_on_rank, str(ex.__file__), str(tmp_path), world_size=2)
    assert ranks[0]["there"], "rank 0's save_training_state returned before train.pt was whole"
    assert ranks[1]["there"], (
        "rank 1 returned from save_training_state while rank 0 was still writing (held up "
        "0.5 s in torch.save): step-00000003/train.pt was not there yet. A rank that goes on "
        "may load it, or a job may end before it is written: dist.barrier() after rank 0's "
        "last sync_to_disk, on every rank")


@pytest.mark.task9_1
def test_the_file_holds_the_layout_of_the_text(ex, tmp_path):
    raise_if_untouched(ex.save_training_state, ex.load_training_state)
    written = run_on_ranks(save_and_load_on_rank, str(ex.__file__), str(tmp_path),
                           world_size=2)[0]["written"]
    layout = ["generators", "model", "optimizer", "position", "scaler", "scheduler"]
    assert written["keys"] == layout, (
        f"train.pt holds the keys {written['keys']}; the layout of the text is {layout}: "
        f"the four state dicts, the position and the generators")
    assert written["position"] == SAVED_AT, (
        f"train.pt's position is {written['position']!r}; the run was at {SAVED_AT}: save the "
        f"position as given")
    assert written["generators"] == 2, (
        f"train.pt's generators are {written['generators']!r}; expected a list of 2, every "
        f"rank's rng_state() in rank order (dist.all_gather_object)")


@pytest.mark.task9_1
def test_every_rank_loads_with_the_map_location_it_is_given(ex, tmp_path):
    raise_if_untouched(ex.save_training_state, ex.load_training_state)
    ranks = run_on_ranks(save_and_load_on_rank, str(ex.__file__), str(tmp_path), world_size=2)
    for rank, got in enumerate(ranks):
        assert got["error"] is None, (
            f"rank {rank}: load_training_state(..., map_location='meta') raised {got['error']}")
        assert got["locations"] and all(where == "'meta'" for where in got["locations"]), (
            f"rank {rank}: load_training_state was given map_location='meta' and called "
            f"torch.load with map_location {', '.join(got['locations']) or '(no torch.load)'}. "
            f"Pass it on: without it every tensor lands on the device it was saved from, so a "
            f"file saved on cuda:0 loads onto cuda:0 on every rank")


# ----------------------------------------------------------------------------- task 9_2

JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[01-02]",
       "SLURM_GPUS_ON_NODE": "4", "SLURM_NTASKS_PER_NODE": "1"}
NODELISTS = {
    "node01": ["node01"],
    "node[01-03]": ["node01", "node02", "node03"],
    "node[01-04,07]": ["node01", "node02", "node03", "node04", "node07"],
    "gpu[8-10],login3": ["gpu8", "gpu9", "gpu10", "login3"],
    "a[098-101]-ib": ["a098-ib", "a099-ib", "a100-ib", "a101-ib"],
    "r[1-2]n[1-2]": ["r1n1", "r1n2", "r2n1", "r2n2"],
    "x[3],y[1,5-6],z": ["x3", "y1", "y5", "y6", "z"],
    "node[3-3]": ["node3"],  # a range of one number runs forwards, not backwards
}


@pytest.mark.task9_2
@pytest.mark.parametrize("nodelist", NODELISTS)
def test_node_lists_expand_as_slurm_does(ex, nodelist):
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
    parts = [compressed(host) for host in hosts]
    nodelist = ",".join(text for text, _ in parts)
    want = [name for _, names in parts for name in names]
    got = ex.expand_nodelist(nodelist)
    assert got == want, (
        f"expand_nodelist({nodelist!r}) gave {got[:12]}{' ...' if len(got) > 12 else ''}, "
        f"expected {want[:12]}{' ...' if len(want) > 12 else ''} (every combination of the "
        "brackets, in order; a range keeps its first number's width)")


# A node list SLURM never writes -> what is wrong with it, in a learner's words.
BAD_NODELISTS = {
    "": "an empty node list",
    "  ": "a blank node list",
    "node[3-1]": "a range that runs backwards",
    "a,,b": "an empty host between two commas",
    "node[1-2],": "a trailing comma (an empty host after it)",
    "node[a-3]": "a bracket of letters, not numbers",
    "node[]": "an empty bracket",
    "node[+1]": "a number with a sign (not plain digits; int() alone takes it)",
    "node[1-+3]": "a range's end with a sign (not plain digits; int() alone takes it)",
    "node[ 1]": "a space in a bracket (not plain digits; int() alone takes it)",
}
# Brackets that do not pair up: refused, and said to be the brackets' fault.
UNPAIRED_BRACKETS = {
    "node[01-02": "an unclosed bracket",
    "a[1-2],b[3": "a bracket unclosed at the end",
    "node]1[": "a ']' before its '['",
    "]a[1]": "a ']' before any '['",
    "node[1-2]]": "a second ']'",
    "node[[1-2]]": "nested brackets",
    "a[1,[2]]": "a bracket inside a bracket",
}


@pytest.mark.task9_2
@pytest.mark.parametrize("nodelist", {**BAD_NODELISTS, **UNPAIRED_BRACKETS})
def test_bad_node_lists_are_refused(ex, nodelist):
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


def expected_args(nodes: int, nproc: int, job: int, endpoint: str) -> list[str]:
    return [f"--nnodes={nodes}", f"--nproc-per-node={nproc}", f"--rdzv-id={job}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]


ENVIRONMENTS = {
    "two nodes, four GPUs each": (JOB, expected_args(2, 4, 4242, "node01:24242")),
    "five nodes from a compressed list, the old variable names": (
        {"SLURM_JOB_ID": "1234567", "SLURM_NNODES": "5", "SLURM_NODELIST": "gpu-[07-09,12],x3",
         "SLURM_GPUS_ON_NODE": "8"}, expected_args(5, 8, 1234567, "gpu-07:24567")),
    "GPUs from --gpus-per-node=h100:8": (
        {**{k: v for k, v in JOB.items() if k != "SLURM_GPUS_ON_NODE"},
         "SLURM_GPUS_PER_NODE": "h100:8"}, expected_args(2, 8, 4242, "node01:24242")),
    "a port chosen by the job script": (
        {**JOB, "MASTER_PORT": "31337"}, expected_args(2, 4, 4242, "node01:31337")),
    "one task per node, said only in SLURM_TASKS_PER_NODE's compressed form": (
        {**{k: v for k, v in JOB.items() if k != "SLURM_NTASKS_PER_NODE"},
         "SLURM_TASKS_PER_NODE": "1(x2)"}, expected_args(2, 4, 4242, "node01:24242")),
}


@pytest.mark.task9_2
@pytest.mark.parametrize("case", ENVIRONMENTS)
def test_slurm_environments_become_torchrun_arguments(ex, case):
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
    ports = {job: ex.slurm_to_torchrun({**JOB, "SLURM_JOB_ID": str(job)})[-1].rsplit(":", 1)[1]
             for job in (4242, 4243)}
    assert ports[4242] != ports[4243], (
        f"jobs 4242 and 4243 both rendezvous on port {ports[4242]}: two jobs sharing a node "
        "would collide; derive the port from SLURM_JOB_ID (20000 + id % 10000)")


@pytest.mark.task9_2
def test_a_bare_gpus_per_node_count_is_the_gpu_count(ex):
    """--gpus-per-node=4 sets SLURM_GPUS_PER_NODE to "4", --gpus-per-node=h100:4 to "h100:4"."""
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


# Both names of a variable set, or the new one empty -> the arguments (SLURM sets both, equal).
BOTH_NAMES = {
    "SLURM_JOB_NODELIST and SLURM_NODELIST both set: the new name wins": (
        {**JOB, "SLURM_NODELIST": "old[1-2]"}, expected_args(2, 4, 4242, "node01:24242")),
    "SLURM_JOB_NUM_NODES and SLURM_NNODES both set: the new name wins": (
        {**JOB, "SLURM_NNODES": "3"}, expected_args(2, 4, 4242, "node01:24242")),
    "SLURM_JOB_NODELIST empty: SLURM_NODELIST is read": (
        {**JOB, "SLURM_JOB_NODELIST": "", "SLURM_NODELIST": "gpu[3-4]"},
        expected_args(2, 4, 4242, "gpu3:24242")),
    "SLURM_JOB_NUM_NODES empty: SLURM_NNODES is read": (
        {**JOB, "SLURM_JOB_NUM_NODES": "", "SLURM_NNODES": "2"},
        expected_args(2, 4, 4242, "node01:24242")),
}


@pytest.mark.task9_2
@pytest.mark.parametrize("case", BOTH_NAMES)
def test_the_new_name_of_a_variable_wins_over_the_old(ex, case):
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


def test_slurm_args_py_follows_the_same_table(outside_launcher, capsys):
    """The script the batch file runs carries its own copy of the mapping (it must run on a
    cluster's node alone): the same table grades it, and its errors end in a clear exit."""
    script = load_lesson_module(LESSON, "slurm_args")
    for nodelist, hosts in NODELISTS.items():
        assert script.expand_nodelist(nodelist) == hosts, nodelist
    for nodelist in {**BAD_NODELISTS, **UNPAIRED_BRACKETS}:
        with pytest.raises(ValueError, match="bracket" if nodelist in UNPAIRED_BRACKETS else None):
            script.expand_nodelist(nodelist)
    for case, (env, want) in {**ENVIRONMENTS, **BOTH_NAMES}.items():
        assert script.slurm_to_torchrun(env) == want, case
    for variable, env in BAD_ENVIRONMENTS.values():
        with pytest.raises(ValueError, match=variable):
            script.slurm_to_torchrun(env)
    pairs = [f"--env={name}={value}" for name, value in JOB.items()]
    assert script.main(pairs) == 0
    assert capsys.readouterr().out.split() == ENVIRONMENTS["two nodes, four GPUs each"][1]
    assert script.main(pairs[1:]) == 2  # no SLURM_JOB_ID
    assert "SLURM_JOB_ID is not set" in capsys.readouterr().err


WITHOUT_NTASKS = {k: v for k, v in JOB.items() if k != "SLURM_NTASKS_PER_NODE"}
# what is wrong -> (the variable the error must name, the environment)
BAD_ENVIRONMENTS = {
    "no node list": ("SLURM_JOB_NODELIST",
                     {k: v for k, v in JOB.items() if k != "SLURM_JOB_NODELIST"}),
    "a node count that is not the list's": ("SLURM_JOB_NUM_NODES",
                                            {**JOB, "SLURM_JOB_NUM_NODES": "3"}),
    "four tasks per node asked": ("SLURM_NTASKS_PER_NODE", {**JOB, "SLURM_NTASKS_PER_NODE": "4"}),
    "two tasks on each node, compressed": ("SLURM_TASKS_PER_NODE",
                                           {**WITHOUT_NTASKS, "SLURM_TASKS_PER_NODE": "2(x2)"}),
    "one node of the two with two tasks": ("SLURM_TASKS_PER_NODE",
                                           {**WITHOUT_NTASKS, "SLURM_TASKS_PER_NODE": "1,2"}),
    "SLURM_TASKS_PER_NODE not in SLURM's form": (
        "SLURM_TASKS_PER_NODE", {**WITHOUT_NTASKS, "SLURM_TASKS_PER_NODE": "1(x2"}),
    "SLURM_NTASKS_PER_NODE not a count": ("SLURM_NTASKS_PER_NODE",
                                          {**JOB, "SLURM_NTASKS_PER_NODE": "one"}),
    "no GPU count": ("SLURM_GPUS_ON_NODE",
                     {k: v for k, v in JOB.items() if k != "SLURM_GPUS_ON_NODE"}),
    "no job id": ("SLURM_JOB_ID", {k: v for k, v in JOB.items() if k != "SLURM_JOB_ID"}),
}


@pytest.mark.task9_2
@pytest.mark.parametrize("case", BAD_ENVIRONMENTS)
def test_a_broken_slurm_environment_names_the_variable(ex, case):
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


# ----------------------------------------------------------------------------- task 9_3


def write_checkpoint(folder: Path, step: int | str, cut: bool = False) -> Path:
    path = folder / (f"step-{step}" if isinstance(step, int) else step)
    path.mkdir(parents=True)
    buffer = io.BytesIO()
    torch.save({"position": {"step": step}, "model": {"w": torch.ones(256)}}, buffer)
    data = buffer.getvalue()
    (path / "train.pt").write_bytes(data[: len(data) // 2] if cut else data)
    return path


@pytest.mark.task9_3
def test_resume_point_picks_the_newest_complete_checkpoint(ex, tmp_path):
    assert ex.resume_point(tmp_path / "not-there-yet") is None, (
        "a folder that does not exist yet means a first run: return None")
    assert ex.resume_point(tmp_path) is None, "an empty folder has no checkpoint: return None"
    write_checkpoint(tmp_path, 99)
    newest = write_checkpoint(tmp_path, 100)
    planted = {
        "step-120.partial": write_checkpoint(tmp_path, "step-120.partial"),  # never renamed
        "step-130 without train.pt": (tmp_path / "step-130"),
        "step-140 with train.pt cut short": write_checkpoint(tmp_path, 140, cut=True),
        "latest (not a step)": write_checkpoint(tmp_path, "latest"),
        "step-abc": write_checkpoint(tmp_path, "step-abc"),
    }
    planted["step-130 without train.pt"].mkdir()
    (tmp_path / "step-150").write_text("a file, not a checkpoint directory")
    (tmp_path / "notes.txt").write_text("")
    stamp = newest.stat().st_mtime + 100
    os.utime(tmp_path / "step-99", (stamp, stamp))  # the oldest checkpoint, touched last
    got = ex.resume_point(tmp_path)
    assert got is not None, f"resume_point found nothing in {sorted(os.listdir(tmp_path))}"
    got = Path(got)
    why = {"step-99": "step-99 is not newer than step-100: compare the numbers (not the names, "
                      "not the modification times)"}
    why.update({name: f"{name} is not a complete checkpoint" for name in planted})
    label = next((name for name, path in planted.items() if path.name == got.name), got.name)
    assert got.name == newest.name, (
        f"resume_point returned {got.name}; expected step-100. {why.get(label, '')}")
    for name in ("step-100", "step-99"):
        shutil.rmtree(tmp_path / name)
    assert ex.resume_point(tmp_path) is None, (
        f"only broken or partial checkpoints are left ({sorted(os.listdir(tmp_path))}); "
        f"resume_point returned {ex.resume_point(tmp_path)}")


ENTRY_KINDS = ("complete", "partial", "empty", "cut", "file", "other name")


@pytest.mark.task9_3
@sweep(entries=st.lists(st.tuples(st.integers(0, 2000), st.sampled_from(ENTRY_KINDS),
                                  st.integers(0, 3)), max_size=8, unique_by=lambda e: e[0]),
       max_examples=20)
def test_resume_point_finds_the_newest_complete_checkpoint_among_any(ex, entries):
    """Any mix of complete checkpoints (their numbers zero-padded or not), .partial
    directories, empty step directories, files cut short, files named like a step, and other
    names; the oracle is the largest step number among the complete ones."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        complete = []
        for step, kind, padding in entries:
            name = f"step-{str(step).zfill(padding + len(str(step)))}"
            if kind == "complete":
                write_checkpoint(folder, name)
                complete.append((step, name))
            elif kind == "partial":
                write_checkpoint(folder, name + ".partial")
            elif kind == "empty":
                (folder / name).mkdir()
            elif kind == "cut":
                write_checkpoint(folder, name, cut=True)
            elif kind == "file":
                (folder / name).write_text("a file, not a checkpoint directory")
            else:
                write_checkpoint(folder, f"{name}-old")
        got = ex.resume_point(folder)
        want = max(complete)[1] if complete else None
        listing = sorted(p.name for p in folder.iterdir())
        assert (Path(got).name if got is not None else None) == want, (
            f"resume_point among {listing} returned {got and Path(got).name}; expected {want}: "
            f"the largest step number among the directories named step-<digits> whose "
            f"train.pt is whole")


# ----------------------------------------------------------------------------- the scripts


def script_fit_on_rank(ctx, name: str, folder: str | None, **options) -> dict:
    script = load_lesson_module(LESSON, name)
    quiet = dict(epochs=2, batch_size=8, train_windows=32, dropout=0.1,
                 log=lambda *args, **kwargs: None)
    model, result = script.fit(ctx.device, checkpoint_dir=folder and Path(folder),
                               **{**quiet, **options})
    return {"digest": parameter_digest(model), "train_loss": result["train_loss"]}


def test_train_checkpoint_resumes_from_an_epoch_bitwise(tmp_path):
    whole = run_on_ranks(script_fit_on_rank, "train_checkpoint", str(tmp_path), world_size=2)
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["step-00000002", "step-00000004"], saved  # 2 steps an epoch, 2 epochs
    shutil.rmtree(tmp_path / "step-00000004")  # as if it had stopped after epoch 1
    resumed = run_on_ranks(script_fit_on_rank, "train_checkpoint", str(tmp_path), world_size=2)
    assert resumed[0]["digest"] == whole[0]["digest"], "resumed after epoch 1: other weights"
    assert resumed[0]["train_loss"] == whole[0]["train_loss"][1:]


def test_train_resilient_resumes_mid_epoch_bitwise(tmp_path):
    whole = run_on_ranks(script_fit_on_rank, "train_resilient", str(tmp_path), world_size=2,
                         batch_size=4, save_every=3)
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["step-00000003", "step-00000006"], saved  # 8 steps, 4 an epoch
    shutil.rmtree(tmp_path / "step-00000006")  # as if it had stopped after step 5
    resumed = run_on_ranks(script_fit_on_rank, "train_resilient", str(tmp_path), world_size=2,
                           batch_size=4, save_every=3)
    assert resumed[0]["digest"] == whole[0]["digest"], "resumed at step 3, mid-epoch: other"


def script_state_onto_meta_on_rank(ctx, name: str, folder: str) -> dict:
    """The script's own save_state, then its load_state onto the meta device, as a GPU rank
    loads onto cuda:k: the generators must come back all the same (and the step folder, saved
    twice as after a restart, must be replaced)."""
    script = load_lesson_module(LESSON, name)
    path = Path(folder) / "step-00000001"
    model = GPT(GPTConfig(**CONFIG), seed=0)
    torch.manual_seed(5 + ctx.rank)
    for _ in range(2):
        script.save_state(path, {"model": model}, {"epoch": 0, "start": 0, "step": 1})
    saved = torch.get_rng_state()
    torch.manual_seed(999)
    position = script.load_state(path, {"model": GPT(GPTConfig(**CONFIG)).to("meta")}, "meta")
    return {"restored": torch.equal(torch.get_rng_state(), saved), "position": position,
            "left": sorted(p.name for p in Path(folder).iterdir())}


@pytest.mark.parametrize("name", ["train_checkpoint", "train_resilient"])
def test_the_scripts_restore_generators_whatever_device_the_tensors_load_onto(tmp_path, name):
    for rank, got in enumerate(run_on_ranks(script_state_onto_meta_on_rank, name,
                                            str(tmp_path), world_size=2)):
        assert got["restored"], f"rank {rank}: {name}.py did not restore its generator"
        assert got["position"]["step"] == 1
        assert got["left"] == ["step-00000001"], got["left"]


# LOGLEVEL=INFO: torchrun shows its agent's decisions (warnings and errors only otherwise).
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each restart gets a fresh store. torchrun's agent
# otherwise keeps one store for every attempt, and a restarted rank can read the address a dead
# one left there (pytorch/pytorch#135712; tests/test_torch_claims.py shows it).
RESTARTABLE = {"LOGLEVEL": "INFO", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


start_launches_first = start_first("launches")  # while the other checks run


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The torchrun runs of this module, started together."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("restart", "no-restart")}
    # gloo on the CPU, as the pooled reference trains, on a GPU machine too: there two nodes on
    # one machine would be two nccl ranks on cuda:0, which NCCL refuses (the GPU test below
    # runs the restart on GPUs).
    common = ("--backend", "gloo", "--epochs", "1", "--batch-size", "4", "--train-windows", "64",
              "--dropout", "0.1", "--save-every", "3")
    runs = {
        "restart": start_script(RESILIENT, *common, "--checkpoint-dir", str(folders["restart"]),
                                "--crash-at-step", "5", launcher="torchrun", nproc=2,
                                launcher_args=("--max-restarts=1",), env=RESTARTABLE,
                                timeout=90),
        # One process: the last rank is rank 0, and one fewer process to start.
        "no-restart": start_script(RESILIENT, *common, "--checkpoint-dir",
                                   str(folders["no-restart"]), "--crash-at-step", "5",
                                   launcher="torchrun", nproc=1, check=False, timeout=90),
    }
    # Two nodes on this machine: the batch script, with a stand-in for srun that starts one
    # task per emulated node (hosts 127.0.0.1 and 127.0.0.2), each a torchrun of one process.
    runs["two nodes"] = start_script(
        SBATCH, *common[:-2], launcher="bash", timeout=90,
        env={"PATH": path_with(REPO_ROOT / SBATCH.rsplit("/", 1)[0]),
             "MASTER_PORT": str(free_port()), "SLURM_JOB_ID": "4242", "SAVE_EVERY": "3",
             "CHECKPOINTS": str(tmp_path_factory.mktemp("slurm")), "FAKE_SLURM_NODES": "2"})
    yield {"runs": runs, "folders": folders}
    for run in runs.values():
        run.stop()


@pytest.fixture(scope="module")
def uninterrupted() -> str:
    """The weights of the torchrun runs' settings, trained without a stop on 2 pooled ranks."""
    return run_on_ranks(script_fit_on_rank, "train_resilient", None, world_size=2,
                        epochs=1, batch_size=4, train_windows=64, save_every=3)[0]["digest"]


@pytest.mark.slow  # a torchrun launch
def test_torchrun_restarts_a_killed_rank_and_the_run_resumes_exactly(launches, uninterrupted):
    run = launches["runs"]["restart"].result()
    assert "killing itself after step 5" in run.output
    # The agent's decisions, at LOGLEVEL=INFO (torchrun shows warnings and errors otherwise).
    assert "failed (exitcode: -9) local_rank: 1" in run.output, run.output[-3000:]
    assert "Worker group FAILED. 1/1 attempts left; will restart worker group" in run.output
    assert "resumed from" in run.output and "step-00000003" in run.output, run.output[-3000:]
    restarted = [line for line in run.output.splitlines() if "TORCHELASTIC_RESTART_COUNT=1" in line]
    assert len(restarted) == 2, f"both ranks start again, and know their attempt: {restarted}"
    assert "closing signal SIGTERM" in run.output, "the agent stops the rank that still runs"
    assert run.data["params_sha256"] == uninterrupted, (
        "killed at step 5, restarted, resumed from step 3: not the uninterrupted run's weights")


@pytest.mark.slow  # a torchrun launch
def test_without_restarts_left_torchrun_names_the_dead_rank(launches):
    run = launches["runs"]["no-restart"].result()
    assert run.returncode != 0
    assert "killing itself after step 5" in run.output
    assert "Signal 9 (SIGKILL)" in run.output, run.output[-3000:]
    assert "rank      : 0 (local_rank: 0)" in run.output, run.output[-3000:]
    saved = sorted(p.name for p in launches["folders"]["no-restart"].iterdir())
    assert saved == ["step-00000003"], f"the checkpoint to resume from by hand: {saved}"


@pytest.mark.slow  # a torchrun launch
def test_a_slurm_job_of_two_nodes_trains_what_one_node_trains(launches, uninterrupted):
    run = launches["runs"]["two nodes"].result()
    found = sorted(re.findall(r"RANK=(\d+) LOCAL_RANK=(\d+) GROUP_RANK=(\d+) WORLD_SIZE=(\d+)",
                              run.output))
    # Two nodes of one process: global ranks 0 and 1, one on each node, each local rank 0.
    assert found == [("0", "0", "0", "2"), ("1", "0", "1", "2")], run.output[-3000:]
    assert run.data["world_size"] == 2
    assert run.data["params_sha256"] == uninterrupted, (
        "two nodes of one process each trained other weights than one node of two processes")


@pytest.mark.slow
def test_the_batch_script_starts_one_torchrun_per_node_and_shares_out_the_cpus(tmp_path):
    """The batch script as a cluster runs it, with stand-ins for srun and torchrun: what every
    node's torchrun is given, and the threads of each of its processes."""
    fake = tmp_path / "torchrun"
    fake.write_text('#!/usr/bin/env bash\necho "node $SLURM_NODEID: OMP_NUM_THREADS='
                    '$OMP_NUM_THREADS torchrun $*"\n')
    fake.chmod(0o755)
    run = start_script(SBATCH, "--epochs", "1", launcher="bash", result=False, timeout=60,
                       env={"PATH": path_with(tmp_path, REPO_ROOT / SBATCH.rsplit("/", 1)[0]),
                            "OMP_NUM_THREADS": "", "SLURM_CPUS_PER_TASK": "16",
                            "SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_ID": "4242",
                            "FAKE_SLURM_NODES": "2"}).result()
    lines = sorted(line for line in run.output.splitlines() if line.startswith("node "))
    assert len(lines) == 2, run.output
    for node, line in enumerate(lines):
        assert line.startswith(f"node {node}: OMP_NUM_THREADS=4 torchrun --nnodes=2 "
                               f"--nproc-per-node=4 --rdzv-id=4242 --rdzv-backend=c10d "
                               f"--rdzv-endpoint=127.0.0.1:24242 --max-restarts=2 "), (
            f"16 CPUs for 4 processes per node: 4 threads each, and the node's torchrun "
            f"arguments: {line}")
        assert line.endswith("--save-every 50 --epochs 1"), line


def dcp_save_on_rank(ctx, folder: str) -> dict:
    script = load_lesson_module(LESSON, "sharded_checkpoint")
    dataset = CharDataset(32)
    model, optimizer = script.build(GPTConfig.named("tiny", vocab_size=dataset.vocab_size))
    script.train(model, optimizer, dataset, 0, 3, 8)
    script.save(Path(folder) / "step-00000003", model, optimizer, 3)
    return {"whole": script.full_state(model)}


def dcp_resume_on_rank(ctx, folder: str) -> dict:
    script = load_lesson_module(LESSON, "sharded_checkpoint")
    dataset = CharDataset(32)
    model, optimizer = script.build(GPTConfig.named("tiny", vocab_size=dataset.vocab_size))
    path = script.newest_checkpoint(Path(folder))
    step = script.load(path, model, optimizer)
    loaded = script.full_state(model)
    script.train(model, optimizer, dataset, step, 6, 8)
    return {"path": path.name, "step": step, "loaded": loaded, "final": script.full_state(model)}


def test_a_sharded_checkpoint_of_4_ranks_resumes_on_2(tmp_path):
    """torch.distributed.checkpoint: 4 ranks save their shards, 2 load them and go on; the
    result is one process's 6 steps (fp32 tolerance: the sums are split differently)."""
    saved = run_on_ranks(dcp_save_on_rank, str(tmp_path), world_size=4)[0]["whole"]
    files = sorted(p.name for p in (tmp_path / "step-00000003").iterdir())
    assert files == [".metadata"] + [f"__{rank}_0.distcp" for rank in range(4)], files
    resumed = run_on_ranks(dcp_resume_on_rank, str(tmp_path), world_size=2)[0]
    assert (resumed["path"], resumed["step"]) == ("step-00000003", 3)
    for name, tensor in saved.items():  # resharding moves bytes; it changes none
        assert torch.equal(resumed["loaded"][name], tensor), f"{name} changed in the resharding"
    script = load_lesson_module(LESSON, "sharded_checkpoint")
    dataset = CharDataset(32)
    alone, optimizer = script.build(GPTConfig.named("tiny", vocab_size=dataset.vocab_size),
                                    shard=False)
    script.train(alone, optimizer, dataset, 0, 6, 8, share=False)
    assert_parameters_close(resumed["final"], alone.state_dict(), "after resharding 4 -> 2")


def hang_on_rank(ctx, bug: str, detail: bool = False, monitor: float | None = None,
                 dump_after: float | None = None, folder: str = "") -> dict:
    """find_a_hang.py's step with ``bug`` on a group of its own, with a short timeout (the
    pool's own group stays healthy); returns what each tool said on this rank."""
    script = load_lesson_module(LESSON, "find_a_hang")
    if detail:
        dist.set_debug_level(dist.DebugLevel.DETAIL)  # groups created now check every call
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    dist.set_debug_level(dist.DebugLevel.OFF)
    stacks = Path(folder) / f"stacks-{ctx.rank}.txt" if dump_after else None
    out = open(stacks, "w") if stacks else None
    if out:
        faulthandler.dump_traceback_later(dump_after, exit=False, file=out)
    check_in = script.monitored(monitor, group=group) if monitor else None
    try:
        script.suspect(ctx.rank, bug, check_in, group=group, stuck_for=1.5)
        error = None
    except RuntimeError as err:
        error = str(err)
    finally:
        if out:
            faulthandler.cancel_dump_traceback_later()
            out.close()
    dist.destroy_process_group(group)
    return {"error": error, "stacks": stacks.read_text() if stacks else ""}


@pytest.mark.parametrize("bug, ops", [("order", ("ALLREDUCE", "BROADCAST")),
                                      ("shapes", ("TensorShape=[4]", "TensorShape=[5]")),
                                      ("skipped", ("ALLREDUCE",))])
def test_distributed_debug_detail_names_the_mismatched_calls(bug, ops):
    ranks = run_on_ranks(hang_on_rank, bug, detail=True, world_size=2)
    for rank, got in enumerate(ranks):
        assert got["error"] and "Detected mismatch between collectives on ranks" in got["error"], (
            f"rank {rank}: {got['error']}")
    assert all(op in ranks[0]["error"] for op in ops), ranks[0]["error"]


def test_monitored_barrier_names_the_straggler_and_the_stacks_show_where_each_rank_is(tmp_path):
    ranks = run_on_ranks(hang_on_rank, "straggler", monitor=0.5, dump_after=0.3,
                         folder=str(tmp_path), world_size=2)
    assert "Ranks 1 failed to pass monitoredBarrier in 500 ms" in (ranks[0]["error"] or ""), (
        ranks[0]["error"])
    # The watchdog's stacks: rank 0 waits in the barrier, rank 1 is stuck reading its data.
    assert "in monitored_barrier" in ranks[0]["stacks"], ranks[0]["stacks"]
    assert "in load_batch" in ranks[1]["stacks"], ranks[1]["stacks"]


@pytest.mark.slow  # a torchrun launch
@needs_gpus(1, "nccl and CUDA generators: train_resilient.py killed and restarted on a GPU")
def test_on_a_gpu_a_killed_rank_is_restarted_and_resumes(tmp_path):
    """One process per GPU (at most 2), nccl, dropout drawing from the CUDA generator: killed
    after step 5, restarted, resumed from step 3. On a GPU the embedding's backward adds with
    atomics (an order that varies), so the weights are compared within fp32 tolerance."""
    gpus = min(2, torch.cuda.device_count())
    common = ("--epochs", "1", "--batch-size", "4", "--train-windows", "64", "--dropout", "0.1",
              "--save-every", "3")
    runs = {name: start_script(RESILIENT, *common, *extra, "--checkpoint",
                               str(tmp_path / f"{name}.pt"), launcher="torchrun", nproc=gpus,
                               launcher_args=launcher_args, env=RESTARTABLE, timeout=240)
            for name, extra, launcher_args in (
                ("whole", (), ()),
                ("restarted", ("--checkpoint-dir", str(tmp_path / "ckpt"), "--crash-at-step",
                               "5"), ("--max-restarts=1",)))}
    restarted = runs["restarted"].result()
    assert runs["whole"].result().data["backend"] == "nccl"
    assert "resumed from" in restarted.output and "step-00000003" in restarted.output
    weights = {name: torch.load(tmp_path / f"{name}.pt", weights_only=True)["model"]
               for name in runs}
    assert_parameters_close(weights["restarted"], weights["whole"], "killed and resumed on GPU")


LAB_04 = "lessons/04_pitfalls/labs/04_device_from_rank.py"


@pytest.mark.slow  # four torchrun launches
@pytest.mark.timeout(300)
@needs_gpus(1, "two nodes of one process per GPU: RANK as the GPU index fails on node 1")
def test_on_gpus_two_nodes_make_the_global_rank_a_gpu_this_machine_lacks():
    """Lesson 04's pitfall 4 for real: two agents on this machine are two nodes of one process
    per GPU, so node 1's ranks are G..2G-1, and cuda:RANK does not exist for any of them."""
    gpus = torch.cuda.device_count()
    outcomes = {}
    for fix in (False, True):
        agents = start_nodes(LAB_04, *(["--fix"] if fix else []), nproc=gpus, job=f"lab{fix}",
                             timeout=120)
        outcomes[fix] = [agent.result() for agent in agents][0].data
    ranks = outcomes[False]["ranks"]
    failed = sorted(r["rank"] for r in ranks if "rank_as_gpu_error" in r)
    assert failed == list(range(gpus, 2 * gpus)), (
        f"with {gpus} GPU(s), node 1's ranks {gpus}..{2 * gpus - 1} should fail to use cuda:RANK; "
        f"failed: {failed}; {ranks}")
    assert outcomes[False]["symptom"] and "asked for cuda:" in outcomes[False]["verdict"]
    fixed = outcomes[True]
    assert not fixed["symptom"], fixed["verdict"]
    assert [r["bare_cuda_tensor"] for r in fixed["ranks"]] == [
        f"cuda:{r['local_rank']}" for r in fixed["ranks"]], fixed["ranks"]


def test_zip_archives_cut_short_do_not_open(tmp_path):
    # What resume_point relies on (asked of torch and zipfile, not assumed): torch.save writes
    # a zip archive whose index is at the end, so a file cut short is not one, and torch.load
    # refuses it.
    path = write_checkpoint(tmp_path, 1) / "train.pt"
    assert zipfile.is_zipfile(path)
    data = path.read_bytes()
    for keep in (len(data) - 1, len(data) // 2, 10):
        path.write_bytes(data[:keep])
        assert not zipfile.is_zipfile(path), keep
        with pytest.raises(Exception):  # noqa: B017 - RuntimeError or EOFError, by version
            torch.load(path, weights_only=True)
