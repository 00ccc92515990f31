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
const FORMATS = {fp32: [24, -126], fp16: [11, -14], bf16: [8, -126]};

// Nearest value, lower and upper neighbours, spacing and relative error of x in a format.
function neighbours(x, fmt) {
  const [bits, emin] = FORMATS[fmt];
  const s = spacing(x, bits, emin);
  const lo = Math.floor(x / s) * s, hi = lo + s;
  let nearest = fmt === "bf16" ? toBf16(x) : (fmt === "fp32" ? Math.fround(x) : (x - lo < hi - x ? lo : (x - lo > hi - x ? hi : ((lo / s) % 2 === 0 ? lo : hi))));
  if (fmt === "fp16" && Math.abs(nearest) > 65504) nearest = Infinity * Math.sign(x);
  return {nearest, lo, hi, spacing: s, relErr: x === 0 ? 0 : Math.abs(nearest - x) / Math.abs(x)};
}

// Steps of size eta before a bf16 copy of w changes: half a spacing.
function stepsToCross(w, eta) { return Math.ceil(spacing(w, 8, -126) / 2 / eta); }

// One token of the clipped surrogate: which branch min() picks and whether the gradient is zero.
function grpoToken(A, alpha, beta, eps) {
  const r = Math.exp(alpha + beta), rClip = Math.min(Math.max(r, 1 - eps), 1 + eps);
  const unclipped = r * A, clipped = rClip * A;
  const zero = (A > 0 && r > 1 + eps) || (A < 0 && r < 1 - eps);
  const rAlpha = Math.exp(alpha);
  const alphaClips = (A > 0 && rAlpha > 1 + eps) || (A < 0 && rAlpha < 1 - eps);
  return {r, loss: -Math.min(unclipped, clipped), unclipped, clipped, zero, phantom: zero && !alphaClips};
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
    let rows = "<tr><th>format</th><th>nearest</th><th>lower neighbour</th><th>upper neighbour</th><th>spacing (ulp)</th><th>relative error</th></tr>";
    for (const f of ["fp32", "fp16", "bf16"]) {
      const n = neighbours(v, f);
      rows += `<tr><td>${f}</td><td>${fmt(n.nearest, 8)}</td><td>${fmt(n.lo, 8)}</td><td>${fmt(n.hi, 8)}</td><td>${fmt(n.spacing)}</td><td>${n.relErr.toExponential(2)}</td></tr>`;
    }
    el.querySelector("#nl-table").innerHTML = rows;
  }
  x.addEventListener("input", () => { const v = parseFloat(x.value); if (isFinite(v)) update(v); });
  lg.addEventListener("input", () => { const v = Math.pow(10, parseFloat(lg.value)); x.value = v.toPrecision(6); el.querySelector("#nl-log-out").textContent = lg.value; update(v); });
  update(0.1);
}

function crossing() {
  const el = document.getElementById("crossing"); if (!el) return;
  el.innerHTML = slider("cr-w", "log10 |w|", -4, 1, 0.01, -1.3) + slider("cr-eta", "log10 update η", -9, -2, 0.01, -5) + `<p id="cr-text"></p>`;
  function update() {
    const w = Math.pow(10, +el.querySelector("#cr-w").value), eta = Math.pow(10, +el.querySelector("#cr-eta").value);
    el.querySelector("#cr-w-out").textContent = w.toExponential(2); el.querySelector("#cr-eta-out").textContent = eta.toExponential(2);
    const k = stepsToCross(w, eta);
    el.querySelector("#cr-text").innerHTML = `A weight of ${w.toExponential(2)} updated by ${eta.toExponential(2)} per step changes in bf16 after <b id="cr-k">${k}</b> step${k === 1 ? "" : "s"} (|w|/(256 η) ≈ ${(w / 256 / eta).toFixed(1)}).`;
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
      `min() picks the ${t.unclipped <= t.clipped ? "unclipped" : "clipped"} branch. ` +
      (t.zero ? `<span class="verdict-zero" id="g-verdict">Gradient zeroed${t.phantom ? ": phantom clipping (α alone is inside the trust region)" : " (the policy really moved)"}.</span>`
              : `<span class="verdict-ok" id="g-verdict">Gradient flows.</span>`);
    const xs = [], un = [], cl = [];
    for (let lr = -0.6; lr <= 0.6001; lr += 0.01) { const r = Math.exp(lr); xs.push(lr); un.push(r * A); cl.push(Math.min(Math.max(r, 1 - eps), 1 + eps) * A); }
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
