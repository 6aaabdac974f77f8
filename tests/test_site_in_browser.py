"""The browser check (tests/site_in_browser.py) against a scratch site built with the course's own
mkdocs.yml: a right page passes with its formulas and diagram drawn, and each kind of breakage a
reader would see fails with its own message. `.ci/run` runs the check itself on the real site."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))

import site_in_browser  # noqa: E402

PAGES = {
    "index.md": r"""# Right

The softmax, $\mathrm{softmax}(s)_i = e^{s_i} / \sum_j e^{s_j}$, and two blocks merged:

$$
m = \max(m_1, m_2), \qquad \ell = e^{m_1 - m}\,\ell_1 + e^{m_2 - m}\,\ell_2
$$

Money stays text: it cost \$5 and \$6. Code stays code: `$x_i$`, `\(x\)`.

```mermaid
sequenceDiagram
    participant A as agent
    participant W as rank 0
    Note over A: node 1 silent, dropped, 1 node left
    A->>W: start again
```

![a picture](picture.svg)
""",
    "raw_tex.md": r"""# Raw TeX

<p>The merge: \(e^{m_1 - m}\,\ell_1\), written in HTML, which the maths extension skips.</p>

Escaped dollars: \$x_i^2\$.
""",
    "semicolon.md": r"""# A semicolon in a Note

```mermaid
sequenceDiagram
    participant A as agent
    participant W as rank 0
    Note over A: node 1 silent; dropped, 1 node left
    A->>W: start again
```
""",
    "broken.md": r"""# Broken

![missing](missing.png)

<script>throw new Error("an error the check must see")</script>

<script>console.error("a console error the check must see")</script>

<img src="https://example.com/picture.png" alt="from another host">
""",
    "bad_formula.md": r"""# A formula KaTeX cannot parse

The sum $\summ_i x_i$.
""",
}

PICTURE = ('<svg xmlns="http://www.w3.org/2000/svg" width="40" height="20">'
           '<rect width="40" height="20" fill="teal"/></svg>')


def course_path() -> str:
    """The home page's course path diagram, as docs/index.md has it."""
    text = (REPO_ROOT / "docs" / "index.md").read_text()
    start = text.index("```mermaid")
    return text[start:text.index("```", start + 3) + 3]


def in_one_row(diagram: str) -> str:
    """The same boxes as the course path, in one row: text too small to read at 1280 px."""
    boxes = re.findall(r'L\d\d\["[^"]+"\]', diagram)
    assert len(boxes) == 12, boxes
    return "```mermaid\nflowchart LR\n    " + " --> ".join(boxes) + "\n```\n"


