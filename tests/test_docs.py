"""The reading side: walkthroughs run and open as notebooks; the site builds with every snippet."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness.exercises import LESSONS_DIR, REPO_ROOT, lesson_names

LESSONS = lesson_names()


WALKTHROUGHS_AT_ONCE = 3  # most of a walkthrough is importing torch and waiting on torchrun


def run_walkthrough(lesson: str) -> subprocess.CompletedProcess:
    path = LESSONS_DIR / lesson / "walkthrough.py"
    # 300 s: lesson 09's starts five torchrun agents (2 min on a 2-core machine running CI)
    return subprocess.run([sys.executable, str(path)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def walkthrough_runs(request):
    """Every selected walkthrough, started a few at a time; each test collects its own."""
    selected = [item.callspec.params["lesson"] for item in request.session.items
                if item.originalname == "test_walkthrough_runs_top_to_bottom_as_a_script"]
    pool = ThreadPoolExecutor(max_workers=WALKTHROUGHS_AT_ONCE)
    runs = {lesson: pool.submit(run_walkthrough, lesson) for lesson in selected}
    yield runs
    for future in runs.values():
        future.cancel()
    pool.shutdown(wait=True)


@pytest.mark.timeout(330)  # past run_walkthrough's own 300 s
@pytest.mark.parametrize("lesson", LESSONS)
def test_walkthrough_runs_top_to_bottom_as_a_script(lesson, walkthrough_runs):
    run = walkthrough_runs[lesson].result()
    assert run.returncode == 0, (
        f"{lesson}/walkthrough.py failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")


@pytest.mark.parametrize("lesson", LESSONS)
def test_walkthrough_opens_as_a_notebook(lesson, tmp_path):
    jupytext = pytest.importorskip("jupytext")
    notebook = jupytext.read(LESSONS_DIR / lesson / "walkthrough.py")
    assert notebook.metadata.get("jupytext", {}).get("text_representation", {}).get(
        "format_name") == "percent", "walkthroughs use jupytext's percent format"
    kinds = {cell.cell_type for cell in notebook.cells}
    assert kinds == {"markdown", "code"}, f"expected prose and code cells, got {kinds}"
    out = tmp_path / "walkthrough.ipynb"
    jupytext.write(notebook, out)
    import nbformat

    nbformat.validate(nbformat.read(out, as_version=4))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    site_dir = tmp_path_factory.mktemp("site")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stderr[-6000:]}"
    return site_dir


# A snippet line left in a page: `--8<-- "path"` at the start of a line of the page's text.
UNRESOLVED = re.compile(r'^\s*--8<--\s+"[^"]+"', re.MULTILINE)


def page_text(page: Path) -> str:
    return page_text_of(page.read_text())


def test_no_page_has_an_unresolved_snippet(site):
    leftovers = {str(page.relative_to(site)): UNRESOLVED.findall(page_text(page))
                 for page in site.rglob("*.html")}
    leftovers = {page: lines for page, lines in leftovers.items() if lines}
    assert not leftovers, f"unresolved snippets: {leftovers}"


def test_the_unresolved_snippet_check_can_fail():
    assert UNRESOLVED.search(page_text_of('<p>--8&lt;-- &quot;lessons/x.md&quot;</p>'))
    assert not UNRESOLVED.search(page_text_of("<p>include with <code>--8&lt;--</code> lines</p>"))


def page_text_of(markup: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_page_shows_text_code_and_collapsed_solutions(site, lesson):
    page = (site / "lessons" / lesson / "index.html").read_text()
    title = next(line for line in (LESSONS_DIR / lesson / "README.md").read_text().splitlines()
                 if line.startswith("# "))[2:].replace("`", "").strip()
    assert title in page_text_of(page), f"the page does not include {lesson}'s README"
    assert page.count("<details") >= 1 and "Solution" in page, "no collapsed solution blocks"
    assert 'class="mermaid"' in page, "the lesson's diagram is missing"


def test_site_works_offline(site):
    """No page loads a script, stylesheet or font from another host at read time."""
    external = re.compile(r'<(?:script|link)[^>]+(?:src|href)="(https?://[^"]+)"')
    found = {url for page in site.rglob("*.html") for url in external.findall(page.read_text())}
    assert not found, f"pages load from the network: {sorted(found)}"
    assert list(site.rglob("mermaid*.js")), "mermaid must be served by the site itself"


# A Markdown link's target: `](page.md#anchor)`, the page relative to docs/.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(markdown: str, site: Path) -> list[str]:
    """The links of a docs/ page (at the top of docs/) whose page or anchor is not in the built
    site. Pages are read from the HTML mkdocs wrote, so anchors are the ids its toc made."""
    broken = []
    for target in LINK.findall(markdown):
        page, _, anchor = target.partition("#")
        if "://" in page:
            continue
        html_file = site / page.removesuffix(".md").removesuffix("index") / "index.html"
        if not page.endswith(".md") or not html_file.is_file():
            broken.append(f"{target}: no page {page}")
        elif anchor and f'id="{anchor}"' not in html_file.read_text():
            broken.append(f"{target}: {page} has no heading with the id {anchor!r}")
    return broken


def test_every_link_on_the_questions_page_reaches_a_section(site):
    markdown = (REPO_ROOT / "docs" / "questions.md").read_text()
    assert len(LINK.findall(markdown)) >= 10, "the questions page should link its answers"
    assert not broken_links(markdown, site), "\n".join(broken_links(markdown, site))
    nav = (REPO_ROOT / "mkdocs.yml").read_text()
    assert "questions.md" in nav and "questions.md" in (REPO_ROOT / "docs" / "index.md").read_text()


def test_the_link_check_can_fail(site):
    assert broken_links("[x](lessons/03_ddp.md#launching) [y](index.md)", site) == []
    assert broken_links("[x](lessons/03_ddp.md#no-such-section)", site)
    assert broken_links("[x](lessons/99_missing.md#launching)", site)


LESSON_00 = LESSONS_DIR / "00_single_gpu" / "README.md"


def text_block_after(marker: str, readme: Path) -> list[str]:
    """The lines of the ```text block that follows ``<!-- marker -->`` in ``readme``."""
    text = readme.read_text()
    start = text.index(f"<!-- {marker} -->\n```text\n") + len(f"<!-- {marker} -->\n```text\n")
    return text[start:text.index("```", start)].splitlines()


