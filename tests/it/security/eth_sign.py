"""An independent Ethereum signer for the Sign-In with Ethereum tests.

Reads one JSON object per line on stdin, answers one per line on stdout:
  {"key": "<32-byte hex private key>"}                 -> {"address": "<EIP-55>"}
  {"key": "<hex>", "message": "<text>"}                -> {"address": ..., "signature": "<65-byte hex, v 27/28>"}
Signing is eth-account's `personal_sign` (EIP-191), not meshgate's code.
"""
import json
import sys

try:
    from eth_account import Account
    from eth_account.messages import encode_defunct
except ImportError:
    sys.stderr.write("eth-account is missing: scripts/test.sh installs it (python3 -m pip install eth-account)\n")
    sys.exit(3)

for line in sys.stdin:
    req = json.loads(line)
    acct = Account.from_key(req["key"])
    out = {"address": acct.address}
    if "message" in req:
        signed = Account.sign_message(encode_defunct(text=req["message"]), req["key"])
        out["signature"] = signed.signature.hex().removeprefix("0x")
    print(json.dumps(out), flush=True)
