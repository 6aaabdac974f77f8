"""Remembers the start but yields the whole epoch again: a resumed run trains the first part of
the epoch twice (the sampler of a plain DistributedSampler, which cannot skip ahead)."""

TASK = "task9_1"
EXPECT = r"set_epoch\(0, start=4\): yielded .* expected the rest of the epoch"


class ResumableSampler:
    def __iter__(self):
        return iter(list(super().__iter__()))
