"""The first half of a delta commit on the server (server/delta_file.py: materialize): copying the base
version's weights file over a recycled version's file, by the kernel (os.copy_file_range) against reads
and writes through user space (what copy_file falls back to). Files in the page cache, as the server's
last version is; the median of --repeats copies of each, alternating.

    .venv/bin/python benchmarks/delta_copy.py [--mb 270] [--repeats 7]

Prints one JSON line: seconds for each way and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

from grpoflow.server.delta_file import copy_file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=270, help="file size (SmolLM2-135M in bf16: 270 MB)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as d:
        src, dst = Path(d) / "base.safetensors", Path(d) / "recycled.safetensors"
        block = os.urandom(1 << 20)
        with open(src, "wb") as f:
            for _ in range(args.mb):
                f.write(block)
        copy_file(str(src), str(dst))  # the recycled version's file, in the page cache too
        times: dict[str, list[float]] = {"kernel": [], "user_space": []}
        for _ in range(args.repeats):
            for way in times:
                start = time.perf_counter()
                if way == "kernel":
                    copy_file(str(src), str(dst))
                else:
                    with mock.patch.object(os, "copy_file_range", side_effect=OSError("off")):
                        copy_file(str(src), str(dst))
                times[way].append(time.perf_counter() - start)
        assert dst.read_bytes() == src.read_bytes()
    kernel, user = (statistics.median(times[way]) for way in ("kernel", "user_space"))
    print(
        json.dumps(
            {
                "mb": args.mb,
                "repeats": args.repeats,
                "kernel_s": round(kernel, 4),
                "user_space_s": round(user, 4),
                "ratio": round(kernel / user, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
