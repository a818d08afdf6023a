"""Quiets gRPC's C-core log for ``hookwire`` command processes (issue 22).

The C core writes its own log lines to stderr (``E1126 ... add_port.cc:83] Failed to
add port``, ``I1126 ... ssl_transport_security.cc``) ahead of the command's one clear
message about the same failure. It reads ``GRPC_VERBOSITY`` and ``GRPC_TRACE`` once,
when ``grpc`` is imported, and ``import hookwire`` imports grpc: so this runs first
thing in ``hookwire/__init__.py``, before the ``hookwire._cli`` module (a submodule,
imported after its package) could. It only acts in a process started as the command
(the ``hookwire`` script, ``python -m hookwire._cli``): a program that imports the SDK
keeps gRPC's defaults. A variable the user set is left as it is (GRPC_VERBOSITY=ERROR
shows the C core's errors again). Imports nothing but os and sys: the command's
start-up stays fast.
"""

from __future__ import annotations

import os
import sys

#: Modules whose ``python -m`` run is the command.
CLI_MODULES = ("hookwire._cli", "hookwire")


def is_cli_process() -> bool:
    """Whether this interpreter was started as the ``hookwire`` command."""
    if os.path.basename(sys.argv[0]) in ("hookwire", "hookwire.exe"):  # the console script
        return True
    # python [options] -m hookwire._cli ...: sys.argv[0] is still "-m" while the package
    # imports, so read the interpreter's own command line.
    argv = list(getattr(sys, "orig_argv", ()))[1:]
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return i + 1 < len(argv) and argv[i + 1] in CLI_MODULES
        if arg.startswith("-m"):
            return arg[2:] in CLI_MODULES
        if arg in ("-X", "-W"):  # options that take the next argument
            i += 2
            continue
        if arg == "-" or not arg.startswith("-") or "c" in arg[1:] and not arg.startswith("--"):
            return False  # a script, stdin or -c code: a -m among its own arguments is not ours
        i += 1
    return False


def quiet_grpc_logging() -> None:
    """Sets GRPC_VERBOSITY=NONE and GRPC_TRACE="" unless the user set them, in a
    process started as the command. Must run before grpc is imported."""
    if is_cli_process():
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
        os.environ.setdefault("GRPC_TRACE", "")
