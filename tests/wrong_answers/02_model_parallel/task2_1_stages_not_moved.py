"""Returns StagedModel(stages, devices) without moving any stage to its device."""

TASK = "task2_1"
EXPECT = r"stage 1: parameter '.*' is on cpu, expected devices\[1\] = meta"


def place_stages(stages, devices):
    if len(stages) != len(devices):
        raise ValueError(f"{len(stages)} stages but {len(devices)} devices: one device each")
    return StagedModel(stages, devices)
