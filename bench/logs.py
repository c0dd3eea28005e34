"""What a JSON log line costs against a text one: records formatted and written per second.

Logs N records (an access-log-like message with five ``extra=`` fields) through
:func:`llmgw.logs.configure_logging` to /dev/null, in text and in JSON, in the
same process, and prints records per second and microseconds per record of
each, and JSON's cost as a ratio of text's (the baseline).

    .venv/bin/python bench/logs.py [--records 100000]
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from llmgw.logs import configure_logging


def run(log_format: str, records: int) -> float:
    """Seconds to log ``records`` records in ``log_format`` to /dev/null."""
    with open(os.devnull, "w") as sink:
        configure_logging(log_format, "info", stream=sink)
        log = logging.getLogger("llmgw.gateway.access")
        fields = {"model": "chat", "replica": "chat-0", "status": 200, "ttft": 0.0123, "tokens": 57}
        began = time.perf_counter()
        for number in range(records):
            log.info("POST /v1/chat/completions %d", number, extra=fields)
        return time.perf_counter() - began


def main() -> None:
    """Print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    args = parser.parse_args()
    run("text", 1000)  # warm up
    took = {fmt: run(fmt, args.records) for fmt in ("text", "json")}
    for fmt, seconds in took.items():
        each = seconds / args.records * 1e6
        print(f"{fmt:>4}: {args.records / seconds:>9,.0f} records/s, {each:6.1f} µs each")
    print(f"json costs {took['json'] / took['text']:.2f}x text per record")


if __name__ == "__main__":
    main()
