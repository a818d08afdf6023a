"""Load test (bounded in time, loopback only): N clients mixing Infer, RegisterHook /
DeregisterHook and BLOCK streams against one server process.

    .venv/bin/python tests/bench/load_test.py [--clients 8] [--seconds 20]

Each client owns a session (BLOCK) and, in a loop: registers a hook capturing fc1's
output, runs a few Infer calls, checks that its stream delivered exactly the events
its hook fired, and removes the hook; every third client also keeps a SCOPE_ALL hook
with a BLOCK subscriber. Prints throughput, latency p50/p99 and events delivered vs
fired; exits non-zero if an event was lost or a hook leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import torch

import hookwire


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3 if s else float("nan")


async def client_loop(target: str, index: int, deadline: float, stats: dict) -> None:
    x = torch.randn(2, 8)
    options = hookwire.ConnectOptions(session_policy="block")
    async with hookwire.connect(target, options=options) as client:
        model = client.model("mlp")
        watcher = None
        if index % 3 == 0:
            shared = await model.hook("fc2", posthook=hookwire.capture("output"), scope="all")
            watcher = (shared, client.subscribe([shared.id], policy="block"))
            await watcher[1].start()
            stats["shared_hooks"].append(shared)
            stats["subscriptions"].append(watcher[1])
        while time.monotonic() < deadline:
            async with model.hook("fc1", posthook=hookwire.capture("output")) as hook:
                stats["registrations"] += 1
                ids = []
                for _ in range(5):
                    started = time.perf_counter()
                    ids.append((await model.infer(x)).request_id)
                    stats["latency"].append(time.perf_counter() - started)
                    stats["calls"] += 1
                got = []
                async for event in hook.events():
                    got.append(event.request_id)
                    if len(got) == len(ids):
                        break
                stats["fired"] += len(ids)
                stats["delivered"] += len(got)
                if got != ids:
                    stats["lost"] += 1


async def drain(sub: hookwire.Subscription, stats: dict) -> None:
    async for event in sub:
        stats["shared_delivered"] += 1
        stats["shared_seqs"].setdefault(id(sub), []).append(event.seq)


async def main_async(target: str, clients: int, seconds: float) -> int:
    stats = {"latency": [], "calls": 0, "registrations": 0, "fired": 0, "delivered": 0, "lost": 0,
             "shared_hooks": [], "subscriptions": [], "shared_delivered": 0, "shared_seqs": {}}
    deadline = time.monotonic() + seconds
    started = time.monotonic()
    tasks = [asyncio.ensure_future(client_loop(target, i, deadline, stats)) for i in range(clients)]
    await asyncio.sleep(0.5)
    drains = [asyncio.ensure_future(drain(sub, stats)) for sub in list(stats["subscriptions"])]
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - started
    for d in drains:
        d.cancel()
    async with hookwire.connect(target) as check:
        leaked = await check.list_hooks()
    contiguous = all(seqs == list(range(seqs[0], seqs[0] + len(seqs))) for seqs in stats["shared_seqs"].values())
    print(f"{clients} clients for {seconds:.0f} s: {stats['calls']} Infer calls ({stats['calls'] / elapsed:.0f}/s), "
          f"{stats['registrations']} hook registrations ({stats['registrations'] / elapsed:.1f}/s)")
    print(f"Infer latency p50 {pct(stats['latency'], .5):.2f} ms, p99 {pct(stats['latency'], .99):.2f} ms")
    print(f"session events delivered {stats['delivered']} of {stats['fired']} fired; passes with a lost event: {stats['lost']}")
    print(f"subscriber events (SCOPE_ALL, BLOCK) {stats['shared_delivered']}, seq contiguous: {contiguous}")
    print(f"hooks left after every client closed: {len(leaked)}")
    ok = stats["lost"] == 0 and stats["delivered"] == stats["fired"] and not leaked and contiguous
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--target", help="an already running server (default: start one)")
    ns = parser.parse_args()
    proc = None
    target = ns.target
    if target is None:
        proc = subprocess.Popen([sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--log-level", "warning"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        target = proc.stdout.readline().rsplit(" ", 1)[-1].strip()  # type: ignore[union-attr]
    try:
        code = asyncio.run(main_async(target, ns.clients, ns.seconds))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    sys.exit(code)


if __name__ == "__main__":
    main()
