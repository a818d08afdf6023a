"""Groundwork for "hooks that survive compilation": can a tap that is a registered custom
op (``torch.library``) live inside vLLM's compiled model, fire every step, edit in place,
and what does it cost when it does nothing? Not hookwire's code path yet: the tap here is
a minimal op patched onto vLLM's ``LlamaDecoderLayer.forward`` (its hidden-states output),
run in vLLM's own process (``LLM``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

Modes, each in a fresh process with a compile cache of its own (vLLM's cache key does not
see a patched forward), alternated over the repeats:
- ``compiled``: vLLM's compiled default (torch.compile, inductor on CPU), no taps;
- ``taps``: compiled, a tap after every decoder layer that does nothing but count;
- ``eager-taps``: ``enforce_eager``, the same taps.
Each run: 8 distinct 12-token prompts x 64 greedy tokens (end token unreachable), one
warm-up generate, then ``--generates`` timed ones (tokens/s); then the same taps adding
0.5 to layer 3's output: the steered tokens of the compiled and the eager model must be
equal, and differ from the unsteered ones.

    .venv-vllm/bin/python tests/bench/bench_compiled_taps.py --repeats 2   # about 8 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch  # module scope: the op's annotations are read as strings here

MODES = ("compiled", "taps", "eager-taps")


def run_mode(mode: str, folder: str, generates: int) -> dict:
    """One mode's figures, in this process (the child)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    torch.set_num_threads(1)
    state: dict = {"calls": 0, "edit": None}

    # A functional-by-mutation op: it edits its input in place (or not at all) and returns
    # nothing, so the compiler keeps it as an opaque call and no copy is needed.
    @torch.library.custom_op("hwbench::tap", mutates_args=("x",))
    def tap(x: torch.Tensor, point: int) -> None:
        state["calls"] += 1
        if state["edit"] is not None and point == 3:
            x.add_(state["edit"])

    @tap.register_fake
    def _(x: torch.Tensor, point: int) -> None:
        return None

    if mode != "compiled":
        from vllm.model_executor.models import llama

        forward, init = llama.LlamaDecoderLayer.forward, llama.LlamaDecoderLayer.__init__
        made = [0]

        def tapped_init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            init(self, *args, **kwargs)
            self.hw_point = made[0]
            made[0] += 1

        def tapped_forward(self, positions, hidden_states, residual):  # type: ignore[no-untyped-def]
            hidden, residual = forward(self, positions, hidden_states, residual)
            torch.ops.hwbench.tap(hidden, int(self.hw_point))
            return hidden, residual

        llama.LlamaDecoderLayer.__init__, llama.LlamaDecoderLayer.forward = tapped_init, tapped_forward

    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=folder, dtype="float32", max_model_len=512, max_num_seqs=32, kv_cache_memory_bytes=512 << 20,
              enforce_eager=mode.startswith("eager"), seed=0)
    startup = time.perf_counter() - started
    prompts = [" ".join(f"t{100 + 37 * i + j}" for j in range(12)) for i in range(8)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    rates = []
    for _ in range(generates):
        state["calls"] = 0
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        rates.append(8 * 64 / (time.perf_counter() - t))
    plain = [list(o.outputs[0].token_ids) for o in outs]
    calls = state["calls"]  # one timed generate's (before the steered one below)
    steered = None
    if mode != "compiled":
        state["edit"] = torch.full((512,), 0.5)
        steered = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    return {"mode": mode, "startup_s": startup, "rates": rates, "tap_calls": calls,
            "plain": plain, "steered": steered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the three modes, alternated")
    parser.add_argument("--generates", type=int, default=5, help="timed generates per run")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_mode(args.child[0], args.child[1], args.generates)), flush=True)
        return
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from bench_serving import save_model  # the serving benchmark's seeded Llama (hidden 512, 6 layers)

    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_taps_"))
    folder = work / "llama"
    folder.mkdir()
    save_model(folder)
    print(f"work folder {work}; {os.cpu_count()} cores", flush=True)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES:
            env = {**os.environ, "VLLM_CACHE_ROOT": str(work / f"cache-{mode}")}
            done = subprocess.run([sys.executable, __file__, "--generates", str(args.generates),
                                   "--child", mode, str(folder)], env=env, capture_output=True, text=True)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
            got = json.loads(line[len("RESULT "):])
            results[mode].append(got)
            print(f"  repeat {r + 1} {mode:10s} {statistics.median(got['rates']):6.0f} tokens/s "
                  f"(start-up {got['startup_s']:.0f} s, taps per generate {got['tap_calls']}"
                  f"{'' if mode == 'compiled' else ': 64 steps x 6 layers'})", flush=True)
    every = {m: [x for run in results[m] for x in run["rates"]] for m in MODES}
    spread = {m: (min(every[m]), max(every[m])) for m in MODES}
    medians = {m: statistics.median(every[m]) for m in MODES}
    for m in MODES:
        print(f"  {m:10s} median {medians[m]:6.0f} tokens/s  spread {spread[m][0]:.0f}-{spread[m][1]:.0f}")
    print(f"  taps / compiled {medians['taps'] / medians['compiled']:.2f}x;  "
          f"eager-taps / compiled {medians['eager-taps'] / medians['compiled']:.2f}x")
    first = {m: results[m][0] for m in MODES}
    print(f"  unsteered tokens equal in all modes: "
          f"{first['compiled']['plain'] == first['taps']['plain'] == first['eager-taps']['plain']}")
    print(f"  steered tokens compiled == eager: {first['taps']['steered'] == first['eager-taps']['steered']}; "
          f"differ from unsteered: {first['taps']['steered'] != first['taps']['plain']}")


if __name__ == "__main__":
    main()
