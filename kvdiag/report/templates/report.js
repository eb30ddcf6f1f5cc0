(function () {
  "use strict";
  // Marks that the page's own script ran (tests use it as a positive control).
  document.documentElement.setAttribute("data-kvdiag-js", "ok");
  function setAll(selector, open) {
    var items = document.querySelectorAll(selector);
    for (var i = 0; i < items.length; i++) { items[i].open = open; }
  }
  function on(id, fn) {
    var el = document.getElementById(id);
    if (el) { el.addEventListener("click", fn); }
  }
  on("expand-threads", function () { setAll("details.thread", true); });
  on("collapse-threads", function () { setAll("details.thread", false); });
  on("only-cited", function (ev) {
    var only = ev.target.getAttribute("aria-pressed") !== "true";
    ev.target.setAttribute("aria-pressed", only ? "true" : "false");
    ev.target.textContent = only ? "show all threads" : "only cited threads";
    var items = document.querySelectorAll("details.thread:not(.cited)");
    for (var i = 0; i < items.length; i++) { items[i].hidden = only; }
  });
})();
