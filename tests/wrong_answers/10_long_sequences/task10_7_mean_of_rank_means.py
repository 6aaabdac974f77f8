"""Averages the ranks' own means (a rank without real tokens counting as 0): each rank's tokens
weigh 1 / its own count, not 1 / every rank's."""

import torch.distributed as dist
import torch.nn.functional as F

TASK = "task10_7"
EXPECT = r"mean of the ranks' means"


def token_mean_loss(logits, targets, ignore_index=-100, group=None):
    mine = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index, reduction="sum")
    mean = mine / (targets != ignore_index).sum().clamp(min=1)
    total = mean.detach().clone()
    dist.all_reduce(total, group=group)
    world = dist.get_world_size(group)
    return (mean + (total - mean.detach())) / world
