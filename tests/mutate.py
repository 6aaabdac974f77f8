"""Mutation check of the graders: does each task's grader reject small changes of its answer?

    python tests/mutate.py --list                      # how many mutants each task has
    python tests/mutate.py --lessons 05,07             # run them: a table per lesson
    python tests/mutate.py --sample 2 --seed abc123    # 2 per lesson, chosen by the seed
    python tests/mutate.py --survivors-to left.txt     # then, after new tests:
    python tests/mutate.py --only left.txt             # grade just those again

A *mutant* is the reference answer of one task with one small change: an operator swapped
(``+`` for ``-``, ``<`` for ``<=``, ``and`` for ``or``), a constant moved (``n`` to ``n + 1``,
``True`` to ``False``), one statement dropped, or the first two arguments of a call swapped. Each
is graded as a learner's answer in a scratch copy of the course (``pytest lessons/NN -m task
-x``, learner mode): *killed* when a test fails, *survived* when every test passes. A survivor is
either a gap in the grader (add the test that kills it) or *equivalent*: it computes the same
thing. ``tests/mutation_equivalents.txt`` lists both kinds that are known, one line each:
``<id>  # equivalent: <why>`` leaves the score; ``<id>  # open: <what test would kill it>`` is a
known gap, counted as survived. The score is killed / (mutants - equivalent), per lesson; the
course's target is 90 %. A sampled run (CI's) fails only on a survivor the file does not list.

Before its mutants, each lesson's unmodified reference is graded the same way (its control):
if the control fails, the scratch copy is broken and every "kill" would be false, so the run
stops there.

Mutants are named by what they change, not by line number, so that the list of equivalents
survives edits elsewhere: ``task5_1/memory_per_rank/Compare: stage >= 3 -> stage > 3#0``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lessons"))

from course.manifest import COURSE  # noqa: E402
from course.selfcheck import processes_under, run_lesson_tests, scratch_course  # noqa: E402
from harness.exercises import SOLUTIONS_DIR  # noqa: E402

EQUIVALENTS = Path(__file__).with_name("mutation_equivalents.txt")
RUN_TIMEOUT = 240.0
SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
         ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult,
         ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
         ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
         ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.And: ast.Or, ast.Or: ast.And}


@dataclasses.dataclass(frozen=True)
class Mutant:
    lesson: str
    task: str
    name: str  # the definition it changes
    id: str
    source: str  # the whole mutated definition, to replace the solution's


def _is_docstring(node: ast.AST, parent: ast.AST) -> bool:
    body = getattr(parent, "body", None)
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str) and bool(body) and body[0] is node)


def _sites(definition: ast.stmt):
    """(kind, node path) of every place a mutation applies, in a fixed order."""
    for parent in ast.walk(definition):
        for field, value in ast.iter_fields(parent):
            children = value if isinstance(value, list) else [value]
            for index, child in enumerate(children):
                if not isinstance(child, ast.AST) or _is_docstring(child, parent):
                    continue
                where = (parent, field, index if isinstance(value, list) else None)
                if isinstance(child, (ast.BinOp, ast.AugAssign)) and type(child.op) in SWAPS:
                    yield "operator", where
                elif isinstance(child, ast.BoolOp) and type(child.op) in SWAPS:
                    yield "operator", where
                elif isinstance(child, ast.Compare) and type(child.ops[0]) in SWAPS:
                    yield "compare", where
                elif (isinstance(child, ast.Constant) and type(child.value) in (int, bool)
                      and not isinstance(parent, ast.keyword)):
                    yield "constant", where
                elif isinstance(child, ast.Call) and len(child.args) >= 2:
                    yield "arguments", where
                if (isinstance(child, ast.stmt) and isinstance(value, list)
                        and not isinstance(child, (ast.FunctionDef, ast.ClassDef))
                        and field in ("body", "orelse") and len(value) >= 2):
                    yield "drop", where


def _apply(kind: str, node: ast.AST) -> ast.AST | None:
    node = copy.deepcopy(node)
    if kind == "operator":
        node.op = SWAPS[type(node.op)]()
    elif kind == "compare":
        node.ops[0] = SWAPS[type(node.ops[0])]()
    elif kind == "constant":
        node.value = (not node.value) if isinstance(node.value, bool) else node.value + 1
    elif kind == "arguments":
        node.args[0], node.args[1] = node.args[1], node.args[0]
    elif kind == "drop":
        return None
    return node


def mutants_of(lesson: str, task: str, names: list[str]) -> list[Mutant]:
    solution = SOLUTIONS_DIR / lesson / "exercises.py"
    tree = ast.parse(solution.read_text())
    found, seen = [], {}
    for definition in tree.body:
        if getattr(definition, "name", None) not in names:
            continue
        for number, (kind, _) in enumerate(list(_sites(definition))):
            mutated = copy.deepcopy(definition)
            parent, field, index = list(_sites(mutated))[number][1]
            original = getattr(parent, field)[index] if index is not None else getattr(
                parent, field)
            replacement = _apply(kind, original)
            before = ast.unparse(original).splitlines()[0][:60]
            if replacement is None:
                getattr(parent, field).pop(index)
                after = "(dropped)"
            else:
                if index is not None:
                    getattr(parent, field)[index] = replacement
                else:
                    setattr(parent, field, replacement)
                after = ast.unparse(replacement).splitlines()[0][:60]
            label = f"{task}/{definition.name}/{kind}: {before} -> {after}"
            seen[label] = seen.get(label, -1) + 1
            ast.fix_missing_locations(mutated)
            found.append(Mutant(lesson, task, definition.name, f"{label}#{seen[label]}",
                                ast.unparse(mutated)))
    return found


def all_mutants(lessons: list[str] | None = None) -> list[Mutant]:
    found = []
    for entry in COURSE:
        if lessons and entry.folder[:2] not in lessons and entry.folder not in lessons:
            continue
        for task, target in entry.tasks.items():
            names = [name.strip() for name in target.split(",")]
            found += mutants_of(entry.folder, task, names)
    return found


def listed() -> dict[str, tuple[str, str]]:
    """{mutant id: ("equivalent" | "open", why)}, from tests/mutation_equivalents.txt."""
    if not EQUIVALENTS.is_file():
        return {}
    found = {}
    for number, line in enumerate(EQUIVALENTS.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        mutant, _, note = line.partition("  # ")
        kind, _, why = note.partition(": ")
        if kind not in ("equivalent", "open") or not why.strip():
            raise SystemExit(f"{EQUIVALENTS.name}:{number}: expected '<id>  # equivalent: <why>'"
                             f" or '<id>  # open: <the test that would kill it>', got {line!r}")
        found[mutant.strip()] = (kind, why.strip())
    return found


def _graded_source(mutant: Mutant) -> str:
    from course.selfcheck import with_wrong_answer

    solution = (SOLUTIONS_DIR / mutant.lesson / "exercises.py").read_text()
    return with_wrong_answer(solution, mutant.source)


def grade(mutant: Mutant, folder: Path) -> tuple[str, float, str]:
    """("killed" | "survived", seconds, the first failure's first line)."""
    return _graded(mutant.lesson, mutant.task, _graded_source(mutant), folder, mutant.id)


def control(lesson: str, tasks: list[str], folder: Path) -> tuple[str, float, str]:
    """The unmodified reference, graded as the mutants are: it must survive."""
    solution = (SOLUTIONS_DIR / lesson / "exercises.py").read_text()
    return _graded(lesson, " or ".join(tasks), solution, folder, f"control of {lesson}")


def _graded(lesson: str, marker: str, source: str, folder: Path, what: str):
    root = folder / "course"
    if not root.exists():
        scratch_course(root)
    (root / "lessons" / lesson / "exercises.py").write_text(source)
    started = time.monotonic()
    try:
        outcomes = run_lesson_tests(lesson, folder, "-m", marker, "-x", root=root,
                                    timeout=RUN_TIMEOUT)
    except Exception as error:  # noqa: BLE001 - a run that breaks down kills the mutant
        return "killed", time.monotonic() - started, f"{type(error).__name__}: {error}"[:120]
    finally:
        left = processes_under(root)
        if left:
            print(f"  processes left behind by {what}: {left}", file=sys.stderr)
    failures = [text for outcome, text in outcomes.values() if outcome in ("failure", "error")]
    first = failures[0].splitlines()[0][:120] if failures and failures[0] else ""
    return ("killed" if failures else "survived"), time.monotonic() - started, first


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lessons", help="comma-separated lesson numbers or folders")
    parser.add_argument("--tasks", help="comma-separated task ids")
    parser.add_argument("--sample", type=int, help="mutants per lesson, chosen by --seed")
    parser.add_argument("--seed", default="0")
    parser.add_argument("--parallel", type=int, default=3)
    parser.add_argument("--list", action="store_true", help="count the mutants, run nothing")
    parser.add_argument("--only", type=Path, help="a file of mutant ids, one a line: only those")
    parser.add_argument("--survivors-to", type=Path, help="write the survivors' ids here")
    args = parser.parse_args(argv)
    mutants = all_mutants(args.lessons.split(",") if args.lessons else None)
    if args.tasks:
        mutants = [m for m in mutants if m.task in args.tasks.split(",")]
    if args.only:
        wanted = {line.strip() for line in args.only.read_text().splitlines() if line.strip()}
        mutants = [m for m in mutants if m.id in wanted]
    notes = listed()
    known = {mutant for mutant, (kind, _) in notes.items() if kind == "equivalent"}
    if args.sample is not None:
        chooser = random.Random(args.seed)
        by_lesson: dict[str, list[Mutant]] = {}
        for mutant in mutants:
            if mutant.id not in known:
                by_lesson.setdefault(mutant.lesson, []).append(mutant)
        mutants = [m for group in by_lesson.values()
                   for m in chooser.sample(group, min(args.sample, len(group)))]
    if args.list:
        counts: dict[str, int] = {}
        for mutant in mutants:
            counts[mutant.task] = counts.get(mutant.task, 0) + 1
        for task, count in counts.items():
            print(f"{task:10} {count:4} mutants")
        print(f"{len(mutants)} in all, {sum(m.id in known for m in mutants)} listed as equivalent")
        return 0
    lessons = sorted({m.lesson for m in mutants})
    results: dict[str, tuple] = {}
    with tempfile.TemporaryDirectory(prefix="course-mutants-") as tmp:
        folders = [Path(tmp) / f"worker{i}" for i in range(max(1, args.parallel))]
        for folder in folders:
            folder.mkdir()
        queue = [m for m in mutants if m.id not in known]
        tasks = {lesson: sorted({m.task for m in mutants if m.lesson == lesson})
                 for lesson in lessons}

        def check(worker: int):
            for lesson in lessons[worker::len(folders)]:
                outcome, seconds, first = control(lesson, tasks[lesson], folders[worker])
                print(f"control  {seconds:5.1f}s  {lesson}: "
                      f"{'passes' if outcome == 'survived' else 'FAILS'}", flush=True)
                if outcome != "survived":
                    raise SystemExit(f"the unmodified reference of {lesson} fails its tests in "
                                     f"the scratch copy ({first}): no mutant result would mean "
                                     "anything")

        def work(worker: int):
            for mutant in queue[worker::len(folders)]:
                results[mutant.id] = (mutant, *grade(mutant, folders[worker]))
                outcome, seconds = results[mutant.id][1:3]
                print(f"{outcome:8} {seconds:5.1f}s  {mutant.id}", flush=True)

        with ThreadPoolExecutor(max_workers=len(folders)) as pool:
            list(pool.map(check, range(len(folders))))
            list(pool.map(work, range(len(folders))))
    print("\nlesson                    mutants  equivalent  killed  survived  score")
    for lesson in lessons:
        mine = [m for m in mutants if m.lesson == lesson]
        equal = sum(m.id in known for m in mine)
        killed = sum(results[m.id][1] == "killed" for m in mine if m.id in results)
        survived = sum(results[m.id][1] == "survived" for m in mine if m.id in results)
        score = killed / (killed + survived) if killed + survived else 1.0
        print(f"{lesson:25} {len(mine):7} {equal:11} {killed:7} {survived:9}  {score:5.0%}")
    survivors = [r[0] for r in results.values() if r[1] == "survived"]
    unlisted = [m for m in survivors if m.id not in notes]
    if args.survivors_to:
        args.survivors_to.write_text("".join(f"{m.id}\n" for m in survivors))
    if survivors:
        print("\nsurvivors (kill each with a test, or list it in tests/mutation_equivalents.txt):")
        for mutant in survivors:
            print(f"  {mutant.id}" + (f"  # open: {notes[mutant.id][1]}"
                                      if mutant.id in notes else "  (not listed)"))
    return 1 if unlisted and args.sample is not None else 0


if __name__ == "__main__":
    sys.exit(main())
