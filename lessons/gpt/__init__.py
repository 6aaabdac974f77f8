"""The course's one running example: a small GPT-style character model and its data.

Defined once here and imported by every lesson script (as nanoGPT keeps ``model.py`` apart from
``train.py``), so each lesson's script differs from the last only by what that lesson teaches.

- ``model.py``: ``GPTConfig`` (with named sizes, ``GPTConfig.named("tiny" | "gpu", ...)``) and
  ``GPT``, a stack of pre-norm transformer ``Block``s that later lessons split by heads
  (tensor parallel), cut between blocks (pipeline parallel) and wrap block by block (FSDP2);
  ``GPTStage(model, start, end)`` is a run of its blocks, one stage of a pipeline;
  ``parameter_digest(model)`` fingerprints trained weights exactly;
- ``data.py``: ``CharDataset``, (input, target) windows of ``text.txt`` (Shakespeare, public
  domain, shipped with the course).

A lesson script (run as ``python lessons/NN_x/script.py`` or under ``torchrun``) imports it with::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
    from gpt import GPT, CharDataset, GPTConfig

Tests need no such line: pytest's ``pythonpath`` already holds ``lessons``.
"""

from .data import TEXT_PATH, CharDataset, load_text, train_val_split
from .model import (
                    GPT,
                    MLP,
                    SIZES,
                    Block,
                    CausalSelfAttention,
                    GPTConfig,
                    GPTStage,
                    parameter_digest,
)

__all__ = [
    "GPT",
    "MLP",
    "SIZES",
    "TEXT_PATH",
    "Block",
    "CausalSelfAttention",
    "CharDataset",
    "GPTConfig",
    "GPTStage",
    "load_text",
    "parameter_digest",
    "train_val_split",
]
