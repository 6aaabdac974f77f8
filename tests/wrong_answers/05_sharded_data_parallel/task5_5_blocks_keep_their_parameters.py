"""Keeps the pieces but leaves the blocks' whole parameters in place: nothing is saved."""

TASK = "task5_5"
EXPECT = r"the blocks still hold their whole parameters"


class Zero3Blocks:
    def __init__(self, blocks):
        super().__init__()
        world_size, rank = dist.get_world_size(), dist.get_rank()
        self.names = [[name for name, _ in block.named_parameters()] for block in blocks]
        self.shapes = [[tuple(p.shape) for p in block.parameters()] for block in blocks]
        pieces = []
        for param in blocks.parameters():
            start, end = shard_bounds(param.numel(), world_size, rank)
            piece = torch.zeros(shard_size(param.numel(), world_size), dtype=param.dtype,
                                device=param.device)
            piece[: end - start] = param.detach().reshape(-1)[start:end]
            pieces.append(nn.Parameter(piece))
        self.shards = nn.ParameterList(pieces)
        self.blocks = blocks
