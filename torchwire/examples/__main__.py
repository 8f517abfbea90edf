"""``./run demo``: the showcase, one example after the other.

    python -m torchwire.examples              # parameter server, distributed RNN
    python -m torchwire.examples --all        # all five
    python -m torchwire.examples rl hybrid    # the ones named
    python -m torchwire.examples --runtime    # the runtime demo (latency, bandwidth...)
    python -m torchwire.examples --profile traces   # and a stitched trace of each
    python -m torchwire.examples --chaos      # the parameter server trains on through
                                              # trainers killed with SIGKILL
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

EXAMPLES = {
    "parameter_server": "a parameter server and 3 trainers learn handwritten digits",
    "rnn": "the distributed RNN: embedding and decoder on a parameter server, LSTM on the "
           "trainer, learning a text character by character",
    "pipeline": "a model cut into 2 stages on 2 workers, micro-batches overlapped, "
                "against one stage",
    "rl": "one agent, 2 observers playing CartPole, REINFORCE",
    "hybrid": "an embedding on a parameter server by RPC + a dense part replicated with DDP",
}
DEFAULT = ["parameter_server", "rnn"]
# --quick: a few seconds each (the test of the showcase)
QUICK = {"parameter_server": ["--steps", "100"], "rnn": ["--steps", "60", "--nlayers", "1"],
         "pipeline": ["--steps", "10", "--hidden", "256"], "rl": ["--steps", "10"],
         "hybrid": ["--steps", "100"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchwire.examples", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"examples to run (default: {' '.join(DEFAULT)}; "
                        f"any of {', '.join(EXAMPLES)})")
    p.add_argument("--all", action="store_true", help="run all five examples")
    p.add_argument("--runtime", action="store_true",
                   help="run the runtime demo instead (torchwire.demo: latency, throughput, "
                        "bandwidth, a call chain, a remote error, counters)")
    p.add_argument("--chaos", action="store_true",
                   help="the parameter server with a trainer killed (SIGKILL) every 100 "
                        "steps (every 30 with --quick): each restarts and rejoins the job")
    p.add_argument("--quick", action="store_true", help="a few steps each")
    p.add_argument("--plots", default=".",
                   help="folder for the learning curves (default: here, torchwire-NAME.png)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--profile", default="", metavar="DIR",
                   help="write a stitched trace of every worker over a few steps of each "
                        "example: DIR/torchwire-NAME-trace.json.gz (open it in "
                        "https://ui.perfetto.dev)")
    args = p.parse_args(argv)
    if args.runtime:
        from torchwire import demo
        return demo.main(["--quick"] if args.quick else [])
    names = list(EXAMPLES) if args.all else (args.names or DEFAULT)
    if args.chaos:
        names = ["parameter_server"]
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        p.error(f"no example {', '.join(unknown)}; there are {', '.join(EXAMPLES)}")
    failed = []
    for i, name in enumerate(names, 1):
        print(f"\n#### {i}/{len(names)}  torchwire.examples.{name}: {EXAMPLES[name]}",
              flush=True)
        cmd = [sys.executable, "-m", f"torchwire.examples.{name}",
               "--plot", os.path.join(args.plots, f"torchwire-{name}.png")]
        cmd += QUICK[name] if args.quick else []
        cmd += ["--chaos", "30" if args.quick else "100"] if args.chaos else []
        cmd += ["--no-progress"] if args.no_progress else []
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            cmd += ["--profile", os.path.join(args.profile, f"torchwire-{name}-trace.json.gz")]
        if subprocess.run(cmd).returncode != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
        return 1
    plots = [os.path.join(args.plots, f"torchwire-{n}.png") for n in names]
    print(f"\nlearning curves: {', '.join(plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
