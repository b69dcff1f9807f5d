"""Wall time of the client commands, side by side: `stagediff --help` and `stagediff health`.

Each setup is a Python interpreter and the directory it runs `python -m stagediff.cli` from (that directory's
`stagediff` comes first on sys.path; from a directory without one, the installed package runs). The setups run
interleaved, `--runs` times each; the JSON gives every time, the medians, and each setup's median against the
first setup's.

    .venv/bin/python bench/client_startup.py --runs 5 \\
        --setup before=.venv/bin/python:/tmp/before --setup after=.venv/bin/python:. \\
        --setup client-venv=/tmp/clientvenv/bin/python:/tmp --endpoint 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path


def _setup(text: str) -> tuple[str, str, Path]:
    name, separator, rest = text.partition("=")
    python, colon, directory = rest.rpartition(":")
    if not separator or not colon or not name or not python:
        raise argparse.ArgumentTypeError(f"--setup {text!r}: use NAME=PYTHON:DIRECTORY")
    return name, str(Path(python).absolute()), Path(directory).resolve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", type=_setup, action="append", required=True, help="NAME=PYTHON:DIRECTORY")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--endpoint", help="a serving cluster: also time `health` against it")
    args = parser.parse_args()

    commands = {"--help": ["--help"], "health, nothing listening": ["health", "--endpoint", "127.0.0.1:1"]}
    if args.endpoint:
        commands["health, serving"] = ["health", "--endpoint", args.endpoint]
    seconds: dict[str, dict[str, list[float]]] = {command: {} for command in commands}
    for _ in range(args.runs):
        for command, arguments in commands.items():
            for name, python, directory in args.setup:
                started = time.perf_counter()
                subprocess.run([python, "-m", "stagediff.cli", *arguments], cwd=directory, capture_output=True)
                seconds[command].setdefault(name, []).append(round(time.perf_counter() - started, 3))

    baseline = args.setup[0][0]
    result = {}
    for command, by_setup in seconds.items():
        medians = {name: statistics.median(times) for name, times in by_setup.items()}
        result[command] = {
            "seconds": by_setup,
            "median_s": medians,
            f"{baseline}_over": {name: round(medians[baseline] / median, 1) for name, median in medians.items()},
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
