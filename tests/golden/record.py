"""Record ``traffic.json`` from the code as it is: ``python -m tests.golden.record``
(from the repository root, ``PYTHONPATH=src``). Only when a change of behaviour is
intended: the golden is what ``test_golden_traffic.py`` holds every later run to."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.golden.traffic import GOLDEN, VARIANTS, dump_golden, record_variant, route_keys


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, route_keys():
        recordings = {name: record_variant(name, Path(tmp)) for name in VARIANTS}
    GOLDEN.write_text(dump_golden(recordings))
    print(f"wrote {GOLDEN} ({', '.join(recordings)})", file=sys.stderr)


if __name__ == "__main__":
    main()
