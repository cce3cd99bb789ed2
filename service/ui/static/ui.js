// The dashboard's only script (no inline script: the CSP forbids it).
// 1. Live pages: a <body data-live="URL"> polls URL every 5 s; when its version changes the
//    page is fetched again and <main> swapped, keeping the scroll and the focused element.
// 2. The lineage: hovering or focusing a bundle shows its details under the picture.
"use strict";

const POLL_MS = 5000;

function describe(target) {
  const detail = document.getElementById("detail");
  const mark = target && target.closest ? target.closest("a.bundle") : null;
  if (!detail || !mark) return;
  const title = mark.querySelector("title");
  detail.textContent = title ? title.textContent : "";
}

function watchMarks() {
  document.addEventListener("focusin", (event) => describe(event.target));
  document.addEventListener("mouseover", (event) => describe(event.target));
}

async function fetchVersion(url) {
  const response = await fetch(url, { credentials: "same-origin", cache: "no-store" });
  if (!response.ok) return null;
  const body = await response.json();
  return body.version;
}

async function swapMain() {
  const response = await fetch(window.location.href, { credentials: "same-origin", cache: "no-store" });
  if (!response.ok || response.redirected) return false;
  const page = new DOMParser().parseFromString(await response.text(), "text/html");
  const fresh = page.querySelector("main");
  const main = document.querySelector("main");
  if (!fresh || !main) return false;
  const focused = document.activeElement && document.activeElement.closest
    ? document.activeElement.closest("[data-key]") : null;
  const key = focused ? focused.getAttribute("data-key") : null;
  const scroll = window.scrollY;
  main.replaceChildren(...Array.from(fresh.childNodes).map((node) => document.importNode(node, true)));
  if (key) {
    const again = main.querySelector(`[data-key="${CSS.escape(key)}"]`);
    if (again && again.focus) again.focus({ preventScroll: true });
  }
  window.scrollTo(window.scrollX, scroll);
  document.body.setAttribute("data-refreshed", String(Date.now()));
  return true;
}

function poll(url) {
  let known = null;
  let busy = false;
  const tick = async () => {
    if (busy || document.hidden) return;
    busy = true;
    try {
      const version = await fetchVersion(url);
      if (version !== null && known !== null && version !== known) await swapMain();
      if (version !== null) known = version;
    } catch (error) {
      // The server is away for a moment: try again at the next tick.
    } finally {
      busy = false;
    }
  };
  tick();
  window.setInterval(tick, POLL_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  watchMarks();
  const live = document.body.getAttribute("data-live");
  if (live) poll(live);
});
