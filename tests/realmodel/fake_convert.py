"""A converter for the cache tests (no torch): same contract as warmserve.realmodel.convert.

``--check`` exits 0 (or 3 with one line when $FAKE_CONVERT_MISSING names a module); a conversion
writes ``config.json`` (what the source was) and ``weights.bin`` (the source's bytes) into
OUT_DIR and prints the result line.  Knobs through the environment, so a test can watch and
break it: FAKE_CONVERT_LOG (a line appended per conversion), FAKE_CONVERT_SLEEP (seconds, after
the first file), FAKE_CONVERT_EXIT (exit with this status after the first file, like a crash).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from warmserve.realmodel.convert import EXIT_MISSING, RESULT_PREFIX


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        missing = os.environ.get("FAKE_CONVERT_MISSING")
        if missing:
            print(f"{sys.executable} lacks {missing}", file=sys.stderr)
            return EXIT_MISSING
        return 0
    src, out = Path(argv[0]), Path(argv[1])
    data = src.read_bytes()
    if log := os.environ.get("FAKE_CONVERT_LOG"):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
    (out / "weights.bin").write_bytes(data)
    time.sleep(float(os.environ.get("FAKE_CONVERT_SLEEP", "0")))
    if code := os.environ.get("FAKE_CONVERT_EXIT"):
        print("fake converter crashed", file=sys.stderr)
        return int(code)
    (out / "config.json").write_text(json.dumps({"architectures": ["Fake"], "bytes": len(data)}))
    print(RESULT_PREFIX + json.dumps({"python": sys.version.split()[0], "fake": "1"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
