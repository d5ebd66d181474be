"""Adversarial pass 19 (in-process side): faults found and fixed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_FORKED = textwrap.dedent("""
    import os, torch
    from asyncinfer.cache.kv_tensors import allocate_kv_caches
    from asyncinfer.cache.spec import KVCacheSpec
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32,
                       device=torch.device("cpu"))
    (k, v), = allocate_kv_caches(spec, num_blocks=64)
    pid = os.fork()
    if pid == 0:  # a forked worker writes its own requests' KV
        k[0].fill_(7.0)
        v[:].fill_(3.0)
        os._exit(0)
    os.waitpid(pid, 0)
    addr = k.data_ptr()
    kind = next(line.split()[1] for line in open("/proc/self/maps")
                if int(line.split()[0].split("-")[0], 16) <= addr < int(line.split()[0].split("-")[1], 16))
    print(float(k.abs().sum()), float(v.abs().sum()), kind)
""")


def test_a_forked_process_writes_its_own_kv_cache_not_its_parents() -> None:
    # A CPU cache's lazy zeros were a shared anonymous mapping (mmap's default flags): a process forked after the
    # engine was built (multiprocessing's default start method on Linux, a pre-forking server) wrote its requests'
    # keys and values into the parent's cache, and read the parent's. Private pages are copied on write.
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _FORKED], check=False, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0.0", "0.0", "rw-p"]
