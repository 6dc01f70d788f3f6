#!/usr/bin/env python3
"""Prints the slowest tests of CTest runs from their JUnit files (ctest --output-junit), one
table per file: `.ci/slowest_tests.py [-n N] FILE...`. A missing file is named and skipped, so
a suite that did not run does not fail CI's summary."""

import argparse
import os
import sys
import xml.etree.ElementTree as ET


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=12, help="how many tests per file (default 12)")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    for path in args.files:
        if not os.path.exists(path):
            print(f"slowest tests: {path}: not written (that suite did not run)")
            continue
        cases = []
        for case in ET.parse(path).getroot().iter("testcase"):
            try:
                seconds = float(case.get("time", "0"))
            except ValueError:
                seconds = 0.0
            name = case.get("name", "?").split("  # GetParam()")[0]  # gtest's parameter dump
            cases.append((seconds, name))
        cases.sort(reverse=True)
        total = sum(s for s, _ in cases)
        print(f"slowest tests of {path} ({len(cases)} tests, {total:.1f} s in all):")
        for seconds, name in cases[: args.n]:
            print(f"  {seconds:8.2f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
