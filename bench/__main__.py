"""
bench/__main__.py: the command line. Runs one section, prints its table, and with --write-results
puts the table between the section's markers in bench/RESULTS.md.

    python -m bench SECTION [--quick] [--threads N] [--write-results]
    python -m bench recipe --variants baseline,lr4e-4   # a section's own flags (--config, --jobs,
                                                        # --records)
    python -m bench --help       # the sections, each with what it measures and its time

Flags take either form, --threads 1 or --threads=1.

Simplifications:
    1. The section's module is imported by name once the arguments are read, so a run loads only
       what its section needs, and `--help` loads no section.
    2. The command a row names is the one typed, with `python -m bench` in front.
    3. A section that prints its rows as they finish has shown its table once it ends: the table is
       printed again only when other output came between those rows (a long section's progress).
"""

import argparse
import contextlib
import importlib
import io
import os
import sys

import torch

from bench.common import RESULTS, write_block

# bench/<name>.py, each with run(): what it measures, and about how long it takes on 2 CPU cores
SECTIONS = {
    "rollout": "stage 2: the engine vs transformers (and vLLM), shared prefill, sparse attention "
               "(15 min; --quick 2)",
    "signal": "stages 1 and 3: growth-zone and dynamic sampling vs uniform, 5 seeds (30 min)",
    "sparrow": "stage 2 in the loop: the nine sparse arms on the long-CoT task, 3 seeds (hours)",
    "regime": "stage 2: the long-CoT regime, attention's share, pages each scorer needs (25 min)",
    "lowalpha": "stage 2: where low alpha falls on the long-CoT task, by token type (30 min)",
    "sparsecost": "stage 2: where a long-CoT decode step's time goes (4 min)",
    "sparsepath": "stage 2: the CPU sparse path vs dense attention at 1k-4k tokens (20 min)",
    "specdecode": "stage 2: self-speculative (lossless) decode vs dense, over k (10 min)",
    "verifycost": "stage 2: a verify's attention against a dense decode step's (1 min)",
    "pagereads": "stage 2: what reading a fraction of the KV pages costs the memory system",
    "gpu": "stage 2 on one GPU: kernel, Flex, SDPA, engine decode, 2:4, 5 RL steps (GPU only)",
    "syncbytes": "stage 5: the bytes a bf16 copy's delta ships per step (4 min)",
    "step": "a whole RL step against TRL's GRPOTrainer (pip install trl; 5 min)",
    "demo": "the default's RL against iterated RFT, more SFT and SFT on every bin (75 min)",
    "moe": "router replay in the loop on the tiny MoE, 3 seeds (25 min)",
    "recipe": "the default's RL variants from the same warm starts, 3 seeds, ranked by pass@1 "
              "against the warm start's pass@64 (about 8 min a run; --quick 1)",
}


class Tee(io.TextIOBase):
    """stdout that also keeps what went through it."""
    def __init__(self, out):
        self.out, self.seen = out, io.StringIO()

    def write(self, text):
        self.seen.write(text)
        return self.out.write(text)

    def flush(self):
        self.out.flush()

    def isatty(self):
        return self.out.isatty()


def main(argv):
    p = argparse.ArgumentParser(
        prog="python -m bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="side-by-side measurements, as a markdown table",
        epilog="sections:\n" + "\n".join(f"  {k:<11} {v}" for k, v in SECTIONS.items()))
    p.add_argument("section", choices=list(SECTIONS), help="what to measure (below)")
    p.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's default); on a busy machine 1 thread is "
                        "steadier than several that wait on each other")
    p.add_argument("--jobs", type=int, default=1,
                   help="sparrow, recipe: training runs at a time, each in its own process at "
                        "--threads (0: run none, only tabulate the runs recorded so far); demo: "
                        "seeds at once, each in its own process")
    p.add_argument("--config", default="",
                   help="sparrow: the config its arms train on (default configs/lagged.py; "
                        "configs/splitting.py is the second task family), its own block of "
                        "RESULTS.md")
    p.add_argument("--variants", default="",
                   help="recipe: the variants to run, comma-separated (default: all of them); "
                        "sparrow: the arms to run, by letter (a,h); the table holds every run "
                        "recorded so far")
    p.add_argument("--records", default="",
                   help="recipe: a folder of bench/recipe_runs/ for another set of warm starts "
                        "(another CPU builds others), with its own block of RESULTS.md")
    p.add_argument("--write-results", action="store_true",
                   help="rewrite the section's marked block of bench/RESULTS.md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    section = importlib.import_module(f"bench.{args.section}")
    if args.config and args.section != "sparrow":
        p.error("--config is sparrow's")
    if args.variants and args.section not in ("recipe", "sparrow"):
        p.error("--variants is recipe's and sparrow's")
    extra, block = {}, args.section
    if args.records and args.section != "recipe":
        p.error("--records is recipe's")
    if args.section == "recipe":
        extra = {"variants": args.variants, "jobs": args.jobs,
                 "runs": os.path.join(section.RUNS, args.records)}
        block += f"-{args.records}" if args.records else ""
    if args.section == "demo":
        extra = {"jobs": args.jobs}
    if args.section == "sparrow":
        extra = {"jobs": args.jobs, "variants": args.variants,
                 **({"config": args.config} if args.config else {})}
        block += section.family(args.config or section.CONFIG)
    out = Tee(sys.stdout)
    with contextlib.redirect_stdout(out):
        table = "\n".join(section.run(args.quick, " ".join(["python -m bench"] + argv), **extra))
    if table not in out.seen.getvalue():  # not already shown, row after row (simplification 3)
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