def what_varies(line: str) -> str:
    """A line of train.py's output without what differs from machine to machine."""
    line = re.sub(r"\s*[\d,.]+ samples/s", " N samples/s", line)  # its width varies too
    line = re.sub(r"sha256 [0-9a-f]+\.\.\.", "sha256 ...", line)
    return re.sub(r"torch \S+,", "torch X,", line)


def test_lesson_00_shows_what_train_py_prints():
    """The README's output of `python lessons/00_single_gpu/train.py`, from a run: every loss,
    accuracy and sample as printed; the throughput, the digest and the torch build vary."""
    from harness.launch import run_script

    run = run_script("lessons/00_single_gpu/train.py", result=False, timeout=180)
    printed = [what_varies(line) for line in run.output.splitlines()
               if not line.startswith("result written")]
    shown = [what_varies(line) for line in text_block_after("train.py's output", LESSON_00)]
    assert shown == printed, (
        "lessons/00_single_gpu/README.md shows another output of train.py than it prints now; "
        "paste a fresh run's:\n" + "\n".join(run.output.splitlines()))


def collected(lesson: str, marks: str) -> int:
    done = subprocess.run([sys.executable, "-m", "pytest", f"lessons/{lesson}", "--collect-only",
                           "-q", "-m", marks, "-p", "no:cacheprovider"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    found = re.search(r"(\d+)(?:/\d+)? tests? collected", done.stdout)
    return int(found.group(1)) if found else 0


def test_lesson_00_shows_the_progress_table_a_fresh_clone_prints():
    """"lesson checks: N passed, M skipped" on a machine without a GPU: the lesson's tests of no
    task, those that need a GPU skipped."""
    from harness.exercises import tasks_of

    untasked = " and ".join(f"not {task}" for task in tasks_of("00_single_gpu"))
    passed = collected("00_single_gpu", f"not gpu and {untasked}")
    skipped = collected("00_single_gpu", f"gpu and {untasked}")
    line = text_block_after("the progress table", LESSON_00)[0]
    assert f"lesson checks: {passed} passed, {skipped} skipped" in line, (
        f"lessons/00_single_gpu/README.md's progress table says {line!r}; a fresh clone without "
        f"a GPU prints {passed} passed, {skipped} skipped")


def test_the_home_pages_course_diagram_has_every_lesson():
    text = (REPO_ROOT / "docs" / "index.md").read_text()
    diagram = text[text.index("```mermaid"):]
    diagram = diagram[:diagram.index("```", 3)]
    missing = [lesson for lesson in LESSONS if f'L{lesson[:2]}["{lesson[:2]}<br/>' not in diagram]
    assert not missing, f"docs/index.md's course diagram lacks {missing}"


def test_lesson_04s_table_of_settings_is_the_doctors():
    """The README's table and the doctor's KNOBS: the same names, in the same order, with the
    same defaults (a README cell may add a note after the doctor's value)."""
    from harness.exercises import load_lesson_module

    knobs = load_lesson_module("04_pitfalls", "doctor").KNOBS
    text = (LESSONS_DIR / "04_pitfalls" / "README.md").read_text()
    section = text[text.index("### Settings that decide hangs and speed"):]
    section = section[:section.index("\n## ")]
    rows = re.findall(r"^\| `([A-Z0-9_]+)` \| ([^|]+) \|", section, re.MULTILINE)
    assert [name for name, _ in rows] == list(knobs), (
        "lesson 04's table of settings and doctor.py's KNOBS name other settings, or in "
        f"another order: {[name for name, _ in rows]} against {list(knobs)}")
    for name, default in rows:
        default = default.strip()
        wanted = knobs[name].default
        assert default == wanted or default.startswith(wanted + " "), (
            f"lesson 04's table gives {name} the default {default!r}, the doctor {wanted!r}")
