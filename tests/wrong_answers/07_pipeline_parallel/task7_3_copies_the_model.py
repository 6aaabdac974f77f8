"""Cuts a deep copy of the model: training the stages would leave the model itself untouched."""

TASK = "task7_3"
EXPECT = r"are not the model's own: keep its modules"


def split_gpt(model, num_stages):
    import copy

    model = copy.deepcopy(model)
    n = len(model.blocks)
    if not 1 <= num_stages <= n:
        raise ValueError(f"{n} blocks cannot be cut into {num_stages} stages")
    sizes = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    sizes[0] += sum(p.numel() for m in (model.tok_emb, model.pos_emb) for p in m.parameters())
    sizes[-1] += sum(p.numel() for m in (model.ln_f, model.lm_head) for p in m.parameters())
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        largest = max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))
        if best is None or largest < best[0]:
            best = (largest, bounds)
    return [GPTStage(model, a, b) for a, b in itertools.pairwise(best[1])]
