"""key_value_try_get of the JAX coordinator: the value, or None at once when no process has set
the key (shared reads poll for peers' addresses this way, never blocking on a dead process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import mp_launch

_SCRIPT = textwrap.dedent("""
    import sys, time
    import jax
    jax.distributed.initialize(coordinator_address="127.0.0.1:" + sys.argv[1], num_processes=1,
                               process_id=0)
    from tensorstash.jax import JaxCoordinator
    coord = JaxCoordinator()
    start = time.monotonic()
    assert coord.key_value_try_get("address/1") is None
    assert time.monotonic() - start < 5, "try_get waited"
    coord.key_value_set("address/1", "127.0.0.1:4000 \\u00e9")
    assert coord.key_value_try_get("address/1") == "127.0.0.1:4000 \\u00e9"
    # Another instance's keys are its own (each operation its own sequence number).
    assert JaxCoordinator().key_value_try_get("address/1") is None
    print("try_get ok")
""")


def test_jax_coordinator_try_get_answers_without_waiting(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(mp_launch.free_port())],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "try_get ok" in out.stdout, out.stdout + out.stderr
