"""Sentences only a GPU or a cluster could test stand on a named source (sourced_claims.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from sourced_claims import CLAIMS, Sourced
from torch.torch_version import TorchVersion

from harness.exercises import LESSONS_DIR

TORCH_ROOT = Path(torch.__file__).parent


def words(text: str) -> str:
    """The text as one line: what a reader sees, whatever the wrapping and the Markdown marks."""
    return re.sub(r"\s+", " ", text.replace("`", "").replace("*", "")).strip()


def defined_names(path: Path) -> set[str]:
    """Every function and class in the file, by its qualified name (``Class.method``)."""
    names: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + child.name)
                visit(child, prefix + child.name + ".")

    visit(ast.parse(path.read_text()), "")
    return names


def claim_id(claim: Sourced) -> str:
    return f"{claim.lesson[:2]}:{claim.sentence[:40]}"


def test_every_claim_names_a_version_and_what_the_source_says():
    assert CLAIMS, "sourced_claims.CLAIMS is empty"
    for claim in CLAIMS:
        assert claim.version.strip() and claim.says.strip(), f"{claim_id(claim)}: say what was read"
        kind = claim.source.split(":", 1)[0]
        assert kind in {"torch", "slurm", "nccl", "paper", "release", "repo"}, (
            f"{claim_id(claim)}: source {claim.source!r} should start with torch:, slurm:, nccl:, "
            "paper:, release: or repo:")


@pytest.mark.parametrize("claim", CLAIMS, ids=claim_id)
def test_the_sentence_is_still_in_its_lesson(claim):
    readme = LESSONS_DIR / claim.lesson / "README.md"
    assert words(claim.sentence) in words(readme.read_text()), (
        f"{claim.lesson}/README.md no longer says {claim.sentence!r}: update sourced_claims.py "
        "with the new words, after reading the source again")


@pytest.mark.parametrize("claim", [c for c in CLAIMS if c.source.startswith("torch:")],
                         ids=claim_id)
def test_the_named_torch_function_is_still_where_the_claim_says(claim):
    """On the torch that was read or a newer one; an older torch may not have it yet."""
    _, path, name = claim.source.split(":")
    read = re.search(r"torch (\d+\.\d+(?:\.\d+)?)", claim.version)
    if read and TorchVersion(torch.__version__) < read.group(1):
        pytest.skip(f"read in torch {read.group(1)}; this is torch {torch.__version__}")
    file = TORCH_ROOT / path
    assert file.is_file(), (
        f"torch {torch.__version__} has no {path} (read in {claim.version}): find where "
        f"{name} went and read it again")
    assert name in defined_names(file), (
        f"torch {torch.__version__}'s {path} defines no {name} (read in {claim.version}): "
        "read the source again before keeping the sentence")
