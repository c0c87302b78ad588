"""Prints the slowest tests of a nextest JUnit report: python3 slowest-tests.py FILE [N]."""

import sys
import xml.etree.ElementTree as ET


def main() -> None:
    path = sys.argv[1]
    most = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        cases.append((float(case.get("time", "0")), case.get("classname", ""), case.get("name", "")))
    cases.sort(reverse=True)
    print(f"== slowest {min(most, len(cases))} of {len(cases)} tests")
    for seconds, binary, name in cases[:most]:
        print(f"{seconds:7.1f}s  {binary} {name}")


if __name__ == "__main__":
    main()
