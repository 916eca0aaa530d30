"""What a user of the installed wheel does, run by tests/packaging/wheel_test.sh in a fresh
environment that sees neither the build tree nor the system's copies of the bundled libraries:
a save on 8 devices split by rows, a restore onto a split by columns, then the `tensorstash`
command's verify and --version, and a step read back from a peer server over HTTP (the bundled
libmicrohttpd and libcurl). Exit code 0 when every value and answer is right."""

import os
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import tensorstash  # noqa: E402

folder = sys.argv[1]
here = os.path.dirname(os.path.abspath(tensorstash.__file__))
assert "site-packages" in here, f"tensorstash imported from {here}, not the installed wheel"

mesh = Mesh(np.array(jax.devices()).reshape(8, 1), ("x", "y"))
values = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
state = {"params": {"w": jax.device_put(values, NamedSharding(mesh, P("x", None)))},
         "step": 7}
# A step folder as a manager names it: the peer server serves "<folder>/<10 digits>/..." only.
STEP = "0000000007"
tensorstash.save(os.path.join(folder, "run", STEP), state)

other = Mesh(np.array(jax.devices()).reshape(1, 8), ("x", "y"))
target = {"params": {"w": jax.ShapeDtypeStruct((64, 32), np.float32,
                                               sharding=NamedSharding(other, P(None, "y")))},
          "step": 0}
restored = tensorstash.restore(os.path.join(folder, "run", STEP), target)
w = restored["params"]["w"]
assert w.sharding.is_equivalent_to(NamedSharding(other, P(None, "y")), 2), w.sharding
np.testing.assert_array_equal(np.asarray(w), values)
assert restored["step"] == 7

command = os.path.join(os.path.dirname(sys.executable), "tensorstash")
verify = subprocess.run([command, "verify", os.path.join(folder, "run", STEP)],
                        capture_output=True, text=True)
assert verify.returncode == 0, verify.stdout + verify.stderr
version = subprocess.run([command, "--version"], capture_output=True, text=True, check=True)
assert version.stdout.strip() == f"tensorstash {tensorstash.__version__}", version.stdout

# The node-local tier's transport: the step served read-only over HTTP and read back.
secret = "wheel-test-secret-0123456789"
server = tensorstash._ext.PeerServer(folder, secret=secret)
reader = tensorstash._ext.Reader.tiered([("peer", server.url, f"run/{STEP}", secret)])
out = np.empty((64, 32), np.float32)
reader.read_many([("params/w", (0, 0), (64, 32), "float32", out.view(np.uint8).reshape(-1))])
np.testing.assert_array_equal(out, values)
assert reader.tier_stats()["bytes"]["peer"] == values.nbytes
reader.close()
server.close()
print(f"wheel_user: save on 8x1, restore onto 1x8, verify, read from a peer: ok "
      f"({version.stdout.strip()})")
