"""The pass's cache key (CommfoldPass.uuid()) follows commfold's own source: a copy
of the package, imported in a fresh process, keys as this checkout does while its
bytes are the same, and keys anew once a byte of its core, its passes or its patterns
changes (Inductor's FX graph cache must never serve a rewrite by older code)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import commfold

ROOT = Path(__file__).resolve().parents[1]
# one file of each folder code_hash reads
EDITED = ("commfold/report.py", "passes/local_topk.py", "patterns/gather.py")

# In the copy: its uuid, then the uuid after each edit (code_hash re-read each time).
_SCRIPT = """
import json, sys
from pathlib import Path
import commfold, commfold.passes, commfold.patterns
from commfold.manager import code_hash
root = Path.cwd().resolve()
mods = (commfold, commfold.passes, commfold.patterns)
assert all(Path(m.__file__).resolve().is_relative_to(root) for m in mods), mods
keys = [commfold.CommfoldPass().uuid()]
code_hash.cache_clear()
keys.append(commfold.CommfoldPass().uuid())  # nothing changed: read again
for name in sys.argv[1:]:
    f = root / name
    f.write_bytes(f.read_bytes() + b"\\n# edited\\n")
    code_hash.cache_clear()
    keys.append(commfold.CommfoldPass().uuid())
print(json.dumps(keys))
"""


def test_uuid_follows_source_bytes(tmp_path):
    for folder in ("commfold", "passes", "patterns"):
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", _SCRIPT, *EDITED], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    copy, again, *edited = json.loads(run.stdout.strip().splitlines()[-1])
    # the same bytes elsewhere: the same key as this checkout's
    assert copy == again == commfold.CommfoldPass().uuid()
    # each edit (cumulative) gives a new key
    assert len({copy, *edited}) == 1 + len(EDITED), edited
