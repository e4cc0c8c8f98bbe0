"""The instructions the proxy executes per chat passthrough request, under valgrind's
callgrind: a count the machine's load does not move, where CPU time on a shared machine
moves by more than a small change.

    python bench/chat_ir.py ROOT[|NAME=value...] [--requests 200] [--stream]

ROOT is a tree holding `proxy/` (a `git archive` of a commit); "|NAME=value" sets the
proxy's environment ("ROOT|THREADKEEPER_EXPLAIN=false"). One `serve` (one worker,
SQLite) runs under callgrind against bench/overhead.py's stub; after 60 warm requests
and the explain writer's batch, the counters are zeroed (`callgrind_control -z`), one
client sends `--requests` of bench/overhead.py's chat body, and after the next batch they
are dumped. Every thread of the process is counted (the store's too); the kernel's work
(socket and file writes) is not. Two runs of one tree differed by about 1%.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import tempfile
import time
from pathlib import Path

import overhead as o
from chat_ab import serve_command

SETTLE_SECONDS = 1.0  # more than explain.BATCH_WAIT_SECONDS: the batch is written inside


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", help="a tree holding proxy/, then |NAME=value...")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        (tmp / "policies").mkdir()
        (tmp / "policies" / "default.yaml").write_text(o.POLICY)
        out = tmp / "callgrind.out"
        stub = o.start_stub()
        port = o.free_port()
        root, serve, env = serve_command("tk", args.root, stub, tmp, port)
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *serve]
        log = tmp / "proxy.log"
        with log.open("wb") as sink:
            process = subprocess.Popen(command, env=env, stdout=sink, stderr=sink, cwd=root)
        try:
            o.wait_ready(f"http://127.0.0.1:{port}/healthz", 600, process, log)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            asyncio.run(send(url, 60, args.stream))
            time.sleep(SETTLE_SECONDS)
            control("-z", process.pid)
            asyncio.run(send(url, args.requests, args.stream))
            time.sleep(SETTLE_SECONDS)
            control("-d", process.pid)
        finally:
            process.terminate()
            process.wait(120)
            stub.stop()
        dumped = Path(f"{out}.1").read_text(errors="replace")
        found = re.search(r"^(?:summary|totals): (\d+)", dumped, re.M)
        assert found is not None, "callgrind wrote no totals"
        total = int(found.group(1))
        print(f"{args.root}: {total / args.requests / 1e6:.3f} M instructions a request")


async def send(url: str, count: int, stream: bool) -> None:
    request = (o.first_byte if stream else o.post)(url, o.encode(o.chat_body(stream=stream)))
    async with o.session(1) as http:
        for _ in range(count):
            assert await request(http) is not None


def control(option: str, pid: int) -> None:
    subprocess.run(["callgrind_control", option, str(pid)], check=True, capture_output=True)


if __name__ == "__main__":
    main()
