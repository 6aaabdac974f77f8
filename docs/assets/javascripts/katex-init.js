// Renders the maths of a page with the vendored KaTeX (docs/assets/katex/), offline.
// pymdownx.arithmatex (generic mode) writes `$x$` as <span class="arithmatex">\(x\)</span> and
// `$$x$$` as <div class="arithmatex">\[x\]</div>; only those elements are rendered, so a dollar
// sign or a backslash anywhere else on the page stays text.
(function () {
  "use strict";
  function render(root) {
    root.querySelectorAll(".arithmatex").forEach(function (element) {
      if (element.querySelector(".katex")) return; // already rendered
      renderMathInElement(element, {
        delimiters: [
          { left: "\\(", right: "\\)", display: false },
          { left: "\\[", right: "\\]", display: true },
        ],
        // A formula KaTeX cannot parse stays as its source, and the console says why
        // (tests/site_in_browser.py fails on both).
        throwOnError: true,
      });
    });
  }
  // material (and Zensical) publish each page, also one loaded by instant navigation, on
  // document$; without it, render once the page is parsed.
  if (typeof document$ !== "undefined") {
    document$.subscribe(function () { render(document.body); });
  } else if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", function () { render(document.body); });
  } else {
    render(document.body);
  }
})();
