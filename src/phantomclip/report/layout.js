// The page's layout rules that need the browser's measurements: the toolbar clear of the legend, legends that never
// scroll inside their figure, tick labels that never overlap, notes that never leave their figure or cover a label, tables that reflow on a phone, the seed-band button
// and links into the folded glossary. fitFigure runs when a figure is first drawn and again after the window changes width (a phone turned upright).

// Plotly's toolbar (the modebar: zoom, pan, download) shows on hover at the figure's top right. Across the top it
// covered legend entries at every width (the legend sits above the plot area, where Plotly's margin push puts it
// at the figure's top whatever the top margin); upright, in a right margin of 32 px (a button is 26 px wide), it
// covers nothing.
const TOOLBAR_WIDTH = 32;
// The least plot-area height a figure keeps under its legend; below this its lines are hard to tell apart.
const MIN_PLOT_HEIGHT = 240;

// Boxes of the visible texts that match `sel` inside gd.
function textBoxes(gd, sel) {
  return [...gd.querySelectorAll(sel)].filter(e => e.textContent.trim()).map(e => e.getBoundingClientRect())
    .filter(r => r.width > 0 && r.height > 0);
}
// Whether any two boxes overlap (by more than a pixel each way: touching is not overlapping).
function anyOverlap(boxes) {
  for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
    const a = boxes[i], b = boxes[j];
    if (a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1) return true;
  }
  return false;
}

// A two-level (multicategory) axis's outer labels broken into lines after each '/', '-' and ',' and at spaces, so
// a run name such as 'force-r1-seed0' takes the width of 'force-'.
function brokenLabels(x) {
  return [x[0].map(s => String(s).replace(/([\/,-]) ?| /g, (m, sep) => (sep || "") + "<br>")), x[1]];
}

// An axis title `long` px long broken at spaces into lines that fit `room` px (by its characters' mean width).
function wrapped(text, long, room) {
  const per = Math.max(8, Math.floor(text.length * room / long)), lines = [""];
  for (const word of text.split(" ")) {
    const last = lines[lines.length - 1];
    if (last && last.length + 1 + word.length > per) lines.push(word); else lines[lines.length - 1] = last ? last + " " + word : word;
  }
  return lines.join("<br>");
}

// After a figure is drawn: first its x tick labels, turned upright (−90°) where they overlap side by side, and a
// two-level axis's outer labels broken into lines where they still do; then its height grown until the plot area
// under the legend is at least MIN_PLOT_HEIGHT (the legend itself may be as tall as its entries need: it never
// scrolls). The figure title sits in HTML above, so a taller figure moves nothing over it.
async function fitFigure(gd) {
  if (anyOverlap(textBoxes(gd, "g.xtick text"))) await Plotly.relayout(gd, {"xaxis.tickangle": -90});
  if (anyOverlap(textBoxes(gd, "g.xtick2 text"))) {
    const multi = gd.data.map(t => Array.isArray(t.x) && Array.isArray(t.x[0]) && !String(t.x[0]).includes("<br>"));
    if (multi.some(Boolean))
      await Plotly.restyle(gd, {x: gd.data.map(t => Array.isArray(t.x[0]) ? brokenLabels(t.x) : t.x)});
  }
  // an axis title is centred on the plot area, so it fits in twice the distance from that centre to the nearer edge
  const fig = gd.getBoundingClientRect(), area = gd.querySelector("rect.nsewdrag");
  const p = area ? area.getBoundingClientRect() : fig;
  const rooms = {xaxis: 2 * Math.min((p.left + p.right) / 2 - fig.left, fig.right - (p.left + p.right) / 2),
                 yaxis: 2 * Math.min((p.top + p.bottom) / 2 - fig.top, fig.bottom - (p.top + p.bottom) / 2)};
  for (const [axis, sel] of [["xaxis", "text.xtitle"], ["yaxis", "text.ytitle"]]) {
    const title = gd.querySelector(sel), room = rooms[axis] - 8;
    if (!title || String(((gd.layout[axis] || {}).title || {}).text).includes("<br>")) continue;  // wrapped once
    const r = title.getBoundingClientRect(), long = Math.max(r.width, r.height);
    if (long > room) await Plotly.relayout(gd, {[axis + ".title.text"]: wrapped(title.textContent, long, room)});
  }
  // Plotly's margin push leaves a two-level axis's title a few px past the figure's bottom: grow the margin by that
  const below = Math.max(...textBoxes(gd, "text.xtitle, g[class^=xtick] text").map(r => r.bottom))
    - gd.getBoundingClientRect().bottom;
  if (below > 0) await Plotly.relayout(gd, {"margin.b": gd._fullLayout._size.b + Math.ceil(below) + 4});
  const plot = gd.querySelector("rect.nsewdrag");
  if (plot) {
    const short = MIN_PLOT_HEIGHT - plot.getBoundingClientRect().height;
    if (short > 1) {
      gd.style.height = (gd.getBoundingClientRect().height + short) + "px";
      await Plotly.Plots.resize(gd);
    }
  }
  await moveStrayNotes(gd);
}

