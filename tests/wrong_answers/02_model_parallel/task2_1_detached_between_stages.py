"""Moves the activations with x.detach().to(device), which cuts the graph: early stages get no gradient."""

TASK = "task2_1"
EXPECT = r"cut the autograd graph"


class StagedModel(nn.Module):
    def __init__(self, stages, devices):
        super().__init__()
        if len(stages) != len(devices):
            raise ValueError(f"{len(stages)} stages but {len(devices)} devices: one device each")
        self.stages = nn.ModuleList(stages)
        self.devices = [torch.device(d) for d in devices]

    def forward(self, x):
        for stage, device in zip(self.stages, self.devices, strict=True):
            x = stage(x.detach().to(device))
        return x
