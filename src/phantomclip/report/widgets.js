// Interactive widgets of the article. Pure functions first (tested in the browser test), then the DOM.

// Round to the nearest bf16 (round half to even on the upper 16 bits of the fp32 pattern).
function toBf16(x) {
  const f = new Float32Array([x]); const u = new Uint32Array(f.buffer);
  if (!isFinite(f[0])) return f[0];
  const lsb = (u[0] >>> 16) & 1;
  u[0] = ((u[0] + 0x7fff + lsb) >>> 16) << 16;
  return f[0];
}

// Spacing (ulp) at |x| for a format with `bits` significand bits (incl. the implicit one) and minimum exponent emin.
function spacing(x, bits, emin) {
  const e = Math.max(Math.floor(Math.log2(Math.abs(x) || Number.MIN_VALUE)), emin);
  return Math.pow(2, e - (bits - 1));
}
// [significand bits incl. the implicit one, minimum exponent, maximum exponent, significant decimal digits that
// tell neighbouring values apart: ceil(1 + bits * log10 2)]
const FORMATS = {fp32: [24, -126, 127, 9], fp16: [11, -14, 15, 5], bf16: [8, -126, 127, 4]};

// Largest finite value of a format: (2 - 2^(1 - bits)) * 2^emax (fp16: 65504).
function maxFinite(fmt) { const [bits, , emax] = FORMATS[fmt]; return (2 - Math.pow(2, 1 - bits)) * Math.pow(2, emax); }

// x rounded to the nearest value of the format, ties to even; past the largest finite value by half a spacing or
// more it overflows to infinity, as the hardware does. x / spacing is exact in a double (the spacing is a power of 2).
function roundTo(x, fmt) {
  const [bits, emin] = FORMATS[fmt], max = maxFinite(fmt), a = Math.abs(x);
  if (!isFinite(x)) return x;
  if (a >= max + spacing(max, bits, emin) / 2) return Math.sign(x) * Infinity;
  const s = spacing(a, bits, emin), q = a / s, f = Math.floor(q), d = q - f;
  const r = (d > 0.5 || (d === 0.5 && f % 2 === 1) ? f + 1 : f) * s;
  return Math.sign(x) * Math.min(r, max);
}

// The next representable value above v >= 0 (Infinity past the largest finite one); below a power of two the
// spacing is half the one above it, so stepping down from one takes half a step.
function nextAbove(v, fmt) {
  const [bits, emin] = FORMATS[fmt];
  const up = v + spacing(v, bits, emin);
  return up > maxFinite(fmt) ? Infinity : up;
}
function nextBelow(v, fmt) {
  const [bits, emin] = FORMATS[fmt];
  if (v === 0) return -spacing(0, bits, emin);
  const s = spacing(v, bits, emin), isPow2 = Math.pow(2, Math.floor(Math.log2(v))) === v;
  return v - (isPow2 && v > Math.pow(2, emin) ? s / 2 : s);
}

// Nearest value of x in a format, the representable values just below and above it, its spacing and the relative
// error of the rounding. An overflow has the largest finite value below it and nothing above.
function neighbours(x, fmt) {
  const [bits, emin] = FORMATS[fmt];
  const nearest = roundTo(x, fmt);
  if (!isFinite(nearest)) {
    const max = maxFinite(fmt) * Math.sign(nearest);
    return {nearest, lo: nearest > 0 ? max : NaN, hi: nearest > 0 ? NaN : max, spacing: NaN, relErr: Infinity};
  }
  const a = Math.abs(nearest), sign = nearest < 0 ? -1 : 1;
  const [lo, hi] = sign > 0 ? [nextBelow(a, fmt), nextAbove(a, fmt)] : [-nextAbove(a, fmt), -nextBelow(a, fmt)];
  return {nearest, lo, hi, spacing: spacing(a, bits, emin), relErr: x === 0 ? 0 : Math.abs(nearest - x) / Math.abs(x)};
}

