"""The ``memtide`` command line, one module per subcommand: ``info``, ``probe``, ``run`` (training, or
``--trace``), ``plan``, ``simulate``, ``timeline`` and ``observe``. Each module holds its parser
(``add_parser``) and its work; ``_common`` what they share. What only the command line uses lives
here too: the training job behind ``run`` (``train_job``, its model ``gpt``), the update-phase plan
behind ``plan`` (``planning``); ``simulate`` is the ``sim`` subpackage, the simulator's glue.
The subcommands are imported when the parser is built, so importing one helper (the tests' model,
``memtide.cli.gpt``) loads no other."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import memtide
from memtide._files import FileRefused

from . import _interrupt
from ._common import EXIT_BROKEN_PIPE, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, UsageError, error


def _parser() -> argparse.ArgumentParser:
    from . import info, observe, plan, probe, run, timeline
    from . import sim as simulate

    parser = argparse.ArgumentParser(
        prog="memtide",
        description="memtide: CUDA-aware caching allocator and memory-tiering runtime.",
    )
    parser.add_argument("--version", action="version", version=f"memtide {memtide.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in (info, probe, run, plan, simulate, timeline, observe):
        command.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    _interrupt.reset()
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        # Ctrl-C in a command that does not report it itself (run and observe do): what finished.
        print(_interrupt.summary(args.command), file=sys.stderr, flush=True)
        return _interrupt.end_interrupted(EXIT_INTERRUPTED)
    except memtide._cleanup.Terminated as e:  # SIGTERM, SIGHUP: the same, exiting 128 + the signal
        print(_interrupt.summary(args.command).replace("Ctrl-C", e.signal_name), file=sys.stderr, flush=True)
        return _interrupt.end_interrupted(int(e.code))
    except (memtide.ConfigError, UsageError, FileRefused) as e:
        # FileRefused: a path given where memtide reads or writes a regular file is none (a link,
        # a FIFO, a folder), or a file that is not what it must be: the user's to change.
        error(e)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader left (`memtide info --json | head`): not an error of ours. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (MemoryError, RuntimeError, ValueError, OverflowError, OSError) as e:
        error(e)
        return EXIT_FAILURE
