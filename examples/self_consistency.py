"""Self-consistency voting with n=5 against the local engine, through ncap.

One request asks for five candidates (one prefill, five decode loops in the engine);
``ncap.client.demux`` splits the stream into the five answers by ``index`` and
``ncap.client.vote`` picks the majority with its agreement ratio.

    python examples/self_consistency.py            # starts the gateway on the embedded default
    python examples/self_consistency.py --url http://127.0.0.1:8080/v1   # a running gateway

The embedded default serves the bundled SmolLM2-135M-Instruct as ``smollm2`` and lets
the ``default`` workload ask for up to 4 candidates, so this script starts its own
gateway with a config that approves 5 (an operator would grant an exception instead).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

QUESTION = "What is 7 + 5? Answer with just the number."


def short_answer(choice: object) -> str | None:
    """The vote key: the last number in the answer (free text rarely matches exactly,
    and a small model often repeats the question before answering it). A 135M-parameter
    model is a weak arithmetician: the point is the mechanics, not the score."""
    from ncap.client import answer_text

    numbers = re.findall(r"-?\d+", answer_text(choice) or "")
    return numbers[-1] if numbers else None


@contextmanager
def local_gateway(workdir: Path) -> Iterator[str]:
    """The embedded default, with n up to 5, on an ephemeral loopback port."""
    import asyncio

    from aiohttp import web

    from ncap.config import default_config
    from ncap.http.app import create_app

    base = default_config()
    workload = base.workloads["default"].model_copy(update={"max_candidates": 5})
    route = base.routes["local-smollm2"].model_copy(update={"n_ctx": 2048})
    config = base.model_copy(
        update={
            "workloads": {"default": workload},
            "routes": {"local-smollm2": route},
            "stores": base.stores.model_copy(
                update={
                    "ledger": f"sqlite:///{workdir}/ledger.db",
                    "budgets": f"sqlite:///{workdir}/budgets.db",
                }
            ),
        }
    )
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(create_app(config), access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def ask(url: str, n: int, max_tokens: int) -> int:
    from ncap.client import demux, retrying_client, vote

    client = retrying_client(base_url=url, api_key="unused-on-loopback")
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTION}],
        n=n,
        temperature=0.8,
        max_tokens=max_tokens,
        seed=42,
        stream=True,
        stream_options={"include_usage": True},
    )
    answers = demux(stream)
    choices = answers.to_choices()
    for choice in choices:
        text = (choice.content or "").strip()
        print(f"candidate {choice.index}: {text!r} ({choice.finish_reason})")
    result = vote(choices, key=short_answer)
    print(
        f"majority: {result.winner!r} with {result.count}/{result.total} votes "
        f"(agreement {result.agreement:.0%}), candidates {list(result.indices)}"
    )
    if answers.usage is not None:
        print(
            f"usage: {answers.usage.prompt_tokens} prompt tokens (prefilled once), "
            f"{answers.usage.completion_tokens} completion tokens over {n} candidates"
        )
    return len(choices)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running gateway's /v1 URL (default: start one)")
    parser.add_argument("-n", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    if args.url:
        got = ask(args.url, args.n, args.max_tokens)
    else:
        with tempfile.TemporaryDirectory() as tmp, local_gateway(Path(tmp)) as url:
            got = ask(url, args.n, args.max_tokens)
    return 0 if got == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
