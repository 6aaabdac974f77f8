"""Generated blocks in a README: text between two markers that a tool writes and a test checks.

Two tools use them: ``chain.py`` (each step's diff) and ``proofs.py`` (each lesson's list of
tests). A block begins with ``<!-- KIND KEY: generated from SOURCE by `COMMAND`; do not edit by
hand -->`` and ends with ``<!-- /KIND -->``; an empty pair of markers is where a new one goes.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Marked:
    kind: str  # "chain-diff"
    source: str  # what the block is generated from: "the files"
    command: str  # what regenerates it: "python tests/course/chain.py --write"

    def begin(self, key: str) -> str:
        return (f"<!-- {self.kind} {key}: generated from {self.source} by `{self.command}`; "
                "do not edit by hand -->")

    @property
    def end(self) -> str:
        return f"<!-- /{self.kind} -->"

    def wrap(self, key: str, body: str) -> str:
        return f"{self.begin(key)}\n{body}\n{self.end}"

    def shown(self, text: str) -> dict[str, str]:
        """key -> the whole block (markers included), as ``text`` has it now."""
        pattern = re.compile(rf"<!-- {re.escape(self.kind)} (?P<key>\S+?):? .*?-->\n.*?"
                             rf"{re.escape(self.end)}", re.DOTALL)
        return {m["key"]: m.group(0) for m in pattern.finditer(text)}

    def missing(self, path: str, key: str, where: str) -> str:
        return (f"{path} has no {self.kind} block for {key}: put the two lines\n"
                f"{self.begin(key)}\n{self.end}\n{where}, then run `{self.command}`")

    def replace(self, path: Path, key: str, block: str) -> bool:
        """Put ``block`` in place of the one ``path`` shows for ``key``; True when it changed.
        KeyError when ``path`` has no block for ``key``."""
        text = path.read_text(encoding="utf-8")
        current = self.shown(text)[key]
        if current == block:
            return False
        path.write_text(text.replace(current, block), encoding="utf-8")
        return True
