"""Gives every stage as many blocks as it can, ignoring that the embeddings and head weigh too."""

TASK = "task7_3"
EXPECT = r"the largest is [\d,]+ but a cut with [\d,]+ exists"


def split_gpt(model, num_stages):
    n = len(model.blocks)
    if not 1 <= num_stages <= n:
        raise ValueError(f"{n} blocks cannot be cut into {num_stages} stages")
    bounds = [round(s * n / num_stages) for s in range(num_stages + 1)]
    return [GPTStage(model, a, b) for a, b in itertools.pairwise(bounds)]
