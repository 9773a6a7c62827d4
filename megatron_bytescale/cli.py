"""The ``bytescale`` command: one entry point, one module per subcommand.

Subcommands are imported only when called, so ``bytescale plan`` never pays for torch or
megatron imports.
"""

from __future__ import annotations

import importlib
import signal
import sys

SUBCOMMANDS = {
    "plan": ("megatron_bytescale.tools.plan_cmd", "Plan a global batch over HDP ranks and compare schedulers."),
    "simulate": ("megatron_bytescale.tools.simulate_cmd", "Simulate training steps of static, pow2 and HDP variants side by side, at any scale."),
    "demo": ("megatron_bytescale.tools.demo_cmd", "Train a small GPT on CPU: static DP x CP vs HDP naive vs HDP balance."),
    "profile": ("megatron_bytescale.tools.profile_cmd", "Measure a model on this machine and fit the planner's cost model."),
}


def _usage() -> str:
    lines = ["usage: bytescale <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {doc}" for name, (_, doc) in SUBCOMMANDS.items()]
    lines += ["", "Run 'bytescale <command> --help' for the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"bytescale: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's 128 + SIGINT, no traceback
        print(f"bytescale {name}: interrupted (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
