"""The sentences no CPU can test, each with the source that says it.

A sentence about torch, NCCL, SLURM or a paper earns its place by a test of exactly the condition
it states (``tests/test_torch_claims.py`` and each lesson's tests). Where only a GPU, NCCL or a real
cluster could run that test, it earns it here instead: the words of the sentence as the lesson
prints them, and where the behaviour is written (a file and a function at a named version, or a
paper's section). ``tests/test_sourced_claims.py`` checks that each sentence is still in its
lesson's text and, for torch, that the named function is still defined in the named file of the
torch this course runs on, so a rename or a rewrite of the text makes somebody read the source
again.

``sentence``: a few words of the lesson's text, enough to find it (whitespace and line breaks do
not matter). ``source``: ``torch:<path under torch/>:<function or Class.method>`` for torch;
anything else (``slurm:``, ``nccl:``, ``paper:``, ``release:`` for a release note or the pull
request that made a change) is a reference checked by a reader, not a test.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sourced:
    lesson: str      # the lesson folder whose README holds the sentence
    sentence: str    # a few words of it, as printed (whitespace-insensitive)
    source: str      # torch:<path>:<qualified name>, or slurm:/nccl:/paper:/release: <where>
    version: str     # the version that was read: "torch 2.14.1", "Slurm 24.05", "arXiv v2"
    says: str        # what that source says, in one line


CLAIMS: list[Sourced] = [
    Sourced("01_data_parallel", "torch 1.9 (2021) added torch.distributed.run, and torch 1.10 gave "
            "it the torchrun command",
            "release: pytorch/pytorch pull request 64049 (\"Introduce the torchrun entrypoint\", "
            "merged August 2021, in 1.10); torch 1.9.0's release notes (torch.distributed.run, "
            "the elastic launcher, June 2021)",
            "torch 1.9.0 and 1.10.0 release notes",
            "torchrun is an entry point for python -m torch.distributed.run, new in 1.10; "
            "torch.distributed.run came with 1.9"),
]
