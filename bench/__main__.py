"""
bench/__main__.py: the command line. Runs one section, prints its table, and with --write-results
puts the table between the section's markers in bench/RESULTS.md.

    python -m bench SECTION [--quick] [--threads N] [--write-results]
    python -m bench --help

Simplifications:
    1. The section's module is imported by name once the arguments are read, so a run loads only
       what its section needs, and `--help` loads no section.
    2. The command a row names is the one typed, with `python -m bench` in front.
"""

import argparse
import importlib
import os
import sys

import torch

from bench.common import RESULTS, write_block

# bench/<name>.py, each with run()
SECTIONS = ("rollout", "signal", "sparrow", "regime", "lowalpha", "sparsecost", "sparsepath",
            "specdecode", "pagereads", "gpu", "syncbytes", "step", "demo", "moe")


def main(argv):
    p = argparse.ArgumentParser(prog="python -m bench",
                                description="side-by-side measurements, as a markdown table")
    p.add_argument("section", choices=SECTIONS)
    p.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's default); on a busy machine 1 thread is "
                        "steadier than several that wait on each other")
    p.add_argument("--jobs", type=int, default=1,
                   help="sparrow: training runs at a time, each in its own process at --threads "
                        "(0: run none, only tabulate the runs recorded so far)")
    p.add_argument("--config", default="",
                   help="sparrow: the config its arms train on (default configs/lagged.py; "
                        "configs/splitting.py is the second task family), its own block of "
                        "RESULTS.md")
    p.add_argument("--write-results", action="store_true",
                   help="rewrite the section's marked block of bench/RESULTS.md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    section = importlib.import_module(f"bench.{args.section}")
    if args.config and args.section != "sparrow":
        p.error("--config is sparrow's")
    extra, block = {}, args.section
    if args.section == "sparrow":
        extra = {"jobs": args.jobs, **({"config": args.config} if args.config else {})}
        block += section.family(args.config or section.CONFIG)
    table = "\n".join(section.run(args.quick, " ".join(["python -m bench"] + argv), **extra))
    print("\n" + table)
    if args.write_results:
        name = os.path.relpath(RESULTS)
        if write_block(block, table):
            print(f"{name}: rewrote the {block} block")
        else:
            print(f"{name} has no <!-- bench:{block} --> ... <!-- /bench:{block} --> block: "
                  f"printed only")


if __name__ == "__main__":
    main(sys.argv[1:])
