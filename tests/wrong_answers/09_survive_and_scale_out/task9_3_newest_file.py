"""Takes the most recently modified checkpoint: a copy, a restore or a touch makes an old one
the newest."""

TASK = "task9_3"
EXPECT = r"step-99 is not newer than step-100"


def resume_point(checkpoints):
    folder = Path(checkpoints)
    if not folder.is_dir():
        return None
    found = [entry for entry in folder.iterdir() if STEP_DIR.fullmatch(entry.name)
             and entry.is_dir() and zipfile.is_zipfile(entry / TRAIN_STATE)]
    return max(found, key=lambda entry: entry.stat().st_mtime, default=None)