// A value with the digits its format needs to tell it from its neighbours.
function showIn(v, fmt) {
  if (!isFinite(v)) return isNaN(v) ? "—" : (v > 0 ? "+∞ (overflow)" : "−∞ (overflow)");
  return v === 0 ? "0" : v.toPrecision(FORMATS[fmt][3]);
}

// Steps of size eta before the bf16 copy of a weight w (a bf16 value, w > 0) changes: it rounds to a new value at
// the first step k whose total update k·η passes half a spacing, 2^(floor(log2 |w|) - 8), which lies in
// (|w|/512, |w|/256]. At exactly half a spacing the tie goes to the even neighbour: away from w only when w's
// last significand bit is odd.
function halfSpacingBf16(w) { return spacing(w, 8, -126) / 2; }
function stepsToCross(w, eta) {
  const q = halfSpacingBf16(w) / eta, odd = (Math.abs(w) / spacing(w, 8, -126)) % 2 === 1;
  return Number.isInteger(q) && odd ? q : Math.floor(q) + 1;
}
// The same count when the trainer keeps an fp32 master weight (mixed precision): each step adds η (an fp32 value)
// and rounds the sum to fp32, and the engine's copy is the master rounded to bf16. Steps are taken one by one with
// Math.fround. A step that leaves the master where it was leaves it there for good (the same sum, the same rounding):
// the update is lost (0), as for any η under half an fp32 spacing of w. Otherwise the bf16 copy moves within 2^16
// steps (each step moves the master by at least one fp32 spacing, 2^-16 of a bf16 one); CAP is past that.
const CAP = 1 << 18;
function stepsToCrossFp32(w, eta) {
  const e = Math.fround(eta);
  let m = Math.fround(w);
  for (let k = 1; k <= CAP; k++) {
    const next = Math.fround(m + e);
    if (next === m) return 0;
    m = next;
    if (toBf16(m) !== w) return k;
  }
  return 0;
}

// One token of the clipped surrogate (loss.clipped_surrogate's rule): which branch min() picks and whether the
// gradient is zero; and, for a zeroed one, whether the clip would fire on α alone (metrics.phantom_clip_mask:
// A > 0 and e^α > 1 + ε, or A < 0 and e^α < 1 − ε). Where α alone stands against the trust region is told apart:
// α = −0.3 with A > 0 is below 1 − ε (outside) and still cannot fire the clip, which for A > 0 guards only the top.
function grpoToken(A, alpha, beta, eps) {
  const r = Math.exp(alpha + beta), rClip = Math.min(Math.max(r, 1 - eps), 1 + eps);
  const unclipped = r * A, clipped = rClip * A;
  const zero = (A > 0 && r > 1 + eps) || (A < 0 && r < 1 - eps);
  const rAlpha = Math.exp(alpha);
  const alphaClips = (A > 0 && rAlpha > 1 + eps) || (A < 0 && rAlpha < 1 - eps);
  const alphaSide = rAlpha < 1 - eps ? "below" : rAlpha > 1 + eps ? "above" : "inside";
  const verdict = A === 0 ? "no-advantage" : !zero ? "flows" : alphaClips ? "real" : "phantom";
  return {r, loss: -Math.min(unclipped, clipped), unclipped, clipped, zero, phantom: zero && !alphaClips,
          alphaSide, verdict};
}

