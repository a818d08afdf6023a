"""The SDK and the ``hookwire`` command import no torch until a tensor needs it (issue #14).

Importing torch takes seconds, and ``hookwire --help``, ``health``, ``models``,
``inspect``, ``hooks`` and ``token new`` never touch a tensor. Each check runs in a
fresh interpreter (this one has torch imported already) and asserts on ``sys.modules``,
never on time. The same commands against a real server: tests/integration/test_cli.py.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: Packages the commands above must not import: torch and the heavy packages the SDK
#: uses for datasets and harvests (and plots), each seconds or hundreds of ms to import.
HEAVY = ("torch", "transformers", "datasets", "pyarrow", "safetensors", "fsspec", "pandas", "matplotlib", "tqdm")


def _run(script: str) -> str:
    env = dict(os.environ)
    env.pop("PYTHONSTARTUP", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


PRELUDE = f"""
import contextlib, io, sys
HEAVY = {HEAVY!r}

def heavy():
    return sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
"""


def test_import_help_argument_parsing_and_token_new_import_no_torch() -> None:
    script = PRELUDE + textwrap.dedent(
        """
        import hookwire
        import hookwire._cli as cli
        assert heavy() == [], heavy()

        parser = cli.build_parser()
        argvs = [
            ["serve", "--port", "0"], ["health"], ["health", "127.0.0.1:1", "--timeout", "2"], ["models"],
            ["inspect", "m"], ["hooks", "list", "--model", "m"], ["hooks", "rm", "hk_" + "0" * 32],
            ["tap", "m", "a.*", "--stats"], ["generate", "m", "hi", "-n", "3"],
            ["harvest", "list"], ["harvest", "m", "--modules", "a.*", "--data", "d.jsonl", "--out", "o"],
            ["token", "new", "alice"],
        ]
        for argv in argvs:
            parser.parse_args(argv)
        helps = [["--help"], *([command, "--help"] for command in
                                ("serve", "health", "models", "inspect", "generate", "tap", "harvest", "hooks"))]
        helps += [["hooks", "list", "--help"], ["hooks", "rm", "--help"], ["token", "new", "--help"]]
        for argv in helps:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    cli.main(argv)
                except SystemExit as exc:
                    assert exc.code == 0, (argv, exc.code)
                else:
                    raise AssertionError(f"{argv} did not exit")
            assert "usage: hookwire" in out.getvalue(), argv
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["token", "new", "alice", "--role", "viewer"]) == 0
        assert "alice:viewer:" in out.getvalue()
        from hookwire._progress import TransferProgress  # tqdm only once a bar is drawn
        with TransferProgress(enabled=True) as bar:
            bar.update(1024, 4096)
        assert heavy() == [], heavy()
        print("OK")
        """
    )
    assert _run(script).strip() == "OK"


def test_the_usage_of_an_sdk_commands_run_names_the_servers_commands_without_importing_them() -> None:
    """Regression guard (issue 34): a run of an SDK command loads no other package's commands
    (entry points), and its top-level usage left out ``serve`` and ``token``."""
    script = PRELUDE + textwrap.dedent(
        """
        import hookwire._cli as cli
        usage = cli.build_parser(added_commands=False).format_usage()
        assert "{serve,token,models," in usage, usage
        assert heavy() == [] and "hookwire_server" not in sys.modules, (heavy(), usage)
        print("OK")
        """
    )
    assert _run(script).strip() == "OK"


def test_tensors_decode_to_torch_importing_it_on_the_first_one() -> None:
    # The documented behaviour stays: torch tensors when torch is importable. It is
    # decided without importing torch, which the first decoded tensor imports.
    script = PRELUDE + textwrap.dedent(
        """
        import numpy as np
        from hookwire.wire import codec
        from hookwire.v1 import tensor_pb2

        assert codec.torch_importable() and "torch" not in sys.modules
        values = np.arange(6, dtype="<f4").reshape(2, 3)
        msg = codec.encode_tensor(values)  # numpy needs no torch
        value = codec.encode_value({"x": values, "n": [1, 2.5, None]})
        assert codec.decode_tensor(msg, as_numpy=True).tolist() == values.tolist()
        assert "torch" not in sys.modules

        # The first tensor to decode here is a chunked one: ChunkAssembler imports torch
        # and allocates torch tensors for the chunks to fill.
        big = np.random.default_rng(0).standard_normal((256, 512)).astype("<f4")  # 512 KiB: chunked
        chunker = codec.Chunker(snapshot=False)
        chunked = tensor_pb2.Value()
        codec.encode_value_into(big, chunked, chunker=chunker)
        assert chunked.tensor.chunk_id and "torch" not in sys.modules
        assembler = codec.ChunkAssembler(chunked)
        for chunk in chunker.chunks(64 * 1024):
            assembler.feed(chunk)
        out = codec.decode_value(chunked, chunked=assembler.result())
        import torch
        assert isinstance(out, torch.Tensor) and torch.equal(out, torch.from_numpy(big)), type(out)

        out = codec.decode_tensor(msg)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float32, type(out)
        assert torch.equal(out, torch.from_numpy(values))
        assert isinstance(codec.decode_value(value)["x"], torch.Tensor)
        assert codec.TORCH_DTYPES[tensor_pb2.DTYPE_BFLOAT16] is torch.bfloat16
        print("OK")
        """
    )
    assert _run(script).strip() == "OK"


def test_torch_imported_by_the_caller_is_used_for_encoding_before_any_decode() -> None:
    # A torch tensor can only exist once torch is imported: encoding finds it in
    # sys.modules (and fills the dtype tables then) without a decode having imported it.
    script = PRELUDE + textwrap.dedent(
        """
        from hookwire.wire import codec
        from hookwire.v1 import tensor_pb2
        import torch

        assert codec.wire_dtype_of(torch.bfloat16) == tensor_pb2.DTYPE_BFLOAT16
        t = torch.arange(12, dtype=torch.int16).reshape(3, 4)
        msg = codec.encode_tensor(t)
        assert msg.dtype == tensor_pb2.DTYPE_INT16 and list(msg.shape) == [3, 4]
        assert torch.equal(codec.decode_tensor(msg), t)
        value = codec.encode_value((t.to(torch.bfloat16), {"m": t > 4}))
        back = codec.decode_value(value)
        assert back[0].dtype == torch.bfloat16 and torch.equal(back[1]["m"], t > 4)
        print("OK")
        """
    )
    assert _run(script).strip() == "OK"


def test_only_the_command_silences_grpc_core_logging() -> None:
    # The hookwire command sets GRPC_VERBOSITY/GRPC_TRACE before grpc is imported (issue 22);
    # a program importing the SDK keeps gRPC's own defaults.
    script = "import os, hookwire; print(os.environ.get('GRPC_VERBOSITY'), repr(os.environ.get('GRPC_TRACE')))"
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_VERBOSITY", "GRPC_TRACE", "PYTHONSTARTUP")}
    library = subprocess.run([sys.executable, "-c", script, "-m", "hookwire._cli"], capture_output=True, text=True,
                             timeout=300, cwd=ROOT, env=env)
    assert library.stdout.strip() == "None None", library.stderr
    from hookwire import _cli_env

    for argv, expected in [
        (["python", "-m", "hookwire._cli", "models"], True), (["python", "-X", "dev", "-m", "hookwire._cli"], True),
        (["python", "-mhookwire"], True), (["python", "-m", "pytest", "-m", "hookwire._cli"], False),
        (["python", "script.py", "-m", "hookwire._cli"], False), (["python", "-c", "x", "-m", "hookwire._cli"], False),
    ]:
        saved = sys.orig_argv, sys.argv
        sys.orig_argv, sys.argv = argv, ["-m"]
        try:
            assert _cli_env.is_cli_process() is expected, argv
        finally:
            sys.orig_argv, sys.argv = saved


def test_commands_of_other_packages_come_from_entry_points(tmp_path: pathlib.Path) -> None:
    # The SDK's command imports no hookwire_server module (tests/unit/test_architecture.py):
    # the server's serve and token come through the hookwire.commands entry points, which an
    # installed distribution declares (here a fake one on the path, found by importlib.metadata),
    # loaded for --help and for commands the SDK does not have, never for its own commands.
    dist = tmp_path / "hookwire_extra-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hookwire-extra\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[hookwire.commands]\nhello = hookwire_extra:add_hello\n")
    (tmp_path / "hookwire_extra.py").write_text(textwrap.dedent(
        """
        def add_hello(sub, name):
            sub.add_parser(name, help="say hello").set_defaults(command_handler=lambda ns: print("hello") or 7)
        """
    ))
    script = PRELUDE + textwrap.dedent(
        f"""
        sys.path.insert(0, {str(tmp_path)!r})
        import hookwire._cli as cli
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["hello"]) == 7
        assert out.getvalue() == "hello\\n", out.getvalue()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                cli.main(["--help"])
            except SystemExit:
                pass
        assert "hello" in out.getvalue() and "say hello" in out.getvalue(), out.getvalue()
        del sys.modules["hookwire_extra"]
        parser_modules = set(sys.modules)
        try:
            cli.main(["models", "--target", "bad target"])  # the SDK's own command: exits 2 on the target
        except SystemExit:
            pass
        assert "hookwire_extra" not in sys.modules and not any(m.startswith("hookwire_server") for m in set(sys.modules) - parser_modules)
        assert heavy() == [], heavy()
        print("OK")
        """
    )
    assert _run(script).strip() == "OK"
