"""Each test file's measured test time, which pytest-xdist hands out longest first (conftest.py).

`--dist loadfile` sends a whole file to one worker. xdist's default order, most tests first, started the
costliest files last: the benchmarks' 8 tests (about 740 s on one worker) ran while the other worker sat idle
at the end of the run. Handing out the longest files first (longest-processing-time-first scheduling) lets the
short ones fill in at the end. The seconds come from a real run's JUnit report; refresh them after a change
that moves a file's time a lot:

    python -m pytest --junitxml=/tmp/suite.xml && python tests/file_seconds.py /tmp/suite.xml

A file missing from the table (a new one) counts as NEW_FILE_SECONDS: early enough not to end the run alone.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

TABLE = Path(__file__).with_name("file_seconds.json")
NEW_FILE_SECONDS = 120.0


def measured() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def seconds(path: str, table: dict[str, float]) -> float:
    """`path`: a test file relative to the repository root, as in a node id."""
    return table.get(path, 0.0 if path.startswith("tests/unit/") else NEW_FILE_SECONDS)


def from_junit(report: Path) -> dict[str, float]:
    per_file: Counter = Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        per_file[case.get("classname").replace(".", "/") + ".py"] += float(case.get("time"))
    return {name: round(total, 1) for name, total in sorted(per_file.items())}


if __name__ == "__main__":
    TABLE.write_text(json.dumps(from_junit(Path(sys.argv[1])), indent=1) + "\n")
    print(f"wrote {TABLE}")