// The sentence the GRPO widget prints for a token (grpoToken's record), with its verdict's words.
function grpoSentence(t, A) {
  const branch = t.unclipped === t.clipped ? "both branches are equal (r inside the trust region, or A = 0)"
                                           : `min() picks the ${t.unclipped < t.clipped ? "unclipped" : "clipped"} branch`;
  const alone = t.alphaSide === "inside" ? "α alone is inside the trust region"
    : `α alone is ${t.alphaSide} it, where the clip does not act for A ${A > 0 ? "> 0" : "< 0"}`;
  const words = {
    "no-advantage": ["verdict-ok", "No gradient either way: A = 0, so both branches are 0 and there is nothing to clip."],
    "flows": ["verdict-ok", "Gradient flows."],
    "phantom": ["verdict-zero", `Gradient zeroed: phantom clipping (the clip would not fire on α alone: ${alone}).`],
    "real": ["verdict-zero", "Gradient zeroed (the policy really moved: the clip fires on α alone)."]}[t.verdict];
  return `${branch}. <span class="${words[0]}" id="g-verdict" data-verdict="${t.verdict}" data-alpha="${t.alphaSide}">${words[1]}</span>`;
}

function slider(id, label, min, max, step, value) {
  return `<label for="${id}">${label}</label> <input type="range" id="${id}" min="${min}" max="${max}" step="${step}" value="${value}"> <output id="${id}-out">${value}</output><br>`;
}
const fmt = (v, d = 6) => (Math.abs(v) >= 1e5 || (Math.abs(v) < 1e-4 && v !== 0)) ? v.toExponential(3) : v.toFixed(d);

function numberLine() {
  const el = document.getElementById("number_line"); if (!el) return;
  el.innerHTML = `<label for="nl-x">value x</label> <input id="nl-x" type="number" value="0.1" step="any"> ` +
    slider("nl-log", "or drag (log10 |x|)", -6, 4, 0.01, -1) + `<table id="nl-table"></table>`;
  const x = el.querySelector("#nl-x"), lg = el.querySelector("#nl-log");
  function update(v) {
    let rows = "<tr><th>format</th><th>nearest</th><th>next below it</th><th>next above it</th><th>spacing (ulp)</th><th>relative error</th></tr>";
    for (const f of ["fp32", "fp16", "bf16"]) {
      const n = neighbours(v, f);
      const err = isFinite(n.relErr) ? n.relErr.toExponential(2) : "overflow";
      rows += `<tr><td>${f}</td><td>${showIn(n.nearest, f)}</td><td>${showIn(n.lo, f)}</td><td>${showIn(n.hi, f)}</td><td>${isFinite(n.spacing) ? fmt(n.spacing) : "—"}</td><td>${err}</td></tr>`;
    }
    el.querySelector("#nl-table").innerHTML = rows;
    labelCells(el.querySelector("#nl-table"));  // the phone layout's header per cell (layout.js)
  }
  // a typed value moves the slider too (clamped to its range), so the two never disagree
  x.addEventListener("input", () => {
    const v = parseFloat(x.value); if (!isFinite(v)) return;
    const l = Math.min(Math.max(Math.log10(Math.abs(v) || 1e-6), +lg.min), +lg.max);
    lg.value = l.toFixed(2); el.querySelector("#nl-log-out").textContent = lg.value; update(v);
  });
  lg.addEventListener("input", () => { const v = Math.pow(10, parseFloat(lg.value)); x.value = v.toPrecision(6); el.querySelector("#nl-log-out").textContent = lg.value; update(v); });
  update(0.1);
}

