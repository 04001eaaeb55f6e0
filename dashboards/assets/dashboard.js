// Suite pages: draw each figure when it scrolls near the viewport, and filter sections by the page controls.
// Figure data comes from the JSON element #dashboard-data; nothing here builds HTML from data (textContent and
// dataset only), and plotly receives strings that were HTML-escaped when the page was rendered.
(function () {
  "use strict";
  var holder = document.getElementById("dashboard-data");
  if (!holder) { return; }
  var figures = JSON.parse(holder.textContent).figures;
  var config = { displaylogo: false, responsive: true };

  function draw(div) {
    if (div.getAttribute("data-drawn")) { return; }
    var fig = figures[div.getAttribute("data-figure")];
    if (!fig) { return; }
    div.setAttribute("data-drawn", "pending");
    Plotly.newPlot(div, fig.data, fig.layout, config).then(function () {
      div.setAttribute("data-drawn", "yes");
    });
  }

  var plots = Array.prototype.slice.call(document.querySelectorAll(".plot[data-figure]"));
  if ("IntersectionObserver" in window) {
    var observer = new IntersectionObserver(function (entries) {
      entries.forEach(function (entry) {
        if (entry.isIntersecting) { observer.unobserve(entry.target); draw(entry.target); }
      });
    }, { rootMargin: "600px 0px" });
    plots.forEach(function (div) { observer.observe(div); });
  } else {
    plots.forEach(draw);
  }

  var selects = Array.prototype.slice.call(document.querySelectorAll("select[data-filter]"));
  var sections = Array.prototype.slice.call(document.querySelectorAll("section.facet"));
  var count = document.getElementById("shown-count");
  var noMatch = document.getElementById("no-match");

  // The filters live in the URL fragment (#pattern=local&mode=fwd), so a filtered view can be linked to.
  function readHash() {
    var wanted = new URLSearchParams(window.location.hash.slice(1));
    selects.forEach(function (select) {
      var value = wanted.get(select.getAttribute("data-filter"));
      var known = Array.prototype.some.call(select.options, function (o) { return o.value === value; });
      select.value = value !== null && known ? value : "";
    });
  }

  function writeHash() {
    var params = new URLSearchParams();
    selects.forEach(function (select) {
      if (select.value !== "") { params.set(select.getAttribute("data-filter"), select.value); }
    });
    var hash = params.toString();
    history.replaceState(null, "", hash ? "#" + hash : window.location.pathname + window.location.search);
  }

  function applyFilters() {
    var shown = 0;
    sections.forEach(function (section) {
      var match = selects.every(function (select) {
        var want = select.value;
        return want === "" || section.getAttribute("data-" + select.getAttribute("data-filter")) === want;
      });
      section.hidden = !match;
      if (match) { shown += 1; }
    });
    if (count) { count.textContent = shown + " of " + sections.length + " sections shown"; }
    if (noMatch) { noMatch.hidden = shown !== 0; }
  }
  selects.forEach(function (select) {
    select.addEventListener("change", function () { writeHash(); applyFilters(); });
  });
  window.addEventListener("hashchange", function () { readHash(); applyFilters(); });
  readHash();
  applyFilters();
})();
