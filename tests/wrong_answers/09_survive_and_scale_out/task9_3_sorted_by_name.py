"""Takes the last name in sorted order: "step-99" sorts after "step-100"."""

TASK = "task9_3"
EXPECT = r"step-99 is not newer than step-100"


def resume_point(checkpoints):
    folder = Path(checkpoints)
    if not folder.is_dir():
        return None
    found = sorted(entry for entry in folder.iterdir() if STEP_DIR.fullmatch(entry.name)
                   and entry.is_dir() and zipfile.is_zipfile(entry / TRAIN_STATE))
    return found[-1] if found else None
