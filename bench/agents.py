"""`python -m bench.agents`: what agents send, answered by mstar and by llama.cpp's
llama-server side by side on the same GGUF file (the default model, SmolLM2-135M-Instruct
Q4_1), one run, the same client code (issue 48).

The cases are `tests/agent_cases.py`'s: the `openai` SDK's `parse()` with five schemas,
forced calls of a `web_search` function whose object is left open, JSON mode, and
LangChain's `with_structured_output` and `bind_tools`; greedy, 300 tokens at most. A case
passes only when its reply parses and validates. llama-server runs with `--jinja` (its
tool calls and `json_schema` need it), from ../shared/peers/serve-llama-server; its binary
from --llama-bin, $LLAMA_SERVER_BIN, or ../shared/peers/install-llama-server's build.

    python -m bench.agents
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from bench.llama_server import LlamaServer
from bench.report import machine, results_dir, table, write_json
from bench.server import PEERS, MstarServer, Server
from tests.agent_cases import Outcome, all_cases

GROUPS = ("parse", "tool", "json_object", "langchain")


def llama_binary(given: str | None) -> str:
    """The llama-server to run: the one given, else the peer build for this CPU (built now
    if it is not there: minutes)."""
    if given:
        return given
    script = PEERS / "install-llama-server"
    return subprocess.run(["bash", str(script)], check=True, capture_output=True, text=True).stdout.strip()


def run_cases(server: Server) -> list[Outcome]:
    server.start()
    try:
        return all_cases(f"http://127.0.0.1:{server.port}/v1")
    finally:
        server.stop()


def counts(outcomes: list[Outcome]) -> dict[str, tuple[int, int]]:
    """(passed, cases) per group of cases."""
    out = {}
    for group in GROUPS:
        mine = [o for o in outcomes if o.case.startswith(group)]
        out[group] = (sum(o.ok for o in mine), len(mine))
    return out


def plot(path: Path, results: dict[str, dict[str, tuple[int, int]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(results)
    for i, (name, per_group) in enumerate(results.items()):
        xs = [g + i * width for g in range(len(GROUPS))]
        ax.bar(xs, [per_group[g][0] / max(1, per_group[g][1]) for g in GROUPS], width, label=name)
    ax.set_xticks([g + width * (len(results) - 1) / 2 for g in range(len(GROUPS))], GROUPS)
    ax.set_ylabel("share of cases that validate")
    ax.set_ylim(0, 1.05)
    ax.legend()
    ax.set_title("agent requests on SmolLM2-135M-Instruct Q4_1, greedy")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--llama-bin", default=os.environ.get("LLAMA_SERVER_BIN"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from shared.gguf_source import find_default_gguf

    model = args.model or str(find_default_gguf())
    out_dir = results_dir(args.out)
    binary = llama_binary(args.llama_bin)
    outcomes = {"mstar": run_cases(MstarServer(model, out_dir / "mstar.log")),
                "llama-server": run_cases(LlamaServer(binary, model, out_dir / "llama.log", ["--jinja"]))}
    cases = [o.case for o in outcomes["mstar"]]
    rows = [[case, *("pass" if o.ok else "FAIL" for o in (next(x for x in outcomes[n] if x.case == case)
                                                            for n in outcomes))] for case in cases]
    print(table(["case", *outcomes], rows))
    per = {name: counts(found) for name, found in outcomes.items()}
    print(table(["group", *per], [[g, *(f"{per[n][g][0]} of {per[n][g][1]}" for n in per)] for g in GROUPS]))
    for name, found in outcomes.items():
        for o in found:
            if not o.ok:
                print(f"{name} {o.case}: {o.detail}")
    write_json(out_dir / "results.json", {"machine": machine(), "model": model,
                                          "outcomes": {n: [o.model_dump() for o in f] for n, f in outcomes.items()},
                                          "counts": per})
    plot(out_dir / "plot.png", per)
    print("results in", out_dir)


if __name__ == "__main__":
    main()
