// The dashboard's frames may not navigate the page (their sandbox has no allow-top-navigation):
// a link in a frame is followed by a link of the page, as a click on the page would be.
"use strict";
document.addEventListener("click", (e) => {
  const link = e.target.closest && e.target.closest("a[href]");
  if (!link) return;
  e.preventDefault();
  try {
    const top = window.parent.document;
    const a = top.createElement("a");
    a.href = new URL(link.getAttribute("href"), window.parent.location.href).href;
    top.body.appendChild(a);
    a.click();
    a.remove();
  } catch (err) {
    window.open(link.getAttribute("href"), "_blank");
  }
});
