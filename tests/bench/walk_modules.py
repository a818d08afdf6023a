"""The walk of a request through the server's modules (issue 23): for one Generate call
and one Infer call against a real server in this process, how often control enters each
hookwire_server module from another one (function calls, every thread), and from where.
A generator or coroutine counts when it first runs (its resumptions are the same visit
going on); generated code (a dataclass's ``__init__``) builds data and is not counted.
``--tokens N`` walks a Generate call of N new tokens (default 1).
A script, not a test: ``.venv/bin/python tests/bench/walk_modules.py`` from the
repository root. docs/architecture.md quotes its latest output."""
import asyncio, collections, sys, threading
import torch
import hookwire
from hookwire_server import ServerSettings
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from support import ServerThread, build_test_registry

state = {"on": False, "tracking": False, "entries": collections.Counter(), "seen": set()}
#: Code flags of frames that resume (generators, coroutines, async generators): a
#: resumption is the same visit going on, not a new entry; only its first run counts.
_RESUMING = 0x20 | 0x80 | 0x200


def prof(frame, event, arg):
    if event != "call" or not state["tracking"]:
        return
    code = frame.f_code
    if code.co_filename.startswith("<"):
        return  # generated code (a dataclass's __init__): building the module's data, not running its code
    if code.co_flags & _RESUMING:
        if frame in state["seen"]:
            return
        state["seen"].add(frame)  # (seen in the warm-up too: a long-lived loop resuming is no entry)
    if not state["on"]:
        return
    mod = frame.f_globals.get("__name__", "")
    if not mod.startswith("hookwire_server"):
        return
    caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
    if caller != mod:
        state["entries"][(mod, caller.split(".")[-1] if caller.startswith("hookwire_server") else "<outside>")] += 1
threading.setprofile(prof)
srv = ServerThread(build_test_registry(), ServerSettings(port=0)).start()

def trace(kind, make):
    async def run():
        async with hookwire.connect(srv.target) as c:
            state["seen"] = set(); state["tracking"] = True
            try:
                await make(c)  # warm up
                state["entries"] = collections.Counter(); state["on"] = True
                await make(c)
            finally:
                state["on"] = state["tracking"] = False
                state["seen"] = set()
    asyncio.run(run())
    per = collections.Counter()
    for (mod, caller), n in state["entries"].items():
        per[mod] += n
    print(f"== {kind}: entries into each server module from another module")
    for m, n in sorted(per.items(), key=lambda x: (-x[1], x[0])):
        callers = sorted({c for (mm, c) in state["entries"] if mm == m})
        print(f"  {n:5d}  {m:45s} from {', '.join(callers)}")

try:
    tokens = int(sys.argv[sys.argv.index("--tokens") + 1]) if "--tokens" in sys.argv else 1

    async def gen(c):
        await c.model("tiny-lm").generate(["hello"], tokens, do_sample=False)
    async def inf(c):
        await c.model("mlp")(torch.ones(2, 8))
    trace(f"Generate ({tokens} new token{'s' if tokens > 1 else ''})", gen)
    trace("Infer", inf)
finally:
    srv.stop()