// A note (a Plotly annotation) drawn past its figure's edge, where the SVG cuts it off, or over a tick label, an axis
// title or a legend entry is written under the figure instead, as a line of text (div.fig-notes): on a phone the
// plot is about 270 px wide and a note of 200 px beside its point rarely fits. Its text is the drawn text, set as
// text, never as markup.
async function moveStrayNotes(gd) {
  const f = gd.getBoundingClientRect();
  const others = textBoxes(gd, "g[class^=xtick] text, g[class^=ytick] text, text.xtitle, text.ytitle, g.legend text");
  const moved = [];
  for (const g of gd.querySelectorAll("g.annotation")) {
    const i = Number(g.dataset.index), text = g.querySelector("text.annotation-text");
    if (!text || ((gd.layout.annotations || [])[i] || {}).visible === false) continue;
    const r = text.getBoundingClientRect();
    const out = r.left < f.left - 1 || r.right > f.right + 1 || r.top < f.top - 1 || r.bottom > f.bottom + 1;
    if (out || others.some(o => anyOverlap([r, o])))
      moved.push([i, text.textContent]);
  }
  if (!moved.length) return;
  let box = gd.nextElementSibling;
  if (!box || !box.classList.contains("fig-notes")) {
    box = document.createElement("div");
    box.className = "fig-notes";
    gd.insertAdjacentElement("afterend", box);
  }
  for (const [, words] of moved) {
    const p = document.createElement("p");
    p.className = "fig-note";
    p.textContent = words;
    box.appendChild(p);
  }
  await Plotly.relayout(gd, Object.fromEntries(moved.map(([i]) => [`annotations[${i}].visible`, false])));
}

// Each cell of a table learns its column's header (data-label), which the phone layout prints before the value;
// rows of another shape (a note spanning the row) keep no label.
function labelCells(table) {
  const rows = [...table.querySelectorAll("tr")];
  const head = rows.find(r => r.querySelector("th"));
  if (!head) return;
  const names = [...head.children].map(c => c.textContent.trim());
  head.classList.add("head");
  table.classList.add("reflow");
  for (const r of rows) if (r !== head && r.children.length === names.length)
    [...r.children].forEach((c, i) => c.setAttribute("data-label", names[i]));
}

// The button under a per-step figure: every arm's seed band, or only those drawn when the page opened (the
// baseline and one more: five translucent bands overlap into one muddy area). Bands are hidden by opacity, not
// visibility, so the legend still shows and hides each arm's line and band together.
function bandToggle(button) {
  const gd = document.getElementById("fig-" + button.dataset.figure);
  const all = button.getAttribute("aria-pressed") !== "true";
  const bands = gd.data.map((t, i) => t.fill === "toself" ? i : -1).filter(i => i >= 0);
  if (!gd._bandOpacity) gd._bandOpacity = bands.map(i => gd.data[i].opacity);  // as drawn when the page opened
  const full = Math.max(...gd._bandOpacity);  // the bands drawn at opening have the band's opacity (plots.seed_band)
  Plotly.restyle(gd, {opacity: bands.map((i, k) => all ? full : gd._bandOpacity[k])}, bands);
  button.setAttribute("aria-pressed", String(all));
  button.textContent = all ? "Show fewer bands" : "Show every arm's band";
  const caption = document.getElementById("caption-" + button.dataset.figure);  // it says which bands are drawn
  if (caption && caption.dataset.every) caption.textContent = all ? caption.dataset.every : caption.dataset.few;
}

// A link to the folded glossary, or to a term in it, opens the box (a closed <details> hides its target) and scrolls
// to the target.
function openLinked() {
  const target = location.hash && document.getElementById(decodeURIComponent(location.hash.slice(1)));
  const box = target && target.closest("details");
  if (box && !box.open) { box.open = true; target.scrollIntoView(); }
}
window.addEventListener("hashchange", openLinked);

// After the window changes width (Plotly's own resize has redrawn each figure at the new width), fit each figure
// again: labels that fitted a landscape phone may overlap upright.
let refitTimer = null, lastWidth = window.innerWidth;
window.addEventListener("resize", () => {
  if (window.innerWidth === lastWidth) return;
  lastWidth = window.innerWidth;
  clearTimeout(refitTimer);
  delete document.body.dataset.fitted;
  refitTimer = setTimeout(async () => {
    const narrow = window.innerWidth < 640;  // the template's NARROW, at the new width: the phone's smaller text
    for (const gd of document.querySelectorAll(".figure.js-plotly-plot")) {
      const base = FIGURES[gd.id.slice("fig-".length)].layout;
      // the notes' size as on a first draw at this width (a note kept at 12 px covered ticks after the turn)
      const notes = Object.fromEntries((base.annotations || []).map((a, i) =>
        [`annotations[${i}].font.size`, narrow ? 10 : (a.font || {}).size]));
      await Plotly.relayout(gd, {"font.size": narrow ? 11 : base.font.size,
                                 "legend.font.size": narrow ? 10 : (base.legend.font || {}).size, ...notes});
      await Plotly.Plots.resize(gd);
      await fitFigure(gd);
    }
    document.body.dataset.fitted = "after-resize";  // every figure fitted again (the browser test waits for it)
  }, 200);
});
