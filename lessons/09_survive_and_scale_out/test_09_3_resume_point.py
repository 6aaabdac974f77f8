"""Lesson 09, task9_3: resume_point finds the newest complete checkpoint among planted partial,
empty and broken ones.

    pytest lessons/09_survive_and_scale_out -m task9_3
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from harness.sweep import st, sweep
from lesson09.common import write_checkpoint

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
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


@pytest.mark.task9_3
def test_resume_point_picks_the_newest_complete_checkpoint(ex, tmp_path):
    """`resume_point` picks `step-100` among planted ones: a `.partial` directory, a step without
    `train.pt`, one cut short, `latest`, `step-abc`, a file named `step-150`, and `step-99` touched
    last; it returns `None` for a missing or empty folder, and when only broken ones are left."""
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
    """`resume_point` returns the complete checkpoint of the largest step number in generated
    folders of up to 8 entries: complete ones (zero-padded or not), `.partial` directories, empty
    step directories, files cut short, files named like a step, other names."""
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
