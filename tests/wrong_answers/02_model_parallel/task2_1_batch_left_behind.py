"""Moves the activations between stages but leaves the batch where the loader put it."""

TASK = "task2_1"
EXPECT = r"stage 0 received the batch on cpu, expected devices\[0\] = meta"


class StagedModel(nn.Module):
    def __init__(self, stages, devices):
        super().__init__()
        if len(stages) != len(devices):
            raise ValueError(f"{len(stages)} stages but {len(devices)} devices: one device each")
        self.stages = nn.ModuleList(stages)
        self.devices = [torch.device(d) for d in devices]

    def forward(self, x):
        for k, (stage, device) in enumerate(zip(self.stages, self.devices, strict=True)):
            if k > 0:  # the batch is assumed to be on the first device already
                x = x.to(device)
            x = stage(x)
        return x
