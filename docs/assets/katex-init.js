// Renders the math that pymdownx.arithmatex (generic mode) leaves in .arithmatex elements, with the KaTeX that
// the build vendors into assets/katex/ (no CDN: the site renders offline). A formula KaTeX cannot parse shows as a
// red .katex-error (throwOnError: false), which tests/docs/test_site.py counts as a failure.
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll(".arithmatex").forEach(function (el) {
    renderMathInElement(el, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    });
  });
});
