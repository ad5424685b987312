"""`sparkd serve` flags for admission control and request logging -> ServerLimits.

Each default is the ServerLimits default; sparkd/api/limits.py says why.
"""

from __future__ import annotations

import argparse

from ..api.limits import ServerLimits


def add_server_limit_flags(parser: argparse.ArgumentParser) -> None:
    defaults = ServerLimits()
    group = parser.add_argument_group("admission and request logging")
    group.add_argument("--max-waiting-requests", type=int, default=defaults.max_waiting_requests,
                       help="answer new requests with 429 and Retry-After while this many wait to be scheduled "
                            "(default: no limit)")
    group.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s, metavar="SECONDS",
                       help="abort a request this long after it arrived and answer 504 (streams: a final error "
                            "event) (default: no timeout)")
    group.add_argument("--max-request-body-bytes", type=int, default=defaults.max_body_bytes,
                       help="answer larger request bodies and WebSocket frames with 413 (default: %(default)s)")
    group.add_argument("--max-n", type=int, default=defaults.max_n,
                       help="most choices (n) per request (default: %(default)s)")
    group.add_argument("--max-tokens-limit", type=int, default=defaults.max_tokens,
                       help="most tokens one request may generate; requests naming no max_tokens get this many "
                            "at most (default: up to the context length)")
    group.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings,
                       help="most stop strings per request (default: %(default)s)")
    group.add_argument("--max-stop-string-length", type=int, default=defaults.max_stop_string_length,
                       help="longest stop string in characters (default: %(default)s)")
    group.add_argument("--log-requests", action="store_true", default=defaults.log_requests,
                       help="log each request's id, sampling params and prompt; without it no prompt or "
                            "generated text is ever logged")
    group.add_argument("--max-log-len", type=int, default=defaults.max_log_len,
                       help="characters of a prompt that --log-requests shows (default: %(default)s)")


def server_limits_from(ns: argparse.Namespace) -> ServerLimits:
    """The limits the flags describe; a value out of range exits with its message, naming the flag."""
    try:
        return ServerLimits(
            max_waiting_requests=ns.max_waiting_requests,
            request_timeout_s=ns.request_timeout,
            max_body_bytes=ns.max_request_body_bytes,
            max_n=ns.max_n,
            max_tokens=ns.max_tokens_limit,
            max_stop_strings=ns.max_stop_strings,
            max_stop_string_length=ns.max_stop_string_length,
            log_requests=ns.log_requests,
            max_log_len=ns.max_log_len,
        )
    except ValueError as exc:
        raise SystemExit(f"sparkd: error: {_flag_named(str(exc))}") from None


# ServerLimits field -> the flag that sets it, for error messages.
_FLAGS = {
    "max_waiting_requests": "--max-waiting-requests",
    "request_timeout_s": "--request-timeout",
    "max_body_bytes": "--max-request-body-bytes",
    "max_n": "--max-n",
    "max_tokens": "--max-tokens-limit",
    "max_stop_strings": "--max-stop-strings",
    "max_stop_string_length": "--max-stop-string-length",
    "max_log_len": "--max-log-len",
}


def _flag_named(message: str) -> str:
    """ServerLimits says "<field> must be ..."; say the flag instead."""
    field, _, rest = message.partition(" ")
    return f"{_FLAGS[field]} {rest}" if field in _FLAGS else message
