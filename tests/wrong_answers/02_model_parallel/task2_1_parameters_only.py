"""Moves each parameter with the old param.data = param.data.to(device) idiom and never the buffers."""

TASK = "task2_1"
EXPECT = r"(?s)place_stages.*raised RuntimeError.*Move each whole stage with stage\.to\(device\)"


def place_stages(stages, devices):
    devices = [torch.device(d) for d in devices]
    if len(stages) != len(devices):
        raise ValueError(f"{len(stages)} stages but {len(devices)} devices: one device each")
    for stage, device in zip(stages, devices, strict=True):
        for param in stage.parameters():
            param.data = param.data.to(device)
    return StagedModel(stages, devices)