def scratch_config() -> str:
    """The course's mkdocs.yml without its nav (the scratch site's pages are found) and its
    watch list (folders the scratch site has not)."""
    text = (REPO_ROOT / "mkdocs.yml").read_text()
    blocks = re.split(r"(?m)^(?=[a-z_]+:)", text)
    kept = [block for block in blocks if not block.startswith(("nav:", "watch:"))]
    assert len(kept) == len(blocks) - 2, "mkdocs.yml should have a nav and a watch list"
    return "".join(kept)


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """{page: PageReport} of the scratch site, checked in one Chromium."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    chromium = site_in_browser.find_chromium()
    if chromium is None:
        pytest.skip("no Chromium (Debian: apt-get install chromium; or set COURSE_CHROMIUM)")
    root = tmp_path_factory.mktemp("scratch")
    docs = root / "docs"
    for folder in ("katex", "javascripts", "stylesheets"):
        shutil.copytree(REPO_ROOT / "docs" / "assets" / folder, docs / "assets" / folder)
    for name, text in PAGES.items():
        (docs / name).write_text(text)
    (docs / "picture.svg").write_text(PICTURE)
    (docs / "course_path.md").write_text("# The course path\n\n" + course_path() + "\n")
    (docs / "one_row.md").write_text("# In one row\n\n" + in_one_row(course_path()))
    (root / "mkdocs.yml").write_text(scratch_config())
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                            "--site-dir", str(root / "site")], cwd=root, capture_output=True,
                           text=True, timeout=180,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr[-3000:]
    pages = ["", "raw_tex/", "semicolon/", "broken/", "bad_formula/", "course_path/",
             "one_row/"]
    reports = site_in_browser.check_site(root / "site", pages, chromium=chromium,
                                         echo=lambda line: None)
    return {report.path: report for report in reports}


def problems(report) -> str:
    return "\n".join(report.problems)


def test_a_right_page_passes_with_its_maths_and_diagram_drawn(checked):
    home = checked[""]
    assert home.problems == [], problems(home)
    assert home.formulas == 2, f"KaTeX drew {home.formulas} formulas of the page's 2"
    assert home.diagrams == 1, f"{home.diagrams} of the page's 1 mermaid diagram drawn"


def test_raw_tex_fails(checked):
    found = problems(checked["raw_tex/"])
    assert found.count("raw TeX shown") == 2, found
    assert r"\(e^{m_1 - m}" in found and "$x_i^2$" in found, found


def test_a_mermaid_block_that_did_not_draw_fails(checked):
    """A `;` inside a sequence diagram's Note ends the statement: mermaid cannot parse the rest
    (the right page draws the same diagram with a comma)."""
    found = problems(checked["semicolon/"])
    assert "1 of the page's 1 mermaid diagrams did not render to SVG" in found, found
    assert "uncaught JavaScript exception: Error: Parse error" in found, found


def test_broken_images_errors_and_the_network_fail(checked):
    found = problems(checked["broken/"])
    for expected in ("broken image: missing.png", "HTTP 404 for", "uncaught JavaScript "
                     "exception: Error: an error the check must see",
                     "console error: a console error the check must see",
                     "fetched from the network (the site must work offline): "
                     "https://example.com/picture.png"):
        assert expected in found, f"{expected!r} not in:\n{found}"


def test_a_formula_katex_cannot_parse_fails(checked):
    found = problems(checked["bad_formula/"])
    assert r'formula not rendered: "\(\summ_i x_i\)"' in found, found
    assert r"console error: KaTeX auto-render: Failed to parse `\summ_i x_i`" in found, found


def test_the_raw_tex_pattern():
    raw = re.compile(site_in_browser.RAW_TEX)
    for tex in (r"\(x\)", r"\[x\]", "$$", r"a \frac{1}{2}", "$x_i$", "$e^{s}$"):
        assert raw.search(tex), tex
    for text in ("it cost $5 and $6", "C:\\path", "x_i and e^{s_j}", "(x) [y]"):
        assert not raw.search(text), text


def test_the_home_pages_course_path_reads_at_1280_px(checked):
    """Drawn 1280 px wide, its text is at least 10 px high; the same boxes in one row are not."""
    wrapped, one_row = checked["course_path/"], checked["one_row/"]
    assert wrapped.problems == [] and wrapped.diagrams == 1, problems(wrapped)
    assert wrapped.notes == [], wrapped.notes
    assert one_row.diagrams == 1 and "its text is about" in " ".join(one_row.notes), one_row.notes


def fonts_missing(css: str, folder: Path) -> list[str]:
    return [url for url in re.findall(r"url\(([^)]+)\)", css) if not (folder / url).is_file()]


def test_katex_css_names_only_the_vendored_fonts():
    """docs/assets/katex keeps the woff2 fonts alone; its CSS must name no other file."""
    folder = REPO_ROOT / "docs" / "assets" / "katex"
    css = (folder / "katex.min.css").read_text()
    assert len(re.findall(r"url\(", css)) == len(list((folder / "fonts").glob("*.woff2"))) > 0
    assert fonts_missing(css, folder) == []
    assert fonts_missing("src:url(fonts/KaTeX_Main-Regular.woff) format(\"woff\")", folder)
