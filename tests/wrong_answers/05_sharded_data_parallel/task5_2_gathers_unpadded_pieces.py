"""All-gathers the short last piece as it is: the ranks' pieces differ in size."""

TASK = "task5_2"
EXPECT = r"must give the all-gather the same number of elements: pad the piece"


def all_gather_pieces(piece, numel):
    world_size = dist.get_world_size()
    whole = torch.empty(world_size * piece.numel(), dtype=piece.dtype, device=piece.device)
    all_gather_single(whole, piece.reshape(-1).contiguous())
    return whole[:numel]
