"""The `--kv-*` command-line flags, for `splitserve serve` and `splitserve engine`."""
from __future__ import annotations

import argparse
from pathlib import Path

from splitserve.kv_transfer.config import SEND_MODES, TRANSPORTS, KVTransferConfig


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV transfer (disaggregated prefill/decode)")
    group.add_argument("--kv-transport", choices=TRANSPORTS, default="shm",
                       help="shm: same host; tcp: across hosts (default: shm)")
    group.add_argument("--kv-lease-s", type=float, default=30.0,
                       help="seconds a prefill instance holds a finished prompt's KV for the "
                            "decode instance to pull (default: 30)")
    group.add_argument("--kv-fault-rate", type=float, default=0.0,
                       help="fail this fraction of transfers on purpose (tests, trials)")
    group.add_argument("--kv-delay-ms", type=float, default=0.0,
                       help="add this latency to every transfer")
    group.add_argument("--kv-host", default="127.0.0.1",
                       help="address the prefill instance's KV socket binds to")
    group.add_argument("--kv-port", type=int, default=0, help="0: any free port")
    group.add_argument("--kv-secret-file", type=Path, default=None,
                       help="file holding the shared secret peers must prove (needed when "
                            "--kv-host is not loopback); a file keeps it out of `ps`")
    group.add_argument("--kv-seed", type=int, default=0, help="seed of the fault injection")
    group.add_argument("--kv-send-mode", choices=SEND_MODES, default="end",
                       help="prefill instance: end = hand the KV over once the prompt is prefilled; "
                            "overlap = hand the request to the decode instance after the first chunk and "
                            "stream the blocks as chunks finish, hiding a slow link behind the prefill (tcp)")
    parser.set_defaults(kv_secret=None)  # bytes `serve` generated for its own engines (no --kv-secret-file)


def kv_config_from_args(args: argparse.Namespace) -> KVTransferConfig:
    """Raises ValueError naming the flag when a value cannot work."""
    secret = args.kv_secret
    if args.kv_secret_file is not None:
        try:
            secret = Path(args.kv_secret_file).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"--kv-secret-file: cannot read {args.kv_secret_file}: "
                             f"{exc.strerror}") from None
    try:
        return KVTransferConfig(transport=args.kv_transport, lease_s=args.kv_lease_s,
                                fault_rate=args.kv_fault_rate, delay_ms=args.kv_delay_ms,
                                host=args.kv_host, port=args.kv_port, secret=secret,
                                seed=args.kv_seed, send_mode=args.kv_send_mode)
    except ValueError as exc:
        raise ValueError(f"{exc} (--kv-* flags)") from None