function crossing() {
  const el = document.getElementById("crossing"); if (!el) return;
  el.innerHTML = slider("cr-w", "log10 |w|", -4, 1, 0.01, -1.3) + slider("cr-eta", "log10 update η", -9, -2, 0.01, -5) + `<p id="cr-text"></p>`;
  function update() {
    const w = toBf16(Math.pow(10, +el.querySelector("#cr-w").value)), eta = Math.pow(10, +el.querySelector("#cr-eta").value);
    el.querySelector("#cr-w-out").textContent = w.toExponential(2); el.querySelector("#cr-eta-out").textContent = eta.toExponential(2);
    const half = halfSpacingBf16(w), k = stepsToCross(w, eta), k32 = stepsToCrossFp32(w, eta);
    const master = k32 ? `after <b id="cr-k32">${k32}</b> step${k32 === 1 ? "" : "s"}` +
        (k32 === k ? " too" : " (its own rounding moves the count)")
      : `<b id="cr-k32" data-lost="1">never</b>: η is under half an fp32 spacing of w ` +
        `(${(spacing(w, 24, -126) / 2).toExponential(3)}), so every update rounds away and the master does not move either`;
    el.querySelector("#cr-text").innerHTML = `A weight stored as <span id="cr-w-bf16">${w.toPrecision(4)}</span> in bf16, updated by ${eta.toExponential(2)} per step, ` +
      `changes in bf16 after <b id="cr-k">${k}</b> step${k === 1 ? "" : "s"} if the updates add up exactly: the first k at which k·η passes half its bf16 spacing, ` +
      `<span id="cr-half">${half.toExponential(3)}</span> (between |w|/512 and |w|/256; half/η = ${(half / eta).toPrecision(4)}). ` +
      `With an fp32 master weight (each step rounded to fp32, the engine's copy rounded from it to bf16) it changes ${master}.`;
  }
  el.addEventListener("input", update); update();
}

function grpoWidget() {
  const el = document.getElementById("grpo_widget"); if (!el) return;
  el.innerHTML = slider("g-A", "advantage A", -2, 2, 0.05, 1) + slider("g-alpha", "α (policy change)", -0.5, 0.5, 0.005, 0) +
    slider("g-beta", "β (precision gap)", -0.5, 0.5, 0.005, 0.25) + slider("g-eps", "ε", 0.05, 0.5, 0.01, 0.2) +
    `<p id="g-text"></p><div id="g-plot" style="height:320px"></div>`;
  function update() {
    const v = id => +el.querySelector(id).value;
    const A = v("#g-A"), alpha = v("#g-alpha"), beta = v("#g-beta"), eps = v("#g-eps");
    for (const id of ["g-A", "g-alpha", "g-beta", "g-eps"]) el.querySelector(`#${id}-out`).textContent = el.querySelector(`#${id}`).value;
    const t = grpoToken(A, alpha, beta, eps);
    el.querySelector("#g-text").innerHTML = `r = e<sup>α+β</sup> = ${t.r.toFixed(3)}; r·A = ${t.unclipped.toFixed(3)}, clip(r)·A = ${t.clipped.toFixed(3)}; ` +
      grpoSentence(t, A);
    // the curves span ±0.6 or past the token, whichever is wider, so its dot always sits on them (α + β reaches ±1)
    const half = Math.max(0.6, Math.ceil((Math.abs(alpha + beta) + 0.05) * 20) / 20), xs = [], un = [], cl = [];
    for (let i = 0; i <= 200; i++) { const lr = -half + i * half / 100, r = Math.exp(lr); xs.push(lr); un.push(r * A); cl.push(Math.min(Math.max(r, 1 - eps), 1 + eps) * A); }
    Plotly.react("g-plot", [
      {x: xs, y: un, name: "r·A", mode: "lines", line: {color: PALETTE[0]}},
      {x: xs, y: cl, name: "clip(r)·A", mode: "lines", line: {color: PALETTE[1], dash: "dash"}},
      {x: [alpha + beta], y: [Math.min(t.unclipped, t.clipped)], name: "this token", mode: "markers", marker: {size: 12, color: PALETTE[3]}},
    ], {margin: {t: 10}, xaxis: {title: {text: "log r = α + β"}}, yaxis: {title: {text: "objective (−loss)"}},
        shapes: [{type: "rect", xref: "x", yref: "paper", x0: Math.log(1 - eps), x1: Math.log(1 + eps), y0: 0, y1: 1, fillcolor: PALETTE[2], opacity: 0.12, line: {width: 0}}]},
      {responsive: true, displaylogo: false});
  }
  el.addEventListener("input", update); update();
}

numberLine(); crossing(); grpoWidget();
