"""Sends the output back to the first device (where the batch came from) instead of leaving it on the last."""

TASK = "task2_1"
EXPECT = r"the output where the last stage made it|the output is on \w+, expected the last stage's device"


class StagedModel(nn.Module):
    def __init__(self, stages, devices):
        super().__init__()
        if len(stages) != len(devices):
            raise ValueError(f"{len(stages)} stages but {len(devices)} devices: one device each")
        self.stages = nn.ModuleList(stages)
        self.devices = [torch.device(d) for d in devices]

    def forward(self, x):
        for stage, device in zip(self.stages, self.devices, strict=True):
            x = stage(x.to(device))
        return x.to(self.devices[0])
