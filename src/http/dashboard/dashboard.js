// kfs-worker dashboard: keeps the page live and hands the admin token to action forms.
// The server renders every fragment; this only fetches and swaps them.
(function () {
  "use strict";
  var KEY = "kfs-admin-token";
  var box = document.getElementById("admin-token");
  if (box) {
    box.value = sessionStorage.getItem(KEY) || "";
    box.addEventListener("input", function () { sessionStorage.setItem(KEY, box.value); });
  }
  // Any action form, including ones swapped in later, carries the token when submitted.
  document.addEventListener("submit", function (ev) {
    var form = ev.target;
    if (!form.classList || !form.classList.contains("action")) return;
    var field = form.querySelector("input[name=token]");
    if (field) field.value = box ? box.value : "";
  }, true);

  var live = document.getElementById("live");
  function mark(ok) { if (live) live.classList.toggle("stale", !ok); }
  function busy() {
    // Do not swap a form out from under someone typing in it.
    var a = document.activeElement;
    return a && a.closest && a.closest("form.action") && a.tagName === "INPUT";
  }

  var overview = document.body.getAttribute("data-overview");
  function pollOverview() {
    fetch(overview, { headers: { accept: "application/json" } })
      .then(function (r) { if (!r.ok) throw new Error(r.status); return r.json(); })
      .then(function (o) {
        if (!busy()) {
          document.querySelectorAll("[data-poll]").forEach(function (el) {
            var html = o.html[el.getAttribute("data-poll")];
            if (typeof html === "string" && el.innerHTML !== html) el.innerHTML = html;
          });
        }
        if (live) {
          live.textContent = "live · " + new Date(o.generated_at * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
          live.setAttribute("data-generated", o.generated_at);
        }
        mark(true);
      })
      .catch(function () { mark(false); });
  }
  if (overview) setInterval(pollOverview, 1500);

  var jobPart = document.querySelector("[data-poll-job]");
  function pollJob() {
    fetch(jobPart.getAttribute("data-poll-job"), { headers: { accept: "application/json" } })
      .then(function (r) { if (!r.ok) throw new Error(r.status); return r.json(); })
      .then(function (d) {
        if (jobPart.innerHTML !== d.html) jobPart.innerHTML = d.html;
        mark(true);
      })
      .catch(function () { mark(false); });
  }
  if (jobPart) setInterval(pollJob, 1500);
})();
