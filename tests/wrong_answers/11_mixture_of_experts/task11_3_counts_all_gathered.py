"""Gathers every rank's whole count vector and slices this rank's columns: the right numbers,
but every rank receives everything."""

TASK = "task11_3"
EXPECT = r"one all-to-all sends each rank exactly the counts it needs"
REPLACE = {"exchange_counts": [
    ("    received = torch.empty_like(per_expert)\n"
     "    dist.all_to_all_single(received, per_expert.contiguous(), group=group)\n"
     "    return received.view(world, -1)",
     "    every = [torch.empty_like(per_expert) for _ in range(world)]\n"
     "    dist.all_gather(every, per_expert.contiguous(), group=group)\n"
     "    mine = per_expert.numel() // world\n"
     "    place = dist.get_rank(group)\n"
     "    return torch.stack([c[place * mine:(place + 1) * mine] for c in every])"),
]}
