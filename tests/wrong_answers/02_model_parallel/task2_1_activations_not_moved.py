"""Runs the stages one after another without moving each stage's input to that stage's device."""

TASK = "task2_1"
EXPECT = r"Move each stage's input to its device just before calling it|stage \d received its input on \w+, expected devices\[\d\]"


class StagedModel(nn.Module):
    def __init__(self, stages, devices):
        super().__init__()
        if len(stages) != len(devices):
            raise ValueError(f"{len(stages)} stages but {len(devices)} devices: one device each")
        self.stages = nn.ModuleList(stages)
        self.devices = [torch.device(d) for d in devices]

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x
