"""Lesson 09, task9_1: a run stopped, saved and resumed (mid-epoch, on fresh objects) takes
bitwise the same steps as one that never stopped; a save is atomic, reaches the disk, and a crash
half-way through it leaves the earlier checkpoint loadable. On gloo/CPU ranks.

    pytest lessons/09_survive_and_scale_out -m task9_1
"""

from __future__ import annotations

import copy
import io
import os
import random
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt import GPT, GPTConfig
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from harness.exercises import raise_if_untouched
from harness.ranks import run_on_ranks
from harness.sweep import st, sweep
from lesson09.common import CONFIG

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
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
}
SEQUENCES, BATCH = 64, 4  # 64 sequences: 8 steps per epoch of 4 per rank on 2 ranks
STOP, MORE = 5, 7  # stop after step 5 (mid-epoch 1), resume, 7 more: into epoch 2


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


@pytest.mark.task9_1
def test_the_sampler_resumes_an_epoch_where_it_stopped(ex):
    """`ResumableSampler.set_epoch(0, start)` yields `DistributedSampler`'s order without its first
    `start` indices, and `len()` counts what is left, for starts 0, 4 and 11 on each of 2 ranks of
    22 shuffled samples; `set_epoch(1)` gives the parent's whole epoch 1; a start of -1 or 12
    raises a `ValueError` naming it."""
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
    """A `ResumableSampler` never given `set_epoch` yields the parent's whole epoch 0, and `len()`
    is the whole share: 2 ranks of 22 samples, shuffled and not.

    A loop that starts without set_epoch: a first run, an evaluation pass."""
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
    """`ResumableSampler` yields `DistributedSampler`'s order from any start in the rank's share,
    and `len()` what is left, for generated dataset sizes (1 to 40), world sizes (1 to 5), ranks,
    shuffle, drop_last and epochs (0 to 3)."""
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
    """A run stopped mid-epoch and resumed on fresh objects gets every piece back and trains
    bitwise the run that never stopped: 2 gloo ranks, dropout, a step schedule, a `GradScaler`
    whose scale doubles every step; saved after 5 steps, loaded under another global seed, 7 more
    steps compared.

    Each piece is compared with what the rank held when it saved: the position, the weights,
    AdamW's state, the schedule, the scale, the rank's own torch generator (not rank 0's) and
    Python's; no `.partial` directory is left."""
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
    """A save whose `torch.save` writes half the file and raises leaves no `step-00000003` and step
    2's checkpoint loadable; the next save of step 3 works over its leftovers; a checkpoint of 2
    ranks loaded by 1 raises `ValueError` naming both. On 1 gloo rank."""
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
    """Loaded with `map_location="meta"` into a model on the meta device, a checkpoint still gives
    each of 2 gloo ranks its own torch and Python generators back, as a GPU rank loading onto
    cuda:k needs."""
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
    """Saving `step-00000003` where a copy of it lies, first one cut short, then a whole older one,
    works both times: the folder then holds `step-00000003` alone, and it loads at the run's newest
    step. On 1 gloo rank."""
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
    """A save fsyncs `train.pt`, then its `.partial` directory, before the rename onto the final
    name, and the checkpoints folder after it: every `os.fsync`, `os.replace` and `os.rename` of
    the save recorded, in order, on 1 gloo rank (Linux: read through `/proc/self/fd`)."""
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
    """`save_training_state` given its path as a `str` saves as with a `Path`: `step-00000001`
    alone in the folder, loading at the run's step. On 1 gloo rank."""
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
    """Saving step 2 again where a crash left `step-00000002.old` beside it (between renaming the
    old copy aside and removing it) works: `step-00000002` alone is left, and it loads at the newer
    step. On 1 gloo rank."""
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
    """No rank returns from `save_training_state` before `train.pt` is a whole zip archive: on 2
    gloo ranks, with rank 0 held up 0.5 s in its `torch.save`, each rank looks as soon as the call
    returns."""
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
    """`train.pt` holds exactly the layout the text gives, the model's, optimizer's, scheduler's
    and scaler's state dicts, the position as given and a list of the 2 ranks' generators: read
    back as rank 0 wrote it, on 2 gloo ranks."""
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
    """`load_training_state(..., "meta")` succeeds on each of 2 gloo ranks and passes
    `map_location="meta"` to every `torch.load` it calls (each call recorded)."""
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
