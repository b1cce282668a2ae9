"""Assemble docs/performance.md from the sections each benchmark writes to docs/perf/.

Each bench script writes its own section (so one can be rerun alone); this joins them in
a fixed order under a header that says how to rerun everything.
"""

from __future__ import annotations

from pathlib import Path

from generated_block import without_markers

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["proxy", "capture_cpu", "replay", "learner", "safety", "swap", "demo"]
HEADER = """# Performance

Every figure below comes from a run on the 2-core, 24 GiB CPU machine this project is
developed on (no GPU), usually while other work shared the cores, except where a section
names another machine; each section says what it compared side by side. A section's tables
come from the script it names; the readings below them, of that run and earlier ones, were
written by hand, and a few name the ad hoc script they measured with instead (the proxy
bench's older readings are in [perf/history/proxy.md](perf/history/proxy.md)). Rerun one
with `$(./olpw env)/bin/python bench/<script>.py` (it replaces its tables in
`docs/perf/<name>.md` and keeps the readings), then `python bench/collect.py` to rebuild
this page. Tests never assert on speed; these scripts do not run in CI.

"""


def main() -> None:
    parts = sorted(
        (ROOT / "docs" / "perf").glob("*.md"),
        key=lambda p: (ORDER.index(p.stem) if p.stem in ORDER else 99, p.stem),
    )
    # A section's links are relative to docs/perf/; this page lies one folder up.
    body = "\n".join(
        without_markers(p.read_text()).rstrip().replace("](../", "](") + "\n" for p in parts
    )
    (ROOT / "docs" / "performance.md").write_text(HEADER + body)
    print(f"docs/performance.md: {', '.join(p.stem for p in parts)}")


if __name__ == "__main__":
    main()
