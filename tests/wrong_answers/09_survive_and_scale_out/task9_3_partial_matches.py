"""Matches the names with re.match, which only anchors the start: "step-120.partial" counts as
step 120, a save that never finished."""

TASK = "task9_3"
EXPECT = r"step-120.partial is not a complete checkpoint"


def resume_point(checkpoints):
    folder = Path(checkpoints)
    if not folder.is_dir():
        return None
    found = [(int(m.group(1)), entry) for entry in folder.iterdir()
             if (m := re.match(r"step-(\d+)", entry.name)) and entry.is_dir()
             and zipfile.is_zipfile(entry / TRAIN_STATE)]
    return max(found)[1] if found else None
