"""Builds the StagedModel and then calls .to(devices[0]) on it, which puts every stage on the first device."""

TASK = "task2_1"
EXPECT = r"stage \d: (parameter|buffer) '.*' is on \w+, expected devices\[\d\] = \w+"


def place_stages(stages, devices):
    if len(stages) != len(devices):
        raise ValueError(f"{len(stages)} stages but {len(devices)} devices: one device each")
    return StagedModel(stages, devices).to(devices[0])
