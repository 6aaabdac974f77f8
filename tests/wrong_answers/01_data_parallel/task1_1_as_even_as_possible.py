"""Splits as evenly as possible (10 on 3 as [4, 3, 3]), like tensor_split, not like DataParallel."""

TASK = "task1_1"
EXPECT = r"scatter_sizes\(10, 3\) returned \[4, 3, 3\]; DataParallel sends \[4, 4, 2\]"


def scatter_sizes(batch_size, num_replicas):
    base, extra = divmod(batch_size, num_replicas)
    sizes = [base + 1] * extra + [base] * (num_replicas - extra)
    return [size for size in sizes if size > 0]
