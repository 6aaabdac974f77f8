"""Takes the highest step-<N> directory without looking inside: the one a crash left without
its train.pt, or with a train.pt cut short."""

TASK = "task9_3"
EXPECT = r"is not a complete checkpoint"


def resume_point(checkpoints):
    folder = Path(checkpoints)
    if not folder.is_dir():
        return None
    found = [(int(m.group(1)), entry) for entry in folder.iterdir()
             if (m := STEP_DIR.fullmatch(entry.name)) and entry.is_dir()]
    return max(found)[1] if found else None
