"""`phantomclip report` on the bundled demo data: build time (target < 10 s), page size (< 8 MB) and time until
the page is interactive in headless Chromium (< 3 s: navigation start to every Plotly figure drawn and the
widgets answering).

    python bench/benchmarks/bench_report.py [--repeats 3]

Feeds bench/RESULTS.md §6 ("`phantomclip report` on the bundled demo data") and docs/results.md "The report's cost".
"""

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from phantomclip.report import FIGURES, build, demo_sources

    builds, loads = [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.repeats):
            t0 = time.perf_counter()
            page = build(demo_sources(), Path(d) / f"r{i}")
            builds.append(time.perf_counter() - t0)
        size = page.stat().st_size + sum(p.stat().st_size for p in (page.parent / "data").iterdir())
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            for _ in range(args.repeats):
                tab = browser.new_page(viewport={"width": 1280, "height": 900})
                t0 = time.perf_counter()
                tab.goto(page.as_uri())
                tab.wait_for_function("document.querySelectorAll('.figure .main-svg').length > 0 "
                                      "&& typeof grpoToken === 'function'")
                drawn = tab.evaluate("document.querySelectorAll('.figure .plot-container').length")
                loads.append(time.perf_counter() - t0)
                tab.close()
            browser.close()
    print(f"build from the demo data: {', '.join(f'{b:.2f}' for b in builds)} s "
          f"(median {statistics.median(builds):.2f} s; target < 10 s)")
    print(f"page + data files: {size / 2**20:.2f} MiB (target < 8 MB)")
    print(f"interactive in headless Chromium: {', '.join(f'{t:.2f}' for t in loads)} s "
          f"(median {statistics.median(loads):.2f} s; target < 3 s); {drawn} of {len(FIGURES)} figure slots drawn")


if __name__ == "__main__":
    main()
