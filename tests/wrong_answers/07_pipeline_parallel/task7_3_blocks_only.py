"""Balances the blocks' parameters only, leaving the embeddings and the head out of the count."""

TASK = "task7_3"
EXPECT = r"the largest is [\d,]+ but a cut with [\d,]+ exists"


def split_gpt(model, num_stages):
    n = len(model.blocks)
    if not 1 <= num_stages <= n:
        raise ValueError(f"{n} blocks cannot be cut into {num_stages} stages")
    sizes = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        largest = max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))
        if best is None or largest < best[0]:
            best = (largest, bounds)
    return [GPTStage(model, a, b) for a, b in itertools.pairwise(best[1])]
