// The dashboard's frames may not navigate the page (their sandbox has no allow-top-navigation):
// a link in a frame is followed by a link of the page, as a click on the page would be.
"use strict";
document.addEventListener("click", (e) => {
  const link = e.target.closest && e.target.closest("a[href]");
  if (!link) return;
  e.preventDefault();
  try {
    const top = window.parent.document;
    const to = new URL(link.getAttribute("href"), window.parent.location.href);
    if (to.origin !== window.parent.location.origin || !/^https?:$/.test(to.protocol)) return;  // pages of this dashboard only
    const a = top.createElement("a");
    a.href = to.href;
    top.body.appendChild(a);
    a.click();
    a.remove();
  } catch (err) {  // the page cannot be reached from here: a dashboard page's own link opens in a tab
    const href = link.getAttribute("href");
    if (/^[\w-]+\?[\w=&%.-]*$/.test(href)) window.open(href, "_blank");
  }
});
