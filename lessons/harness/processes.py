"""The live processes of this machine, read from Linux's /proc: one walker for the harness's
clean-up (a launch stops every process below it), the maintainer's check that a run left no
process behind, and the tests of both."""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def live_processes() -> dict[int, tuple[int, str]]:
    """pid -> (its parent's pid, its state: "R", "S", ..., "Z" for a zombie), for every process
    that exists now; one that exits while it is read is left out."""
    found = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:  # the command name (in parentheses) may hold spaces: split after its last ")"
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            found[int(entry.name)] = (int(fields[1]), fields[0])
        except (OSError, IndexError, ValueError):
            continue
    return found


def command_line(pid: int) -> str:
    """A live process's command line; "" once it has exited (a zombie has none)."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def working_directory(pid: int) -> str | None:
    """A live process's working directory, or None when it cannot be read (gone, or not ours)."""
    try:
        return os.readlink(PROC / str(pid) / "cwd")
    except OSError:
        return None


def descendants(root: int) -> list[int]:
    """Every live process below ``root``, deepest first (so that stopping them in this order
    never orphans one)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _state) in live_processes().items():
        children.setdefault(parent, []).append(pid)
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found[::-1]
